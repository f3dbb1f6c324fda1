#include "fulgur/data/torch_dataset.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::TempDir;

// A map-style torch::data dataset: sample i is (x_i, y_i) of a regression.
struct TorchRegression : torch::data::datasets::Dataset<TorchRegression> {
  explicit TorchRegression(int64_t n) : data(fulgur::test::regression_dataset(n)) {}
  torch::data::Example<> get(size_t index) override {
    const auto& t = data->tensors();
    return {t[0][static_cast<int64_t>(index)], t[1][static_cast<int64_t>(index)]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(data->size()); }
  std::shared_ptr<fulgur::TensorDataset> data;
};

// Tensor-only examples: sample i is the scalar i.
struct TorchIndices : torch::data::datasets::Dataset<TorchIndices, torch::data::TensorExample> {
  torch::data::TensorExample get(size_t index) override {
    return torch::data::TensorExample(torch::tensor(static_cast<int64_t>(index)));
  }
  torch::optional<size_t> size() const override { return 10; }
};

std::vector<int64_t> epoch_order(fulgur::DataLoader& loader, int64_t epoch) {
  std::vector<int64_t> out;
  loader.start_epoch(epoch);
  while (auto batch = loader.next()) {
    for (int64_t v : fulgur::test::to_vector(batch->tensor())) out.push_back(v);
  }
  return out;
}

TEST(TorchDatasetAdapter, CollatesExamplesIntoPairs) {
  auto dataset = fulgur::from_torch_dataset(TorchRegression(10));
  EXPECT_EQ(dataset->size(), 10);
  auto batch = dataset->get_batch(torch::tensor({0, 3, 4}, torch::kLong));
  ASSERT_TRUE(batch.is_pair());
  auto reference =
      fulgur::test::regression_dataset(10)->get_batch(torch::tensor({0, 3, 4}, torch::kLong));
  EXPECT_TRUE(torch::equal(batch.pair().first, reference.pair().first));
  EXPECT_TRUE(torch::equal(batch.pair().second, reference.pair().second));
}

TEST(TorchDatasetAdapter, CollatesTensorExamplesIntoTensors) {
  auto loader =
      fulgur::make_data_loader(fulgur::from_torch_dataset(TorchIndices()), {.batch_size = 4});
  EXPECT_EQ(loader->num_batches(), 3);
  EXPECT_EQ(epoch_order(*loader, 0), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

TEST(TorchSamplerAdapter, UsesTheTorchSamplersOrder) {
  auto sampler = std::make_shared<fulgur::TorchSamplerAdapter>(
      std::make_shared<torch::data::samplers::SequentialSampler>(0));
  auto loader = fulgur::make_data_loader(fulgur::from_torch_dataset(TorchIndices()),
                                         {.batch_size = 3}, sampler);
  EXPECT_EQ(epoch_order(*loader, 0), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

TEST(TorchSamplerAdapter, ResumesTheSavedEpochOrderEvenAfterTheGlobalGeneratorMoved) {
  torch::manual_seed(3);
  auto make = [] {
    auto sampler = std::make_shared<fulgur::TorchSamplerAdapter>(
        std::make_shared<torch::data::samplers::RandomSampler>(0));
    return fulgur::make_data_loader(fulgur::from_torch_dataset(TorchIndices()), {.batch_size = 2},
                                    sampler);
  };
  auto original = make();
  original->start_epoch(0);
  std::vector<int64_t> first_two;
  for (int i = 0; i < 2; ++i) {
    for (int64_t v : fulgur::test::to_vector(original->next()->tensor())) first_two.push_back(v);
  }
  const fulgur::StateDict state = original->state_dict();
  // The adapter's state: the epoch and its whole order, as a buffer.
  const fulgur::StateDict& sampler = state.section_at("sampler");
  EXPECT_EQ(sampler.integer("epoch"), 0);
  EXPECT_TRUE(sampler.is_buffer("order"));
  EXPECT_EQ(sampler.tensor("order").numel(), 10);
  std::vector<int64_t> rest;
  while (auto batch = original->next()) {
    for (int64_t v : fulgur::test::to_vector(batch->tensor())) rest.push_back(v);
  }
  const std::string bytes = fulgur::to_bytes(state);

  torch::randn({100});  // move the global generator the RandomSampler draws from
  auto resumed = make();
  resumed->load_state_dict(fulgur::from_bytes(bytes));
  EXPECT_EQ(resumed->position(), 2);
  std::vector<int64_t> resumed_rest;
  while (auto batch = resumed->next()) {
    for (int64_t v : fulgur::test::to_vector(batch->tensor())) resumed_rest.push_back(v);
  }
  EXPECT_EQ(resumed_rest, rest);
  EXPECT_EQ(first_two.size() + rest.size(), 10u);
}

TEST(TorchDatasetAdapter, TrainsThroughTheTrainer) {
  TempDir dir;
  fulgur::test::LinearRegression model;
  fulgur::Trainer trainer(fulgur::test::test_options(dir));
  auto loader = fulgur::make_data_loader(fulgur::from_torch_dataset(TorchRegression(12)),
                                         {.batch_size = 4, .shuffle = true});
  auto result = trainer.fit(model, loader);
  EXPECT_EQ(result.global_step, 3);
}

TEST(TorchSamplerAdapter, NullSamplerIsAConfigError) {
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::TorchSamplerAdapter(nullptr),
                     {"TorchSamplerAdapter", "torch::data sampler"});
}

}  // namespace
