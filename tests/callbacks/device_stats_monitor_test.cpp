// DeviceStatsMonitor: the device's statistics (here the CPU's: HostStats)
// reach the loggers under "DeviceStatsMonitor.<hook>/<name>" at the loggers'
// cadence in training, validation (not its sanity check) and test;
// cpu_stats=false on the CPU logs nothing; without a logger it says what to
// do, except under fast_dev_run, which has none.
#include "fulgur/callbacks/device_stats_monitor.h"

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

std::vector<int64_t> steps_of(const RecordingLogger& logger, const std::string& key) {
  std::vector<int64_t> steps;
  for (const auto& [step, value] : logger.series(key)) steps.push_back(step);
  return steps;
}

TEST(DeviceStatsMonitor, LogsTheCpusStatisticsAtTheLoggersCadence) {
  TempDir dir;
  auto logger = std::make_shared<RecordingLogger>();
  auto monitor = std::make_shared<fulgur::DeviceStatsMonitor>();
  auto options = logged_options(dir, logger, monitor);
  options.log_every_n_steps = 2;
  LinearRegression model;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(6), regression_loader(4));
  trainer.test(model, regression_loader(5));

  const std::string start = "DeviceStatsMonitor.on_train_batch_start/";
  const std::string end = "DeviceStatsMonitor.on_train_batch_end/";
  // The batches that start steps 1, 3, 5 (the 2nd, 4th, 6th) and end them.
  EXPECT_EQ(steps_of(*logger, start + "cpu_rss_bytes"), (std::vector<int64_t>{1, 3, 5}));
  EXPECT_EQ(steps_of(*logger, end + "cpu_rss_bytes"), (std::vector<int64_t>{2, 4, 6}));
  for (const auto& [step, rss] : logger->series(end + "cpu_rss_bytes")) {
    EXPECT_GT(rss, 1 << 20) << step;
  }
  for (const auto& [step, vm] : logger->series(start + "cpu_vm_percent")) {
    EXPECT_GT(vm, 0) << step;
    EXPECT_LE(vm, 100) << step;
  }
  for (const auto& [step, cpu] : logger->series(end + "cpu_percent")) {
    EXPECT_GE(cpu, 0) << step;
    EXPECT_LE(cpu, 100) << step;
  }
  EXPECT_EQ(logger->series(end + "cpu_rss_peak_bytes").size(), 3u);
  // Validation's 2nd and 4th batches after the epoch (the sanity check's
  // two batches log nothing), the test's 2nd and 4th of 5.
  EXPECT_EQ(logger->series("DeviceStatsMonitor.on_validation_batch_start/cpu_rss_bytes").size(),
            2u);
  EXPECT_EQ(logger->series("DeviceStatsMonitor.on_validation_batch_end/cpu_rss_bytes").size(), 2u);
  EXPECT_EQ(logger->series("DeviceStatsMonitor.on_test_batch_end/cpu_swap_percent").size(), 2u);
  ASSERT_FALSE(monitor->last_logged().empty());
  for (const auto& [key, value] : monitor->last_logged()) {
    EXPECT_EQ(key.rfind("DeviceStatsMonitor.on_test_batch_end/cpu_", 0), 0u) << key;
  }
}

