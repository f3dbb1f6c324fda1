#include "fulgur/callbacks/throughput_monitor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <map>
#include <string>
#include <thread>
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

TEST(ThroughputMonitor, LogsBatchAndSampleRates) {
  TempDir dir;
  auto logger = std::make_shared<RecordingLogger>();
  auto monitor =
      std::make_shared<fulgur::ThroughputMonitor>(fulgur::ThroughputMonitorOptions{.window = 4});
  LinearRegression model;
  fulgur::Trainer trainer(logged_options(dir, logger, monitor));
  trainer.fit(model, regression_loader(6, /*batch_size=*/5));
  auto batches = logger->series("throughput/batches_per_sec");
  auto samples = logger->series("throughput/samples_per_sec");
  ASSERT_EQ(batches.size(), 5u);  // from the second batch on
  EXPECT_GT(monitor->batches_per_sec(), 0);
  // Every batch holds 5 samples.
  EXPECT_NEAR(monitor->samples_per_sec(), 5 * monitor->batches_per_sec(),
              1e-9 * monitor->samples_per_sec());
  EXPECT_THROW(fulgur::ThroughputMonitor({.window = 1}), fulgur::ConfigError);
}

// The window runs on across epochs: epochs of one batch each log rates
// (the window was cleared at every epoch's start, so they logged nothing),
// and a second fit starts with no rate (0 until its window has two
// batches), not the first fit's.
TEST(ThroughputMonitor, TheWindowRunsAcrossEpochsAndEachFitStartsAfresh) {
  TempDir dir;
  auto logger = std::make_shared<RecordingLogger>();
  auto monitor =
      std::make_shared<fulgur::ThroughputMonitor>(fulgur::ThroughputMonitorOptions{.window = 3});
  std::vector<double> at_first_batch;
  struct AtFirstBatch : fulgur::Callback {
    std::shared_ptr<fulgur::ThroughputMonitor> monitor;
    std::vector<double>* seen = nullptr;
    std::string state_key() const override { return "AtFirstBatch"; }
    void on_train_batch_end(fulgur::Trainer&, fulgur::Module&, const at::Tensor&,
                            const fulgur::Batch&, int64_t) override {
      if (!seen->empty() && seen->back() < 0) seen->push_back(monitor->batches_per_sec());
    }
    void on_train_start(fulgur::Trainer&, fulgur::Module&) override { seen->push_back(-1); }
  };
  auto probe = std::make_shared<AtFirstBatch>();
  probe->monitor = monitor;
  probe->seen = &at_first_batch;
  auto options = logged_options(dir, logger, monitor);
  options.callbacks.push_back(probe);  // after the monitor
  options.max_epochs = 6;
  LinearRegression model;
  fulgur::Trainer(options).fit(model, regression_loader(1));
  EXPECT_EQ(logger->series("throughput/batches_per_sec").size(), 5u);  // from the second epoch
  fulgur::Trainer(options).fit(model, regression_loader(1));
  // Each fit's first batch end: no rate yet.
  ASSERT_EQ(at_first_batch.size(), 4u);
  EXPECT_EQ(at_first_batch[1], 0.0);
  EXPECT_EQ(at_first_batch[3], 0.0);
}

// A validation's time is not training: with a validation far longer than
// the training batches in the window, the rate stays that of the training
// batches. (Not a speed check: counting the 0.5 s validation would hold
// the rate under 3 batches / 0.5 s = 6 per second whatever the machine;
// the training batches alone take well under a millisecond each.)
// The batch rates a window of 4 logs over one epoch of 6 batches that
// validates after batches 2 and 4, with `more` callbacks after the monitor.
std::vector<std::pair<int64_t, double>> rates_validating_every_2_batches(
    LinearRegression& model, std::vector<std::shared_ptr<fulgur::Callback>> more = {}) {
  TempDir dir;
  auto logger = std::make_shared<RecordingLogger>();
  auto monitor =
      std::make_shared<fulgur::ThroughputMonitor>(fulgur::ThroughputMonitorOptions{.window = 4});
  auto options = logged_options(dir, logger, monitor);
  options.callbacks.insert(options.callbacks.end(), more.begin(), more.end());
  options.num_sanity_val_steps = 0;
  options.val_check_interval = int64_t{2};
  options.max_epochs = 1;
  fulgur::Trainer(options).fit(model, regression_loader(6), regression_loader(1));
  return logger->series("throughput/batches_per_sec");
}

TEST(ThroughputMonitor, AValidationsTimeIsNotTraining) {
  LinearRegression model;
  model.val_hook = [](LinearRegression&, fulgur::Batch&, int64_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  };
  const auto rates = rates_validating_every_2_batches(model);
  ASSERT_EQ(rates.size(), 5u);
  // The last window (batches 3 to 6) spans the validations after batches 2 and 4.
  EXPECT_GT(rates.back().second, 6.0);
}

// What the callbacks after it do at a validation's end (a ModelCheckpoint's
// save, here a callback that takes 500 ms) is not training either: it was
// counted, the monitor's clock resumed first in that hook.
TEST(ThroughputMonitor, TheSaveAfterAValidationIsNotTraining) {
  struct SlowSave : fulgur::Callback {
    std::string state_key() const override { return "SlowSave"; }
    void on_validation_end(fulgur::Trainer&, fulgur::Module&) override {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  };
  LinearRegression model;
  const auto rates = rates_validating_every_2_batches(model, {std::make_shared<SlowSave>()});
  ASSERT_EQ(rates.size(), 5u);
  EXPECT_GT(rates.back().second, 6.0);
}

}  // namespace
