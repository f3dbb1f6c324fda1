// File: fulgur/loggers/logger.h
//
// A Logger receives metrics (name → value at a step) and hyper-parameters.
// The Trainer calls loggers on rank 0 only.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "fulgur/core/module.h"

namespace fulgur {

class Logger {
 public:
  virtual ~Logger() = default;
  virtual std::string name() const = 0;
  /// Where this logger writes (a directory), for messages.
  virtual std::string log_dir() const = 0;
  virtual void log_hyperparams(const HParams& params) = 0;
  virtual void log_metrics(const std::map<std::string, double>& metrics, int64_t step) = 0;
  /// Flushes buffered rows.
  virtual void save() {}
  /// Flushes and closes at the end of a run.
  virtual void finalize() { save(); }
};

}  // namespace fulgur