// Under manual optimization with two optimizers global_step counts two a
// batch; the loggers write every log_every_n_steps-th batch that stepped,
// and the monitoring callbacks log with them (they counted optimizer steps,
// which logged at every batch here). A second fit with the same callbacks
// logs at the same batches again.
TEST(MonitoringCallbacks, KeepTheLoggersCadenceUnderManualOptimizationAndInASecondFit) {
  struct TwoOptimizers : LinearRegression {
    fulgur::OptimizerConfig configure_optimizers() override {
      return fulgur::OptimizerConfig(std::vector<std::shared_ptr<torch::optim::Optimizer>>{
          std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{fc->weight},
                                              torch::optim::SGDOptions(0.05)),
          std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{fc->bias},
                                              torch::optim::SGDOptions(0.05))});
    }
    at::Tensor training_step(fulgur::Batch& batch, int64_t idx) override {
      auto loss = LinearRegression::training_step(batch, idx);
      manual_backward(loss);
      for (auto& o : optimizers()) optimizer_step(*o);
      return loss;
    }
  };
  TempDir dir;
  auto stats = std::make_shared<fulgur::DeviceStatsMonitor>();
  auto rates = std::make_shared<fulgur::LearningRateMonitor>();
  auto throughput = std::make_shared<fulgur::ThroughputMonitor>();
  for (int fit = 0; fit < 2; ++fit) {
    SCOPED_TRACE(fit);
    auto logger = std::make_shared<RecordingLogger>();
    auto options = logged_options(dir, logger, stats);
    options.callbacks.insert(options.callbacks.end(), {rates, throughput});
    options.log_every_n_steps = 2;
    TwoOptimizers model;
    model.set_automatic_optimization(false);
    fulgur::Trainer trainer(options);
    trainer.fit(model, regression_loader(6));
    ASSERT_EQ(trainer.global_step(), 12);
    ASSERT_EQ(trainer.batches_that_stepped(), 6);
    // The loggers' rows: the ends of the 2nd, 4th and 6th batches.
    const std::vector<int64_t> ends = {4, 8, 12};
    EXPECT_EQ(steps_of(*logger, "train_loss"), ends);
    EXPECT_EQ(steps_of(*logger, "DeviceStatsMonitor.on_train_batch_end/cpu_rss_bytes"), ends);
    EXPECT_EQ(steps_of(*logger, "throughput/batches_per_sec"), ends);
    // The starts of the same batches.
    const std::vector<int64_t> starts = {2, 6, 10};
    EXPECT_EQ(steps_of(*logger, "DeviceStatsMonitor.on_train_batch_start/cpu_rss_bytes"), starts);
    EXPECT_EQ(steps_of(*logger, "lr-SGD"), starts);
    EXPECT_EQ(steps_of(*logger, "lr-SGD-1"), starts);
  }
}

TEST(DeviceStatsMonitor, CpuStatsFalseOnTheCpuLogsNothing) {
  TempDir dir;
  auto logger = std::make_shared<RecordingLogger>();
  auto monitor = std::make_shared<fulgur::DeviceStatsMonitor>(
      fulgur::DeviceStatsMonitorOptions{.cpu_stats = false});
  LinearRegression model;
  fulgur::Trainer trainer(logged_options(dir, logger, monitor));
  trainer.fit(model, regression_loader(3));
  for (const auto& [step, metrics] : logger->calls) {
    for (const auto& [key, value] : metrics) {
      EXPECT_EQ(key.find("DeviceStatsMonitor"), std::string::npos) << key << " at " << step;
    }
  }
  EXPECT_TRUE(monitor->last_logged().empty());
}

TEST(DeviceStatsMonitor, WithoutALoggerSaysWhatToDoExceptUnderFastDevRun) {
  TempDir dir;
  auto options = test_options(dir);  // logger=false
  options.callbacks = {std::make_shared<fulgur::DeviceStatsMonitor>()};
  {
    LinearRegression model;
    fulgur::Trainer trainer(options);
    EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, regression_loader(2)),
                       {"DeviceStatsMonitor", "no logger (logger=false)", "logger=true"});
    // The other stages log nothing without a logger, as Lightning's.
    EXPECT_NO_THROW(trainer.validate(model, regression_loader(2)));
    EXPECT_NO_THROW(trainer.test(model, regression_loader(2)));
    EXPECT_NO_THROW(trainer.predict(model, regression_loader(2)));
  }
  options.fast_dev_run = 1;
  LinearRegression model;
  fulgur::Trainer trainer(options);
  EXPECT_NO_THROW(trainer.fit(model, regression_loader(2)));
}

}  // namespace
