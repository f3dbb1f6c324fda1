// File: fulgur/callbacks/finetuning.h
//
// Fine-tuning a pretrained part of a model: frozen when the fit starts, made
// trainable later at a learning rate of its own (Lightning's BaseFinetuning
// and BackboneFinetuning).
//
// BaseFinetuning is the mechanism. freeze_before_training(module) runs at
// the fit's setup on every rank, before configure_optimizers, which then
// gives the optimizer the trainable parameters only:
//
//   std::vector<at::Tensor> trainable;
//   for (auto& p : parameters()) if (p.requires_grad()) trainable.push_back(p);
//   return std::make_shared<torch::optim::Adam>(trainable, 1e-3);
//
// finetune_function(module, epoch, optimizer) runs at each epoch's start for
// each optimizer; there unfreeze_and_add_param_group makes a part trainable
// and adds its parameters to the optimizer as a new parameter group.
// BackboneFinetuning unfreezes the Module's submodule "backbone" at one
// epoch, at a fraction of the head's learning rate, and raises that rate
// every epoch after (up to the head's).
//
// A resumed fit goes on bit-identical: the callback's state keeps which of
// the module's parameters are trainable, the groups it added (by parameter
// name) and its frozen BatchNorm layers. On resume it makes them so again
// before the optimizers' states load (Callback::on_restore_optimizers), and
// an epoch the saved run had already fine-tuned (a resume within it) is not
// fine-tuned again. Lightning calls finetune_function again there, and a
// resumed BackboneFinetuning raises the backbone's rate twice.
//
// BatchNorm layers (BatchNorm1d/2d/3d, fulgur::nn::SyncBatchNorm) stay
// trainable when freeze() is given train_bn=true (Lightning's default).
// With train_bn=false their weight and bias are frozen and their running
// statistics kept: LibTorch's BatchNorm updates its statistics in every
// training forward, so the layer's momentum is 0 while it is frozen, and its
// num_batches_tracked is set back when it is made trainable. Training
// batches are then normalised with their own statistics and evaluation with
// the running ones, as a frozen BatchNorm in Lightning is. A layer still
// frozen when the fit ends gets its momentum back (its parameters stay
// frozen). Where Lightning's unfreeze_and_add_param_group(train_bn=false)
// makes the BatchNorm layers' parameters require gradients without adding
// them to the optimizer, fulgur's leaves those layers frozen.
//
// Strategies: single_device, and ddp (its ranks compare which parameters
// train at each epoch's first step and at every change, and rebuild their
// gradient buckets after a change). Those whose
// StrategyTraits::trainable_change_unsupported_reason says why not (fsdp,
// manual) are refused at setup. Under cuda_graph a change re-captures the
// step after a warm-up. After a fit under a forking launcher (ddp_fork,
// ddp_spawn) the caller's callback holds rank 0's state, but the caller's
// module keeps its own requires_grad flags (the ranks froze theirs).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fulgur/callbacks/callback.h"

namespace torch::nn {
class Module;
}

namespace fulgur {

class BaseFinetuning : public Callback {
 public:
  /// The class's name (two fine-tuning callbacks of one class need
  /// state_key overridden).
  std::string state_key() const override;

  /// Freezes the parameters of `modules` and of every module in it
  /// (requires_grad=false); BatchNorm layers stay trainable when
  /// `train_bn`, and are frozen with their statistics otherwise (see the
  /// file comment). Called during a fit (in freeze_before_training or
  /// finetune_function); `modules` is the fit's Module or a part of it.
  void freeze(torch::nn::Module& modules, bool train_bn = true);
  /// Makes the parameters of `modules` and of every module in it
  /// trainable, and its frozen BatchNorm layers update their statistics
  /// again.
  void make_trainable(torch::nn::Module& modules);
  /// Makes `modules` trainable (its BatchNorm layers only when `train_bn`)
  /// and adds its trainable parameters that `optimizer` does not hold yet
  /// as one new parameter group: at learning rate `lr`, or without it at
  /// group 0's divided by `initial_denom_lr` (Lightning's). Parameters the
  /// optimizer already holds are left where they are, with a note.
  /// Returns how many parameters the new group holds (0: none was added).
  size_t unfreeze_and_add_param_group(torch::nn::Module& modules,
                                      torch::optim::Optimizer& optimizer,
                                      std::optional<double> lr = std::nullopt,
                                      double initial_denom_lr = 10.0, bool train_bn = true);

