#include "fulgur/callbacks/throughput_monitor.h"

#include <torch/torch.h>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/data/batch.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"
#include "callbacks/log_support.h"

namespace fulgur {

ThroughputMonitor::ThroughputMonitor(ThroughputMonitorOptions options) : options_(options) {
  if (options_.window < 2) {
    throw ConfigError(str("ThroughputMonitor(window=", options_.window,
                          "): must be >= 2 (a rate needs two batch ends)."));
  }
}

void ThroughputMonitor::on_train_start(Trainer&, Module&) {
  logged_ = -1;
  window_.clear();
  batches_per_sec_ = 0;
  samples_per_sec_ = 0;
  excluded_ = Clock::duration{};
  paused_ = 0;
  validation_ended_ = false;
}

void ThroughputMonitor::pause() {
  if (paused_++ == 0) paused_since_ = Clock::now();
}

void ThroughputMonitor::resume() {
  if (paused_ > 0 && --paused_ == 0) excluded_ += Clock::now() - paused_since_;
}

// The time between epochs (the epoch's end, its validation and checkpoints)
// and a validation's are not training.
void ThroughputMonitor::on_train_epoch_end(Trainer&, Module&) { pause(); }
void ThroughputMonitor::on_train_epoch_start(Trainer&, Module&) { resume(); }
void ThroughputMonitor::on_validation_start(Trainer&, Module&) {
  if (validation_ended_) return;  // validations back to back: still paused
  pause();
}
// The callbacks after this one in the hook (a ModelCheckpoint's save) are
// not training either: the pause ends when training goes on.
void ThroughputMonitor::on_validation_end(Trainer&, Module&) { validation_ended_ = true; }
void ThroughputMonitor::on_train_batch_start(Trainer&, Module&, const Batch&, int64_t) {
  if (!validation_ended_) return;
  validation_ended_ = false;
  resume();
}

void ThroughputMonitor::on_train_batch_end(Trainer& trainer, Module&, const at::Tensor&,
                                           const Batch& batch, int64_t) {
  window_.emplace_back(training_now(), batch.batch_size());
  if (static_cast<int64_t>(window_.size()) > options_.window) window_.pop_front();
  if (window_.size() >= 2) {
    const double seconds =
        std::chrono::duration<double>(window_.back().first - window_.front().first).count();
    int64_t samples = 0;
    // The first entry marks the window's start; its samples came before it.
    for (size_t i = 1; i < window_.size(); ++i) samples += window_[i].second;
    if (seconds > 0) {
      batches_per_sec_ = static_cast<double>(window_.size() - 1) / seconds;
      samples_per_sec_ = static_cast<double>(samples) * trainer.strategy().world_size() / seconds;
    }
  }
  if (batches_per_sec_ > 0 && detail::due_at_train_batch_end(trainer, logged_)) {
    detail::log_to_loggers(trainer, {{"throughput/batches_per_sec", batches_per_sec_},
                                     {"throughput/samples_per_sec", samples_per_sec_}});
  }
}

}  // namespace fulgur
