// The precision plugins: what each does to the module, its inputs and the
// computation, through the Trainer where the CPU can run it (the half
// precisions, which need CUDA, are refused on the CPU with a suggestion);
// and the deterministic flag. The loss scaler: grad_scaler_test.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <limits>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::TempDir;

// A linear model that records the dtypes it sees inside training_step.
struct DtypeProbe : fulgur::Module {
  torch::nn::Linear fc{nullptr};
  c10::ScalarType input_dtype = c10::ScalarType::Undefined;
  c10::ScalarType label_dtype = c10::ScalarType::Undefined;
  c10::ScalarType output_dtype = c10::ScalarType::Undefined;
  c10::ScalarType weight_dtype = c10::ScalarType::Undefined;
  std::vector<float> losses;

  DtypeProbe() { fc = register_module("fc", torch::nn::Linear(3, 1)); }

  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    auto& [x, y] = batch.pair();
    input_dtype = x.scalar_type();
    label_dtype = y.scalar_type();
    weight_dtype = fc->weight.scalar_type();
    auto out = fc(x);
    output_dtype = out.scalar_type();
    // LibTorch 1.13 has no bfloat16 mse_loss on the CPU: the loss in float32 there.
    const auto loss_type =
        out.scalar_type() == torch::kBFloat16 ? torch::kFloat : out.scalar_type();
    auto loss = torch::mse_loss(out.to(loss_type), y.to(loss_type));
    losses.push_back(loss.detach().to(torch::kFloat).item<float>());
    return loss;
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(parameters(), 0.05)};
  }
  // Whether the last epoch's mean loss is below the first's. Single batches
  // are too noisy to compare: the first and the last batch of a run hold
  // different samples, and from some starts the last one's loss was higher
  // while the epochs' means fell (seen in CI on LibTorch 2.6).
  [[nodiscard]] bool loss_fell(size_t batches_per_epoch) const {
    if (losses.size() < 2 * batches_per_epoch) return false;
    auto mean = [&](size_t first) {
      float sum = 0;
      for (size_t i = first; i < first + batches_per_epoch; ++i) sum += losses[i];
      return sum / static_cast<float>(batches_per_epoch);
    };
    return mean(losses.size() - batches_per_epoch) < mean(0);
  }
};

fulgur::TrainerOptions options_with(const TempDir& dir, fulgur::PrecisionFlag precision) {
  auto options = fulgur::test::test_options(dir);
  options.precision = std::move(precision);
  options.max_epochs = 3;
  return options;
}

TEST(Precision, RegistryHasEveryBuiltIn) {
  EXPECT_EQ(fulgur::precision_registry().names(),
            (std::vector<std::string>{"16-mixed", "16-true", "32-true", "64-true", "bf16-mixed",
                                      "bf16-true"}));
  for (const auto& name : fulgur::precision_registry().names()) {
    EXPECT_EQ(fulgur::precision_registry().create(name)->name(), name);
  }
}

TEST(Precision, LegacySpellingsMeanWhatLightningMeans) {
  EXPECT_EQ(fulgur::PrecisionFlag(32).canonical(), "32-true");
  EXPECT_EQ(fulgur::PrecisionFlag(64).canonical(), "64-true");
  EXPECT_EQ(fulgur::PrecisionFlag(16).canonical(), "16-mixed");
  EXPECT_EQ(fulgur::PrecisionFlag("16").canonical(), "16-mixed");
  EXPECT_EQ(fulgur::PrecisionFlag("bf16").canonical(), "bf16-mixed");
  EXPECT_TRUE(fulgur::PrecisionFlag("bf16").is_legacy());
  EXPECT_FALSE(fulgur::PrecisionFlag("bf16-true").is_legacy());
  EXPECT_EQ(fulgur::PrecisionFlag().text(), "32-true");
}

