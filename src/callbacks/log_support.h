// Private: what the monitoring callbacks share. Not installed.
#pragma once

#include <map>
#include <string>

#include "fulgur/core/errors.h"
#include "fulgur/loggers/logger.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"

namespace fulgur::detail {

/// `metrics` to every logger at the current step, on global rank 0.
inline void log_to_loggers(Trainer& trainer, const std::map<std::string, double>& metrics) {
  if (!trainer.strategy().is_global_zero() || metrics.empty()) return;
  for (const auto& logger : trainer.loggers()) logger->log_metrics(metrics, trainer.global_step());
}

/// A fit of a Trainer without a logger (logger=false) is refused for a
/// monitoring callback `who`, whose `what` would go nowhere (as Lightning's
/// monitors refuse it); under fast_dev_run, which turns the loggers off,
/// and in the other stages, it logs nothing.
inline void require_logger_to_fit(const Trainer& trainer, Stage stage, const std::string& who,
                                  const std::string& what) {
  if (stage != Stage::kFit || !trainer.loggers().empty() || trainer.options().fast_dev_run != 0) {
    return;
  }
  throw ConfigError(str(who, ": the Trainer has no logger (logger=false), so ", what,
                        " would go nowhere. Keep a logger (logger=true, \"csv\" or "
                        "\"tensorboard\", or your own in loggers), or leave ",
                        who, " out."));
}

/// The loggers' cadence, for what a callback logs at a training batch's
/// start: true for the batch that may make the next stepping batch the
/// log_every_n_steps-th (Trainer::batches_that_stepped), once for it (the
/// first micro-batch of an accumulation window). `last` keeps the count
/// already logged at; start it at -1.
inline bool due_at_train_batch_start(const Trainer& trainer, int64_t& last) {
  const int64_t stepped = trainer.batches_that_stepped();
  if (stepped == last || (stepped + 1) % trainer.options().log_every_n_steps != 0) return false;
  last = stepped;
  return true;
}

/// The same at a training batch's end: the batch whose step was the
/// log_every_n_steps-th, once.
inline bool due_at_train_batch_end(const Trainer& trainer, int64_t& last) {
  const int64_t stepped = trainer.batches_that_stepped();
  if (stepped == 0 || stepped == last || stepped % trainer.options().log_every_n_steps != 0) {
    return false;
  }
  last = stepped;
  return true;
}

}  // namespace fulgur::detail
