// The dynamic loss scaler of 16-mixed on CPU tensors: unscale, skip, back off
// and grow, and its state in checkpoints (through MixedPrecision).
#include "fulgur/plugins/precision/grad_scaler.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

// ---- GradScaler, on CPU tensors.

struct ScalerFixture {
  at::Tensor w = torch::tensor({1.0f, 2.0f}).requires_grad_();
  torch::optim::SGD sgd{std::vector<at::Tensor>{w}, torch::optim::SGDOptions(0.5)};
  void backward(fulgur::GradScaler& scaler, float factor) {
    sgd.zero_grad();
    auto loss = (w * factor).sum();  // d loss / d w = factor
    scaler.scale(loss).backward();
  }
};

TEST(GradScaler, ScalesTheLossAndUnscalesTheGradients) {
  fulgur::GradScaler scaler({.init_scale = 1024.0});
  ScalerFixture f;
  f.backward(scaler, 3.0f);
  EXPECT_TRUE(torch::allclose(f.w.grad(), torch::full({2}, 3.0f * 1024.0f)));
  scaler.unscale(f.sgd);
  EXPECT_TRUE(torch::allclose(f.w.grad(), torch::full({2}, 3.0f)));
  EXPECT_TRUE(scaler.step(f.sgd));  // already unscaled: not divided twice
  EXPECT_TRUE(torch::allclose(f.w.detach(), torch::tensor({1.0f - 1.5f, 2.0f - 1.5f})));
  scaler.update();
  EXPECT_FALSE(scaler.last_step_skipped());
  EXPECT_EQ(scaler.get_scale(), 1024.0);
  EXPECT_EQ(scaler.growth_tracker(), 1);
}

// A sparse gradient (an Embedding's, sparse=true): its values are unscaled,
// as PyTorch's scaler does (the unscale ran LibTorch's dense kernels on it:
// "Could not run 'aten::ne.Scalar' ... 'SparseCPU' backend").
TEST(GradScaler, UnscalesASparseGradientsValues) {
  torch::nn::Embedding table(torch::nn::EmbeddingOptions(4, 2).sparse(true));
  const at::Tensor before = table->weight.detach().clone();
  fulgur::optim::SGD sgd(table->parameters(), torch::optim::SGDOptions(1.0));
  fulgur::GradScaler scaler({.init_scale = 8.0});
  scaler.scale(table(torch::tensor({1, 1}, torch::kLong)).sum()).backward();
  ASSERT_TRUE(table->weight.grad().is_sparse());
  EXPECT_TRUE(scaler.step(sgd));
  scaler.update();
  EXPECT_FALSE(scaler.last_step_skipped());
  at::Tensor expected = before.clone();
  expected[1] -= 2.0;  // looked up twice, gradient 1 each time
  EXPECT_TRUE(torch::allclose(table->weight.detach(), expected)) << table->weight;
  // An inf among the values is found.
  sgd.zero_grad();
  scaler.scale(table(torch::tensor({2}, torch::kLong)).sum() * INFINITY).backward();
  EXPECT_FALSE(scaler.step(sgd));
  scaler.update();
  EXPECT_TRUE(scaler.last_step_skipped());
}

// Gradients on two GPUs (a module placed across them under `manual`): each
// device's are unscaled by its own kernel call, their verdicts joined.
TEST(GradScaler, UnscalesGradientsOnSeveralDevices_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(2);
  at::Tensor a = torch::ones({2}, torch::device(torch::Device(torch::kCUDA, 0))).requires_grad_();
  at::Tensor b = torch::ones({2}, torch::device(torch::Device(torch::kCUDA, 1))).requires_grad_();
  torch::optim::SGD sgd({a, b}, torch::optim::SGDOptions(1.0));
  fulgur::GradScaler scaler({.init_scale = 4.0});
  (scaler.scale(a.sum() * 3) + scaler.scale(b.sum() * 3).to(a.device())).backward();
  EXPECT_TRUE(scaler.step(sgd));
  scaler.update();
  EXPECT_TRUE(torch::allclose(a.detach().cpu(), torch::full({2}, -2.0f)));
  EXPECT_TRUE(torch::allclose(b.detach().cpu(), torch::full({2}, -2.0f)));
}

TEST(GradScaler, SkipsTheStepOnInfOrNanAndBacksOff) {
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    fulgur::GradScaler scaler({.init_scale = 1024.0, .backoff_factor = 0.25});
    ScalerFixture f;
    f.backward(scaler, 1.0f);
    scaler.step(f.sgd);
    scaler.update();
    EXPECT_EQ(scaler.growth_tracker(), 1);
    f.backward(scaler, 1.0f);
    f.w.mutable_grad()[1].fill_(bad);
    const auto before = f.w.detach().clone();
    EXPECT_FALSE(scaler.step(f.sgd));
    EXPECT_TRUE(torch::equal(f.w.detach(), before)) << "the step was not skipped";
    scaler.update();
    EXPECT_TRUE(scaler.last_step_skipped());
    EXPECT_EQ(scaler.get_scale(), 256.0);
    EXPECT_EQ(scaler.growth_tracker(), 0);
  }
}

