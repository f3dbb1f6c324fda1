// File: fulgur/callbacks/learning_rate_monitor.h
//
// Logs every optimizer's learning rate (and momentum, on request) to the
// loggers, as "lr-SGD", "lr-Adam", "lr-Adam/pg2" for a second parameter
// group, "lr-SGD-1" for a second SGD: the rate each optimizer step is about
// to use, at that step's index, at the start of the batches whose values
// go to the loggers (every log_every_n_steps-th batch that steps;
// Trainer::batches_that_stepped), or at each epoch's start (the rate the
// epoch's steps use, at its first step's index), on global rank 0. A fit
// without a logger is refused (the rates would go nowhere).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "fulgur/callbacks/callback.h"
#include "fulgur/core/interval.h"

namespace fulgur {

struct LearningRateMonitorOptions {
  /// "step" (at the loggers' cadence) or "epoch".
  Choice<Interval> logging_interval = Interval::kStep;
  /// Also "momentum-<name>": SGD's momentum, Adam's and AdamW's beta1,
  /// RMSprop's momentum.
  bool log_momentum = false;
};

class LearningRateMonitor : public Callback {
 public:
  explicit LearningRateMonitor(LearningRateMonitorOptions options = {});
  std::string state_key() const override { return "LearningRateMonitor"; }
  void setup(Trainer& trainer, Module& module, Stage stage) override;
  void on_train_start(Trainer& trainer, Module& module) override;
  void on_train_batch_start(Trainer& trainer, Module& module, const Batch& batch,
                            int64_t batch_idx) override;
  void on_train_epoch_start(Trainer& trainer, Module& module) override;
  /// What it logged last (name → value), for programs and tests.
  const std::map<std::string, double>& last_logged() const { return last_; }

 private:
  void log(Trainer& trainer, Module& module);
  LearningRateMonitorOptions options_;
  std::map<std::string, double> last_;
  int64_t logged_ = -1;  // Trainer::batches_that_stepped() at the last log
};

}  // namespace fulgur
