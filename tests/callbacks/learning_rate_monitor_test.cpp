#include "fulgur/callbacks/learning_rate_monitor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::logged_options;
using fulgur::test::RecordingLogger;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using ::testing::HasSubstr;

TEST(LearningRateMonitor, LogsTheRateEachStepUsesAsTheSchedulerChangesIt) {
  TempDir dir;
  auto logger = std::make_shared<RecordingLogger>();
  auto monitor = std::make_shared<fulgur::LearningRateMonitor>(
      fulgur::LearningRateMonitorOptions{.log_momentum = true});
  LinearRegression model({.lr = 0.1, .momentum = 0.9});
  model.make_schedulers = [](torch::optim::Optimizer& o) {
    return std::vector<fulgur::SchedulerConfig>{
        {std::make_shared<torch::optim::StepLR>(o, 1, 0.5), fulgur::Interval::kStep}};
  };
  fulgur::Trainer trainer(logged_options(dir, logger, monitor));
  trainer.fit(model, regression_loader(3));
  // The rate each step uses, at its index. LibTorch's StepLR applies its
  // first decay at its second step(): 0.1, 0.1, 0.05.
  auto lr = logger->series("lr-SGD");
  ASSERT_EQ(lr.size(), 3u);
  EXPECT_EQ(lr[0].first, 0);
  EXPECT_DOUBLE_EQ(lr[0].second, 0.1);
  EXPECT_DOUBLE_EQ(lr[1].second, 0.1);
  EXPECT_EQ(lr[2].first, 2);
  EXPECT_DOUBLE_EQ(lr[2].second, 0.05);
  EXPECT_DOUBLE_EQ(model.optimizer->param_groups()[0].options().get_lr(), 0.025);
  EXPECT_DOUBLE_EQ(monitor->last_logged().at("momentum-SGD"), 0.9);
}

TEST(LearningRateMonitor, NamesParamGroupsAndRepeatedOptimizersApart) {
  TempDir dir;
  auto logger = std::make_shared<RecordingLogger>();
  auto monitor = std::make_shared<fulgur::LearningRateMonitor>(
      fulgur::LearningRateMonitorOptions{.logging_interval = "epoch"});
  struct TwoOptimizers : LinearRegression {
    fulgur::OptimizerConfig configure_optimizers() override {
      std::vector<torch::optim::OptimizerParamGroup> groups = {
          torch::optim::OptimizerParamGroup({fc->weight}),
          torch::optim::OptimizerParamGroup({fc->bias},
                                            std::make_unique<torch::optim::AdamOptions>(0.5))};
      return fulgur::OptimizerConfig(std::vector<std::shared_ptr<torch::optim::Optimizer>>{
          std::make_shared<torch::optim::Adam>(groups, torch::optim::AdamOptions(0.1)),
          std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(0.2))});
    }
    at::Tensor training_step(fulgur::Batch& batch, int64_t idx) override {
      auto loss = LinearRegression::training_step(batch, idx);
      manual_backward(loss);
      for (auto& o : optimizers()) optimizer_step(*o);
      return loss;
    }
  } model;
  model.set_automatic_optimization(false);
  fulgur::Trainer trainer(logged_options(dir, logger, monitor));
  trainer.fit(model, regression_loader(2));
  const auto& last = monitor->last_logged();
  EXPECT_DOUBLE_EQ(last.at("lr-Adam/pg1"), 0.1);
  EXPECT_DOUBLE_EQ(last.at("lr-Adam/pg2"), 0.5);
  EXPECT_DOUBLE_EQ(last.at("lr-Adam-1"), 0.2);
  EXPECT_EQ(logger->series("lr-Adam-1").size(), 1u);  // once, at the epoch's start
}

// logging_interval="epoch" logs the rate each epoch's steps use, at the
// epoch's first step: an epoch scheduler steps after an epoch's end, so the
// epoch's start sees the new rate (at the epoch's end the monitor logged
// the next epoch's rate, and never the first one).
TEST(LearningRateMonitor, AnEpochIntervalLogsTheRateEachEpochUses) {
  TempDir dir;
  auto logger = std::make_shared<RecordingLogger>();
  auto monitor = std::make_shared<fulgur::LearningRateMonitor>(
      fulgur::LearningRateMonitorOptions{.logging_interval = "epoch"});
  LinearRegression model({.lr = 1.0});
  model.make_schedulers = [](torch::optim::Optimizer& o) {
    return std::vector<fulgur::SchedulerConfig>{
        {std::make_shared<fulgur::ExponentialLR>(o, 0.5), fulgur::Interval::kEpoch}};
  };
  auto options = logged_options(dir, logger, monitor);
  options.max_epochs = 3;
  fulgur::Trainer(options).fit(model, regression_loader(2));
  const auto lr = logger->series("lr-SGD");
  ASSERT_EQ(lr.size(), 3u);
  const std::vector<std::pair<int64_t, double>> expected = {{0, 1.0}, {2, 0.5}, {4, 0.25}};
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(lr[i].first, expected[i].first) << i;
    EXPECT_DOUBLE_EQ(lr[i].second, expected[i].second) << i;
  }
}

// A fit whose Trainer has no logger is refused, naming what to do (the rates
// would go nowhere), as Lightning's; fast_dev_run, which turns the loggers
// off, and the other stages are not.
TEST(LearningRateMonitor, WithoutALoggerAFitIsRefused) {
  TempDir dir;
  auto options = test_options(dir);  // logger=false
  options.callbacks = {std::make_shared<fulgur::LearningRateMonitor>()};
  {
    LinearRegression model;
    fulgur::Trainer trainer(options);
    EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, regression_loader(2)),
                       {"LearningRateMonitor: the Trainer has no logger (logger=false), so the "
                        "learning rates would go nowhere",
                        "logger=true"});
    EXPECT_NO_THROW(trainer.validate(model, regression_loader(2)));
  }
  options.fast_dev_run = 1;
  LinearRegression model;
  fulgur::Trainer trainer(options);
  EXPECT_NO_THROW(trainer.fit(model, regression_loader(2)));
}

}  // namespace
