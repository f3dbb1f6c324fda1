// File: fulgur/callbacks/ema.h
//
// An exponential moving average of the weights, often better than the last
// weights themselves: after every `every_n_steps`-th optimizer step,
//   average = decay * average + (1 - decay) * weight
// for every parameter (buffers, e.g. BatchNorm's running statistics, stay the
// training run's). Validation runs with the averaged weights, and at the end
// of fit the module keeps them. A checkpoint's module weights are the ones
// the fit's validations measure, as Lightning's WeightAveraging writes
// them: with validate_with_average, the average at the save's step (so
// ModelCheckpoint's "best" is evaluated, tested or deployed with the
// weights it was ranked by), and the training weights are EMA's state;
// without it, the training weights, and the average is EMA's state. (A
// save from within a training step, e.g. from on_before_backward, holds the
// training weights as the module's: autograd may hold them.) While a save
// holds the average in the module, what Module::on_save_checkpoint and the
// callbacks' state_dict() read of the module is the average; as a
// checkpoint is loaded, Module::on_load_checkpoint reads the checkpoint's
// module weights, and the training weights go back into the module after
// the callbacks' states are loaded. Either way a resumed run goes on
// bit-identical, and a fit from the start begins a new average (as
// StochasticWeightAveraging's and Lightning's weight averaging do). Under ddp
// every rank holds the same average. Under fsdp each rank averages its own
// shard of each parameter (the one its optimizer steps): 1/N of the model
// per rank, and an update gathers nothing; swapping the average in or out
// writes the shards and gathers the parameters as an optimizer step does,
// and a checkpoint holds both whole (gathered as it is saved: it loads into
// any strategy and world size). A rank that fails alone under
// fsdp keeps the weights it holds (putting them back would be a collective
// its peers never join).
//
//   fulgur::Trainer trainer({.max_epochs = 10,
//                            .callbacks = {std::make_shared<fulgur::EMA>(
//                                fulgur::EMAOptions{.decay = 0.999})}});
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fulgur/callbacks/callback.h"

namespace fulgur {

namespace detail {
class ParameterCopy;
}

struct EMAOptions {
  /// Weight of the average so far, in [0, 1).
  double decay = 0.999;
  /// The average is updated after every n-th optimizer step (>= 1).
  int64_t every_n_steps = 1;
  /// Fit's validations run with the averaged weights (a standalone
  /// Trainer::validate evaluates the module's own: after fit with
  /// apply_at_end, the average), and the fit's checkpoints hold the average
  /// as the module's weights (the training weights as EMA's state).
  bool validate_with_average = true;
  /// At the end of fit, the module keeps the averaged weights.
  bool apply_at_end = true;
};

class EMA : public Callback {
 public:
  explicit EMA(EMAOptions options = {});
  ~EMA() override;
  std::string state_key() const override { return "EMA"; }
  void on_fit_start(Trainer& trainer, Module& module) override;
  void on_train_start(Trainer& trainer, Module& module) override;
  void on_train_batch_end(Trainer& trainer, Module& module, const at::Tensor& loss,
                          const Batch& batch, int64_t batch_idx) override;
  void on_validation_start(Trainer& trainer, Module& module) override;
  void on_validation_end(Trainer& trainer, Module& module) override;
  void on_train_end(Trainer& trainer, Module& module) override;
  void on_exception(Trainer& trainer, Module& module, const std::exception& error) override;
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;
  /// A checkpoint whose module weights are the average: the training
  /// weights from EMA's state go back into the module.
  void on_restore_optimizers(Trainer& trainer, Module& module) override;
  /// With validate_with_average, during training: the average into the
  /// module for the save (what ModelCheckpoint ranked), the training
  /// weights into EMA's state; back after it.
  void on_before_checkpoint_save(Trainer& trainer, Module& module) override;
  void on_after_checkpoint_save(Trainer& trainer, Module& module, bool failed) override;

  const EMAOptions& options() const { return options_; }
  /// The averaged parameters, in the module's parameters() order (empty
  /// before training starts): whole before and after fit; during a fit
  /// under fsdp, this rank's 1-D shard of each parameter an optimizer steps.
  const std::vector<at::Tensor>& average() const;
  /// The optimizer step of the last update (-1: none yet).
  int64_t last_update_step() const { return last_update_step_; }

 private:
  void swap_in(Module& module);
  void swap_out(Module& module);
  EMAOptions options_;
  std::unique_ptr<detail::ParameterCopy> average_;
  std::unique_ptr<detail::ParameterCopy> training_weights_;  // while the average is swapped in
  // A checkpoint's training weights (whole), until on_restore_optimizers.
  std::vector<at::Tensor> loaded_training_weights_;
  bool training_ = false;          // between on_train_start and on_train_end
  bool swapped_for_save_ = false;  // on_before_checkpoint_save swapped the average in
  int64_t failed_saves_ = 0;       // names each failed save's meeting of the ranks
  int64_t last_update_step_ = -1;
};

}  // namespace fulgur
