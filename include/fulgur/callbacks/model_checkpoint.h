// File: fulgur/callbacks/model_checkpoint.h
//
// Saves checkpoints during fit: every N training steps and/or every N
// epochs, keeps the best `save_top_k` by a monitored metric, and maintains
// `last.ckpt` for `fit(..., {.ckpt_path = "last"})`. Files go to
// `<default_root_dir>/checkpoints/` unless `dirpath` is set. At the start of
// fit it removes what saves killed mid-write left there (temporary files of
// writers no longer alive). It deletes only files of its own directory. A
// fit from the start (a second fit of the same Trainer too) ranks and saves
// afresh; a resumed one goes on with the checkpoint's ranking.
//
//   trainer_options.callbacks.push_back(std::make_shared<fulgur::ModelCheckpoint>(
//       fulgur::ModelCheckpointOptions{.monitor = "val_acc", .mode = "max",
//                                      .save_top_k = 3}));
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "fulgur/callbacks/callback.h"
#include "fulgur/core/choice.h"

namespace fulgur {

/// Which end of the monitored metric is best.
enum class CheckpointMode { kMin, kMax };
template <>
struct ChoiceNames<CheckpointMode> {
  static constexpr std::pair<CheckpointMode, const char*> kNames[] = {
      {CheckpointMode::kMin, "min"}, {CheckpointMode::kMax, "max"}};
};

struct ModelCheckpointOptions {
  /// Directory for checkpoints; default `<default_root_dir>/checkpoints`.
  std::string dirpath = "";
  /// File name template; `{epoch}`, `{step}` and `{<metric>}` are filled in,
  /// each with an optional format ([0][width][.precision] and f, e, g or d:
  /// `{val_loss:.2f}`, `{epoch:03d}`; a metric without one has 4 decimals).
  /// A name of no metric logged reads "nan" (with a note). A name a kept
  /// checkpoint of another step has gets "-v1", "-v2", ... No '/': the
  /// directory is dirpath.
  std::string filename = "{epoch}-{step}";
  /// Each field is preceded by its name and '=', as Lightning's default:
  /// "{epoch}-{val_loss:.2f}" names "epoch=3-val_loss=0.12.ckpt"; false
  /// fills in the values alone ("3-0.12.ckpt"). A metric whose name holds a
  /// '/' ("val/loss") needs false (the name would make a directory).
  bool auto_insert_metric_name = true;
  /// Metric to rank checkpoints by; empty keeps the latest only.
  std::string monitor = "";
  /// "min" or "max" (CheckpointMode::kMin / kMax).
  Choice<CheckpointMode> mode = CheckpointMode::kMin;
  /// How many to keep: -1 all, 0 none (only last), k the k best.
  int64_t save_top_k = 1;
  /// Also maintain `last.ckpt`.
  bool save_last = true;
  /// Save every N optimizer steps (0: off).
  int64_t every_n_train_steps = 0;
  /// Save at the end of every N-th epoch (0: off). Default: every epoch
  /// unless every_n_train_steps is set. With a monitor and validation
  /// within epochs or every N-th epoch (check_val_every_n_epoch), at the end
  /// of every validation of those epochs instead (an epoch's end rewrites
  /// last.ckpt only: no validation scored its weights).
  std::optional<int64_t> every_n_epochs = std::nullopt;
};

class ModelCheckpoint : public Callback {
 public:
  /// Throws ConfigError on an invalid mode, save_top_k < -1 or negative
  /// intervals.
  explicit ModelCheckpoint(ModelCheckpointOptions options = {});

  std::string state_key() const override;
  void on_fit_start(Trainer& trainer, Module& module) override;
  void on_train_batch_end(Trainer& trainer, Module& module, const at::Tensor& loss,
                          const Batch& batch, int64_t batch_idx) override;
  void on_train_epoch_end(Trainer& trainer, Module& module) override;
  void on_validation_end(Trainer& trainer, Module& module) override;
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;

  const std::string& dirpath() const { return dirpath_; }
  const std::string& best_model_path() const { return best_model_path_; }
  std::optional<double> best_model_score() const { return best_model_score_; }
  const std::string& last_model_path() const { return last_model_path_; }
  const ModelCheckpointOptions& options() const { return options_; }

 private:
  void save(Trainer& trainer);
  void save_last(Trainer& trainer);
  bool enabled(Trainer& trainer) const;
  /// With a monitor, where the fit validates other than once at each
  /// epoch's end (within epochs, or every N-th epoch): the checkpoints are
  /// ranked at every validation's end, and none at an epoch's end (whose
  /// weights no validation scored), as Lightning's.
  bool ranks_at_each_validation(const Trainer& trainer) const;
  /// The filename template, parsed once: literal text, or a {key:spec}
  /// field (a '{' without its '}' is text).
  struct NamePart {
    std::string text;  // the text, or the field's key
    std::string spec;  // the field's format, "" for none
    bool field = false;
  };
  static std::vector<NamePart> parse_name(const std::string& name_template);
  /// `metrics`: what ranked_metrics() returned.
  std::string format_name(Trainer& trainer, const std::map<std::string, double>& metrics);
  /// The metrics a save ranks and names checkpoints by (the monitor, the
  /// filename's fields), as global rank 0 has them: with several ranks,
  /// one all-gather, so that every rank keeps the same list and paths as
  /// the rank that writes the files (values logged without sync_dist are
  /// each rank's own; said once where they differ). `stopping`: whether
  /// any rank has asked to stop.
  std::map<std::string, double> ranked_metrics(Trainer& trainer, bool& stopping);
  /// `path`, or "<stem>-v<N>.ckpt" when a checkpoint kept under it is from
  /// another step (and is not `replaced`, the one this save replaces).
  std::string unclaimed(const std::string& path, int64_t step, const std::string& replaced) const;
  bool better(double candidate, double reference) const;

  ModelCheckpointOptions options_;
  std::string dirpath_;
  std::string best_model_path_;
  std::optional<double> best_model_score_;
  std::string last_model_path_;
  std::vector<std::pair<double, std::string>> top_k_;  // score, path
  std::string latest_path_;                            // when no monitor
  // The checkpoints it keeps (top-k, the latest, every one with
  // save_top_k=-1): path -> the step it was saved at (-1: not known).
  std::map<std::string, int64_t> saved_at_;
  std::vector<NamePart> name_parts_;     // options_.filename's
  std::set<std::string> noted_missing_;  // template metrics said to be missing
  int64_t last_saved_step_ = -1;
  bool validated_this_epoch_ = false;
  // A validation (not the sanity check) has run in this fit: from then on a
  // monitored metric that is missing is an error.
  bool validation_ran_ = false;
  // The note that nothing could be ranked before any validation ran: once.
  bool noted_no_validation_ = false;
  // The note that the ranks' values differ: once.
  bool noted_rank_values_ = false;
};

}  // namespace fulgur
