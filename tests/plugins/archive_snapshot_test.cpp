// The snapshot AsyncCheckpointIO takes at the save point: every tensor of an
// archive (nested archives, lists, tuples and dicts of tensors included) is
// replaced by a copy, so the archive serializes the values of the save point
// however the live tensors change after; the copies' buffers are reused by
// the next snapshot; containers the user still holds are not changed.
#include "plugins/io/archive_snapshot.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace {

// The archive serialized and read back, as the writer thread would.
torch::serialize::InputArchive round_trip(torch::serialize::OutputArchive& archive) {
  std::stringstream bytes;
  archive.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  return in;
}

TEST(ArchiveSnapshot, TheArchiveKeepsTheValuesOfTheSavePoint) {
  at::Tensor weight = torch::arange(6, torch::kFloat).reshape({2, 3}).requires_grad_();
  at::Tensor buffer = torch::ones({4});
  at::Tensor in_list = torch::full({3}, 7.0);
  c10::List<at::Tensor> user_list({in_list});
  torch::serialize::OutputArchive archive, nested;
  archive.write("weight", weight);
  archive.write("buffer", buffer, /*is_buffer=*/true);
  nested.write("momentum", buffer * 2);
  archive.write("optimizer", nested);
  archive.write("list", c10::IValue(user_list));
  archive.write("step", c10::IValue(int64_t{12}));

  fulgur::detail::ArchiveSnapshot snapshot;
  const size_t copied = snapshot.take(archive);
  EXPECT_EQ(copied, (6 + 4 + 4 + 3) * sizeof(float));
  EXPECT_EQ(snapshot.capacity_bytes(), copied);
  // The next step changes everything in place.
  {
    torch::NoGradGuard no_grad;
    weight.add_(100);
  }
  buffer.add_(100);
  in_list.add_(100);
  EXPECT_TRUE(user_list.get(0).is_same(in_list)) << "the user's list was changed";

  auto in = round_trip(archive);
  at::Tensor w, b, l;
  in.read("weight", w);
  in.read("buffer", b, /*is_buffer=*/true);
  EXPECT_TRUE(torch::equal(w, torch::arange(6, torch::kFloat).reshape({2, 3})));
  EXPECT_TRUE(w.requires_grad());  // a parameter stays one
  EXPECT_TRUE(torch::equal(b, torch::ones({4})));
  torch::serialize::InputArchive opt;
  in.read("optimizer", opt);
  at::Tensor m;
  opt.read("momentum", m);
  EXPECT_TRUE(torch::equal(m, torch::full({4}, 2.0)));
  c10::IValue list, step;
  in.read("list", list);
  in.read("step", step);
  EXPECT_TRUE(torch::equal(list.toTensorList().get(0), torch::full({3}, 7.0)));
  EXPECT_EQ(step.toInt(), 12);
}

// Tied weights: one tensor under two keys is copied once and still shared
// after the round trip, as a synchronous save would keep it.
TEST(ArchiveSnapshot, ATensorHeldTwiceIsCopiedOnce) {
  at::Tensor tied = torch::ones({64});
  torch::serialize::OutputArchive archive, nested;
  archive.write("encoder", tied);
  nested.write("decoder", tied);
  archive.write("head", nested);
  fulgur::detail::ArchiveSnapshot snapshot;
  EXPECT_EQ(snapshot.take(archive), 64 * sizeof(float));
  EXPECT_EQ(snapshot.buffers().size(), 1u);
  tied.add_(1);
  auto in = round_trip(archive);
  at::Tensor encoder, decoder;
  torch::serialize::InputArchive head;
  in.read("encoder", encoder);
  in.read("head", head);
  head.read("decoder", decoder);
  EXPECT_TRUE(torch::equal(encoder, torch::ones({64})));
  EXPECT_EQ(encoder.data_ptr(), decoder.data_ptr());  // one storage in the file
}

TEST(ArchiveSnapshot, TheNextSnapshotReusesTheBuffers) {
  at::Tensor state = torch::zeros({1 << 16});
  fulgur::detail::ArchiveSnapshot snapshot;
  const void* buffer = nullptr;
  for (int save = 0; save < 3; ++save) {
    torch::serialize::OutputArchive archive;
    archive.write("state", state);
    snapshot.take(archive);
    ASSERT_EQ(snapshot.buffers().size(), 1u);
    if (save == 0) buffer = snapshot.buffers()[0].data_ptr();
    EXPECT_EQ(snapshot.buffers()[0].data_ptr(), buffer) << "a new allocation at save " << save;
    state.add_(1);
    auto in = round_trip(archive);
    at::Tensor saved;
    in.read("state", saved);
    EXPECT_TRUE(torch::equal(saved, torch::full({1 << 16}, static_cast<float>(save))));
  }
  EXPECT_EQ(snapshot.capacity_bytes(), size_t{1 << 16} * sizeof(float));
  // A state of another shape gets a buffer of its own size.
  torch::serialize::OutputArchive other;
  other.write("state", torch::zeros({10}));
  snapshot.take(other);
  EXPECT_EQ(snapshot.capacity_bytes(), size_t{10} * sizeof(float));
}

// From the second snapshot on, the copies into the kept buffers are split
// between the caller and a helper thread (over 8 MiB in all, in 4 MiB
// pieces): every tensor, a large one of odd size and one the archive held
// the only reference to among them, keeps the values of its save point.
TEST(ArchiveSnapshot, LargeStatesAreCopiedOnTwoThreadsWithTheSavePointsValues) {
  std::vector<at::Tensor> live = {torch::randn({1000003}), torch::randn({2 << 20}),
                                  torch::randn({17})};
  fulgur::detail::ArchiveSnapshot snapshot;
  for (int save = 0; save < 3; ++save) {
    torch::serialize::OutputArchive archive;
    for (size_t i = 0; i < live.size(); ++i) archive.write("t" + std::to_string(i), live[i]);
    // Written only here: the snapshot must keep it alive until it is copied.
    archive.write("temporary", torch::arange(3 << 20, torch::kFloat) * (save + 1));
    std::vector<at::Tensor> expected;
    for (const auto& t : live) expected.push_back(t.clone());
    snapshot.take(archive);
    for (auto& t : live) t.add_(1);  // the next step
    auto in = round_trip(archive);
    for (size_t i = 0; i < live.size(); ++i) {
      at::Tensor saved;
      in.read("t" + std::to_string(i), saved);
      EXPECT_TRUE(torch::equal(saved, expected[i])) << "save " << save << ", tensor " << i;
    }
    at::Tensor temporary;
    in.read("temporary", temporary);
    EXPECT_TRUE(torch::equal(temporary, torch::arange(3 << 20, torch::kFloat) * (save + 1)))
        << "save " << save;
  }
}

// A GPU's tensors are copied on that GPU (no host memory, no transfer at
// the save point); the writer thread's serialization moves them.
TEST(ArchiveSnapshot, CopiesOnTheTensorsDevice_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  at::Tensor state = torch::arange(1000, torch::kFloat).to(torch::kCUDA);
  torch::serialize::OutputArchive archive;
  archive.write("state", state);
  fulgur::detail::ArchiveSnapshot snapshot;
  snapshot.take(archive);
  ASSERT_EQ(snapshot.buffers().size(), 1u);
  EXPECT_TRUE(snapshot.buffers()[0].is_cuda());
  state.add_(1);
  auto in = round_trip(archive);
  at::Tensor saved;
  in.read("state", saved);
  EXPECT_TRUE(torch::equal(saved.cpu(), torch::arange(1000, torch::kFloat)));
}

}  // namespace
