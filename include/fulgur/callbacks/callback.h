// File: fulgur/callbacks/callback.h
//
// A Callback observes and steers a run from outside the Module: checkpoints,
// progress output, early stopping. Hooks are called after the Module's hook
// of the same name. The validation hooks run in fit's validation (and its
// sanity check) and in Trainer::validate; the test and predict hooks in
// Trainer::test and Trainer::predict. trainer.stage() tells a fit's
// validation (Stage::kFit) from a standalone one (Stage::kValidate). A callback with state (best score, ...) returns it from
// state_dict() and takes it back in load_state_dict(); the checkpoint holds
// it under "callbacks/<state_key()>", so a resumed run continues with it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "fulgur/core/state_dict.h"

namespace torch::optim {
class Optimizer;
}

namespace fulgur {

class Batch;
class Module;
class Trainer;
enum class Stage;  // fulgur/data/data_module.h

class Callback {
 public:
  virtual ~Callback() = default;

  /// Identifies this callback's state in a checkpoint; unique per run.
  virtual std::string state_key() const = 0;

  /// Every stage starts with setup(stage) on every rank, after the Module's
  /// setup, and ends with teardown(stage), also when it failed.
  virtual void setup(Trainer&, Module&, Stage) {}
  virtual void teardown(Trainer&, Module&, Stage) {}
  virtual void on_fit_start(Trainer&, Module&) {}
  virtual void on_fit_end(Trainer&, Module&) {}
  virtual void on_train_start(Trainer&, Module&) {}
  virtual void on_train_end(Trainer&, Module&) {}
  virtual void on_train_epoch_start(Trainer&, Module&) {}
  virtual void on_train_epoch_end(Trainer&, Module&) {}
  virtual void on_train_batch_start(Trainer&, Module&, const Batch&, int64_t /*batch_idx*/) {}
  virtual void on_train_batch_end(Trainer&, Module&, const at::Tensor& /*loss*/, const Batch&,
                                  int64_t /*batch_idx*/) {}
  /// The step hooks, after the Module's (manual_backward calls the backward
  /// ones too): `loss` as training_step returned it, before accumulation's
  /// scaling. Under cuda_graph the backward hooks run in the eager steps
  /// (warm-up, batches of other shapes) and for the capture, never in a
  /// replay; on_before_zero_grad runs every step.
  virtual void on_before_backward(Trainer&, Module&, const at::Tensor& /*loss*/) {}
  virtual void on_after_backward(Trainer&, Module&) {}
  virtual void on_before_zero_grad(Trainer&, Module&, torch::optim::Optimizer&) {}
  /// Around fit's sanity check (num_sanity_val_steps validation batches
  /// before training), which runs the validation hooks too.
  virtual void on_sanity_check_start(Trainer&, Module&) {}
  virtual void on_sanity_check_end(Trainer&, Module&) {}
  /// The evaluation hooks run in eval mode without autograd (as the steps
  /// do); the start hooks before the epoch's first hook, the end hooks after
  /// the epoch's metrics are published (callback_metrics()).
  virtual void on_validation_start(Trainer&, Module&) {}
  virtual void on_validation_end(Trainer&, Module&) {}
  virtual void on_validation_epoch_start(Trainer&, Module&) {}
  virtual void on_validation_epoch_end(Trainer&, Module&) {}
  virtual void on_validation_batch_start(Trainer&, Module&, const Batch&, int64_t) {}
  virtual void on_validation_batch_end(Trainer&, Module&, const Batch&, int64_t) {}
  virtual void on_test_start(Trainer&, Module&) {}
  virtual void on_test_end(Trainer&, Module&) {}
  virtual void on_test_epoch_start(Trainer&, Module&) {}
  virtual void on_test_epoch_end(Trainer&, Module&) {}
  virtual void on_test_batch_start(Trainer&, Module&, const Batch&, int64_t) {}
  virtual void on_test_batch_end(Trainer&, Module&, const Batch&, int64_t) {}
  virtual void on_predict_start(Trainer&, Module&) {}
  virtual void on_predict_end(Trainer&, Module&) {}
  virtual void on_predict_epoch_start(Trainer&, Module&) {}
  virtual void on_predict_epoch_end(Trainer&, Module&) {}
  virtual void on_predict_batch_start(Trainer&, Module&, const Batch&, int64_t) {}
  /// `prediction`: what predict_step returned for `batch` (the loader's).
  virtual void on_predict_batch_end(Trainer&, Module&, const Batch& /*prediction*/,
                                    const Batch& /*batch*/, int64_t /*batch_idx*/) {}
  virtual void on_before_optimizer_step(Trainer&, Module&, torch::optim::Optimizer&) {}
  virtual void on_exception(Trainer&, Module&, const std::exception&) {}
  /// Around each checkpoint a fit saves (Trainer::save_checkpoint,
  /// ModelCheckpoint), on every rank at the same point, after the loggers
  /// flushed: before the checkpoint's state is taken (to save other weights
  /// as the module's, as EMA's average), and once the checkpoint IO has it
  /// (the async one copied it). `failed`: the save threw; put back what
  /// on_before_checkpoint_save changed (a callback whose
  /// on_before_checkpoint_save threw is ended too). Not around a save from
  /// within a training step (autograd may hold the parameters) nor from
  /// on_exception.
  virtual void on_before_checkpoint_save(Trainer&, Module&) {}
  virtual void on_after_checkpoint_save(Trainer&, Module&, bool /*failed*/) {}

  /// The state a checkpoint keeps under "callbacks/<state_key()>" (empty:
  /// nothing to keep; an empty section is still written).
  virtual StateDict state_dict() const { return {}; }
  /// Restores what state_dict() returned, from a checkpoint being resumed
  /// (its tensors in host memory, whatever device saved them).
  /// Called before on_fit_start, only when the checkpoint holds a section
  /// under this callback's state_key(): after the module's weights load and
  /// before the optimizers' states do.
  virtual void load_state_dict(const StateDict& /*state*/) {}
  /// A resumed fit only, on every rank: after every callback's
  /// load_state_dict, before the optimizers' states load from the
  /// checkpoint (module.optimizers() are configure_optimizers' fresh ones).
  /// A callback that changed the optimizers in the run that saved the
  /// checkpoint (BaseFinetuning adds parameter groups) makes them so again
  /// here, so that the saved states fit. Lightning restores the optimizers
  /// after on_fit_start, where its callbacks do this; fulgur restores the
  /// whole run (loops, schedulers, RNGs) before on_fit_start.
  virtual void on_restore_optimizers(Trainer&, Module&) {}
};

}  // namespace fulgur