  /// Stage::kFit: refuses a strategy that cannot follow trainable
  /// parameters that change, then freeze_before_training.
  void setup(Trainer& trainer, Module& module, Stage stage) override;
  /// Gives the frozen BatchNorm layers their momentum back.
  void teardown(Trainer& trainer, Module& module, Stage stage) override;
  /// finetune_function for each optimizer, once per epoch.
  void on_train_epoch_start(Trainer& trainer, Module& module) override;
  /// A resume: the trainable parameters, the frozen BatchNorm layers and
  /// the added parameter groups as the checkpoint's run had them.
  void on_restore_optimizers(Trainer& trainer, Module& module) override;
  StateDict state_dict() const override;
  /// CheckpointError (at on_restore_optimizers) when what it names does
  /// not fit the module or its optimizers.
  void load_state_dict(const StateDict& state) override;

 protected:
  /// Freezes what trains later (freeze()): at the fit's setup, before
  /// configure_optimizers.
  virtual void freeze_before_training(Module& module) = 0;
  /// At the start of each epoch, for each optimizer: unfreezes parts
  /// (unfreeze_and_add_param_group) and sets their groups' learning rates.
  virtual void finetune_function(Module& module, int64_t epoch,
                                 torch::optim::Optimizer& optimizer) = 0;
  /// A subclass's own state (kept under "extra" in this callback's).
  virtual StateDict extra_state() const { return {}; }
  virtual void load_extra_state(const StateDict& /*state*/) {}

 private:
  struct FrozenNorm {
    std::optional<double> momentum;  // the layer's own (none: cumulative)
    int64_t batches_tracked = 0;     // num_batches_tracked when frozen
  };
  struct Saved;
  /// The fit's Module, named in errors when the helpers run outside one.
  Module& fit_module(const char* method) const;
  void freeze_norms(torch::nn::Module& modules, bool freeze);
  std::vector<std::string> trainable_names() const;

  Module* module_ = nullptr;
  /// Frozen BatchNorm layers, by their name in the module.
  std::map<std::string, FrozenNorm> frozen_norms_;
  /// Per optimizer: the parameter groups added during the fit, each as
  /// its parameters' names.
  std::vector<std::vector<std::vector<std::string>>> added_groups_;
  /// The last epoch fine-tuned (-1: none yet).
  int64_t finetuned_epoch_ = -1;
  /// The trainable parameters' names when the fit ended (state_dict after
  /// it).
  std::vector<std::string> trainable_at_end_;
  /// From a checkpoint being resumed, until on_restore_optimizers.
  std::shared_ptr<Saved> saved_;
};

/// Lightning's default schedule for the backbone: x2 per epoch.
double multiplicative(int64_t epoch);

struct BackboneFinetuningOptions {
  /// The epoch at whose start the backbone becomes trainable (>= 0).
  int64_t unfreeze_backbone_at_epoch = 10;
  /// Each epoch after: backbone lr = previous x lambda_func(epoch + 1).
  std::function<double(int64_t)> lambda_func = multiplicative;
  /// The backbone's first lr: backbone_initial_lr, or the head's (group
  /// 0's) x backbone_initial_ratio_lr.
  double backbone_initial_ratio_lr = 0.1;
  std::optional<double> backbone_initial_lr = std::nullopt;
  /// The backbone's lr never passes the head's.
  bool should_align = true;
  /// Lightning's option, kept for ports: unused, as in Lightning (the
  /// backbone's group always gets the lr computed above).
  double initial_denom_lr = 10.0;
  /// The backbone's BatchNorm layers train (see the file comment).
  bool train_bn = true;
  /// A note (on global rank 0) at each epoch with both learning rates.
  bool verbose = false;
  /// The Module's submodule to fine-tune: its name as named_modules()
  /// gives it ("backbone", "encoder.backbone").
  std::string backbone = "backbone";
};

/// Freezes the Module's backbone when the fit starts and makes it trainable
/// at unfreeze_backbone_at_epoch, in a parameter group of its own. One
/// optimizer only (the backbone would be stepped by each).
class BackboneFinetuning : public BaseFinetuning {
 public:
  explicit BackboneFinetuning(BackboneFinetuningOptions options = {});
  void on_fit_start(Trainer& trainer, Module& module) override;

  const BackboneFinetuningOptions& options() const { return options_; }
  /// The backbone's learning rate now (none before it is unfrozen).
  std::optional<double> backbone_lr() const { return backbone_lr_; }

 protected:
  void freeze_before_training(Module& module) override;
  void finetune_function(Module& module, int64_t epoch,
                         torch::optim::Optimizer& optimizer) override;
  StateDict extra_state() const override;
  void load_extra_state(const StateDict& state) override;

 private:
  torch::nn::Module& backbone_of(Module& module) const;

  BackboneFinetuningOptions options_;
  std::optional<double> backbone_lr_;
  size_t backbone_group_ = 0;
};

}  // namespace fulgur
