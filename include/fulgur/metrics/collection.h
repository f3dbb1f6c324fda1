// File: fulgur/metrics/collection.h
//
// Several metrics of the same predictions, updated together and logged
// together (each under the collection's prefix and its key):
//
//   fulgur::metrics::MetricCollection val("val_");
//   val.add("acc", std::make_shared<fulgur::metrics::Accuracy>(options))
//      .add("f1", std::make_shared<fulgur::metrics::F1Score>(macro));
//   val.update(logits, labels);   // in validation_step
//   log_dict(val);                // val_acc, val_f1
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fulgur/metrics/metric.h"

namespace fulgur::metrics {

class MetricCollection {
 public:
  explicit MetricCollection(std::string prefix = "") : prefix_(std::move(prefix)) {}

  /// Adds `metric` under `key` (logged as prefix + key). ConfigError for an
  /// empty or repeated key, a null metric, or one already in the collection.
  MetricCollection& add(const std::string& key, std::shared_ptr<PredictionMetric> metric);
  /// Every metric's update, or none: a batch that one metric refuses
  /// (PredictionMetric::check, ConfigError naming its key) is counted by
  /// none of them.
  void update(const at::Tensor& preds, const at::Tensor& target);
  /// prefix + key -> value, each as Metric::compute(group) (every rank
  /// calls it with the same collection).
  std::map<std::string, at::Tensor> compute(ProcessGroup* group = nullptr) const;
  void reset();

  const std::string& prefix() const { return prefix_; }
  /// (key, metric), in the order added.
  const std::vector<std::pair<std::string, std::shared_ptr<PredictionMetric>>>& metrics() const {
    return metrics_;
  }

 private:
  std::string prefix_;
  std::vector<std::pair<std::string, std::shared_ptr<PredictionMetric>>> metrics_;
};

}  // namespace fulgur::metrics
