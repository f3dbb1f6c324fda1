// What the fit loop does to the parameters: gradient accumulation, gradient
// clipping, LR schedulers and manual optimization, checked against values
// computed by hand.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <cmath>
#include <functional>

#include "fulgur/fulgur.h"
#include "support/process.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::parameters_close;
using fulgur::test::parameters_equal;
using fulgur::test::regression_dataset;
using fulgur::test::regression_loader;
using fulgur::test::sgd_lr;
using fulgur::test::TempDir;
using fulgur::test::test_options;

// ---- What configure_optimizers returns.

/// fc scaled by a tensor that is not a registered parameter; its optimizer
/// steps what `pick` makes of the module.
class ChoosyNet : public fulgur::Module {
 public:
  explicit ChoosyNet(std::function<std::vector<at::Tensor>(ChoosyNet&)> pick)
      : fulgur::Module("ChoosyNet"), pick_(std::move(pick)) {
    fc = register_module("fc", torch::nn::Linear(3, 1));
  }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    const auto& [x, y] = batch.pair();
    return torch::nn::functional::mse_loss(fc(x) * scale, y);
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    std::shared_ptr<torch::optim::Optimizer> sgd =
        std::make_shared<torch::optim::SGD>(pick_(*this), 0.1);
    return sgd;
  }
  torch::nn::Linear fc{nullptr};
  at::Tensor scale = torch::ones({1}, torch::requires_grad());

 private:
  std::function<std::vector<at::Tensor>(ChoosyNet&)> pick_;
};

// An optimizer of no parameters would step nothing (PyTorch refuses one);
// a tensor that is not the module's parameter trains, with a note that no
// checkpoint keeps it and no rank averages its gradient.
TEST(ConfigureOptimizers, NoParametersIsRefusedAndATensorNotTheModulesIsNoted) {
  TempDir dir;
  fulgur::Trainer trainer(test_options(dir));
  ChoosyNet empty([](ChoosyNet&) { return std::vector<at::Tensor>{}; });
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(empty, regression_loader(2)),
                     {"ChoosyNet.configure_optimizers(): optimizer 0 has no parameters"});

  ChoosyNet with_scale([](ChoosyNet& net) {
    auto params = net.parameters();
    params.push_back(net.scale);
    return params;
  });
  ::testing::internal::CaptureStderr();
  trainer.fit(with_scale, regression_loader(2));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(fulgur::test::message_contains(
      err, {"optimizer 0 steps 1 tensor(s) that are not parameters of the module (shapes [1])",
            "register_parameter()"}))
      << err;
  EXPECT_NE(with_scale.scale.item<double>(), 1.0);  // it trains all the same

  ChoosyNet own([](ChoosyNet& net) { return net.parameters(); });
  ::testing::internal::CaptureStderr();
  trainer.fit(own, regression_loader(2));
  EXPECT_EQ(::testing::internal::GetCapturedStderr().find("not parameters"), std::string::npos);
}

// ---- Gradient accumulation.

TEST(GradientAccumulation, FourMicroBatchesEqualOneBatchOfFourTimesTheSize) {
  auto data = regression_dataset(64);
  torch::manual_seed(3);
  LinearRegression accumulated({.lr = 0.1});
  LinearRegression whole({.lr = 0.1});
  fulgur::test::copy_parameters(accumulated, whole);
  auto initial = fulgur::test::clone_parameters(whole);

  TempDir dir_a;
  auto options_a = test_options(dir_a);
  options_a.accumulate_grad_batches = 4;
  fulgur::Trainer trainer_a(options_a);
  auto result_a = trainer_a.fit(accumulated, fulgur::make_data_loader(data, {.batch_size = 16}));

  TempDir dir_b;
  fulgur::Trainer trainer_b(test_options(dir_b));
  auto result_b = trainer_b.fit(whole, fulgur::make_data_loader(data, {.batch_size = 64}));

  EXPECT_EQ(result_a.global_step, 1);
  EXPECT_EQ(result_b.global_step, 1);
  EXPECT_EQ(accumulated.training_steps, 4);
  EXPECT_EQ(whole.training_steps, 1);
  EXPECT_TRUE(parameters_close(accumulated, whole, /*rtol=*/1e-5, /*atol=*/1e-6));
  // And the step did move the parameters.
  EXPECT_FALSE(torch::allclose(whole.fc->weight, initial[0]));
}

// A preemption signal within an accumulation window: the checkpoint waits
// for the window's step. It was saved after the window's first micro-batch,
// whose gradient no checkpoint holds: the resumed run stepped with the
// window's second micro-batch alone, and ended elsewhere.
struct PreemptedBySigusr1 : fulgur::LightningEnvironment {
  std::vector<int> preemption_signals() const override { return {SIGUSR1}; }
};

