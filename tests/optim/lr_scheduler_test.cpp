// Learning-rate schedules: LambdaLR, ReduceLROnPlateau and PyTorch's
// closed-form schedules against values worked out by hand; a run resumed
// from any checkpoint (mid-epoch, the last batch of an epoch before its
// scheduler step, after an epoch boundary) ends bit-identical to the
// uninterrupted one under a per-epoch, a per-step, a metric-driven, a
// callback-driven, a one-cycle (momentum too) and a sequential schedule; and
// the errors of a SchedulerConfig that cannot work.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using fulgur::test::list_files;
using fulgur::test::parameters_equal;
using fulgur::test::regression_dataset;
using fulgur::test::TempDir;
using fulgur::test::test_options;

std::vector<double> lrs(const torch::optim::Optimizer& optimizer) {
  std::vector<double> out;
  for (const auto& group : optimizer.param_groups()) out.push_back(group.options().get_lr());
  return out;
}

std::shared_ptr<torch::optim::SGD> two_group_sgd(double lr0, double lr1) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{torch::zeros({2}, torch::requires_grad())},
                      std::make_unique<torch::optim::SGDOptions>(lr0));
  groups.emplace_back(std::vector<at::Tensor>{torch::zeros({3}, torch::requires_grad())},
                      std::make_unique<torch::optim::SGDOptions>(lr1));
  return std::make_shared<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(lr0));
}

// ---- The schedules' values.

TEST(LambdaLR, AppliesFactorZeroAtOnceAndFactorNAfterNSteps) {
  auto sgd = two_group_sgd(0.5, 2.0);
  fulgur::LambdaLR schedule(*sgd, [](int64_t step) { return 1.0 / (step + 2.0); });
  EXPECT_THAT(lrs(*sgd), ::testing::ElementsAre(0.25, 1.0));
  schedule.step();
  EXPECT_THAT(lrs(*sgd), ::testing::ElementsAre(0.5 / 3.0, 2.0 / 3.0));
  schedule.step();
  schedule.step();
  EXPECT_THAT(lrs(*sgd), ::testing::ElementsAre(0.5 / 5.0, 2.0 / 5.0));
  EXPECT_THAT(schedule.base_lrs(), ::testing::ElementsAre(0.5, 2.0));
}

// A group added after the scheduler was made (BaseFinetuning's) keeps the
// rate it is given, as under PyTorch's LambdaLR; the first ones follow the
// schedule.
TEST(LambdaLR, AGroupAddedLaterKeepsItsOwnRate) {
  auto sgd = two_group_sgd(0.5, 2.0);
  fulgur::LambdaLR schedule(*sgd, [](int64_t step) { return 1.0 / (step + 1.0); });
  sgd->add_param_group(torch::optim::OptimizerParamGroup(
      std::vector<at::Tensor>{torch::zeros({4}, torch::requires_grad())},
      std::make_unique<torch::optim::SGDOptions>(0.125)));
  schedule.step();
  EXPECT_THAT(lrs(*sgd), ::testing::ElementsAre(0.25, 1.0, 0.125));
  sgd->param_groups()[2].options().set_lr(0.0625);
  schedule.step();
  EXPECT_THAT(lrs(*sgd), ::testing::ElementsAre(0.5 / 3.0, 2.0 / 3.0, 0.0625));
}

TEST(LambdaLR, RefusesAnEmptyFunction) {
  auto sgd = two_group_sgd(0.5, 2.0);
  EXPECT_THROW(fulgur::LambdaLR(*sgd, nullptr), fulgur::ConfigError);
}

/// The rates of group 0 after 0, 1, ... `count` - 1 steps of `schedule`.
std::vector<double> rates_over(torch::optim::LRScheduler& schedule,
                               const torch::optim::Optimizer& optimizer, int count) {
  std::vector<double> out;
  for (int i = 0; i < count; ++i) {
    if (i > 0) schedule.step();
    out.push_back(lrs(optimizer)[0]);
  }
  return out;
}

#define EXPECT_RATES(actual, ...)                                        \
  EXPECT_THAT(actual, ::testing::Pointwise(::testing::DoubleNear(1e-12), \
                                           std::vector<double>(__VA_ARGS__)))

// PyTorch's StepLR decays after step_size steps (LibTorch's a step later).
TEST(ClosedFormLR, StepMultiStepAndExponentialDecayAsPyTorchs) {
  auto sgd = two_group_sgd(1.0, 2.0);
  fulgur::StepLR step(*sgd, 2, 0.1);
  EXPECT_RATES(rates_over(step, *sgd, 6), {1, 1, 0.1, 0.1, 0.01, 0.01});
  EXPECT_NEAR(lrs(*sgd)[1], 0.02, 1e-12);
  EXPECT_EQ(step.steps(), 5);

  auto sgd2 = two_group_sgd(1.0, 2.0);
  fulgur::MultiStepLR multi(*sgd2, {2, 5}, 0.5);
  EXPECT_RATES(rates_over(multi, *sgd2, 7), {1, 1, 0.5, 0.5, 0.5, 0.25, 0.25});

  auto sgd3 = two_group_sgd(1.0, 2.0);
  fulgur::ExponentialLR exponential(*sgd3, 0.5);
  EXPECT_RATES(rates_over(exponential, *sgd3, 4), {1, 0.5, 0.25, 0.125});
  EXPECT_NEAR(lrs(*sgd3)[1], 0.25, 1e-12);
}

TEST(ClosedFormLR, CosineLinearConstantAndPolynomialShapes) {
  auto sgd = two_group_sgd(1.0, 2.0);
  // Down to eta_min at t_max, and up again after it, as PyTorch's.
  fulgur::CosineAnnealingLR cosine(*sgd, 4, 0.1);
  EXPECT_RATES(rates_over(cosine, *sgd, 9), {1, 0.1 + 0.9 * (1 + std::cos(M_PI / 4)) / 2, 0.55,
                                             0.1 + 0.9 * (1 + std::cos(3 * M_PI / 4)) / 2, 0.1,
                                             0.1 + 0.9 * (1 + std::cos(3 * M_PI / 4)) / 2, 0.55,
                                             0.1 + 0.9 * (1 + std::cos(M_PI / 4)) / 2, 1});

  // Periods of 2, 4, 8 steps, each restarting at the initial rate.
  auto sgd2 = two_group_sgd(1.0, 2.0);
  fulgur::CosineAnnealingWarmRestarts restarts(*sgd2, 2, 2);
  EXPECT_RATES(rates_over(restarts, *sgd2, 8),
               {1, 0.5, 1, 0.5 + std::cos(M_PI / 4) / 2, 0.5, 0.5 + std::cos(3 * M_PI / 4) / 2, 1,
                0.5 + std::cos(M_PI / 8) / 2});
  auto sgd3 = two_group_sgd(1.0, 2.0);
  fulgur::CosineAnnealingWarmRestarts every_two(*sgd3, 2);
  EXPECT_RATES(rates_over(every_two, *sgd3, 5), {1, 0.5, 1, 0.5, 1});

  auto sgd4 = two_group_sgd(1.0, 2.0);
  fulgur::LinearLR linear(*sgd4, 0.25, 1.0, 4);
  EXPECT_RATES(rates_over(linear, *sgd4, 6), {0.25, 0.4375, 0.625, 0.8125, 1, 1});
  EXPECT_NEAR(lrs(*sgd4)[1], 2.0, 1e-12);

  auto sgd5 = two_group_sgd(1.0, 2.0);
  fulgur::ConstantLR constant(*sgd5, 0.5, 2);
  EXPECT_RATES(rates_over(constant, *sgd5, 4), {0.5, 0.5, 1, 1});

  auto sgd6 = two_group_sgd(1.0, 2.0);
  fulgur::PolynomialLR polynomial(*sgd6, 4, 2.0);
  EXPECT_RATES(rates_over(polynomial, *sgd6, 6), {1, 0.5625, 0.25, 0.0625, 0, 0});
}

