#include "fulgur/callbacks/throughput_monitor.h"

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

}  // namespace
