// Private: the fit loop. Epochs of training batches, automatic and manual
// optimization, gradient accumulation and clipping, schedulers, and when to
// validate; it owns the progress of a fit (epoch, step, position in the
// epoch, the stop request) and nothing else. Not installed.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "fulgur/core/module.h"
#include "fulgur/data/data_loader.h"
#include "fulgur/trainer/trainer.h"
#include "fulgur/trainer/trainer_options.h"
#include "trainer/loops/cuda_graph_step.h"
#include "trainer/loops/device_feed.h"
#include "trainer/profiler.h"

namespace fulgur::detail {

/// The loop flags as the Trainer resolved them (defaults chosen,
/// fast_dev_run applied).
struct LoopLimits {
  int64_t max_epochs = 1000;  // -1: unlimited
  int64_t max_steps = -1;
  BatchLimit train = 1.0, val = 1.0, test = 1.0, predict = 1.0;
  /// The flags `train` and `val` came from, for messages.
  const char* train_flag = "limit_train_batches";
  const char* val_flag = "limit_val_batches";
  int64_t num_sanity_val_steps = 2;
};

/// Where a fit stands: what a checkpoint records to resume it exactly.
struct FitProgress {
  int64_t epoch = 0;
  int64_t global_step = 0;
  /// Training batches done in the current epoch.
  int64_t batch_position = 0;
  int64_t batches_that_stepped = 0;
  /// Training batches of the epochs before this one (val_check_interval
  /// counted across epochs); -1: not known (a checkpoint without it).
  int64_t batches_before_epoch = -1;
  /// Taken during on_train_epoch_end: the epoch is complete.
  bool epoch_done = false;
  /// Batch position of the last in-epoch validation; -1 for none.
  int64_t validated_at_position = -1;
  /// The step's monitored step-interval schedulers have not stepped yet:
  /// they step after the validation that follows the step.
  bool monitored_step_due = false;
  /// Taken during a hook that a resume finishes instead of running again
  /// (kValidationEnd: the Module's or the callbacks' on_validation_end of a
  /// fit's validation, which is not run again; kTrainEpochEnd: the callbacks'
  /// on_train_epoch_end); empty for none.
  std::string hook;
  /// The state keys of the callbacks that had started `hook` (the one that
  /// wrote the checkpoint among them): a resume runs it for the others.
  std::vector<std::string> hook_started;
};

/// FitProgress::hook's values (as checkpoints hold them).
inline constexpr const char* kValidationEnd = "on_validation_end";
inline constexpr const char* kTrainEpochEnd = "on_train_epoch_end";

class FitLoop {
 public:
  explicit FitLoop(Trainer::Impl& trainer) : trainer_(trainer) {}
  FitLoop(const FitLoop&) = delete;
  FitLoop& operator=(const FitLoop&) = delete;

  /// A new fit over these loaders (already split across ranks): progress
  /// back to zero, no stop requested.
  /// `data`: the DataModule that made them (null: loaders given to fit),
  /// which makes them again under reload_dataloaders_every_n_epochs.
  void start(std::shared_ptr<DataLoader> train, std::shared_ptr<DataLoader> val, DataModule* data);
  /// What configure_optimizers returned, set up by the strategy; under
  /// cuda_graph, refuses (ConfigError) what a captured step cannot do.
  void set_optimizers(OptimizerConfig optimizers);
  /// The sanity check: a few validation batches before training, when there
  /// is validation data and num_sanity_val_steps is not 0.
  void run_sanity_check();
  /// Trains until a limit or an agreed stop.
  void run();
  /// Lets go of the loaders; the progress stays readable.
  void finish();
  /// Run state back to idle, whatever way the stage ended.
  void detach();

  // ---- Progress, for the Trainer's accessors and the checkpoint connector.
  int64_t current_epoch() const { return current_epoch_; }
  int64_t global_step() const { return global_step_; }
  int64_t batches_that_stepped() const { return batches_that_stepped_; }
  int64_t batch_idx() const { return batch_idx_; }
  int64_t num_training_batches() const { return num_training_batches_; }
  bool sanity_checking() const { return sanity_checking_; }
  /// A checkpoint is being saved: from within on_train_batch_end (after
  /// the step's values were published, before its row goes to the
  /// loggers), the row due at this step is written first with those values
  /// (the loggers' files then hold every row up to the checkpoint's step);
  /// what the hooks log goes in a second row after them.
  void write_step_row_before_save();
  /// Within a training batch's step: from its training_step to its
  /// optimizer step (autograd may hold the parameters).
  bool within_step() const { return within_step_; }
  void request_stop() { should_stop_ = true; }
  /// Batches per optimizer step now (accumulate_grad_batches, or what a
  /// GradientAccumulationScheduler set for this epoch).
  int64_t accumulate_grad_batches() const { return accumulate_; }
  /// From the next batch on; ConfigError when < 1, inside an accumulation
  /// window, or with manual optimization.
  void set_accumulate_grad_batches(int64_t n);
  bool should_stop() const { return should_stop_; }
  /// This fit has validation to run (a loader, and limit_val_batches not 0).
  bool validates() const;
  const std::string& stop_reason() const { return stop_reason_; }
  const OptimizerConfig& optimizers() const { return optimizers_; }
  DataLoader* train_loader() const { return train_loader_.get(); }