// max_lr 1, div_factor 10 (start at 0.1), final_div_factor 100 (end at
// 0.001); the rise ends at step 0.3 x 10 - 1 = 2 and the fall at step 9.
TEST(OneCycleLR, RisesToMaxLrThenAnnealsAndMovesTheMomentumTheOtherWay) {
  auto sgd = two_group_sgd(7.0, 7.0);
  fulgur::OneCycleLR cycle(
      *sgd,
      {.max_lr = {1.0, 2.0}, .total_steps = 10, .div_factor = 10.0, .final_div_factor = 100.0});
  auto momentum = [&] {
    return static_cast<torch::optim::SGDOptions&>(sgd->param_groups()[0].options()).momentum();
  };
  EXPECT_NEAR(lrs(*sgd)[0], 0.1, 1e-12);  // the optimizer's 7 is not used
  EXPECT_NEAR(lrs(*sgd)[1], 0.2, 1e-12);
  EXPECT_NEAR(momentum(), 0.95, 1e-12);
  cycle.step();
  EXPECT_NEAR(lrs(*sgd)[0], 0.55, 1e-12);
  EXPECT_NEAR(momentum(), 0.9, 1e-12);
  cycle.step();
  EXPECT_NEAR(lrs(*sgd)[0], 1.0, 1e-12);
  EXPECT_NEAR(lrs(*sgd)[1], 2.0, 1e-12);
  EXPECT_NEAR(momentum(), 0.85, 1e-12);
  for (int i = 0; i < 7; ++i) cycle.step();  // step 9: the end of the fall
  EXPECT_NEAR(lrs(*sgd)[0], 0.001, 1e-12);
  EXPECT_NEAR(momentum(), 0.95, 1e-12);
  cycle.step();  // step 10 = total_steps: allowed, as PyTorch's
  const auto before = lrs(*sgd);
  EXPECT_THROWS_WITH(fulgur::ConfigError, cycle.step(),
                     {"scheduler step 11 is beyond total_steps=10", "estimated_stepping_batches"});
  EXPECT_EQ(lrs(*sgd), before);  // a refused step changes nothing
  EXPECT_EQ(cycle.steps(), 10);

  // Adam's first beta moves; the second stays.
  auto adam = std::make_shared<torch::optim::Adam>(
      std::vector<at::Tensor>{torch::zeros({2}, torch::requires_grad())},
      torch::optim::AdamOptions(1.0).betas({0.5, 0.99}));
  fulgur::OneCycleLR adam_cycle(
      *adam,
      {.max_lr = {1.0}, .total_steps = 10, .anneal_strategy = "linear", .three_phase = true});
  adam_cycle.step();
  const auto betas =
      static_cast<torch::optim::AdamOptions&>(adam->param_groups()[0].options()).betas();
  EXPECT_NEAR(std::get<0>(betas), 0.9, 1e-12);
  EXPECT_EQ(std::get<1>(betas), 0.99);
  EXPECT_NEAR(lrs(*adam)[0], (1.0 - 0.04) * 0.5 + 0.04, 1e-12);
}

// Chained as PyTorch's step(): two schedules on one optimizer multiply, a
// cut ReduceLROnPlateau made stays through a finished warm-up, and a
// multiplicative schedule scales a group added later (a cosine does not).
TEST(ClosedFormLR, ChainedSchedulesMultiplyAndKeepOtherChanges) {
  auto sgd = two_group_sgd(1.0, 2.0);
  fulgur::LinearLR warmup(*sgd, 0.5, 1.0, 2);
  fulgur::ExponentialLR decay(*sgd, 0.5);
  std::vector<double> seen = {lrs(*sgd)[0]};
  for (int i = 0; i < 3; ++i) {
    warmup.step();
    decay.step();
    seen.push_back(lrs(*sgd)[0]);
  }
  EXPECT_RATES(seen, {0.5, 0.75 * 0.5, 0.25, 0.125});
  EXPECT_NEAR(lrs(*sgd)[1], 0.25, 1e-12);

  auto sgd2 = two_group_sgd(1.0, 2.0);
  fulgur::LinearLR warmup2(*sgd2, 0.5, 1.0, 1);
  fulgur::ReduceLROnPlateau plateau(*sgd2, {.factor = 0.1, .patience = 0});
  warmup2.step();  // 1.0: warmed up
  plateau.step(1.0);
  plateau.step(2.0);  // worse: cut to 0.1
  warmup2.step();     // factor 1 -> 1: the cut stays
  EXPECT_NEAR(lrs(*sgd2)[0], 0.1, 1e-12);

  auto sgd3 = two_group_sgd(1.0, 2.0);
  fulgur::StepLR halving(*sgd3, 1, 0.5);
  fulgur::CosineAnnealingLR cosine(*sgd3, 4);
  sgd3->add_param_group(torch::optim::OptimizerParamGroup(
      std::vector<at::Tensor>{torch::zeros({4}, torch::requires_grad())},
      std::make_unique<torch::optim::SGDOptions>(0.125)));
  halving.step();
  EXPECT_NEAR(lrs(*sgd3)[2], 0.0625, 1e-15);
  cosine.step();
  EXPECT_NEAR(lrs(*sgd3)[2], 0.0625, 1e-15);
  EXPECT_NEAR(lrs(*sgd3)[0], 0.5 * (0.5 + std::cos(M_PI / 4) / 2), 1e-12);
}

// A warm-up then a cosine, each from its own step 0 and on the first's
// initial rates (the cosine was built after the warm-up lowered the rate).
TEST(SequentialLR, RunsItsSchedulersInTurnOnTheFirstsInitialRates) {
  auto sgd = two_group_sgd(1.0, 2.0);
  auto warmup = std::make_shared<fulgur::LinearLR>(*sgd, 0.5, 1.0, 2);
  auto cosine = std::make_shared<fulgur::CosineAnnealingLR>(*sgd, 4);
  fulgur::SequentialLR sequence(*sgd, {warmup, cosine}, {2});
  EXPECT_RATES(rates_over(sequence, *sgd, 7), {0.5, 0.75, 1, 0.5 + std::cos(M_PI / 4) / 2, 0.5,
                                               0.5 + std::cos(3 * M_PI / 4) / 2, 0});
  EXPECT_TRUE(fulgur::SequentialLR::in_sequence(*warmup));
  EXPECT_FALSE(fulgur::SequentialLR::in_sequence(sequence));
}

