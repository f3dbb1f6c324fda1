#include "fulgur/callbacks/gradient_accumulation_scheduler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::GradientAccumulationScheduler;
using fulgur::test::LinearRegression;
using fulgur::test::parameters_equal;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using ::testing::HasSubstr;

std::shared_ptr<GradientAccumulationScheduler> schedule() {
  return std::make_shared<GradientAccumulationScheduler>(
      std::map<int64_t, int64_t>{{1, 2}, {2, 4}});
}

// 8 batches per epoch: 8 steps in epoch 0 (before the first key: 1), 4 in
// epoch 1, 2 in epoch 2.
TEST(GradientAccumulationScheduler, ChangesTheStepsPerEpoch) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = 3;
  options.callbacks = {schedule()};
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(8));
  EXPECT_EQ(result.global_step, 14);
  EXPECT_EQ(trainer.accumulate_grad_batches(), 4);
  EXPECT_EQ(schedule()->factor(0), 1);
  EXPECT_EQ(schedule()->factor(7), 4);
}

// The same as accumulate_grad_batches=2 from the start, when the schedule
// says 2 from epoch 0.
TEST(GradientAccumulationScheduler, MatchesTheFlagItReplaces) {
  TempDir dir;
  LinearRegression flag_model, scheduled_model;
  fulgur::test::copy_parameters(flag_model, scheduled_model);
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.accumulate_grad_batches = 2;
  fulgur::Trainer(options).fit(flag_model, regression_loader(6));
  options.accumulate_grad_batches = 1;
  options.callbacks = {
      std::make_shared<GradientAccumulationScheduler>(std::map<int64_t, int64_t>{{0, 2}})};
  fulgur::Trainer(options).fit(scheduled_model, regression_loader(6));
  EXPECT_TRUE(parameters_equal(flag_model, scheduled_model));
}

// Stopped after epoch 1 and resumed: the run accumulates as the
// uninterrupted one did and ends with the same parameters.
TEST(GradientAccumulationScheduler, AResumedRunAccumulatesAsTheUninterruptedOne) {
  TempDir whole, parts;
  LinearRegression uninterrupted, first, resumed;
  fulgur::test::copy_parameters(uninterrupted, first);
  auto options = test_options(whole);
  options.max_epochs = 3;
  options.enable_checkpointing = true;
  options.callbacks = {schedule()};
  auto full = fulgur::Trainer(options).fit(uninterrupted, regression_loader(8));
  options.default_root_dir = parts.path();
  options.max_epochs = 2;
  options.callbacks = {schedule()};
  fulgur::Trainer(options).fit(first, regression_loader(8));
  options.max_epochs = 3;
  options.callbacks = {schedule()};
  auto result =
      fulgur::Trainer(options).fit(resumed, regression_loader(8), nullptr, {.ckpt_path = "last"});
  EXPECT_EQ(result.global_step, full.global_step);
  EXPECT_TRUE(parameters_equal(uninterrupted, resumed));
}

TEST(GradientAccumulationScheduler, ConflictsAndBadSchedulesAreErrors) {
  EXPECT_THROW(GradientAccumulationScheduler({}), fulgur::ConfigError);
  try {
    GradientAccumulationScheduler bad({{-1, 2}, {3, 0}});
    ADD_FAILURE() << "no error";
  } catch (const fulgur::ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("epoch -1: must be >= 0"));
    EXPECT_THAT(e.what(), HasSubstr("factor 0 at epoch 3"));
  }
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.accumulate_grad_batches = 3;
  options.callbacks = {schedule()};
  fulgur::Trainer trainer(options);
  try {
    trainer.fit(model, regression_loader(4));
    ADD_FAILURE() << "no error";
  } catch (const fulgur::ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("set the accumulation in one place"));
  }
}

// With cuda_graph a schedule that ever accumulates is refused as the fit
// starts, naming the factor (it failed at the epoch the factor first grew,
// after the epochs before it had trained). It comes at the callbacks'
// setup, before the graph's own checks, so a CPU build shows it too.
TEST(GradientAccumulationScheduler, ACudaGraphFitRefusesAScheduleThatAccumulatesBeforeTraining) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.cuda_graph = true;
  options.max_epochs = 6;
  options.callbacks = {
      std::make_shared<GradientAccumulationScheduler>(std::map<int64_t, int64_t>{{0, 1}, {4, 2}})};
  fulgur::Trainer trainer(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, regression_loader(4)),
                     {"GradientAccumulationScheduler with cuda_graph=true: factor 2 from epoch 4",
                      "Keep every factor at 1, or pass cuda_graph=false"});
  EXPECT_EQ(model.training_steps, 0);
  // A factor from an epoch the fit never reaches is not refused (the
  // graph's own checks come next: a CPU build has no CUDA graphs).
  options.max_epochs = 4;
  fulgur::Trainer short_fit(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError, short_fit.fit(model, regression_loader(4)),
                     {"cuda_graph=true"});
  try {
    short_fit.fit(model, regression_loader(4));
  } catch (const fulgur::ConfigError& e) {
    EXPECT_THAT(e.what(), ::testing::Not(HasSubstr("GradientAccumulationScheduler")));
  }
}

}  // namespace