fulgur::FitResult fit_in_windows_of_two(const std::string& root, LinearRegression& model,
                                        const std::string& ckpt_path) {
  TempDir unused;
  auto options = test_options(unused);
  options.default_root_dir = root;
  options.accumulate_grad_batches = 2;
  options.max_epochs = 2;
  options.plugins = {std::make_shared<PreemptedBySigusr1>()};
  fulgur::Trainer trainer(options);
  return trainer.fit(model, fulgur::make_data_loader(regression_dataset(64), {.batch_size = 8}),
                     nullptr, {.ckpt_path = ckpt_path});
}

// The preempted run of the test below, in a process of its own (run by it
// through this program: the test's process has trained, and LibTorch 2.x
// refuses autograd in a child forked from it). The model is seeded as the
// test's uninterrupted one.
TEST(GradientAccumulation, PreemptedChild) {
  const char* dir = std::getenv("FULGUR_TEST_PREEMPTED_DIR");
  if (dir == nullptr) GTEST_SKIP() << "the preempted run of the test below";
  torch::manual_seed(3);
  LinearRegression model({.lr = 0.1, .momentum = 0.9});
  model.train_hook = [](LinearRegression& m, fulgur::Batch&, int64_t batch_idx) {
    // Seen at the next batch's start, the second window's first: the
    // stop came after it.
    if (m.current_epoch() == 0 && batch_idx == 1) ::raise(SIGUSR1);
  };
  fit_in_windows_of_two(dir, model, "");
  FAIL() << "the preemption signal did not end the run";
}

TEST(GradientAccumulation, APreemptionWithinAWindowSavesAfterItsStepAndResumesBitIdentical) {
  torch::manual_seed(3);
  LinearRegression uninterrupted({.lr = 0.1, .momentum = 0.9});
  TempDir whole;
  fit_in_windows_of_two(whole.path(), uninterrupted, "");
  TempDir dir;
  const auto child = fulgur::test::run_test_alone("GradientAccumulation.PreemptedChild",
                                                  {{"FULGUR_TEST_PREEMPTED_DIR", dir.path()}},
                                                  std::chrono::seconds(60));
  ASSERT_EQ(child.signal, SIGUSR1) << child.output;
  LinearRegression resumed({.lr = 0.1, .momentum = 0.9});
  const auto result = fit_in_windows_of_two(dir.path(), resumed, dir.file("checkpoints/last.ckpt"));
  EXPECT_EQ(resumed.training_steps, 16 - 4);  // saved after the window's step (batches 2, 3)
  EXPECT_EQ(result.global_step, 8);
  EXPECT_TRUE(parameters_equal(uninterrupted, resumed));
}

// ---- Gradient clipping.

/// y = x · wᵀ with a fixed weight and no bias; SGD with lr = 1, so one step
/// subtracts exactly the (clipped) gradient.
class FixedLinear : public fulgur::Module {
 public:
  explicit FixedLinear(const at::Tensor& w0) : fulgur::Module("FixedLinear") {
    fc = register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(3, 1).bias(false)));
    torch::NoGradGuard no_grad;
    fc->weight.copy_(w0);
  }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    const auto& [x, y] = batch.pair();
    return torch::nn::functional::mse_loss(fc(x), y);
  }
  void on_before_optimizer_step(torch::optim::Optimizer&) override {
    grad_at_hook = fc->weight.grad().clone();
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return fulgur::OptimizerConfig(
        std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(1.0)));
  }
  torch::nn::Linear fc{nullptr};
  at::Tensor grad_at_hook;
};

struct ClipData {
  at::Tensor w0 = torch::tensor({{1.0f, 2.0f, 3.0f}});
  at::Tensor x = torch::arange(12, torch::kFloat32).reshape({4, 3}) * 0.5;
  at::Tensor y = torch::zeros({4, 1});

  /// d mse(x wᵀ, y) / dw at w0, by autograd outside fulgur.
  at::Tensor gradient() const {
    auto w = w0.clone().requires_grad_(true);
    auto loss = torch::nn::functional::mse_loss(torch::nn::functional::linear(x, w), y);
    loss.backward();
    return w.grad().clone();
  }
  std::shared_ptr<fulgur::DataLoader> loader() const {
    return fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(x, y),
                                    {.batch_size = 4});
  }
};