// The initial rates are the optimizer's from before the first of its
// schedulers was built, whatever their order in the list (PyTorch's
// initial_lr): a cosine built after a warm-up lowered the rate, and run
// first, starts from 1, not 0.5.
TEST(SequentialLR, TheInitialRatesDoNotDependOnTheOrderOfBuilding) {
  auto sgd = two_group_sgd(1.0, 2.0);
  auto warmup = std::make_shared<fulgur::LinearLR>(*sgd, 0.5, 1.0, 2);
  auto cosine = std::make_shared<fulgur::CosineAnnealingLR>(*sgd, 4);
  fulgur::SequentialLR sequence(*sgd, {cosine, warmup}, {4});
  EXPECT_RATES(rates_over(sequence, *sgd, 7), {1, 0.5 + std::cos(M_PI / 4) / 2, 0.5,
                                               0.5 + std::cos(3 * M_PI / 4) / 2, 0.5, 0.75, 1});
  EXPECT_NEAR(lrs(*sgd)[1], 2.0, 1e-12);
}

// A SequentialLR that is gone lets its schedulers go.
TEST(SequentialLR, ItsSchedulersAreFreeOnceItIsGone) {
  auto sgd = two_group_sgd(1.0, 2.0);
  auto warmup = std::make_shared<fulgur::LinearLR>(*sgd, 0.5, 1.0, 2);
  auto cosine = std::make_shared<fulgur::CosineAnnealingLR>(*sgd, 4);
  { fulgur::SequentialLR first(*sgd, {warmup, cosine}, {2}); }
  EXPECT_FALSE(fulgur::SequentialLR::in_sequence(*warmup));
  EXPECT_NO_THROW(fulgur::SequentialLR(*sgd, {warmup, cosine}, {3}));
}

