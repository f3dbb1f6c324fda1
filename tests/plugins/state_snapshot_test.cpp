// The snapshot AsyncCheckpointIO takes at the save point: every tensor of a
// StateDict (sections, lists, tuples and dicts of tensors included) is
// replaced by a copy, so the state serializes the values of the save point
// however the live tensors change after; the copies' buffers are reused by
// the next snapshot; containers the user still holds are not changed.
#include "plugins/io/state_snapshot.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "fulgur/core/state_dict.h"
#include "support/test_support.h"

namespace {

// The state serialized and read back, as the writer thread would.
fulgur::StateDict round_trip(const fulgur::StateDict& state) {
  return fulgur::from_bytes(fulgur::to_bytes(state));
}

TEST(StateSnapshot, TheStateKeepsTheValuesOfTheSavePoint) {
  at::Tensor weight = torch::arange(6, torch::kFloat).reshape({2, 3}).requires_grad_();
  at::Tensor buffer = torch::ones({4});
  at::Tensor in_list = torch::full({3}, 7.0);
  c10::List<at::Tensor> user_list({in_list});
  fulgur::StateDict state;
  state.set("weight", weight);
  state.set_buffer("buffer", buffer);
  state.section("optimizer").set("momentum", buffer * 2);
  state.set("list", c10::IValue(user_list));
  state.set("step", c10::IValue(int64_t{12}));

  fulgur::detail::StateSnapshot snapshot;
  const size_t copied = snapshot.take(state);
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
  EXPECT_TRUE(state.is_buffer("buffer")) << "the snapshot dropped the buffer mark";

  const fulgur::StateDict in = round_trip(state);
  const at::Tensor w = in.tensor("weight");
  EXPECT_TRUE(torch::equal(w, torch::arange(6, torch::kFloat).reshape({2, 3})));
  EXPECT_TRUE(w.requires_grad());  // a parameter stays one
  EXPECT_TRUE(torch::equal(in.tensor("buffer"), torch::ones({4})));
  EXPECT_TRUE(torch::equal(in.section_at("optimizer").tensor("momentum"), torch::full({4}, 2.0)));
  EXPECT_TRUE(torch::equal(in.at("list").toTensorList().get(0), torch::full({3}, 7.0)));
  EXPECT_EQ(in.integer("step"), 12);
}

// Tensors in tuples and dicts are copied too, and the user's containers
// stay as they were.
TEST(StateSnapshot, TensorsInTuplesAndDictsAreCopied) {
  at::Tensor in_tuple = torch::full({2}, 3.0);
  at::Tensor in_dict = torch::full({5}, 4.0);
  c10::impl::GenericDict user_dict(c10::StringType::get(), c10::TensorType::get());
  user_dict.insert("avg", in_dict);
  fulgur::StateDict state;
  state.set("pair", c10::ivalue::Tuple::create(c10::IValue(in_tuple), c10::IValue(int64_t{1})));
  state.set("dict", c10::IValue(user_dict));
  fulgur::detail::StateSnapshot snapshot;
  EXPECT_EQ(snapshot.take(state), (2 + 5) * sizeof(float));
  in_tuple.add_(100);
  in_dict.add_(100);
  EXPECT_TRUE(user_dict.at("avg").toTensor().is_same(in_dict)) << "the user's dict was changed";
  const fulgur::StateDict in = round_trip(state);
  const auto& pair = in.at("pair").toTupleRef().elements();
  ASSERT_EQ(pair.size(), 2u);
  EXPECT_TRUE(torch::equal(pair[0].toTensor(), torch::full({2}, 3.0)));
  EXPECT_EQ(pair[1].toInt(), 1);
  EXPECT_TRUE(
      torch::equal(in.at("dict").toGenericDict().at("avg").toTensor(), torch::full({5}, 4.0)));
}

// Tied weights: one tensor under two keys is copied once and still shared
// after the round trip, as a synchronous save would keep it.
TEST(StateSnapshot, ATensorHeldTwiceIsCopiedOnce) {
  at::Tensor tied = torch::ones({64});
  fulgur::StateDict state;
  state.set("encoder", tied);
  state.section("head").set("decoder", tied);
  fulgur::detail::StateSnapshot snapshot;
  EXPECT_EQ(snapshot.take(state), 64 * sizeof(float));
  EXPECT_EQ(snapshot.buffers().size(), 1u);
  tied.add_(1);
  const fulgur::StateDict in = round_trip(state);
  const at::Tensor encoder = in.tensor("encoder");
  const at::Tensor decoder = in.section_at("head").tensor("decoder");
  EXPECT_TRUE(torch::equal(encoder, torch::ones({64})));
  EXPECT_EQ(encoder.data_ptr(), decoder.data_ptr());  // one storage in the file
}

TEST(StateSnapshot, TheNextSnapshotReusesTheBuffers) {
  at::Tensor live = torch::zeros({1 << 16});
  fulgur::detail::StateSnapshot snapshot;
  const void* buffer = nullptr;
  for (int save = 0; save < 3; ++save) {
    fulgur::StateDict state;
    state.set("state", live);
    snapshot.take(state);
    ASSERT_EQ(snapshot.buffers().size(), 1u);
    if (save == 0) buffer = snapshot.buffers()[0].data_ptr();
    EXPECT_EQ(snapshot.buffers()[0].data_ptr(), buffer) << "a new allocation at save " << save;
    live.add_(1);
    const fulgur::StateDict in = round_trip(state);
    EXPECT_TRUE(torch::equal(in.tensor("state"), torch::full({1 << 16}, static_cast<float>(save))));
  }
  EXPECT_EQ(snapshot.capacity_bytes(), size_t{1 << 16} * sizeof(float));
  // A state of another shape gets a buffer of its own size.
  fulgur::StateDict other;
  other.set("state", torch::zeros({10}));
  snapshot.take(other);
  EXPECT_EQ(snapshot.capacity_bytes(), size_t{10} * sizeof(float));
}

// From the second snapshot on, the copies into the kept buffers are split
// between the caller and a helper thread (over 8 MiB in all, in 4 MiB
// pieces): every tensor, a large one of odd size and one the state held
// the only reference to among them, keeps the values of its save point.
TEST(StateSnapshot, LargeStatesAreCopiedOnTwoThreadsWithTheSavePointsValues) {
  std::vector<at::Tensor> live = {torch::randn({1000003}), torch::randn({2 << 20}),
                                  torch::randn({17})};
  fulgur::detail::StateSnapshot snapshot;
  for (int save = 0; save < 3; ++save) {
    fulgur::StateDict state;
    for (size_t i = 0; i < live.size(); ++i) state.set("t" + std::to_string(i), live[i]);
    // Set only here: the snapshot must keep it alive until it is copied.
    state.set("temporary", torch::arange(3 << 20, torch::kFloat) * (save + 1));
    std::vector<at::Tensor> expected;
    for (const auto& t : live) expected.push_back(t.clone());
    snapshot.take(state);
    for (auto& t : live) t.add_(1);  // the next step
    const fulgur::StateDict in = round_trip(state);
    for (size_t i = 0; i < live.size(); ++i) {
      EXPECT_TRUE(torch::equal(in.tensor("t" + std::to_string(i)), expected[i]))
          << "save " << save << ", tensor " << i;
    }
    EXPECT_TRUE(
        torch::equal(in.tensor("temporary"), torch::arange(3 << 20, torch::kFloat) * (save + 1)))
        << "save " << save;
  }
}

// A GPU's tensors are copied on that GPU (no host memory, no transfer at
// the save point); the writer thread's serialization moves them.
TEST(StateSnapshot, CopiesOnTheTensorsDevice_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  at::Tensor live = torch::arange(1000, torch::kFloat).to(torch::kCUDA);
  fulgur::StateDict state;
  state.set("state", live);
  fulgur::detail::StateSnapshot snapshot;
  snapshot.take(state);
  ASSERT_EQ(snapshot.buffers().size(), 1u);
  EXPECT_TRUE(snapshot.buffers()[0].is_cuda());
  live.add_(1);
  const fulgur::StateDict in = round_trip(state);
  EXPECT_TRUE(torch::equal(in.tensor("state").cpu(), torch::arange(1000, torch::kFloat)));
}

}  // namespace
