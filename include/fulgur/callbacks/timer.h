// File: fulgur/callbacks/timer.h
//
// Stops fit once its training time reaches a duration (the
// Trainer's max_time adds one). The request is agreed by every rank like
// request_stop(); the end of fit then runs as usual (the ModelCheckpoint's
// epoch-end save included). The time already trained is saved in
// checkpoints, so a resumed run counts on from it (one resumed with its time
// already spent stops before training, as Lightning's, where min_epochs
// and min_steps allow); a fit from the start (a second fit with the same
// Timer or Trainer) has the whole duration again.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "fulgur/callbacks/callback.h"
#include "fulgur/core/interval.h"

namespace fulgur {

struct TimerOptions {
  /// Training time after which fit stops (> 0).
  std::chrono::milliseconds duration = std::chrono::hours(1);
  /// Checked after every training batch ("step") or epoch ("epoch").
  Choice<Interval> interval = Interval::kStep;
};

class Timer : public Callback {
 public:
  explicit Timer(TimerOptions options);
  std::string state_key() const override { return "Timer"; }
  void setup(Trainer& trainer, Module& module, Stage stage) override;
  void on_fit_start(Trainer& trainer, Module& module) override;
  void on_train_start(Trainer& trainer, Module& module) override;
  void on_train_end(Trainer& trainer, Module& module) override;
  void on_train_batch_end(Trainer& trainer, Module& module, const at::Tensor& loss,
                          const Batch& batch, int64_t batch_idx) override;
  void on_train_epoch_end(Trainer& trainer, Module& module) override;
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;

  /// Training time of this fit so far (earlier runs of a resumed fit
  /// included), or of the last fit once it ended.
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

}  // namespace fulgur
