#include "fulgur/callbacks/timer.h"

#include <torch/torch.h>

#include <iostream>

#include "fulgur/core/errors.h"
#include "fulgur/data/data_loader.h"
#include "fulgur/data/data_module.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"

namespace fulgur {

namespace {
using Clock = std::chrono::steady_clock;

std::string seconds_text(std::chrono::milliseconds d) {
  return str(static_cast<double>(d.count()) / 1000.0, " s");
}
}  // namespace

Timer::Timer(TimerOptions options) : options_(std::move(options)) {
  std::vector<std::string> problems;
  if (options_.duration.count() <= 0) {
    problems.push_back(str("duration=", options_.duration.count(), " ms: must be > 0"));
  }
  if (!options_.interval.is_valid()) {
    problems.push_back(
        str("interval=\"", options_.interval.text(), "\": pass ", options_.interval.spellings()));
  }
  if (!problems.empty()) throw ConfigError(str("Timer(", join(problems, "; "), ")."));
}

std::chrono::milliseconds Timer::time_elapsed() const {
  auto total = before_;
  if (running_since_) {
    total += std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - *running_since_);
  }
  return total;
}

void Timer::setup(Trainer&, Module&, Stage stage) {
  // Before a resumed fit loads its checkpoint's time (which then counts
  // on): a fit from the start has the whole duration, whatever an earlier
  // fit of this Timer used or stopped.
  if (stage != Stage::kFit) return;
  before_ = std::chrono::milliseconds(0);
  stopped_ = false;
  running_since_.reset();
}

void Timer::on_fit_start(Trainer& trainer, Module&) {
  // After a resume has loaded the time trained: a checkpoint of a run this
  // Timer stopped trains no further. Under the epoch interval not within an
  // epoch (a checkpoint of a batch's end): the uninterrupted run went on to
  // the epoch's end, which checks.
  if (options_.interval == Interval::kEpoch) {
    const DataLoader* loader = trainer.train_dataloader();
    const int64_t total = trainer.num_training_batches();
    if (loader != nullptr && loader->epoch() == trainer.current_epoch() && loader->position() > 0 &&
        (total < 0 || loader->position() < total)) {
      return;
    }
  }
  check(trainer);
}

void Timer::on_train_start(Trainer&, Module&) { running_since_ = Clock::now(); }

void Timer::on_train_end(Trainer&, Module&) {
  before_ = time_elapsed();
  running_since_.reset();
}

void Timer::check(Trainer& trainer) {
  if (stopped_ || time_elapsed() < options_.duration) return;
  stopped_ = true;
  trainer.request_stop();
  if (trainer.strategy().is_global_zero()) {
    detail::print_note(str("Timer: ", seconds_text(time_elapsed()),
                           " of training reached max_time=", seconds_text(options_.duration),
                           "; stopping at epoch ", trainer.current_epoch(), ", step ",
                           trainer.global_step(), "."));
  }
}

void Timer::on_train_batch_end(Trainer& trainer, Module&, const at::Tensor&, const Batch&,
                               int64_t) {
  if (options_.interval == Interval::kStep) check(trainer);
}

void Timer::on_train_epoch_end(Trainer& trainer, Module&) {
  if (options_.interval == Interval::kEpoch) check(trainer);
}

// elapsed_ms (int): the training time so far, optional on load.
StateDict Timer::state_dict() const {
  StateDict state;
  state.set("elapsed_ms", static_cast<int64_t>(time_elapsed().count()));
  return state;
}

void Timer::load_state_dict(const StateDict& state) {
  if (state.contains("elapsed_ms")) {
    before_ = std::chrono::milliseconds(state.integer("elapsed_ms"));
    if (running_since_) running_since_ = Clock::now();
  }
}

}  // namespace fulgur
