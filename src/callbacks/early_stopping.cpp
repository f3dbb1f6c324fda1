#include "fulgur/callbacks/early_stopping.h"

#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <limits>

#include "fulgur/core/errors.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"

namespace fulgur {

EarlyStopping::EarlyStopping(EarlyStoppingOptions options)
    : options_(std::move(options)), best_score_(std::numeric_limits<double>::quiet_NaN()) {
  std::vector<std::string> problems;
  if (options_.monitor.empty()) {
    problems.push_back("monitor=\"\": name the logged metric to watch (e.g. \"val_loss\")");
  }
  if (!options_.mode.is_valid()) {
    problems.push_back(
        str("mode=\"", options_.mode.text(), "\": pass ", options_.mode.spellings()));
  }
  if (!(options_.min_delta >= 0.0) || std::isinf(options_.min_delta)) {
    problems.push_back(str("min_delta=", options_.min_delta,
                           ": must be a finite number >= 0 (an improvement must exceed it)"));
  }
  if (options_.patience < 1) {
    problems.push_back(str("patience=", options_.patience, ": must be >= 1"));
  }
  for (const auto& [name, value] :
       {std::pair{"stopping_threshold", options_.stopping_threshold},
        std::pair{"divergence_threshold", options_.divergence_threshold}}) {
    if (value && !std::isfinite(*value)) {
      problems.push_back(str(name, "=", *value, ": must be a finite number, or unset"));
    }
  }
  if (!problems.empty()) throw ConfigError(str("EarlyStopping(", join(problems, "; "), ")."));
}

std::string EarlyStopping::state_key() const {
  return str("EarlyStopping{monitor=", options_.monitor, ",mode=", options_.mode.text(), "}");
}

bool EarlyStopping::better(double a, double b, double delta) const {
  if (std::isnan(a)) return false;
  if (std::isnan(b)) return true;
  return options_.mode == CheckpointMode::kMin ? a < b - delta : a > b + delta;
}

bool EarlyStopping::checks_at_epoch_end(const Trainer& trainer) const {
  if (options_.check_on_train_epoch_end) return *options_.check_on_train_epoch_end;
  // After each validation unless there is one at every epoch's end (then
  // the epoch's end comes right after it) or none at all (a training
  // metric). Checking at every epoch's end when validation runs every
  // N-th epoch found no value, or counted the last one again.
  if (!trainer.fit_validates()) return true;
  const BatchLimit& interval = trainer.options().val_check_interval;
  const auto& every_n_epochs = trainer.options().check_val_every_n_epoch;
  return interval.is_fraction() && interval.fraction() >= 1.0 && every_n_epochs &&
         *every_n_epochs == 1;
}

void EarlyStopping::on_train_epoch_end(Trainer& trainer, Module&) {
  if (checks_at_epoch_end(trainer)) check(trainer);
}

void EarlyStopping::on_validation_end(Trainer& trainer, Module&) {
  // A standalone Trainer::validate stops nothing and counts no patience.
  if (trainer.stage() != Stage::kFit || trainer.sanity_checking()) return;
  if (!checks_at_epoch_end(trainer)) check(trainer);
}

void EarlyStopping::check(Trainer& trainer) {
  if (trainer.options().fast_dev_run > 0) return;
  Strategy& strategy = trainer.strategy();
  const auto& metrics = trainer.callback_metrics();
  auto it = metrics.find(options_.monitor);
  // Every rank reaches this point equally often, so the agreements below
  // are collectives on every rank. Whether any rank lacks the metric is
  // agreed first (one logged on some ranks only): every rank then stops or
  // skips alike, none waits alone in the decision's collective.
  const bool missing = it == metrics.end();
  const bool any_missing = strategy.world_size() > 1
                               ? strategy.reduce_boolean_decision(missing, /*all=*/false)
                               : missing;
  if (any_missing) {
    std::vector<std::string> names;
    for (const auto& [k, _] : metrics) names.push_back(k);
    const std::string what =
        missing ? str("EarlyStopping(monitor=\"", options_.monitor,
                      "\"): no metric of that name was logged",
                      strategy.world_size() > 1 ? str(" on rank ", strategy.global_rank())
                                                : std::string(),
                      ". Logged metrics: ", names.empty() ? std::string("none") : join(names),
                      ". Log it with log(\"", options_.monitor, "\", ...) or change monitor")
                : str("EarlyStopping(monitor=\"", options_.monitor,
                      "\"): another rank logged no metric of that name (this rank ",
                      strategy.global_rank(),
                      " did). Log it on every rank (with sync_dist=true for one value across "
                      "them) or change monitor");
    if (options_.strict) throw ConfigError(what + ".");
    if (!warned_missing_ && strategy.is_global_zero()) {
      detail::print_note(str(what, "; not checking (strict=false)."));
    }
    warned_missing_ = true;
    return;
  }
  const double current = it->second;
  std::string reason = threshold_reason(current);
  if (reason.empty()) {
    if (better(current, best_score_, options_.min_delta)) {
      best_score_ = current;
      wait_count_ = 0;
    } else if (++wait_count_ >= options_.patience) {
      reason =
          str(options_.monitor, " did not improve by more than min_delta=", options_.min_delta,
              " in ", wait_count_, " checks in a row (best ", best_score_, ", now ", current, ")");
    }
  }
  if (!agreed(trainer, !reason.empty())) return;
  if (reason.empty()) reason = "another rank's EarlyStopping decided to stop";
  stopped_epoch_ = trainer.current_epoch();
  stopped_step_ = trainer.global_step();
  stop_reason_ = reason;
  trainer.request_stop();
  if (strategy.is_global_zero()) {
    detail::print_note(str("EarlyStopping: ", reason, ". Stopping at epoch ",
                           trainer.current_epoch(), ", step ", trainer.global_step(), "."));
  }
}

std::string EarlyStopping::threshold_reason(double current) const {
  if (options_.check_finite && !std::isfinite(current)) {
    return str(options_.monitor, " = ", current, " is not finite; the best was ", best_score_);
  }
  if (options_.stopping_threshold && better(current, *options_.stopping_threshold, 0.0)) {
    return str(options_.monitor, " = ", current,
               " reached stopping_threshold=", *options_.stopping_threshold);
  }
  if (options_.divergence_threshold && !std::isnan(current) &&
      !better(current, *options_.divergence_threshold, 0.0) &&
      current != *options_.divergence_threshold) {
    return str(options_.monitor, " = ", current,
               " is worse than divergence_threshold=", *options_.divergence_threshold);
  }
  return {};
}

bool EarlyStopping::agreed(Trainer& trainer, bool stop) {
  // One rank's decision stops every rank (a metric without sync_dist may
  // differ by rank).
  Strategy& strategy = trainer.strategy();
  if (strategy.world_size() > 1) stop = strategy.reduce_boolean_decision(stop, /*all=*/false);
  return stop;
}

void EarlyStopping::on_train_start(Trainer& trainer, Module&) {
  if (trainer.global_step() == 0 && trainer.current_epoch() == 0) {
    // A fit from the start (a second fit of the same Trainer too): it
    // counts afresh, as a new EarlyStopping would (a resumed fit has taken
    // the checkpoint's count and best).
    wait_count_ = 0;
    best_score_ = std::numeric_limits<double>::quiet_NaN();
    stopped_epoch_ = -1;
    stopped_step_ = -1;
    stop_reason_.clear();
    warned_missing_ = false;
    return;
  }
  // Every rank holds the same state (decisions are agreed), so every rank
  // takes this branch or none (-1, no decision, is no step).
  if (stopped_step_ != trainer.global_step() || trainer.options().fast_dev_run > 0) return;
  const auto& metrics = trainer.callback_metrics();
  const auto it = metrics.find(options_.monitor);
  const bool stop = it != metrics.end() &&
                    (!threshold_reason(it->second).empty() || wait_count_ >= options_.patience);
  if (!agreed(trainer, stop)) return;
  trainer.request_stop();
  if (trainer.strategy().is_global_zero()) {
    detail::print_note(str("EarlyStopping: resumed at step ", trainer.global_step(),
                           ", where it had stopped the fit (",
                           stop_reason_.empty() ? std::string("its check then") : stop_reason_,
                           "); stopping again. A larger patience trains on."));
  }
}

// wait_count (int), best_score (double, NaN before the first check),
// stopped_epoch and stopped_step (int, -1: none), stop_reason (string);
// each optional on load.
StateDict EarlyStopping::state_dict() const {
  StateDict state;
  state.set("wait_count", wait_count_);
  state.set("best_score", best_score_);
  state.set("stopped_epoch", stopped_epoch_);
  state.set("stopped_step", stopped_step_);
  state.set("stop_reason", stop_reason_);
  return state;
}

void EarlyStopping::load_state_dict(const StateDict& state) {
  if (state.contains("wait_count")) wait_count_ = state.integer("wait_count");
  if (state.contains("best_score")) best_score_ = state.real("best_score");
  if (state.contains("stopped_epoch")) stopped_epoch_ = state.integer("stopped_epoch");
  if (state.contains("stopped_step")) stopped_step_ = state.integer("stopped_step");
  if (state.contains("stop_reason")) stop_reason_ = state.string("stop_reason");
}

}  // namespace fulgur
