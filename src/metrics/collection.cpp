// MetricCollection: several metrics of the same predictions.
#include "fulgur/metrics/collection.h"

#include "fulgur/core/errors.h"

namespace fulgur::metrics {

MetricCollection& MetricCollection::add(const std::string& key,
                                        std::shared_ptr<PredictionMetric> metric) {
  if (key.empty() || !metric) {
    throw ConfigError(str("MetricCollection(\"", prefix_, "\").add(\"", key,
                          "\", ...): pass a non-empty key and a metric."));
  }
  for (const auto& [k, _] : metrics_) {
    if (k == key) {
      throw ConfigError(str("MetricCollection(\"", prefix_, "\").add(\"", key,
                            "\"): the key is taken; give each metric its own."));
    }
  }
  metrics_.emplace_back(key, std::move(metric));
  return *this;
}

void MetricCollection::update(const at::Tensor& preds, const at::Tensor& target) {
  for (auto& [_, m] : metrics_) m->update(preds, target);
}

std::map<std::string, at::Tensor> MetricCollection::compute(ProcessGroup* group) const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [key, m] : metrics_) out[prefix_ + key] = m->compute(group);
  return out;
}

void MetricCollection::reset() {
  for (auto& [_, m] : metrics_) m->reset();
}

}  // namespace fulgur::metrics