  FitProgress progress() const;
  /// Resumes at `p`: the training loader is positioned from `loader_state`
  /// (its saved state) or, when null, by seeking to the position.
  void restore(const FitProgress& p, const StateDict* loader_state);
  /// What a forked run's rank 0 reached, for the calling process.
  void set_result(int64_t epochs, int64_t global_step);

  /// The end of a fit's validation: the Module's on_validation_end, then
  /// the callbacks', a checkpoint written meanwhile resuming after it
  /// (FitProgress::hook).
  void validation_end(Module& module);

  /// The last step's monitored step-interval schedulers, when still due:
  /// the fit's validation calls it once its values are published (before
  /// the callbacks' epoch-end hooks, so that a checkpoint they write has
  /// the step), or instead of running no batch.
  void step_monitored_schedulers();

  // ---- Manual optimization (the Module, through TrainerLink).
  void manual_backward(Module& module, const at::Tensor& loss);
  void manual_optimizer_step(Module& module, torch::optim::Optimizer& optimizer);
  // Manual optimization: the loss scaler's update() for the steps since the
  // last one (at a backward after them, and after training_step).
  void end_scaler_iteration();
  /// Module::clip_gradients: unscales (once per step) and clips through
  /// the strategy (by norm on the device, the norm not read back).
  void clip_gradients(torch::optim::Optimizer& optimizer, double value,
                      GradientClipAlgorithm algorithm);

  /// The training batches per epoch (num_training_batches()) from the
  /// loader and the limits: at the fit's start, before
  /// configure_optimizers (estimated_stepping_batches() sizes a
  /// OneCycleLR there), and at each reload of the loaders.
  void count_training_batches();

 private:
  void train_epoch();
  /// The stop check after the batch before `position` (or the checkpoint
  /// written after it): a requested stop validates there when the batch's
  /// own validation did not run, as Lightning's does.
  bool stop_after_batch(int64_t position);
  /// Whether global_step has reached max_steps (when set): the fit ends
  /// there, and the epoch with it.
  bool max_steps_reached() const;
  /// Under reload_dataloaders_every_n_epochs=N: the DataModule's loaders
  /// for `epoch` (made at `epoch` rounded down to a multiple of N) unless
  /// those are the ones in use; then the batch count again.
  void load_loaders_for(int64_t epoch);
  /// num_training_batches_ from the training loader and the limits, and
  /// the checks of val_check_interval against it.
  void training_batch(Batch& batch, int64_t batch_idx, bool is_last_batch);
  /// What the Module logs next goes to the training sink, per step
  /// (`training_step`: inside a batch, weighted by `batch_size`) or per
  /// epoch by default.
  void log_to_train_sink(Module& module, bool training_step, int64_t batch_size);
  void step_optimizers();
  /// Every optimizer's unscale, hooks, clipping and step, then the
  /// precision's update (the device work of step_optimizers).
  void run_optimizer_steps();
  /// The host's part after the steps: on_before_zero_grad (and zero_grad
  /// when `zero_grads`), the step counters, step-interval schedulers.
  void finish_optimizer_steps(bool zero_grads);
  /// A batch's step under cuda_graph: CudaGraphStep runs step_body (eagerly
  /// or as a graph), then the host's part of step_optimizers.
  at::Tensor graph_training_batch(Batch& on_device, int64_t batch_idx, bool is_last_batch);
  /// The device work of one step under cuda_graph: training_step, backward,
  /// clipping and the optimizer steps (gradients are not zeroed: the next
  /// step's backward writes them afresh).
  at::Tensor step_body(Batch& on_device, int64_t batch_idx);
  /// on_before_backward (the Module's, then the callbacks') with `loss`,
  /// the strategy's backward of `scaled` (`vote`: carrying the stop vote),
  /// on_after_backward: automatic optimization, a captured step and
  /// manual_backward alike.
  void backward_with_hooks(Module& m, const at::Tensor& loss, const at::Tensor& scaled, bool vote);
  /// The checks on what training_step returned (automatic optimization).
  static void check_loss(const at::Tensor& loss);
  /// The schedulers of `interval` due now; `monitored`: those that read a
  /// logged metric (ReduceLROnPlateau), or the others. A step's monitored
  /// ones run after the step's values are published, after
  /// on_train_batch_end (monitored_step_due_), so they read this step's
  /// metrics, those hooks' included, and where a validation follows the
  /// step, after that validation's values (as Lightning's plateau
  /// schedulers): step_monitored_schedulers.
  void step_schedulers(Interval interval, bool monitored);
  /// Every parameter group's learning rate, optimizer by optimizer, into
  /// `out` (its capacity reused: no allocation per step).
  void read_learning_rates(std::vector<double>& out) const;
  /// After scheduler `index` stepped (`before`: read_learning_rates before):
  /// ConfigError for a rate it made NaN or infinite (a NaN gamma, a
  /// lambda's NaN), a note for one it made negative.
  void check_learning_rates(size_t index, const std::vector<double>& before);
  /// Whether this epoch validates at all (a loader, limit_val_batches,
  /// check_val_every_n_epoch).
  bool validates_this_epoch() const;
  bool should_validate_now(int64_t position, bool is_last_batch) const;
  void run_validation(bool sanity);
  using CallbackHook = void (Callback::*)(Trainer&, Module&);
  /// `hook`: `module_part` (may be empty), then every callback's `fn` in
  /// order but those whose state keys `started` lists, each recorded as it
  /// starts for a checkpoint written meanwhile (FitProgress::hook).
  void run_resumable_hook(const char* hook, const std::function<void()>& module_part,
                          CallbackHook fn, const std::vector<std::string>& started);
  /// Resumed from a checkpoint written within the end of a fit's
  /// validation: the callbacks that had not started it run it, as they
  /// did then (the validation's values are the checkpoint's).
  void finish_resumed_validation_end();
  /// Resumed from a checkpoint written within the callbacks'
  /// on_train_epoch_end: the others run it, at the epoch that ended.
  void finish_resumed_epoch_end();
  bool stop_requested_by_limits(bool boundary);
  void publish_step_metrics();
  /// Whether this step's values go to the loggers (every
  /// log_every_n_steps-th batch that stepped, once per count).
  bool step_row_due() const;