TEST(ClosedFormLR, EveryBadOptionIsNamed) {
  auto sgd = two_group_sgd(1.0, 2.0);
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::StepLR(*sgd, 0), {"StepLR: step_size=0"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::StepLR(*sgd, 3, std::nan("")),
                     {"StepLR: gamma=nan"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::MultiStepLR(*sgd, {5, 5}),
                     {"MultiStepLR: milestones={5, 5}", "each after the one before"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::MultiStepLR(*sgd, {}), {"no milestones"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::ExponentialLR(*sgd, -0.5),
                     {"ExponentialLR: gamma=-0.5"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::CosineAnnealingLR(*sgd, 0, -1.0),
                     {"t_max=0", "eta_min=-1"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::CosineAnnealingWarmRestarts(*sgd, 0, 0),
                     {"t_0=0", "t_mult=0"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::LinearLR(*sgd, 0.0, 1.5, 0),
                     {"start_factor=0", "end_factor=1.5", "total_iters=0"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::ConstantLR(*sgd, 2.0, -1),
                     {"ConstantLR: factor=2", "total_iters=-1"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::PolynomialLR(*sgd, 0, -1.0),
                     {"total_iters=0", "power=-1"});
  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      fulgur::OneCycleLR(*sgd, {.max_lr = {1.0, 2.0, 3.0},
                                .pct_start = 1.5,
                                .anneal_strategy = "cosine",
                                .div_factor = 0.0,
                                .base_momentum = 0.99}),
      {"max_lr has 3 value(s) for 2 parameter group(s)", "total_steps=0", "pct_start=1.5",
       "anneal_strategy=\"cosine\"", "div_factor=0", "base_momentum=0.99"});
  auto adagrad = std::make_shared<torch::optim::Adagrad>(
      std::vector<at::Tensor>{torch::zeros({2}, torch::requires_grad())});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::OneCycleLR(*adagrad, {.max_lr = {1.0}, .total_steps = 5}),
                     {"has no momentum or first beta", "cycle_momentum=false"});
  EXPECT_NO_THROW(
      fulgur::OneCycleLR(*adagrad, {.max_lr = {1.0}, .total_steps = 5, .cycle_momentum = false}));
  // Refused before anything is changed: the rates are the optimizer's.
  EXPECT_EQ(lrs(*sgd), std::vector<double>({1.0, 2.0}));

  auto warmup = std::make_shared<fulgur::LinearLR>(*sgd);
  auto other = two_group_sgd(1.0, 2.0);
  auto foreign = std::make_shared<fulgur::StepLR>(*other, 2);
  EXPECT_THROWS_WITH(
      fulgur::ConfigError, fulgur::SequentialLR(*sgd, {warmup, foreign, nullptr}, {3, 2}),
      {"scheduler 1 schedules another optimizer", "scheduler 2 is null", "milestones={3, 2}"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::SequentialLR(*sgd, {warmup, warmup}, {3}),
                     {"schedulers 0 and 1 are the same object"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::SequentialLR(*sgd, {warmup}, {3}),
                     {"1 milestone(s) for 1 schedulers"});
}

TEST(ReduceLROnPlateau, ReducesAfterPatienceBadStepsThenRestsForTheCooldown) {
  auto sgd = two_group_sgd(1.0, 0.1);
  fulgur::ReduceLROnPlateau plateau(
      *sgd, {.factor = 0.5, .patience = 1, .threshold = 0.0, .cooldown = 1, .min_lr = 0.3});
  // value:      5    4    4    4    4    4    3    3    3
  // better:     y    y    n    n    n    n    y    n    n
  // bad count:  0    0    1    2->0 0(cd) 1    0    1    2->0
  // lr group 0: 1    1    1    .5   .5   .5   .5   .5   .3 (min_lr)
  // group 1 stays 0.1: below min_lr already, no reduction is applied.
  const std::vector<double> values = {5, 4, 4, 4, 4, 4, 3, 3, 3};
  const std::vector<double> expected = {1, 1, 1, 0.5, 0.5, 0.5, 0.5, 0.5, 0.3};
  for (size_t i = 0; i < values.size(); ++i) {
    plateau.step(values[i]);
    EXPECT_DOUBLE_EQ(lrs(*sgd)[0], expected[i]) << "after value " << i;
    EXPECT_DOUBLE_EQ(lrs(*sgd)[1], 0.1) << "after value " << i;
  }
  EXPECT_EQ(plateau.best(), 3.0);
}

// A plateau scheduler on the step interval reads the step's values after
// on_train_batch_end, as Lightning's does: a metric logged there is this
// step's (it read the step before's, and strict failed at step 1, "not
// logged"). The metric stays at 1: from the second step on, every step is
// a bad one (patience 0), and halves the rate.
TEST(ReduceLROnPlateau, OnTheStepIntervalItReadsWhatOnTrainBatchEndLogged) {
  struct LogsAtBatchEnd : fulgur::test::LinearRegression {
    void on_train_batch_end(const at::Tensor&, const fulgur::Batch&, int64_t) override {
      log("end_metric", 1.0);
    }
  };
  fulgur::test::TempDir dir;
  LogsAtBatchEnd model;
  model.make_schedulers = [](torch::optim::Optimizer& optimizer) {
    auto plateau = std::make_shared<fulgur::ReduceLROnPlateau>(
        optimizer, fulgur::ReduceLROnPlateauOptions{.factor = 0.5, .patience = 0});
    return std::vector<fulgur::SchedulerConfig>{
        {.scheduler = plateau, .interval = fulgur::Interval::kStep, .monitor = "end_metric"}};
  };
  auto options = fulgur::test::test_options(dir);
  options.num_sanity_val_steps = 0;
  fulgur::Trainer trainer(options);
  trainer.fit(model, fulgur::test::regression_loader(4));
  // 4 steps: the first sets the best, the 3 others halve 0.05.
  EXPECT_DOUBLE_EQ(fulgur::test::sgd_lr(*model.optimizer), 0.05 * 0.125);
}

TEST(ReduceLROnPlateau, MaxModeWithAnAbsoluteThreshold) {
  auto sgd = two_group_sgd(1.0, 1.0);
  fulgur::ReduceLROnPlateau plateau(
      *sgd,
      {.mode = "max", .factor = 0.1, .patience = 0, .threshold = 0.5, .threshold_mode = "abs"});
  plateau.step(1.0);  // better than -inf
  EXPECT_DOUBLE_EQ(lrs(*sgd)[0], 1.0);
  plateau.step(1.4);  // not above 1.0 + 0.5: bad, patience 0
  EXPECT_DOUBLE_EQ(lrs(*sgd)[0], 0.1);
  plateau.step(1.6);  // above 1.5
  EXPECT_DOUBLE_EQ(lrs(*sgd)[0], 0.1);
  EXPECT_EQ(plateau.best(), 1.6);
  plateau.step(std::nan(""));  // never better
  EXPECT_NEAR(lrs(*sgd)[0], 0.01, 1e-15);
}

TEST(ReduceLROnPlateau, RefusesEveryBadOptionInOneError) {
  auto sgd = two_group_sgd(1.0, 1.0);
  try {
    fulgur::ReduceLROnPlateau(
        *sgd, {.mode = "lowest", .factor = 1.5, .patience = -1, .threshold_mode = "relative"});
    FAIL() << "no error";
  } catch (const fulgur::ConfigError& e) {
    const std::string what = e.what();
    for (const char* part :
         {"mode=\"lowest\"", "factor=1.5", "patience=-1", "threshold_mode=\"relative\""}) {
      EXPECT_NE(what.find(part), std::string::npos) << what;
    }
  }
}

TEST(ReduceLROnPlateau, StateRoundTripsThroughAStateDictAndAnArchive) {
  auto sgd = two_group_sgd(1.0, 1.0);
  fulgur::ReduceLROnPlateau plateau(*sgd, {.patience = 3, .cooldown = 2});
  for (double v : {3.0, 2.0, 2.5, 2.5}) plateau.step(v);
  const fulgur::StateDict state = plateau.state_dict();
  EXPECT_EQ(state.keys(), (std::vector<std::string>{"best", "num_bad_steps", "cooldown_counter"}));
  for (const fulgur::StateDict& loaded : {state, fulgur::from_bytes(fulgur::to_bytes(state))}) {
    auto other_sgd = two_group_sgd(1.0, 1.0);
    fulgur::ReduceLROnPlateau other(*other_sgd, {.patience = 3, .cooldown = 2});
    other.load_state_dict(loaded);
    EXPECT_EQ(other.best(), 2.0);
    EXPECT_EQ(other.num_bad_steps(), 2);
    EXPECT_EQ(other.cooldown_counter(), 0);
  }
}

TEST(ReduceLROnPlateau, RefusesAStateWithoutItsCounters) {
  auto sgd = two_group_sgd(1.0, 1.0);
  fulgur::ReduceLROnPlateau plateau(*sgd, {.patience = 3});
  fulgur::StateDict state;
  state.set("best", 2.0);
  state.set("num_bad_steps", int64_t{1});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, plateau.load_state_dict(state),
                     {"ReduceLROnPlateau", "cooldown_counter", "holds best, num_bad_steps"});
  EXPECT_EQ(plateau.num_bad_steps(), 0);
}

// ---- Resuming under a schedule.

enum class Schedule {
  PerEpoch,
  PerStep,
  Plateau,
  PlateauPerStep,
  PlateauEveryStep,
  Callback,
  OneCycle,
  Sequential
};

std::string to_string(Schedule s) {
  switch (s) {
    case Schedule::PerEpoch: return "PerEpoch";
    case Schedule::PerStep: return "PerStep";
    case Schedule::Plateau: return "Plateau";
    case Schedule::PlateauPerStep: return "PlateauPerStep";
    case Schedule::PlateauEveryStep: return "PlateauEveryStep";
    case Schedule::Callback: return "Callback";
    case Schedule::OneCycle: return "OneCycle";
    case Schedule::Sequential: return "Sequential";
  }
  return "?";
}

/// Dropout (the RNG), SGD with momentum (optimizer state), shuffling (the
/// sampler), and one of the schedules.
class ScheduledNet : public fulgur::Module {
 public:
  explicit ScheduledNet(Schedule s) : fulgur::Module("ScheduledNet"), schedule(s) {
    fc1 = register_module("fc1", torch::nn::Linear(3, 16));
    dropout = register_module("dropout", torch::nn::Dropout(0.3));
    fc2 = register_module("fc2", torch::nn::Linear(16, 1));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(dropout(torch::relu(fc1(x)))); }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    const auto& [x, y] = batch.pair();
    return torch::nn::functional::mse_loss(forward(x), y);
  }
  void validation_step(fulgur::Batch& batch, int64_t) override {
    const auto& [x, y] = batch.pair();
    log("val_loss", torch::nn::functional::mse_loss(forward(x), y));
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    optimizer = std::make_shared<torch::optim::SGD>(parameters(),
                                                    torch::optim::SGDOptions(0.05).momentum(0.9));
    std::vector<fulgur::SchedulerConfig> schedulers;
    switch (schedule) {
      case Schedule::PerEpoch:
        schedulers.push_back(
            {.scheduler = std::make_shared<torch::optim::StepLR>(*optimizer, 1, 0.5),
             .interval = fulgur::Interval::kEpoch});
        break;
      case Schedule::PerStep:
        // Warm-up over 4 steps, then a cosine decay over the 36 others.
        schedulers.push_back(
            {.scheduler = std::make_shared<fulgur::LambdaLR>(
                 *optimizer,
                 [](int64_t step) {
                   if (step < 4) return (step + 1) / 4.0;
                   return 0.5 * (1 + std::cos(M_PI * static_cast<double>(step - 4) / 36.0));
                 }),
             .interval = fulgur::Interval::kStep});
        break;
      case Schedule::Plateau:
        // val_loss falls; in "max" mode that is no improvement, so with
        // patience 1 the rate halves every other epoch: a lost bad-step
        // count or best value shows.
        plateau = std::make_shared<fulgur::ReduceLROnPlateau>(
            *optimizer,
            fulgur::ReduceLROnPlateauOptions{.mode = "max", .factor = 0.5, .patience = 1});
        schedulers.push_back({.scheduler = plateau, .monitor = "val_loss"});
        break;
      case Schedule::PlateauPerStep:
        // The same on the step interval, after each validation
        // (val_check_interval = 5): the rate halves every other one.
        plateau = std::make_shared<fulgur::ReduceLROnPlateau>(
            *optimizer,
            fulgur::ReduceLROnPlateauOptions{.mode = "max", .factor = 0.5, .patience = 1});
        schedulers.push_back({.scheduler = plateau,
                              .interval = fulgur::Interval::kStep,
                              .frequency = 5,
                              .monitor = "val_loss"});
        break;
      case Schedule::PlateauEveryStep:
        // Every step, reading the val_loss of the latest validation
        // (val_check_interval = 5; the steps before the first skip, strict
        // = false): a resume between two validations reads the one before
        // it, the value the checkpoint kept.
        plateau = std::make_shared<fulgur::ReduceLROnPlateau>(
            *optimizer,
            fulgur::ReduceLROnPlateauOptions{.mode = "max", .factor = 0.7, .patience = 2});
        schedulers.push_back({.scheduler = plateau,
                              .interval = fulgur::Interval::kStep,
                              .monitor = "val_loss",
                              .strict = false});
        break;
      case Schedule::Callback: break;
      case Schedule::OneCycle:
        // Over the 40 steps of the run; the momentum moves too.
        schedulers.push_back(
            {.scheduler = std::make_shared<fulgur::OneCycleLR>(
                 *optimizer, fulgur::OneCycleLROptions{.max_lr = {0.1}, .total_steps = 40}),
             .interval = fulgur::Interval::kStep});
        break;
      case Schedule::Sequential: {
        // A warm-up over 6 steps, then a cosine with restarts every 8.
        auto warmup = std::make_shared<fulgur::LinearLR>(*optimizer, 0.1, 1.0, 6);
        auto restarts = std::make_shared<fulgur::CosineAnnealingWarmRestarts>(*optimizer, 8);
        schedulers.push_back(
            {.scheduler = std::make_shared<fulgur::SequentialLR>(
                 *optimizer, std::vector<std::shared_ptr<fulgur::ClosedFormLR>>{warmup, restarts},
                 std::vector<int64_t>{6}),
             .interval = fulgur::Interval::kStep});
        break;
      }
    }
    return {{optimizer}, std::move(schedulers)};
  }

  Schedule schedule;
  torch::nn::Linear fc1{nullptr};
  torch::nn::Dropout dropout{nullptr};
  torch::nn::Linear fc2{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer;
  std::shared_ptr<fulgur::ReduceLROnPlateau> plateau;
};

/// Multiplies every learning rate by 0.7 after every fourth step: the only
/// record of the schedule is the optimizer's learning rate.
class DecayingCallback : public fulgur::Callback {
 public:
  std::string state_key() const override { return "DecayingCallback"; }
  void on_train_batch_end(fulgur::Trainer& trainer, fulgur::Module& module, const at::Tensor&,
                          const fulgur::Batch&, int64_t) override {
    if (trainer.global_step() % 4 != 0) return;
    for (auto& group : static_cast<ScheduledNet&>(module).optimizer->param_groups()) {
      group.options().set_lr(group.options().get_lr() * 0.7);
    }
  }
};

constexpr int64_t kEpochs = 4;
constexpr int64_t kBatches = 10;

/// Checkpoints every 3 steps under `<ckpt_dir>/steps` and at every
/// epoch's end (after its scheduler step) under `<ckpt_dir>/epochs`.
fulgur::TrainerOptions options_for(const TempDir& root, const std::string& ckpt_dir, Schedule s) {
  auto options = test_options(root);
  options.max_epochs = kEpochs;
  options.seed = 42;
  options.enable_checkpointing = true;
  options.callbacks = {
      std::make_shared<fulgur::ModelCheckpoint>(fulgur::ModelCheckpointOptions{
          .dirpath = ckpt_dir + "/steps", .save_top_k = -1, .every_n_train_steps = 3}),
      std::make_shared<fulgur::ModelCheckpoint>(fulgur::ModelCheckpointOptions{
          .dirpath = ckpt_dir + "/epochs", .save_top_k = -1, .save_last = false})};
  if (s == Schedule::Callback) options.callbacks.push_back(std::make_shared<DecayingCallback>());
  if (s == Schedule::PlateauPerStep || s == Schedule::PlateauEveryStep) {
    options.val_check_interval = 5;
  }
  return options;
}

std::shared_ptr<fulgur::DataLoader> train_loader() {
  return fulgur::make_data_loader(regression_dataset(4 * kBatches),
                                  {.batch_size = 4, .shuffle = true});
}
std::shared_ptr<fulgur::DataLoader> val_loader() {
  return fulgur::make_data_loader(regression_dataset(8), {.batch_size = 4});
}

::testing::AssertionResult same_training_state(const ScheduledNet& a, const ScheduledNet& b) {
  if (auto params = parameters_equal(a, b); !params) return params;
  for (size_t i = 0; i < a.optimizer->param_groups().size(); ++i) {
    const auto momentum = [i](const torch::optim::SGD& sgd) {
      return static_cast<const torch::optim::SGDOptions&>(sgd.param_groups()[i].options())
          .momentum();
    };
    if (momentum(*a.optimizer) != momentum(*b.optimizer)) {
      return ::testing::AssertionFailure()
             << "the momentum of group " << i << " differs: " << momentum(*a.optimizer) << " vs "
             << momentum(*b.optimizer);
    }
  }
  if (lrs(*a.optimizer) != lrs(*b.optimizer)) {
    return ::testing::AssertionFailure()
           << "learning rates differ: " << ::testing::PrintToString(lrs(*a.optimizer)) << " vs "
           << ::testing::PrintToString(lrs(*b.optimizer));
  }
  // The same module type: parameters in the same order.
  const auto pa = a.parameters();
  const auto pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    auto& state_a = a.optimizer->state().at(fulgur::compat::optimizer_state_key(pa[i]));
    auto& state_b = b.optimizer->state().at(fulgur::compat::optimizer_state_key(pb[i]));
    if (!torch::equal(static_cast<torch::optim::SGDParamState&>(*state_a).momentum_buffer(),
                      static_cast<torch::optim::SGDParamState&>(*state_b).momentum_buffer())) {
      return ::testing::AssertionFailure()
             << "the momentum buffer of parameter " << i << " differs";
    }
  }
  if (a.plateau) {
    if (a.plateau->best() != b.plateau->best() ||
        a.plateau->num_bad_steps() != b.plateau->num_bad_steps() ||
        a.plateau->cooldown_counter() != b.plateau->cooldown_counter()) {
      return ::testing::AssertionFailure()
             << "ReduceLROnPlateau's state differs: best " << a.plateau->best() << " vs "
             << b.plateau->best() << ", bad steps " << a.plateau->num_bad_steps() << " vs "
             << b.plateau->num_bad_steps();
    }
  }
  return ::testing::AssertionSuccess();
}

class ResumeUnderASchedule : public ::testing::TestWithParam<Schedule> {};

TEST_P(ResumeUnderASchedule, FromEveryKindOfCheckpointEndsBitIdentical) {
  const Schedule schedule = GetParam();
  TempDir root;
  const std::string ckpt_dir = root.file("ckpts");
  torch::manual_seed(1);
  ScheduledNet uninterrupted(schedule);
  const double initial_lr = 0.05;
  {
    fulgur::Trainer trainer(options_for(root, ckpt_dir, schedule));
    auto result = trainer.fit(uninterrupted, train_loader(), val_loader());
    ASSERT_EQ(result.global_step, kEpochs * kBatches);
  }
  // The schedule did move the rate (the test would prove nothing otherwise).
  ASSERT_NE(lrs(*uninterrupted.optimizer)[0], initial_lr);

  // Step 9: mid-epoch. Step 12: after the first epoch boundary. Step 21:
  // after the second (a plateau with one bad epoch counted). Step 30: the
  // last batch of the third epoch, written before that epoch's scheduler
  // step and validation. Then the checkpoints of two epochs' ends.
  // Under PlateauPerStep, step 15 too: written mid-epoch before the
  // validation that follows it (and the scheduler step that reads it).
  std::vector<std::string> names = {"steps/epoch=0-step=9.ckpt",   "steps/epoch=1-step=12.ckpt",
                                    "steps/epoch=2-step=21.ckpt",  "steps/epoch=2-step=30.ckpt",
                                    "epochs/epoch=0-step=10.ckpt", "epochs/epoch=2-step=30.ckpt"};
  if (schedule == Schedule::PlateauPerStep) names.push_back("steps/epoch=1-step=15.ckpt");
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    const std::string path = (fs::path(ckpt_dir) / name).string();
    ASSERT_TRUE(fs::exists(path)) << ::testing::PrintToString(list_files(ckpt_dir + "/steps"))
                                  << ::testing::PrintToString(list_files(ckpt_dir + "/epochs"));
    torch::manual_seed(2);
    ScheduledNet resumed(schedule);
    TempDir root_b;
    fulgur::Trainer trainer(options_for(root_b, root_b.file("ckpts"), schedule));
    auto result = trainer.fit(resumed, train_loader(), val_loader(), {.ckpt_path = path});
    EXPECT_EQ(result.global_step, kEpochs * kBatches);
    EXPECT_TRUE(same_training_state(uninterrupted, resumed));
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, ResumeUnderASchedule,
                         ::testing::Values(Schedule::PerEpoch, Schedule::PerStep, Schedule::Plateau,
                                           Schedule::PlateauPerStep, Schedule::PlateauEveryStep,
                                           Schedule::Callback, Schedule::OneCycle,
                                           Schedule::Sequential),
                         [](const auto& info) { return to_string(info.param); });

// ---- SchedulerConfigs that cannot work.

/// A module whose configure_optimizers returns what the test sets.
class ConfiguredNet : public fulgur::Module {
 public:
  ConfiguredNet() : fulgur::Module("ConfiguredNet") {
    fc = register_module("fc", torch::nn::Linear(3, 1));
    optimizer = std::make_shared<torch::optim::SGD>(parameters(), 0.1);
  }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    const auto& [x, y] = batch.pair();
    auto loss = torch::nn::functional::mse_loss(fc(x), y);
    log("train_loss", loss);
    return loss;
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    std::vector<fulgur::SchedulerConfig> all{config};
    all.insert(all.end(), more.begin(), more.end());
    return {{optimizer}, std::move(all)};
  }
  torch::nn::Linear fc{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer;
  fulgur::SchedulerConfig config;
  std::vector<fulgur::SchedulerConfig> more;
};

std::string fit_error(ConfiguredNet& model, const TempDir& root) {
  fulgur::Trainer trainer(test_options(root));
  try {
    trainer.fit(model, fulgur::test::regression_loader(4));
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(SchedulerConfig, AMonitorOnASchedulerThatReadsNoMetricIsRefused) {
  TempDir root;
  ConfiguredNet model;
  model.config = {.scheduler = std::make_shared<torch::optim::StepLR>(*model.optimizer, 1),
                  .monitor = "val_loss"};
  EXPECT_THAT(fit_error(model, root),
              ::testing::HasSubstr("scheduler 0 has monitor=\"val_loss\", but it is not stepped "
                                   "with a metric"));
}

TEST(SchedulerConfig, APlateauSchedulerWithoutAMonitorIsRefused) {
  TempDir root;
  ConfiguredNet model;
  model.config = {.scheduler = std::make_shared<fulgur::ReduceLROnPlateau>(*model.optimizer)};
  EXPECT_THAT(fit_error(model, root), ::testing::HasSubstr("has no monitor. Pass .monitor"));
}

TEST(SchedulerConfig, AMonitoredMetricNeverLoggedNamesTheMetricsThereAre) {
  TempDir root;
  ConfiguredNet model;
  model.config = {.scheduler = std::make_shared<fulgur::ReduceLROnPlateau>(*model.optimizer),
                  .monitor = "val_loss"};
  EXPECT_THAT(fit_error(model, root),
              ::testing::AllOf(::testing::HasSubstr("scheduler 0 monitors \"val_loss\""),
                               ::testing::HasSubstr("logged: train_loss"),
                               ::testing::HasSubstr("strict=false")));
}

TEST(SchedulerConfig, NotStrictSkipsTheStepsWithoutTheMetric) {
  TempDir root;
  ConfiguredNet model;
  model.config = {.scheduler = std::make_shared<fulgur::ReduceLROnPlateau>(
                      *model.optimizer, fulgur::ReduceLROnPlateauOptions{.patience = 0}),
                  .monitor = "val_loss",
                  .strict = false};
  EXPECT_EQ(fit_error(model, root), "");
  EXPECT_DOUBLE_EQ(lrs(*model.optimizer)[0], 0.1);
}

// A ReduceLROnPlateau on the step interval reads the value training_step
// logged in the same step (it stepped before the step's values were
// published: "not logged by step 1", or the previous step's value with
// strict=false). Every value after the first is no improvement here, so
// with patience 0 the rate halves at each of the 3 later steps.
TEST(SchedulerConfig, APlateauSchedulerOnTheStepIntervalReadsThatStepsValue) {
  for (const bool strict : {true, false}) {
    SCOPED_TRACE(strict);
    TempDir root;
    ConfiguredNet model;
    model.config = {
        .scheduler = std::make_shared<fulgur::ReduceLROnPlateau>(
            *model.optimizer, fulgur::ReduceLROnPlateauOptions{.mode = "max",
                                                               .factor = 0.5,
                                                               .patience = 0,
                                                               .threshold = 1e9,
                                                               .threshold_mode = "abs"}),
        .interval = fulgur::Interval::kStep,
        .monitor = "train_loss",
        .strict = strict};
    EXPECT_EQ(fit_error(model, root), "");
    EXPECT_DOUBLE_EQ(lrs(*model.optimizer)[0], 0.1 * 0.5 * 0.5 * 0.5);
  }
}

/// Records the values it is stepped with.
class RecordingPlateau : public fulgur::ReduceLROnPlateau {
 public:
  using ReduceLROnPlateau::ReduceLROnPlateau;
  void step(double value) override {
    values.push_back(value);
    ReduceLROnPlateau::step(value);
  }
  std::vector<double> values;
};

/// Logs val_loss = 100 + k in its k-th validation of the fit.
class ValidatedNet : public ConfiguredNet {
 public:
  void on_validation_epoch_start() override { ++validations; }
  void validation_step(fulgur::Batch&, int64_t) override { log("val_loss", 100.0 + validations); }
  int validations = 0;
};

// A ReduceLROnPlateau on the step interval whose step a validation follows
// (val_check_interval) reads that validation's value, as Lightning's plateau
// schedulers step after it: it stepped before it, so at its first due step
// val_loss was "not logged" (the recipe frequency = val_check_interval
// failed), and with strict=false it read each value one validation late.
TEST(SchedulerConfig, APlateauSchedulerOnTheStepIntervalReadsTheValidationAfterItsStep) {
  for (const bool strict : {true, false}) {
    SCOPED_TRACE(strict);
    TempDir root;
    ValidatedNet model;
    auto plateau = std::make_shared<RecordingPlateau>(*model.optimizer);
    model.config = {.scheduler = plateau,
                    .interval = fulgur::Interval::kStep,
                    .frequency = 2,
                    .monitor = "val_loss",
                    .strict = strict};
    auto options = test_options(root);
    options.val_check_interval = 2;
    options.num_sanity_val_steps = 0;
    fulgur::Trainer trainer(options);
    trainer.fit(model, fulgur::test::regression_loader(6), fulgur::test::regression_loader(2));
    EXPECT_EQ(model.validations, 3);
    EXPECT_THAT(plateau->values, ::testing::ElementsAre(101.0, 102.0, 103.0));
  }
}

// A resumed run runs each validation that the uninterrupted run ran after
// its checkpoint: from one written after a step and before the validation
// that follows it (on_train_batch_end) it runs that validation first
// (mid-epoch it was skipped). One written at the end of a validation, by
// its callbacks, runs none: that validation is done, and its metrics, which
// the epoch's end reads, are in the checkpoint.
TEST(SchedulerConfig, AResumeRunsEachValidationAfterItsCheckpointOnce) {
  TempDir root;
  auto fit = [&](const std::string& dir, const std::string& ckpt_path) {
    auto options = fulgur::test::checkpoint_every_step_options(root, dir);
    options.val_check_interval = 2;  // after steps 2, 4 and 6
    ValidatedNet model;
    model.config = {.scheduler = std::make_shared<torch::optim::StepLR>(*model.optimizer, 1)};
    fulgur::Trainer trainer(options);
    trainer.fit(model, fulgur::test::regression_loader(6), fulgur::test::regression_loader(2),
                {.ckpt_path = ckpt_path});
    return model.validations;
  };
  ASSERT_EQ(fit("first", ""), 3);
  // The validations after step s: 3 - s / 2; one more where a step's own
  // validation came after its checkpoint.
  for (int64_t step = 1; step <= 6; ++step) {
    SCOPED_TRACE(step);
    const std::string name = "epoch=0-step=" + std::to_string(step) + ".ckpt";
    EXPECT_EQ(fit("again", root.file("first/steps/" + name)),
              3 - step / 2 + (step % 2 == 0 ? 1 : 0));
  }
  const std::string validated = root.file("first/validated/epoch=0-step=6.ckpt");
  ASSERT_TRUE(fs::exists(validated))
      << ::testing::PrintToString(list_files(root.file("first/validated")));
  EXPECT_EQ(fit("again", validated), 0);
}

// A schedule that sets its optimizer's rates outright at each step
// (LambdaLR) beside another of the same optimizer (a warm-up beside a
// plateau cut, say) undoes the other's changes at its next step, as in
// PyTorch: a note names both and the ways to combine them; chained
// schedules, or one schedule per optimizer, get none.
TEST(SchedulerConfig, AScheduleThatSetsRatesOutrightBesideAnotherIsNoted) {
  auto notes = [](auto configure) {
    TempDir root;
    ConfiguredNet model;
    configure(model);
    ::testing::internal::CaptureStderr();
    const std::string error = fit_error(model, root);
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(error, "");
    return err;
  };
  const std::string outright = notes([](ConfiguredNet& model) {
    model.config = {.scheduler = std::make_shared<fulgur::StepLR>(*model.optimizer, 1, 0.5)};
    model.more = {{.scheduler = std::make_shared<fulgur::LambdaLR>(
                       *model.optimizer, [](int64_t step) { return 1.0 / (1 + step); }),
                   .interval = fulgur::Interval::kStep}};
  });
  EXPECT_TRUE(fulgur::test::message_contains(
      outright,
      {"scheduler 1 (fulgur::LambdaLR) sets its optimizer's learning rates outright at its steps",
       "what scheduler 0 (fulgur::StepLR) does to the same optimizer lasts only until 1's "
       "next step",
       "SequentialLR"}))
      << outright;
  // A SequentialLR one of whose schedulers sets them outright, after a
  // chained warm-up.
  const std::string sequence = notes([](ConfiguredNet& model) {
    auto warmup = std::make_shared<fulgur::LinearLR>(*model.optimizer, 0.1, 1.0, 2);
    auto decay = std::make_shared<fulgur::LambdaLR>(*model.optimizer,
                                                    [](int64_t step) { return 1.0 / (1 + step); });
    model.config = {.scheduler = std::make_shared<fulgur::StepLR>(*model.optimizer, 1, 0.5)};
    model.more = {
        {.scheduler = std::make_shared<fulgur::SequentialLR>(
             *model.optimizer, std::vector<std::shared_ptr<fulgur::ClosedFormLR>>{warmup, decay},
             std::vector<int64_t>{2}),
         .interval = fulgur::Interval::kStep}};
  });
  EXPECT_TRUE(fulgur::test::message_contains(
      sequence, {"scheduler 1 (fulgur::SequentialLR) sets its optimizer's learning rates"}))
      << sequence;
  const std::string chained = notes([](ConfiguredNet& model) {
    model.config = {.scheduler = std::make_shared<fulgur::StepLR>(*model.optimizer, 1, 0.5)};
    model.more = {{.scheduler = std::make_shared<fulgur::ExponentialLR>(*model.optimizer, 0.9),
                   .interval = fulgur::Interval::kStep}};
  });
  EXPECT_EQ(chained.find("outright"), std::string::npos) << chained;
  const std::string alone = notes([](ConfiguredNet& model) {
    model.config = {.scheduler = std::make_shared<fulgur::LambdaLR>(
                        *model.optimizer, [](int64_t step) { return 1.0 / (1 + step); }),
                    .interval = fulgur::Interval::kStep};
  });
  EXPECT_EQ(alone.find("outright"), std::string::npos) << alone;
}

// A scheduler that makes a rate NaN (a NaN factor made every parameter NaN,
// silently) is named at the step it did so; one that makes it negative (the
// loss climbs) gets one note, and one that makes it 0 nothing.
TEST(SchedulerConfig, ASchedulerThatMakesARateNaNIsNamedAndANegativeOneNoted) {
  auto fit_with = [](double factor, std::string& err) {
    TempDir root;
    ConfiguredNet model;
    model.config = {
        .scheduler = std::make_shared<fulgur::LambdaLR>(
            *model.optimizer, [factor](int64_t step) { return step >= 2 ? factor : 1.0; }),
        .interval = fulgur::Interval::kStep};
    ::testing::internal::CaptureStderr();
    const std::string error = fit_error(model, root);
    err = ::testing::internal::GetCapturedStderr();
    return error;
  };
  std::string err;
  const std::string nan_error = fit_with(std::nan(""), err);
  EXPECT_TRUE(fulgur::test::message_contains(
      nan_error, {"scheduler 0 (interval step) set the learning rate of parameter group 0 of "
                  "optimizer 0 to nan at step 2",
                  "every parameter it steps NaN", "gamma"}))
      << nan_error;
  EXPECT_EQ(fit_with(-1.0, err), "");
  EXPECT_EQ(fulgur::test::count_occurrences(err, "a negative rate climbs the loss"), 1) << err;
  EXPECT_TRUE(fulgur::test::message_contains(err, {"to -0.1 at step 2"})) << err;
  EXPECT_EQ(fit_with(0.0, err), "");
  EXPECT_EQ(err.find("climbs"), std::string::npos) << err;
}

/// Logs a value per batch and per epoch, one per epoch only, and one in
/// on_train_epoch_end; a plateau scheduler on the epoch interval monitors
/// each.
class EpochLoggingNet : public fulgur::Module {
 public:
  EpochLoggingNet() : fulgur::Module("EpochLoggingNet") {
    fc = register_module("fc", torch::nn::Linear(3, 1));
  }
  at::Tensor training_step(fulgur::Batch& batch, int64_t batch_idx) override {
    const auto& [x, y] = batch.pair();
    const auto b = static_cast<double>(batch_idx);
    log("per_batch", b, {.on_step = true, .on_epoch = true});
    log("epoch_only", 2 * b, {.on_step = false, .on_epoch = true});
    return torch::nn::functional::mse_loss(fc(x), y);
  }
  void on_train_epoch_end() override {
    log("at_epoch_end", 10.0 + static_cast<double>(current_epoch()));
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    auto optimizer = std::make_shared<torch::optim::SGD>(parameters(), 0.1);
    std::vector<fulgur::SchedulerConfig> schedulers;
    for (const char* name : {"per_batch", "epoch_only", "at_epoch_end"}) {
      plateaus.push_back(std::make_shared<RecordingPlateau>(*optimizer));
      schedulers.push_back({.scheduler = plateaus.back(), .monitor = name});
    }
    return {{optimizer}, std::move(schedulers)};
  }
  torch::nn::Linear fc{nullptr};
  std::vector<std::shared_ptr<RecordingPlateau>> plateaus;
};

// An epoch-interval monitored scheduler reads the epoch's values: the mean
// of a value logged per step and per epoch (it read the last step's), one
// logged per epoch only, and one logged in on_train_epoch_end (both were
// "not logged"), as Lightning's scheduler, stepped after that hook and the
// epoch's values.
TEST(SchedulerConfig, AnEpochSchedulerReadsTheEpochsValues) {
  TempDir root;
  EpochLoggingNet model;
  auto options = test_options(root);
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, fulgur::test::regression_loader(4));
  ASSERT_EQ(model.plateaus.size(), 3U);
  EXPECT_THAT(model.plateaus[0]->values, ::testing::ElementsAre(1.5, 1.5));
  EXPECT_THAT(model.plateaus[1]->values, ::testing::ElementsAre(3.0, 3.0));
  EXPECT_THAT(model.plateaus[2]->values, ::testing::ElementsAre(10.0, 11.0));
}

// A schedule of an optimizer configure_optimizers did not return, one of a
// SequentialLR's listed beside it, and one listed twice would move rates
// nothing trains with, or step twice a step.
TEST(SchedulerConfig, ASchedulerOfAnotherOptimizerOrSteppedTwiceIsRefused) {
  TempDir root;
  {
    ConfiguredNet model;
    auto other = std::make_shared<torch::optim::SGD>(model.parameters(), 0.1);
    model.config = {.scheduler = std::make_shared<fulgur::StepLR>(*other, 1)};
    EXPECT_THAT(fit_error(model, root),
                ::testing::HasSubstr("scheduler 0 schedules an optimizer that "
                                     "configure_optimizers did not return"));
  }
  {
    ConfiguredNet model;
    auto warmup = std::make_shared<fulgur::LinearLR>(*model.optimizer);
    auto decay = std::make_shared<fulgur::ExponentialLR>(*model.optimizer, 0.9);
    model.config = {.scheduler = std::make_shared<fulgur::SequentialLR>(
                        *model.optimizer,
                        std::vector<std::shared_ptr<fulgur::ClosedFormLR>>{warmup, decay},
                        std::vector<int64_t>{5})};
    model.more = {{.scheduler = decay}};
    EXPECT_THAT(fit_error(model, root),
                ::testing::HasSubstr("scheduler 1 is one of a SequentialLR's"));
  }
  {
    ConfiguredNet model;
    model.config = {.scheduler = std::make_shared<fulgur::StepLR>(*model.optimizer, 1)};
    model.more = {model.config};
    EXPECT_THAT(fit_error(model, root),
                ::testing::HasSubstr("schedulers 0 and 1 are the same object"));
  }
}

// A OneCycleLR shorter than the run stops it at the first step past its
// cycle, naming total_steps (PyTorch's ValueError), instead of climbing the
// cosine back up.
TEST(SchedulerConfig, AOneCycleShorterThanTheRunNamesItsTotalSteps) {
  TempDir root;
  ConfiguredNet model;
  model.config = {
      .scheduler = std::make_shared<fulgur::OneCycleLR>(
          *model.optimizer, fulgur::OneCycleLROptions{.max_lr = {0.1}, .total_steps = 2}),
      .interval = fulgur::Interval::kStep};
  EXPECT_THAT(fit_error(model, root),
              ::testing::HasSubstr("OneCycleLR: scheduler step 3 is beyond total_steps=2"));
}

TEST(SchedulerConfig, ACheckpointWithoutAStatefulSchedulersStateIsRefused) {
  TempDir root;
  std::string last;
  {
    ConfiguredNet model;
    model.config = {.scheduler = std::make_shared<torch::optim::StepLR>(*model.optimizer, 1)};
    auto options = test_options(root);
    options.enable_checkpointing = true;
    fulgur::Trainer trainer(options);
    last = trainer.fit(model, fulgur::test::regression_loader(4)).last_model_path;
  }
  ConfiguredNet model;
  model.config = {.scheduler = std::make_shared<fulgur::ReduceLROnPlateau>(*model.optimizer),
                  .monitor = "train_loss"};
  auto options = test_options(root);
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  try {
    trainer.fit(model, fulgur::test::regression_loader(4), nullptr, {.ckpt_path = last});
    FAIL() << "resumed without the scheduler's state";
  } catch (const fulgur::CheckpointError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("holds no state for scheduler 0"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr(last));
  }
}

}  // namespace
