// File: fulgur/callbacks/early_stopping.h
//
// Stops fit when a monitored metric stops improving: after `patience`
// checks without an improvement larger than `min_delta`, at once when it
// reaches `stopping_threshold` (good enough) or `divergence_threshold`
// (hopeless), or when it is not finite (`check_finite`). Checked at the end
// of every training epoch (after its validation), or at the end of every
// validation when validation runs several times per epoch or every N-th
// epoch. With several ranks the ranks agree: one rank's decision stops them
// all after the same batch (a metric logged without sync_dist may differ by
// rank). Its wait count and best score are saved in checkpoints, so a
// resumed run stops where the uninterrupted one would; a fit from the start
// (a second fit of the same Trainer too) counts afresh.
//
//   trainer_options.callbacks.push_back(std::make_shared<fulgur::EarlyStopping>(
//       fulgur::EarlyStoppingOptions{.monitor = "val_loss", .patience = 3}));
#pragma once

#include <optional>
#include <string>

#include "fulgur/callbacks/callback.h"
#include "fulgur/callbacks/model_checkpoint.h"
#include "fulgur/core/choice.h"

namespace fulgur {

struct EarlyStoppingOptions {
  /// The logged metric to watch (required).
  std::string monitor = "";
  /// An improvement must be larger than this (>= 0).
  double min_delta = 0.0;
  /// Checks without improvement before stopping (>= 1).
  int64_t patience = 3;
  /// "min" (lower is better) or "max".
  Choice<CheckpointMode> mode = CheckpointMode::kMin;
  /// A monitored metric that was never logged is an error (false: a warning
  /// once, and no check).
  bool strict = true;
  /// Stop when the metric is NaN or infinite.
  bool check_finite = true;
  /// Stop once the metric is better than this (good enough).
  std::optional<double> stopping_threshold = std::nullopt;
  /// Stop once the metric is worse than this (hopeless); NaN is not
  /// (check_finite stops on it).
  std::optional<double> divergence_threshold = std::nullopt;
  /// Check at the end of each training epoch (true) or of each validation
  /// (false). Unset: at the epoch's end when validation runs at every
  /// epoch's end only (val_check_interval 1.0, check_val_every_n_epoch 1)
  /// or never (a training metric), else after each validation.
  std::optional<bool> check_on_train_epoch_end = std::nullopt;
};

class EarlyStopping : public Callback {
 public:
  /// ConfigError naming each invalid option.
  explicit EarlyStopping(EarlyStoppingOptions options);
  std::string state_key() const override;
  /// Resumed from a checkpoint written at the step where it decided to stop
  /// (in the hook that checked, before the fit ended): it decides again,
  /// from its restored count and the values the checkpoint kept, under its
  /// options now (a larger patience trains on).
  void on_train_start(Trainer& trainer, Module& module) override;
  void on_train_epoch_end(Trainer& trainer, Module& module) override;
  void on_validation_end(Trainer& trainer, Module& module) override;
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;

  const EarlyStoppingOptions& options() const { return options_; }
  /// Checks in a row without improvement.
  int64_t wait_count() const { return wait_count_; }
  /// The best value seen (NaN before the first check).
  double best_score() const { return best_score_; }
  /// The epoch in which it stopped the run (-1: it did not).
  int64_t stopped_epoch() const { return stopped_epoch_; }
  /// Why it stopped the run ("" when it did not).
  const std::string& stop_reason() const { return stop_reason_; }

 private:
  bool checks_at_epoch_end(const Trainer& trainer) const;
  void check(Trainer& trainer);
  /// Why `current` stops the fit whatever the patience count (not finite,
  /// a threshold reached), or "".
  std::string threshold_reason(double current) const;
  /// Every rank agrees: one rank's decision stops all (a collective where
  /// several ranks run).
  static bool agreed(Trainer& trainer, bool stop);
  /// Whether `a` is better than `b` by more than `delta`.
  bool better(double a, double b, double delta) const;

  EarlyStoppingOptions options_;
  int64_t wait_count_ = 0;
  double best_score_;
  int64_t stopped_epoch_ = -1;
  int64_t stopped_step_ = -1;  // the global step of that decision
  std::string stop_reason_;
  bool warned_missing_ = false;
};

}  // namespace fulgur