  Trainer::Impl& trainer_;
  OptimizerConfig optimizers_;
  std::shared_ptr<DataLoader> train_loader_;
  std::shared_ptr<DataLoader> val_loader_;
  DataModule* data_ = nullptr;
  int64_t loaders_epoch_ = 0;  // the epoch the loaders in use were made for

  bool training_ = false;
  bool within_step_ = false;
  bool sanity_checking_ = false;
  int64_t current_epoch_ = 0;
  int64_t global_step_ = 0;
  int64_t batch_idx_ = 0;
  int64_t batch_position_ = 0;  // training batches done in the current epoch
  int64_t batches_that_stepped_ = 0;
  // batches_that_stepped_ when the step values last went to the loggers:
  // once per count (the micro-batches that do not step after it keep it).
  int64_t published_at_stepped_ = -1;
  bool in_batch_end_ = false;         // within on_train_batch_end's hooks
  int64_t batches_before_epoch_ = 0;  // -1: not known (resumed from a checkpoint without it)
  bool monitored_step_due_ = false;  // see step_schedulers
  bool negative_rate_noted_ = false;
  std::vector<double> rates_before_;  // step_schedulers' read_learning_rates
  // An earlier micro-batch of the current accumulation window ran backward.
  bool window_has_gradient_ = false;
  bool preemption_deferred_noted_ = false;
  // Manual optimization: the optimizers stepped since the loss scaler's
  // last update().
  std::set<const torch::optim::Optimizer*> stepped_since_update_;
  int64_t accumulate_ = 1;
  int64_t num_training_batches_ = -1;
  bool should_stop_ = false;
  std::string stop_reason_;
  std::set<size_t> missing_monitor_noted_;  // schedulers whose missing metric was noted
  bool in_epoch_end_ = false;           // checkpoints taken now resume at the next epoch
  int64_t validated_at_position_ = -1;  // batch position of the last in-epoch validation
  // Restored within an epoch (after one of its batches): the epoch goes
  // on from the check that followed that batch, whatever limit it reached.
  bool resumes_within_epoch_ = false;
  // The training loader was positioned in this epoch by restore(): the
  // epoch goes on from there. Any other loader starts the epoch anew (one
  // read before, by an earlier fit or stage, is wherever it was left).
  bool loader_positioned_ = false;
  // The hook running now that a checkpoint resumes within, and the
  // callbacks that have started it (FitProgress::hook).
  std::string hook_;
  std::vector<std::string> hook_started_;
  // Restored within such a hook: the resume finishes it.
  std::string resumed_hook_;
  std::vector<std::string> resumed_started_;
  int64_t resumed_epoch_length_ = 0;  // kTrainEpochEnd: the ended epoch's batches
  // The ranks agree on each training batch's look-ahead (a loader of
  // unknown length on some rank: count_training_batches), and a note said
  // that another rank's loader ended sooner.
  bool agree_on_end_ = false;
  bool noted_shorter_peer_ = false;
  DeviceFeed feed_;                     // the training batches, moved to the device ahead
  bool cuda_graph_ = false;             // this fit's steps go through graph_
  CudaGraphStep graph_;
  std::unique_ptr<LoopProfiler> profiler_;  // the Trainer option profiler; null when "none"
};

}  // namespace fulgur::detail