TEST(GradientClipping, ByNormScalesTheGradientToTheMaxNorm) {
  ClipData data;
  auto grad = data.gradient();
  const double max_norm = 0.5;
  const double norm = grad.norm().item<double>();
  ASSERT_GT(norm, 10 * max_norm) << "the data must make clipping matter";
  auto expected = data.w0 - grad * (max_norm / (norm + 1e-6));

  TempDir dir;
  FixedLinear model(data.w0);
  auto options = test_options(dir);
  options.gradient_clip_val = max_norm;
  options.gradient_clip_algorithm = fulgur::GradientClipAlgorithm::kNorm;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, data.loader());
  ASSERT_EQ(result.global_step, 1);
  EXPECT_TRUE(torch::allclose(model.fc->weight.detach(), expected, 1e-5, 1e-6))
      << model.fc->weight << "\nexpected\n"
      << expected;
  // on_before_optimizer_step sees the gradient before clipping.
  ASSERT_TRUE(model.grad_at_hook.defined());
  EXPECT_TRUE(torch::allclose(model.grad_at_hook, grad, 1e-5, 1e-6));
}

TEST(GradientClipping, ByValueClampsEveryComponent) {
  ClipData data;
  auto grad = data.gradient();
  const double clip = 0.1;
  ASSERT_GT(grad.abs().min().item<double>(), clip) << "every component must be clipped";
  auto expected = data.w0 - grad.clamp(-clip, clip);

  TempDir dir;
  FixedLinear model(data.w0);
  auto options = test_options(dir);
  options.gradient_clip_val = clip;
  options.gradient_clip_algorithm = fulgur::GradientClipAlgorithm::kValue;
  fulgur::Trainer trainer(options);
  trainer.fit(model, data.loader());
  EXPECT_TRUE(torch::allclose(model.fc->weight.detach(), expected, 1e-5, 1e-6))
      << model.fc->weight << "\nexpected\n"
      << expected;
  EXPECT_TRUE(torch::allclose(model.grad_at_hook, grad, 1e-5, 1e-6));
}

TEST(GradientClipping, OffByDefaultAndAtZero) {
  ClipData data;
  auto expected = data.w0 - data.gradient();
  for (std::optional<double> clip : {std::optional<double>(), std::optional<double>(0.0)}) {
    TempDir dir;
    FixedLinear model(data.w0);
    auto options = test_options(dir);
    options.gradient_clip_val = clip;
    fulgur::Trainer trainer(options);
    trainer.fit(model, data.loader());
    EXPECT_TRUE(torch::allclose(model.fc->weight.detach(), expected, 1e-5, 1e-6));
  }
}

// ---- LR schedulers.

/// Halves the learning rate at every step() and counts the calls.
class HalvingScheduler : public torch::optim::LRScheduler {
 public:
  explicit HalvingScheduler(torch::optim::Optimizer& optimizer) : LRScheduler(optimizer) {}
  int64_t calls = 0;

 private:
  std::vector<double> get_lrs() override {
    ++calls;
    auto lrs = get_current_lrs();
    for (auto& lr : lrs) lr *= 0.5;
    return lrs;
  }
};

struct SchedulerCase {
  const char* name;
  fulgur::Interval interval;
  int64_t frequency;
  int64_t max_epochs;
  int64_t accumulate_grad_batches;
  int64_t expected_calls;
};

// Test names and failure messages show the case's name, not its bytes.
void PrintTo(const SchedulerCase& c, std::ostream* os) { *os << c.name; }

class SchedulerStepping : public ::testing::TestWithParam<SchedulerCase> {};

// 4 batches per epoch throughout.
TEST_P(SchedulerStepping, StepsAtTheConfiguredIntervalAndFrequency) {
  const auto& c = GetParam();
  TempDir dir;
  LinearRegression model({.lr = 0.1});
  std::shared_ptr<HalvingScheduler> scheduler;
  model.make_schedulers = [&](torch::optim::Optimizer& optimizer) {
    scheduler = std::make_shared<HalvingScheduler>(optimizer);
    return std::vector<fulgur::SchedulerConfig>{
        {.scheduler = scheduler, .interval = c.interval, .frequency = c.frequency}};
  };
  auto options = test_options(dir);
  options.max_epochs = c.max_epochs;
  options.accumulate_grad_batches = c.accumulate_grad_batches;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(4));
  ASSERT_NE(scheduler, nullptr);
  EXPECT_EQ(scheduler->calls, c.expected_calls);
  EXPECT_DOUBLE_EQ(sgd_lr(*model.optimizer),
                   0.1 * std::pow(0.5, static_cast<double>(c.expected_calls)));
}

