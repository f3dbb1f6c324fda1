// File: fulgur/core/monitored_scheduler.h
//
// The interface of a learning-rate scheduler stepped with a metric's value
// (fulgur::ReduceLROnPlateau, fulgur/optim/lr_scheduler.h).
#pragma once

namespace fulgur {

/// Implemented by a scheduler that is stepped with the value of a metric
/// (ReduceLROnPlateau): SchedulerConfig::monitor names the metric, and the
/// Trainer calls step(value) instead of step() (through
/// Module::lr_scheduler_step). Under several ranks the value is global rank
/// 0's (log it with sync_dist=true for the mean over ranks), so that every
/// rank takes the same decision.
class MonitoredScheduler {
 public:
  virtual ~MonitoredScheduler() = default;
  virtual void step(double value) = 0;
};

}  // namespace fulgur
