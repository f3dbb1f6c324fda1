// MetricCollection: its metrics updated together, named with the prefix.
#include "fulgur/metrics/collection.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

namespace M = fulgur::metrics;

TEST(MetricCollection, UpdatesEveryMetricAndNamesThemWithThePrefix) {
  M::MetricCollection val("val_");
  auto acc = std::make_shared<M::Accuracy>(M::ClassificationOptions{.num_classes = 3});
  auto f1 = std::make_shared<M::F1Score>(
      M::ClassificationOptions{.num_classes = 3, .average = "macro"});
  val.add("acc", acc).add("f1", f1);
  val.update(torch::tensor({0, 1, 1}, torch::kLong), torch::tensor({0, 1, 2}, torch::kLong));
  const auto values = val.compute();
  ASSERT_EQ(values.size(), 2u);
  EXPECT_DOUBLE_EQ(values.at("val_acc").item<double>(), 2.0 / 3);
  // Per-class F1 1, 2/3 and 0 (class 2 was never predicted).
  EXPECT_DOUBLE_EQ(values.at("val_f1").item<double>(), (1.0 + 2.0 / 3 + 0.0) / 3);
  val.reset();
  EXPECT_EQ(acc->update_count(), 0);
  EXPECT_THROWS_WITH(fulgur::ConfigError, val.add("acc", acc), {"\"acc\"", "taken"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, val.add("", acc), {"non-empty key"});
  // The same object under a second key counted every sample twice.
  EXPECT_THROWS_WITH(fulgur::ConfigError, val.add("acc2", acc),
                     {"\"acc2\"", "Accuracy is in the collection already, as \"acc\""});
}

// A batch that one metric refuses is counted by none (the first metrics
// had counted it before the error).
TEST(MetricCollection, ABatchOneMetricRefusesIsCountedByNone) {
  M::MetricCollection val("val_");
  auto acc = std::make_shared<M::Accuracy>(M::ClassificationOptions{.num_classes = 3});
  auto f1 = std::make_shared<M::F1Score>(M::ClassificationOptions{.num_classes = 4});
  auto mse = std::make_shared<M::MeanSquaredError>();
  val.add("acc", acc).add("f1", f1).add("mse", mse);
  EXPECT_THROWS_WITH(
      fulgur::ConfigError, val.update(torch::eye(3), torch::tensor({0, 1, 2}, torch::kLong)),
      {"MetricCollection(\"val_\").update: \"f1\" refuses this batch", "F1Score.update", "[N, 4]"});
  EXPECT_EQ(acc->update_count(), 0);
  EXPECT_EQ(f1->update_count(), 0);
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     val.update(torch::eye(3), torch::tensor({0, 1, 2}, torch::kLong)), {"\"f1\""});
}

}  // namespace
