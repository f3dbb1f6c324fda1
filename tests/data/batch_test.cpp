#include "fulgur/data/batch.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/core/errors.h"
#include "support/test_support.h"

namespace {

TEST(Batch, TensorBatch) {
  auto t = torch::arange(6).reshape({3, 2});
  fulgur::Batch batch(t);
  EXPECT_TRUE(batch.is_tensor());
  EXPECT_FALSE(batch.is_pair());
  EXPECT_STREQ(batch.kind(), "tensor");
  EXPECT_TRUE(torch::equal(batch.tensor(), t));
  EXPECT_EQ(batch.num_tensors(), 1u);
  EXPECT_EQ(batch.batch_size(), 3);
}

TEST(Batch, PairBatch) {
  auto x = torch::ones({4, 3});
  auto y = torch::zeros({4, 1});
  fulgur::Batch batch(x, y);
  EXPECT_TRUE(batch.is_pair());
  EXPECT_STREQ(batch.kind(), "pair");
  auto& [input, target] = batch.pair();
  EXPECT_TRUE(torch::equal(input, x));
  EXPECT_TRUE(torch::equal(target, y));
  EXPECT_TRUE(torch::equal(batch[0], x));
  EXPECT_TRUE(torch::equal(batch[1], y));
  EXPECT_EQ(batch.num_tensors(), 2u);
  EXPECT_EQ(batch.batch_size(), 4);
  // The pair constructor and the two-tensor constructor agree.
  fulgur::Batch from_pair(fulgur::Batch::Pair(x, y));
  EXPECT_TRUE(from_pair.is_pair());
}

TEST(Batch, ListBatch) {
  fulgur::Batch batch(
      fulgur::Batch::List{torch::ones({5}), torch::zeros({5, 2}), torch::ones({5})});
  EXPECT_TRUE(batch.is_list());
  EXPECT_STREQ(batch.kind(), "list");
  EXPECT_EQ(batch.list().size(), 3u);
  EXPECT_TRUE(torch::equal(batch[1], torch::zeros({5, 2})));
  EXPECT_EQ(batch.num_tensors(), 3u);
  EXPECT_EQ(batch.batch_size(), 5);
}

TEST(Batch, MapBatch) {
  fulgur::Batch batch(fulgur::Batch::Map{{"x", torch::ones({2, 3})}, {"y", torch::zeros({2})}});
  EXPECT_TRUE(batch.is_map());
  EXPECT_STREQ(batch.kind(), "map");
  EXPECT_TRUE(torch::equal(batch["x"], torch::ones({2, 3})));
  EXPECT_TRUE(torch::equal(batch.map().at("y"), torch::zeros({2})));
  EXPECT_EQ(batch.num_tensors(), 2u);
  EXPECT_EQ(batch.batch_size(), 2);
}

TEST(Batch, WrongKindErrorsNameBothKinds) {
  fulgur::Batch tensor(torch::ones({2}));
  fulgur::Batch pair(torch::ones({2}), torch::ones({2}));
  EXPECT_THROWS_WITH(fulgur::ConfigError, tensor.pair(), {"pair", "tensor"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, tensor.list(), {"list", "tensor"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, pair.map(), {"map", "pair"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, pair.tensor(), {"tensor", "pair"});
  const fulgur::Batch& const_pair = pair;
  EXPECT_THROWS_WITH(fulgur::ConfigError, const_pair.list(), {"list", "pair"});
}

TEST(Batch, IndexingErrors) {
  fulgur::Batch tensor(torch::ones({2}));
  fulgur::Batch pair(torch::ones({2}), torch::ones({2}));
  fulgur::Batch map(fulgur::Batch::Map{{"x", torch::ones({2})}, {"y", torch::ones({2})}});
  EXPECT_THROWS_WITH(fulgur::ConfigError, tensor[0], {"tensor"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, pair[2], {"out of range", "2"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, pair["x"], {"\"x\"", "pair"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, map["z"], {"\"z\"", "x, y"});
}

TEST(Batch, EmptyBatch) {
  fulgur::Batch batch;
  EXPECT_TRUE(batch.is_tensor());
  EXPECT_EQ(batch.num_tensors(), 0u);
  EXPECT_EQ(batch.batch_size(), 0);
}

TEST(Batch, ScalarTensorCountsAsOneSample) {
  fulgur::Batch batch(torch::tensor(3.0));
  EXPECT_EQ(batch.batch_size(), 1);
}

TEST(Batch, ForEachVisitsEveryTensorInOrder) {
  fulgur::Batch batch(
      fulgur::Batch::List{torch::full({1}, 1), torch::full({1}, 2), torch::full({1}, 3)});
  std::vector<double> seen;
  batch.for_each([&](const at::Tensor& t) { seen.push_back(t.item<double>()); });
  EXPECT_EQ(seen, (std::vector<double>{1, 2, 3}));
}

TEST(Batch, MapTensorsKeepsTheShape) {
  fulgur::Batch pair(torch::ones({2}), torch::full({2}, 2.0));
  auto doubled = pair.map_tensors([](const at::Tensor& t) { return t * 2; });
  ASSERT_TRUE(doubled.is_pair());
  EXPECT_TRUE(torch::equal(doubled[0], torch::full({2}, 2.0)));
  EXPECT_TRUE(torch::equal(doubled[1], torch::full({2}, 4.0)));

  fulgur::Batch map(fulgur::Batch::Map{{"a", torch::ones({1})}});
  auto mapped = map.map_tensors([](const at::Tensor& t) { return t + 1; });
  ASSERT_TRUE(mapped.is_map());
  EXPECT_TRUE(torch::equal(mapped["a"], torch::full({1}, 2.0)));
}

// A member left undefined (a batch without targets) stays undefined when
// the batch is moved or mapped, as a lone undefined tensor did (moving such
// a pair threw LibTorch's "tensor does not have a device"), and its size
// comes from the defined one.
TEST(Batch, AnUndefinedMemberStaysUndefined) {
  for (const fulgur::Batch& batch :
       {fulgur::Batch(torch::ones({3, 2}), at::Tensor()),
        fulgur::Batch(fulgur::Batch::List{at::Tensor(), torch::ones({3, 2})}),
        fulgur::Batch(fulgur::Batch::Map{{"x", torch::ones({3, 2})}, {"y", at::Tensor()}})}) {
    const fulgur::Batch moved = batch.to(c10::Device(c10::kCPU));
    int defined = 0;
    int all = 0;
    moved.for_each([&](const at::Tensor& t) {
      defined += t.defined() ? 1 : 0;
      ++all;
    });
    EXPECT_EQ(defined, 1);
    EXPECT_EQ(all, 2);  // for_each visits the undefined one too
    EXPECT_EQ(moved.batch_size(), 3);
    const fulgur::Batch doubled = batch.map_tensors([](const at::Tensor& t) { return t * 2; });
    EXPECT_EQ(doubled.batch_size(), 3);
  }
}

TEST(Batch, ToSameDeviceDoesNotCopy) {
  auto x = torch::ones({2, 2});
  fulgur::Batch batch(x, torch::zeros({2}));
  auto moved = batch.to(c10::Device(c10::kCPU));
  ASSERT_TRUE(moved.is_pair());
  EXPECT_EQ(moved[0].device(), c10::Device(c10::kCPU));
  EXPECT_EQ(moved[0].data_ptr(), x.data_ptr());
}

TEST(Batch, ToMovesEveryTensor_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  c10::Device cuda(c10::kCUDA, 0);
  fulgur::Batch batch(fulgur::Batch::Map{{"x", torch::ones({2})}, {"y", torch::zeros({2})}});
  auto moved = batch.to(cuda);
  moved.for_each([&](const at::Tensor& t) { EXPECT_EQ(t.device(), cuda); });
  EXPECT_TRUE(torch::equal(moved["x"].cpu(), torch::ones({2})));
}

}  // namespace
