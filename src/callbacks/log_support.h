// Private: what the monitoring callbacks share. Not installed.
#pragma once

#include <map>
#include <string>

#include "fulgur/loggers/logger.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"

namespace fulgur::detail {

/// `metrics` to every logger at the current step, on global rank 0.
inline void log_to_loggers(Trainer& trainer, const std::map<std::string, double>& metrics) {
  if (!trainer.strategy().is_global_zero() || metrics.empty()) return;
  for (const auto& logger : trainer.loggers()) logger->log_metrics(metrics, trainer.global_step());
}

}  // namespace fulgur::detail
