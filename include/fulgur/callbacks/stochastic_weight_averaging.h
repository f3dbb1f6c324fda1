// File: fulgur/callbacks/stochastic_weight_averaging.h
//
// StochasticWeightAveraging (Izmailov et al. 2018; Lightning's callback of
// the same name): from epoch `swa_epoch_start` on, every optimizer's rate
// anneals to `swa_lr` over `annealing_epochs`, and the weights at the end of
// each of those epochs are averaged with equal weight (as PyTorch's
// swa_utils pattern: update_parameters after each epoch; taken when the
// next epoch starts, and the last when training ends, so that a checkpoint
// written at an epoch's end resumes to the same average whatever the order
// of the callbacks). When fit ends the
// module takes the average, and its BatchNorm layers' running statistics
// are recomputed for it: one pass of predict_step over the training data in
// training mode, gradients off, each layer's momentum set to a cumulative
// average meanwhile.
//
//   trainer_options.callbacks.push_back(std::make_shared<fulgur::StochasticWeightAveraging>(
//       fulgur::SWAOptions{.swa_lr = 0.01, .swa_epoch_start = 0.75}));
//
// The rate is set before every optimizer step of an averaging epoch,
// overriding what the configured schedulers set (as Lightning replaces them
// with torch's SWALR): lr = swa_lr * a + lr0 * (1 - a), lr0 each parameter
// group's rate when averaging began, a = f(min(1, (e - start) /
// annealing_epochs)) in averaging epoch e (f(t) = (1 - cos(pi t)) / 2 for
// "cos", t for "linear"; a = 1 with annealing_epochs = 0). The average, its
// count and the lr0s are in checkpoints, so a resumed run ends
// bit-identical. The checkpoints written during fit are resume points
// (training weights and the average so far); the averaged module is what
// fit leaves: save it after fit (module_state_dict). The BatchNorm pass
// moves batches as the strategy does and covers limit_train_batches. Under
// ddp every rank holds the same average (each rank's BatchNorm pass sees
// its shard of the data; SyncBatchNorm layers combine them). Under fsdp
// each rank averages its own shard of each parameter (the one its
// optimizer steps): 1/N of the model per rank, and nothing is gathered to
// average; the average is given to the module through the shards, then
// gathered as after an optimizer step, and checkpoints hold it whole
// (gathered as they are saved). cuda_graph and an EMA with apply_at_end
// are refused.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "fulgur/callbacks/callback.h"
#include "fulgur/core/choice.h"

namespace fulgur {

namespace detail {
class ParameterCopy;
}

enum class AnnealingStrategy { kCos, kLinear };
template <>
struct ChoiceNames<AnnealingStrategy> {
  static constexpr std::pair<AnnealingStrategy, const char*> kNames[] = {
      {AnnealingStrategy::kCos, "cos"}, {AnnealingStrategy::kLinear, "linear"}};
};

struct SWAOptions {
  /// The rate every parameter group anneals to (> 0; required).
  double swa_lr = 0.0;
  /// The first averaged epoch, as Lightning counts it: a fraction of
  /// max_epochs in (0, 1) (0.8 of 10 epochs: the 8th, index 7), or the
  /// epoch's number counted from 1 (an integral value >= 1).
  double swa_epoch_start = 0.8;
  /// Epochs over which the rate goes from the groups' own to swa_lr (>= 0).
  int64_t annealing_epochs = 10;
  Choice<AnnealingStrategy> annealing_strategy = AnnealingStrategy::kCos;
  /// Recompute the BatchNorm layers' running statistics for the averaged
  /// weights at the end of fit (needs predict_step: the forward pass); false
  /// leaves them as trained.
  bool update_bn = true;
};

class StochasticWeightAveraging : public Callback {
 public:
  /// ConfigError naming every option that cannot work.
  explicit StochasticWeightAveraging(SWAOptions options);
  ~StochasticWeightAveraging() override;
  std::string state_key() const override { return "StochasticWeightAveraging"; }

  void on_fit_start(Trainer& trainer, Module& module) override;
  void on_before_optimizer_step(Trainer& trainer, Module& module,
                                torch::optim::Optimizer& optimizer) override;
  void on_train_epoch_start(Trainer& trainer, Module& module) override;
  void on_train_epoch_end(Trainer& trainer, Module& module) override;
  void on_train_end(Trainer& trainer, Module& module) override;
  /// count, last_epoch, the average (average_<i>) and the rates the
  /// annealing started from (lr0_<optimizer>).
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;

  /// The first averaged epoch, as resolved at fit start (-1 before).
  int64_t start_epoch() const { return start_epoch_; }
  /// Epochs averaged so far.
  int64_t count() const { return count_; }
  /// The average, in the module's parameters() order (empty before the
  /// first averaged epoch ends): whole before and after fit; during a fit
  /// under fsdp, this rank's 1-D shard of each parameter an optimizer steps.
  const std::vector<at::Tensor>& average() const;

 private:
  double annealed_lr(double lr0, int64_t epoch) const;
  /// Adds the weights at the end of `epoch` to the average (once per epoch,
  /// from the start epoch on).
  void average_end_of(int64_t epoch, Module& module);
  void update_batch_norm(Trainer& trainer, Module& module);

  SWAOptions options_;
  int64_t start_epoch_ = -1;
  int64_t count_ = 0;
  int64_t last_epoch_ = -1;   // the last epoch averaged
  int64_t ended_epoch_ = -1;  // the last epoch whose end this fit reached
  std::unique_ptr<detail::ParameterCopy> average_;
  /// Each optimizer's group rates when annealing began, by the order in
  /// which the optimizers step (configure_optimizers' order).
  std::vector<std::vector<double>> lr0_;
  // This fit's optimizers that configure_optimizers() did not return, in
  // the order they first stepped (lr0_ follows the returned ones).
  std::vector<const torch::optim::Optimizer*> seen_;
};

}  // namespace fulgur
