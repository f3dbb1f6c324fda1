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
  for (const auto& [k, m] : metrics_) {
    if (k == key) {
      throw ConfigError(str("MetricCollection(\"", prefix_, "\").add(\"", key,
                            "\"): the key is taken; give each metric its own."));
    }
    if (m == metric) {
      throw ConfigError(str("MetricCollection(\"", prefix_, "\").add(\"", key, "\"): this ",
                            metric->name(), " is in the collection already, as \"", k,
                            "\"; each update would count every sample twice in it. Add another "
                            "object (std::make_shared) for a second key."));
    }
  }
  metrics_.emplace_back(key, std::move(metric));
  return *this;
}

void MetricCollection::update(const at::Tensor& preds, const at::Tensor& target) {
  // All or none: a batch one metric refuses is counted by none.
  if (metrics_.size() > 1) {
    for (const auto& [key, m] : metrics_) {
      try {
        m->check(preds, target);
      } catch (const ConfigError& error) {
        throw ConfigError(str("MetricCollection(\"", prefix_, "\").update: \"", key,
                              "\" refuses this batch, so no metric of the collection counted "
                              "it: ",
                              error.what()));
      }
    }
  }
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