const SchedulerCase kSchedulerCases[] = {
    {"step_every_step", fulgur::Interval::kStep, 1, 2, 1, 8},
    {"step_every_third_step", fulgur::Interval::kStep, 3, 2, 1, 2},
    {"step_with_accumulation", fulgur::Interval::kStep, 1, 2, 2, 4},
    {"epoch_every_epoch", fulgur::Interval::kEpoch, 1, 2, 1, 2},
    {"epoch_every_second_epoch", fulgur::Interval::kEpoch, 2, 3, 1, 1},
};

INSTANTIATE_TEST_SUITE_P(Intervals, SchedulerStepping, ::testing::ValuesIn(kSchedulerCases),
                         [](const ::testing::TestParamInfo<SchedulerCase>& info) {
                           return std::string(info.param.name);
                         });

/// The lr of an SGD optimizer after `steps` calls of StepLR(step_size=1,
/// gamma=0.5), computed outside fulgur.
double step_lr_after(int64_t steps) {
  auto param = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD optimizer(std::vector<at::Tensor>{param}, torch::optim::SGDOptions(0.1));
  torch::optim::StepLR scheduler(optimizer, /*step_size=*/1, /*gamma=*/0.5);
  for (int64_t i = 0; i < steps; ++i) scheduler.step();
  return sgd_lr(optimizer);
}

TEST(Schedulers, StepLRPerStepAndPerEpoch) {
  for (auto [interval, expected_calls] : {std::pair{fulgur::Interval::kStep, int64_t{8}},
                                          std::pair{fulgur::Interval::kEpoch, int64_t{2}}}) {
    TempDir dir;
    LinearRegression model({.lr = 0.1});
    model.make_schedulers = [interval = interval](torch::optim::Optimizer& optimizer) {
      return std::vector<fulgur::SchedulerConfig>{
          {.scheduler = std::make_shared<torch::optim::StepLR>(optimizer, 1, 0.5),
           .interval = interval}};
    };
    auto options = test_options(dir);
    options.max_epochs = 2;
    fulgur::Trainer trainer(options);
    trainer.fit(model, regression_loader(4));
    EXPECT_DOUBLE_EQ(sgd_lr(*model.optimizer), step_lr_after(expected_calls))
        << (interval == fulgur::Interval::kStep ? "per step" : "per epoch");
  }
}

// ---- Manual optimization.

/// Steps itself every second batch.
class ManualRegression : public LinearRegression {
 public:
  ManualRegression() { set_automatic_optimization(false); }
  at::Tensor training_step(fulgur::Batch& batch, int64_t batch_idx) override {
    events.emplace_back("training_step");
    ++training_steps;
    const auto& [x, y] = batch.pair();
    auto loss = torch::nn::functional::mse_loss(forward(x), y);
    manual_backward(loss);
    if ((batch_idx + 1) % 2 == 0) {
      optimizer_step(0);
      optimizers()[0]->zero_grad();
    }
    return loss;
  }
};

// Two optimizers fed by one backward under a loss scaler: each is unscaled
// with the scale that backward ran with. The scaler's update() came after
// each optimizer_step, so the scale grew (growth_interval=1) before the
// second optimizer's gradients were unscaled: b stepped by half its
// gradient. A second backward in the same training_step (an optimizer
// stepped twice) runs with the scale the first step's verdict set.
TEST(ManualOptimization, EveryOptimizerAScaledBackwardFedIsUnscaledByItsScale) {
  struct TwoParameters : fulgur::Module {
    at::Tensor a, b;
    bool twice = false;
    TwoParameters() : fulgur::Module("TwoParameters") {
      a = register_parameter("a", torch::zeros({1}));
      b = register_parameter("b", torch::zeros({1}));
      set_automatic_optimization(false);
    }
    at::Tensor training_step(fulgur::Batch&, int64_t) override {
      const at::Tensor loss = (a * 3 + b * 3).sum();
      manual_backward(loss);
      optimizer_step(0);
      optimizer_step(1);
      if (twice) {
        optimizers()[0]->zero_grad();
        manual_backward((a * 3).sum());
        optimizer_step(0);
      }
      for (auto& o : optimizers()) o->zero_grad();
      return loss;
    }
    fulgur::OptimizerConfig configure_optimizers() override {
      fulgur::OptimizerConfig config(
          std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{a}, 1.0));
      config.optimizers.push_back(
          std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{b}, 1.0));
      return config;
    }
  };
  for (const bool twice : {false, true}) {
    TempDir dir;
    auto options = test_options(dir);
    options.max_epochs = 1;
    options.plugins = {std::make_shared<fulgur::MixedPrecision>(
        at::kBFloat16,
        std::make_shared<fulgur::GradScaler>(fulgur::GradScalerOptions{.growth_interval = 1}))};
    TwoParameters model;
    model.twice = twice;
    fulgur::Trainer trainer(options);
    trainer.fit(model, regression_loader(2));
    // Two batches, each stepping a and b by their gradient, 3 (a twice).
    EXPECT_EQ(model.a.item<float>(), twice ? -12.0f : -6.0f) << twice;
    EXPECT_EQ(model.b.item<float>(), -6.0f) << twice;
  }
}