TEST(Precision, Bf16MixedRunsMatmulsInBf16AndKeepsFloat32Parameters) {
  TempDir dir;
  torch::manual_seed(3);
  DtypeProbe model;
  fulgur::Trainer trainer(options_with(dir, "bf16-mixed"));
  trainer.fit(model, fulgur::test::regression_loader(4));
  EXPECT_EQ(model.input_dtype, torch::kFloat);      // inputs are not converted
  EXPECT_EQ(model.output_dtype, torch::kBFloat16);  // autocast ran the linear in bf16
  EXPECT_EQ(model.weight_dtype, torch::kFloat);     // master weights stay float32
  for (const auto& p : model.parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
  EXPECT_TRUE(model.loss_fell(4));
  // Autocast is off again outside the step.
  EXPECT_EQ(model.fc(torch::ones({1, 3})).scalar_type(), torch::kFloat);
}

TEST(Precision, AutocastScopeNestsAndRestores) {
  auto linear = torch::nn::Linear(4, 2);
  auto x = torch::ones({2, 4});
  {
    fulgur::AutocastScope outer(c10::kCPU, at::kBFloat16);
    EXPECT_EQ(linear(x).scalar_type(), at::kBFloat16);
    {
      fulgur::AutocastScope inner(c10::kCPU, at::kBFloat16);
      EXPECT_EQ(linear(x).scalar_type(), at::kBFloat16);
    }
    EXPECT_EQ(linear(x).scalar_type(), at::kBFloat16);
  }
  EXPECT_EQ(linear(x).scalar_type(), at::kFloat);
}

TEST(Precision, SixtyFourTrueTrainsInFloat64) {
  TempDir dir;
  torch::manual_seed(3);
  DtypeProbe model;
  fulgur::Trainer trainer(options_with(dir, 64));
  trainer.fit(model, fulgur::test::regression_loader(4));
  EXPECT_EQ(model.input_dtype, torch::kDouble);
  EXPECT_EQ(model.label_dtype, torch::kDouble);
  EXPECT_EQ(model.weight_dtype, torch::kDouble);
  EXPECT_EQ(model.output_dtype, torch::kDouble);
  for (const auto& p : model.parameters()) EXPECT_EQ(p.scalar_type(), torch::kDouble);
  EXPECT_TRUE(model.loss_fell(4));
}

TEST(Precision, TruePrecisionLeavesIntegerInputsAlone) {
  fulgur::TruePrecision p(at::kDouble);
  EXPECT_EQ(p.convert_input(torch::ones({2}, torch::kLong)).scalar_type(), torch::kLong);
  EXPECT_EQ(p.convert_input(torch::ones({2}, torch::kFloat)).scalar_type(), torch::kDouble);
}

TEST(Precision, Bf16TrueConvertsTheModule) {
  TempDir dir;
  DtypeProbe model;
  fulgur::Trainer trainer(options_with(dir, "bf16-true"));
  trainer.fit(model, fulgur::test::regression_loader(4));
  EXPECT_EQ(model.input_dtype, torch::kBFloat16);
  EXPECT_EQ(model.weight_dtype, torch::kBFloat16);
  for (const auto& p : model.parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
}

TEST(Precision, HalfPrecisionsOnTheCpuSuggestBf16) {
  TempDir dir;
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer(options_with(dir, "16-mixed")),
                     {"precision=\"16-mixed\" with accelerator=\"cpu\"", "bfloat16 only",
                      "precision=\"bf16-mixed\""});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer(options_with(dir, 16)),
                     {"precision=\"16-mixed\" with accelerator=\"cpu\""});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer(options_with(dir, "16-true")),
                     {"precision=\"16-true\" with accelerator=\"cpu\"", "\"bf16-true\""});
}

TEST(Precision, Bf16MixedTrainsOnCuda_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  TempDir dir;
  torch::manual_seed(3);
  DtypeProbe model;
  auto options = options_with(dir, "bf16-mixed");
  options.accelerator = "cuda";
  fulgur::Trainer trainer(options);
  trainer.fit(model, fulgur::test::regression_loader(4));
  EXPECT_EQ(model.output_dtype, torch::kBFloat16);
  EXPECT_EQ(model.weight_dtype, torch::kFloat);
  EXPECT_TRUE(model.loss_fell(4));
}

TEST(Precision, HalfMixedTrainsOnCuda_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  TempDir dir;
  torch::manual_seed(3);
  DtypeProbe model;
  auto options = options_with(dir, "16-mixed");
  options.accelerator = "cuda";
  fulgur::Trainer trainer(options);
  trainer.fit(model, fulgur::test::regression_loader(4));
  EXPECT_EQ(model.output_dtype, torch::kHalf);
  EXPECT_EQ(model.weight_dtype, torch::kFloat);
  auto* mixed = dynamic_cast<fulgur::MixedPrecision*>(&trainer.strategy().precision());
  ASSERT_NE(mixed, nullptr);
  ASSERT_NE(mixed->scaler(), nullptr);
  // 12 steps (3 epochs of 4 batches). The first ones may overflow in fp16 at
  // the initial scale 2^16 and be skipped, each halving the scale (seen on an
  // H200: two); the last step must be finite, and no growth happens within
  // the 2000-step growth interval.
  const double scale = mixed->scaler()->get_scale();
  const double halvings = std::log2(65536.0 / scale);
  EXPECT_EQ(halvings, std::round(halvings)) << "scale " << scale << " is not 2^16 halved";
  EXPECT_GE(halvings, 0);
  EXPECT_GE(mixed->scaler()->growth_tracker(), 1) << "the last step was skipped";
  EXPECT_LE(mixed->scaler()->growth_tracker() + halvings, 12) << "scale " << scale;
  EXPECT_FALSE(mixed->scaler()->last_step_skipped());
}