TEST(GradScaler, GrowsAfterGrowthIntervalFiniteSteps) {
  fulgur::GradScaler scaler({.init_scale = 8.0, .growth_factor = 2.0, .growth_interval = 3});
  ScalerFixture f;
  std::vector<double> scales;
  for (int i = 0; i < 7; ++i) {
    f.backward(scaler, 1.0f);
    EXPECT_TRUE(scaler.step(f.sgd));
    scaler.update();
    scales.push_back(scaler.get_scale());
  }
  EXPECT_EQ(scales, (std::vector<double>{8, 8, 16, 16, 16, 32, 32}));
}

TEST(GradScaler, UpdateJudgesEveryOptimizerOfTheIteration) {
  fulgur::GradScaler scaler({.init_scale = 64.0});
  ScalerFixture a, b;
  a.backward(scaler, 1.0f);
  b.backward(scaler, 1.0f);
  b.w.mutable_grad()[0].fill_(std::numeric_limits<float>::infinity());
  EXPECT_TRUE(scaler.step(a.sgd));
  EXPECT_FALSE(scaler.step(b.sgd));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32.0);
}

TEST(GradScaler, UnscalingTwiceInOneIterationIsAnError) {
  fulgur::GradScaler scaler;
  ScalerFixture f;
  f.backward(scaler, 1.0f);
  scaler.unscale(f.sgd);
  EXPECT_THROWS_WITH(fulgur::ConfigError, scaler.unscale(f.sgd), {"already unscaled"});
  scaler.update();
  f.backward(scaler, 1.0f);
  EXPECT_NO_THROW(scaler.unscale(f.sgd));
}

TEST(GradScaler, StateRoundTripsThroughAStateDictAndAnArchive) {
  fulgur::GradScaler scaler({.init_scale = 128.0, .growth_interval = 10});
  ScalerFixture f;
  for (int i = 0; i < 3; ++i) {
    f.backward(scaler, 1.0f);
    scaler.step(f.sgd);
    scaler.update();
  }
  f.backward(scaler, 1.0f);
  f.w.mutable_grad().fill_(std::nanf(""));
  scaler.step(f.sgd);
  scaler.update();
  f.backward(scaler, 1.0f);
  scaler.step(f.sgd);
  scaler.update();
  const fulgur::StateDict state = scaler.state_dict();
  EXPECT_EQ(state.keys(), (std::vector<std::string>{"scale", "growth_tracker"}));
  EXPECT_FALSE(state.is_buffer("scale"));
  EXPECT_FALSE(state.is_buffer("growth_tracker"));
  {
    fulgur::GradScaler restored({.init_scale = 128.0, .growth_interval = 10});
    restored.load_state_dict(state);
    EXPECT_EQ(restored.get_scale(), 64.0);
    EXPECT_EQ(restored.growth_tracker(), 1);
  }
  // Through the archive codec (the checkpoint's bytes).
  fulgur::GradScaler restored({.init_scale = 128.0, .growth_interval = 10});
  restored.load_state_dict(fulgur::from_bytes(fulgur::to_bytes(state)));
  EXPECT_EQ(restored.get_scale(), 64.0);
  EXPECT_EQ(restored.growth_tracker(), 1);

  fulgur::StateDict empty;
  empty.set("other", torch::zeros({1}));
  EXPECT_THROWS_WITH(fulgur::CheckpointError,
                     restored.load_state_dict(fulgur::from_bytes(fulgur::to_bytes(empty))),
                     {"no GradScaler state", "16-mixed"});
  // Present but not a tensor: the entry is named.
  fulgur::StateDict wrong;
  wrong.set("scale", 64.0);
  wrong.set("growth_tracker", torch::zeros({1}, torch::kInt32));
  EXPECT_THROWS_WITH(fulgur::CheckpointError, restored.load_state_dict(wrong),
                     {"\"scale\"", "a tensor"});
}

TEST(GradScaler, RejectsInvalidOptionsAllAtOnce) {
  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      fulgur::GradScaler(
          {.init_scale = 0.0, .growth_factor = 1.0, .backoff_factor = 1.5, .growth_interval = 0}),
      {"init_scale=0", "growth_factor=1", "backoff_factor=1.5", "growth_interval=0"});
}

TEST(MixedPrecision, HalfHasAScalerWhoseStateTravelsInCheckpoints) {
  fulgur::MixedPrecision half(at::kHalf);
  fulgur::MixedPrecision bf16(at::kBFloat16);
  ASSERT_NE(half.scaler(), nullptr);
  EXPECT_EQ(bf16.scaler(), nullptr);
  // The 16-mixed training step without autocast (CPU): backward scales,
  // optimizer_step unscales and steps, update adjusts.
  ScalerFixture f;
  f.sgd.zero_grad();
  half.backward((f.w * 2.0f).sum());
  EXPECT_TRUE(torch::allclose(f.w.grad(), torch::full({2}, 2.0f * 65536.0f)));
  EXPECT_TRUE(half.optimizer_step(f.sgd));
  EXPECT_TRUE(torch::allclose(f.w.detach(), torch::tensor({0.0f, 1.0f})));
  half.update();
  const fulgur::StateDict state = fulgur::from_bytes(fulgur::to_bytes(half.state_dict()));
  fulgur::MixedPrecision other(at::kHalf);
  EXPECT_NO_THROW(other.load_state_dict(state));
  EXPECT_EQ(other.scaler()->growth_tracker(), 1);
  EXPECT_TRUE(bf16.state_dict().empty());
}

}  // namespace
