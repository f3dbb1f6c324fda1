// File: fulgur/callbacks/throughput_monitor.h
//
// Logs training throughput over a window of recent batches to the loggers:
// "throughput/batches_per_sec" and "throughput/samples_per_sec" (every
// rank's samples), at the end of the batches whose values go to the loggers
// (every log_every_n_steps-th batch that steps), on global rank 0. The
// window runs on across epochs, and the time of validations and between
// epochs (from an epoch's end to the next one's start: its validation and
// checkpoints) is not counted, as Lightning's leaves out validation; nor is
// what follows a validation until the next training batch starts (the
// checkpoint a ModelCheckpoint writes at its end).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>

#include "fulgur/callbacks/callback.h"

namespace fulgur {

struct ThroughputMonitorOptions {
  /// Batches the rates are averaged over (>= 2).
  int64_t window = 50;
};

class ThroughputMonitor : public Callback {
 public:
  explicit ThroughputMonitor(ThroughputMonitorOptions options = {});
  std::string state_key() const override { return "ThroughputMonitor"; }
  void on_train_start(Trainer& trainer, Module& module) override;
  void on_train_epoch_start(Trainer& trainer, Module& module) override;
  void on_train_epoch_end(Trainer& trainer, Module& module) override;
  void on_validation_start(Trainer& trainer, Module& module) override;
  void on_validation_end(Trainer& trainer, Module& module) override;
  void on_train_batch_start(Trainer& trainer, Module& module, const Batch& batch,
                            int64_t batch_idx) override;
  void on_train_batch_end(Trainer& trainer, Module& module, const at::Tensor& loss,
                          const Batch& batch, int64_t batch_idx) override;
  /// The latest rates (0 before this fit's window has two batches).
  double batches_per_sec() const { return batches_per_sec_; }
  double samples_per_sec() const { return samples_per_sec_; }

 private:
  using Clock = std::chrono::steady_clock;
  /// Training time: the clock less what was not training.
  Clock::time_point training_now() const { return Clock::now() - excluded_; }
  void pause();
  void resume();
  ThroughputMonitorOptions options_;
  /// (end of batch in training time, samples in it) of the window's batches.
  std::deque<std::pair<Clock::time_point, int64_t>> window_;
  Clock::duration excluded_{};  // time not training, since the fit's start
  int paused_ = 0;              // nested pauses (a validation within an epoch's end)
  bool validation_ended_ = false;  // its pause ends at the next training batch's start
  Clock::time_point paused_since_{};
  double batches_per_sec_ = 0;
  double samples_per_sec_ = 0;
  int64_t logged_ = -1;  // Trainer::batches_that_stepped() at the last log
};

}  // namespace fulgur
