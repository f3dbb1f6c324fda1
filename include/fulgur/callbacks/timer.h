// File: fulgur/callbacks/timer.h
//
// Timer: stops fit once its training time reaches a duration (the
// Trainer's max_time adds one). The request is agreed by every rank like
// request_stop(); the end of fit then runs as usual (the ModelCheckpoint's
// epoch-end save included). The time already trained is saved in
// checkpoints, so a resumed run counts on from it.
//
// OnExceptionCheckpoint: when fit fails with an exception (a NaN check, a
// bug in a step, a peer that died), saves a checkpoint of the state the run
// had reached, named in a message, before the error reaches the caller.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "fulgur/callbacks/callback.h"
#include "fulgur/callbacks/monitors.h"

namespace fulgur {

struct TimerOptions {
  /// Training time after which fit stops (> 0).
  std::chrono::milliseconds duration = std::chrono::hours(1);
  /// Checked after every training batch ("step") or epoch ("epoch").
  Choice<LoggingInterval> interval = LoggingInterval::kStep;
};

class Timer : public Callback {
 public:
  explicit Timer(TimerOptions options);
  std::string state_key() const override { return "Timer"; }
  void on_train_start(Trainer& trainer, Module& module) override;
  void on_train_end(Trainer& trainer, Module& module) override;
  void on_train_batch_end(Trainer& trainer, Module& module, const at::Tensor& loss,
                          const Batch& batch, int64_t batch_idx) override;
  void on_train_epoch_end(Trainer& trainer, Module& module) override;
  void save_state(torch::serialize::OutputArchive& archive) const override;
  void load_state(torch::serialize::InputArchive& archive) override;

  /// Training time so far (earlier runs of a resumed fit included).
  std::chrono::milliseconds time_elapsed() const;
  /// Whether it stopped the run.
  bool stopped() const { return stopped_; }

 private:
  void check(Trainer& trainer);
  TimerOptions options_;
  std::chrono::milliseconds before_{0};  // from a checkpoint, or ended runs
  std::optional<std::chrono::steady_clock::time_point> running_since_;
  bool stopped_ = false;
};

struct OnExceptionCheckpointOptions {
  /// Default: the run's checkpoint directory (<default_root_dir>/checkpoints,
  /// or the ModelCheckpoint's dirpath).
  std::string dirpath = "";
  std::string filename = "on_exception";
};

class OnExceptionCheckpoint : public Callback {
 public:
  explicit OnExceptionCheckpoint(OnExceptionCheckpointOptions options = {});
  std::string state_key() const override { return "OnExceptionCheckpoint"; }
  void on_fit_start(Trainer& trainer, Module& module) override;
  void on_fit_end(Trainer& trainer, Module& module) override;
  void on_exception(Trainer& trainer, Module& module, const std::exception& error) override;
  /// Where it saved ("" while it has not).
  const std::string& saved_path() const { return saved_path_; }

 private:
  OnExceptionCheckpointOptions options_;
  bool in_fit_ = false;
  std::string saved_path_;
};

}  // namespace fulgur