// ---- deterministic.

class DeterministicFlag : public ::testing::Test {
 protected:
  void TearDown() override { at::globalContext().setDeterministicAlgorithms(false, false); }
};

TEST_F(DeterministicFlag, TrueMakesNondeterministicOpsThrow) {
  TempDir dir;
  auto options = fulgur::test::test_options(dir);
  options.deterministic = true;
  fulgur::Trainer trainer(options);
  EXPECT_TRUE(at::globalContext().deterministicAlgorithms());
  EXPECT_FALSE(at::globalContext().deterministicAlgorithmsWarnOnly());
  EXPECT_THROW(at::globalContext().alertNotDeterministic("an op"), c10::Error);
}

TEST_F(DeterministicFlag, WarnOnlyWarns) {
  TempDir dir;
  auto options = fulgur::test::test_options(dir);
  options.deterministic = "warn";
  fulgur::Trainer trainer(options);
  EXPECT_TRUE(at::globalContext().deterministicAlgorithms());
  EXPECT_TRUE(at::globalContext().deterministicAlgorithmsWarnOnly());
  EXPECT_NO_THROW(at::globalContext().alertNotDeterministic("an op"));
}

// false turns LibTorch's flag off; unset leaves it as it is (Lightning's
// None: a Trainer made only to validate turned a program's own setting off).
TEST_F(DeterministicFlag, FalseTurnsItOffAndUnsetLeavesTheProgramsOwnSetting) {
  TempDir dir;
  auto& context = at::globalContext();
  auto unset = fulgur::test::test_options(dir);
  unset.deterministic = {};
  ASSERT_FALSE(unset.deterministic.given());
  context.setDeterministicAlgorithms(true, false);
  { fulgur::Trainer trainer(unset); }
  EXPECT_TRUE(context.deterministicAlgorithms());

  auto off = fulgur::test::test_options(dir);
  off.deterministic = false;
  { fulgur::Trainer trainer(off); }
  EXPECT_FALSE(context.deterministicAlgorithms());

  auto on = fulgur::test::test_options(dir);
  on.deterministic = true;
  { fulgur::Trainer trainer(on); }
  EXPECT_TRUE(context.deterministicAlgorithms());
  { fulgur::Trainer trainer(unset); }
  EXPECT_TRUE(context.deterministicAlgorithms());
}

// One seeded, deterministic fit on `accelerator`; its trained parameters.
std::vector<at::Tensor> seeded_deterministic_run(const char* accelerator) {
  TempDir dir;
  auto options = fulgur::test::test_options(dir);
  options.accelerator = accelerator;
  options.deterministic = true;
  options.seed = 7;
  options.max_epochs = 2;
  fulgur::seed_everything(7);
  DtypeProbe model;
  fulgur::Trainer trainer(options);
  trainer.fit(model, fulgur::make_data_loader(fulgur::test::regression_dataset(32),
                                              {.batch_size = 4, .shuffle = true}));
  return fulgur::test::clone_parameters(model);
}

void expect_bit_identical(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << i;
}

TEST_F(DeterministicFlag, WithASeedTwoRunsGiveBitIdenticalWeights) {
  auto a = seeded_deterministic_run("cpu");
  auto b = seeded_deterministic_run("cpu");
  expect_bit_identical(a, b);
}

TEST_F(DeterministicFlag, OnCudaTwoSeededRunsGiveBitIdenticalWeights_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  auto a = seeded_deterministic_run("cuda");
  auto b = seeded_deterministic_run("cuda");
  expect_bit_identical(a, b);
  // cuBLAS's deterministic workspace setting was made for the run.
  const char* workspace = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  ASSERT_NE(workspace, nullptr);
}

}  // namespace