TEST(ManualOptimization, GlobalStepCountsOptimizerSteps) {
  TempDir dir;
  ManualRegression model;
  auto initial = fulgur::test::clone_parameters(model);
  auto options = test_options(dir);
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(10));
  EXPECT_EQ(model.training_steps, 20);
  EXPECT_EQ(result.global_step, 10);
  EXPECT_EQ(model.count("on_before_backward"), 20);
  EXPECT_EQ(model.count("on_after_backward"), 20);
  EXPECT_EQ(model.count("on_before_optimizer_step"), 10);
  EXPECT_FALSE(torch::equal(model.fc->weight, initial[0])) << "the parameters must move";
}

TEST(ManualOptimization, MaxStepsCountsManualSteps) {
  TempDir dir;
  ManualRegression model;
  auto options = test_options(dir);
  options.max_epochs = std::nullopt;
  options.max_steps = 3;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(10));
  EXPECT_EQ(result.global_step, 3);
  EXPECT_EQ(model.training_steps, 6);
}

TEST(ManualOptimization, MatchesTheSameStepsDoneByHand) {
  torch::manual_seed(5);
  ManualRegression model;
  LinearRegression reference;
  fulgur::test::copy_parameters(model, reference);
  TempDir dir;
  fulgur::Trainer trainer(test_options(dir));
  trainer.fit(model, regression_loader(4));

  // The same thing without fulgur: backward on every batch, step every second.
  torch::optim::SGD optimizer(reference.parameters(),
                              torch::optim::SGDOptions(reference.config.lr));
  auto data = regression_dataset(8);
  for (int64_t k = 0; k < 4; ++k) {
    auto x = data->tensors()[0].slice(0, 2 * k, 2 * k + 2);
    auto y = data->tensors()[1].slice(0, 2 * k, 2 * k + 2);
    torch::nn::functional::mse_loss(reference.forward(x), y).backward();
    if ((k + 1) % 2 == 0) {
      optimizer.step();
      optimizer.zero_grad();
    }
  }
  EXPECT_TRUE(parameters_close(model, reference));
}

TEST(ManualOptimization, SchedulersAreNotSteppedAutomatically) {
  TempDir dir;
  ManualRegression model;
  std::shared_ptr<HalvingScheduler> scheduler;
  model.make_schedulers = [&](torch::optim::Optimizer& optimizer) {
    scheduler = std::make_shared<HalvingScheduler>(optimizer);
    return std::vector<fulgur::SchedulerConfig>{
        {.scheduler = scheduler, .interval = fulgur::Interval::kEpoch}};
  };
  auto options = test_options(dir);
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(4));
  ASSERT_NE(scheduler, nullptr);
  EXPECT_EQ(scheduler->calls, 0);
}

TEST(ManualOptimization, AccumulationIsAConfigError) {
  TempDir dir;
  ManualRegression model;
  auto options = test_options(dir);
  options.accumulate_grad_batches = 2;
  fulgur::Trainer trainer(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, regression_loader(4)),
                     {"accumulate_grad_batches=2", "manual optimization"});
  EXPECT_EQ(model.training_steps, 0);
}

TEST(ManualOptimization, GradientClippingIsAConfigError) {
  TempDir dir;
  ManualRegression model;
  auto options = test_options(dir);
  options.gradient_clip_val = 1.0;
  fulgur::Trainer trainer(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, regression_loader(4)),
                     {"gradient_clip_val=1", "manual optimization"});
}

TEST(ManualOptimization, OptimizerIndexOutOfRangeIsAConfigError) {
  struct BadIndex : ManualRegression {
    at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
      const auto& [x, y] = batch.pair();
      auto loss = torch::nn::functional::mse_loss(forward(x), y);
      manual_backward(loss);
      optimizer_step(size_t{3});
      return loss;
    }
  };
  TempDir dir;
  BadIndex model;
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, regression_loader(2)),
                     {"optimizer_step(3)", "1 optimizer"});
}

}  // namespace
