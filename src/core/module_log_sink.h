// Private: where Module::log() puts what a Module logs. The Trainer's
// logger connector implements it (one sink for training, one for
// evaluation) and points the module at the loop's sink. Not installed.
#pragma once

#include <ATen/core/Tensor.h>

#include <string_view>

#include "fulgur/core/module.h"

namespace fulgur::detail {

class ModuleLogSink {
 public:
  virtual void log(std::string_view name, double value, const LogOptions& options) = 0;
  /// `value` has one element; an implementation does not read it back here.
  virtual void log(std::string_view name, const at::Tensor& value, const LogOptions& options) = 0;
  /// A metric, per epoch; kept by reference. ConfigError for on_step=true
  /// or a metric that is not one number.
  virtual void log(std::string_view name, metrics::Metric& metric, const LogOptions& options) = 0;
  /// log() of each metric of `collection` under its prefix + key.
  virtual void log_dict(metrics::MetricCollection& collection, const LogOptions& options) = 0;

 protected:
  ~ModuleLogSink() = default;
};

}  // namespace fulgur::detail
