// Private: the checkpoint connector. The training state as a checkpoint
// (module, optimizers, schedulers, precision, the fit loop's progress, the
// training loader, callbacks, RNGs, hyper-parameters, the module's extras)
// written and read through the strategy, and which file `ckpt_path` names.
// Not installed.
#pragma once

#include <string>

#include "fulgur/core/state_dict.h"
#include "fulgur/trainer/trainer.h"


namespace fulgur::detail {

class CheckpointConnector {
 public:
  explicit CheckpointConnector(Trainer::Impl& trainer) : trainer_(trainer) {}
  CheckpointConnector(const CheckpointConnector&) = delete;
  CheckpointConnector& operator=(const CheckpointConnector&) = delete;

  /// The complete training state of the attached module.
  StateDict dump();
  /// dump() written to `path` through the strategy (its checkpoint IO).
  void save(const std::string& path);
  /// `ckpt_path` as a file ("" for none). "last": the newest checkpoint of
  /// this run's checkpoint directory that verifies (last.ckpt first among
  /// equals), with a note on rank 0 naming any newer one it skipped;
  /// CheckpointError when there is none. "auto": the same, but "" (start
  /// fresh) when the directory holds no checkpoint. "best": best_path().
  /// Anything else is returned as given.
  std::string resolve_path(const std::string& ckpt_path) const;
  /// The best checkpoint ModelCheckpoint knows (its best_model_path: the
  /// best by its monitor, else the latest it saved): this Trainer's after a
  /// fit in this process, else the one the run's newest checkpoint
  /// recorded ("last"). CheckpointError when there is none or it does not
  /// verify.
  std::string best_path() const;
  /// The newest checkpoint of this run's checkpoint directory that
  /// verifies, for ckpt_path=`keyword` ("last", "auto", "best"): "" for
  /// "auto" when there is none; CheckpointError naming `keyword` otherwise.
  std::string newest_checkpoint(const std::string& keyword) const;
  /// Where this run's ModelCheckpoint writes (or will): its dirpath, else
  /// `<default_root_dir>/checkpoints`.
  std::string checkpoint_dir() const;
  /// For a fit that starts from scratch (no checkpoint was loaded): a note
  /// on rank 0 when its checkpoint directory already holds checkpoints of
  /// an earlier run, whose files of the same names (last.ckpt) this run's
  /// saves will replace; nothing when checkpointing is off.
  void note_checkpoints_of_an_earlier_run() const;
  /// Loads `path` into the module, and with `full` everything else a fit
  /// resumes from. CheckpointError names the file and what does not fit.
  void restore(const std::string& path, bool full);

  /// Every callback's state under "callbacks", one section per state_key()
  /// (checkpoints, and a forked run's results); loading skips callbacks the
  /// state has none for.
  void save_callback_states(StateDict& state);
  void load_callback_states(const StateDict& state);

 private:
  /// A note (global rank 0) naming the callback states a resume leaves
  /// unread: the fit has no callback of their state_key().
  void note_callback_states_left(const StateDict& checkpoint, const std::string& path) const;
  void restore(const StateDict& checkpoint, const std::string& path, bool full);
  Trainer::Impl& trainer_;
  bool in_save_hooks_ = false;  // a save from a callback's checkpoint-save hook runs none
};

}  // namespace fulgur::detail
