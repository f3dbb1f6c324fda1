// File: fulgur/strategies/fsdp.h
//
// Sharded data parallel. strategy = "fsdp_shard_grad_op" (ZeRO stage 2,
// PyTorch FSDP's SHARD_GRAD_OP): every rank holds the whole model for its
// forward and backward, as under DDP; the gradients are reduce-scattered so
// that each rank keeps its shard of their mean, the optimizer keeps state
// for that shard only and steps it, and the parameters are all-gathered
// after the step. Per rank, with Adam in fp32 (16 bytes per parameter under
// DDP): 4 + 4 + 8/N bytes while the full gradients exist in backward, then
// 4 + 12/N (ShardedParameters: one shard per parameter, so each keeps its
// own optimizer options and state, and DDP's rule for a parameter without
// a gradient holds).
//
//   fulgur::Trainer trainer({.strategy = "fsdp_shard_grad_op", .devices = 2});
//
// The same launchers, cluster environments and process groups as DDP;
// gradient accumulation, manual optimization, precision plugins and
// gradient clipping (the norm over every shard) work as under DDP.
// Checkpoints are sharded (ShardedCheckpoint): each rank writes the model
// and its optimizer shard, and resuming needs the same world size.
//
// Not yet: FULL_SHARD (parameters sharded between their uses too), which
// needs units around which to gather: LibTorch's C++ modules have no
// forward hooks, so they will be declared (as fulgur::nn::SyncBatchNorm is);
// a full single-file checkpoint; sync_batchnorm.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fulgur/strategies/parallel.h"

namespace fulgur {

class ShardedParameters;

struct FSDPOptions {
  /// "popen" (re-execute the program per rank) or "fork", as for DDP.
  Choice<StartMethod> start_method = StartMethod::kPopen;
  /// The process group's timeout and backend, and the launcher's stop grace.
  ParallelOptions parallel;
};

class FSDPStrategy : public ParallelStrategy {
 public:
  explicit FSDPStrategy(FSDPOptions options = {}, std::string name = "fsdp_shard_grad_op");
  ~FSDPStrategy() override;

  std::string_view name() const override { return name_; }
  const FSDPOptions& options() const { return options_; }
  void configure_launcher() override;
  std::string sync_batchnorm_unsupported_reason() const override {
    return "fsdp does not connect SyncBatchNorm layers yet; use strategy \"ddp\" for them";
  }

  /// The module's optimizers, each rebuilt on the shards of the parameters
  /// it steps (ConfigError for a parameter two optimizers step, or an
  /// optimizer that already has state).
  OptimizerConfig setup_optimizers(Module& module) override;
  /// Backward; at the last micro-batch of a step, the reduce-scatter.
  void backward(const at::Tensor& loss, Module& module) override;
  /// Joins the peers' reduce-scatter with this rank's accumulated gradient
  /// (or none); the optimizers step when any rank has one.
  bool backward_skipped(Module& module, bool accumulated) override;
  void set_gradient_sync(bool enabled) override { sync_ = enabled; }
  /// The step on the shards, then the all-gather of the parameters.
  bool optimizer_step(torch::optim::Optimizer& optimizer, Module& module) override;
  /// The norm over the shards of every rank (one all-reduce).
  void clip_gradients_norm(const std::vector<at::Tensor>& parameters, double max_norm) override;
  /// The module's state, then every shard taken from it again.
  void load_module_state(Module& module, torch::serialize::InputArchive& archive) override;

  static void register_strategies(StrategyRegistry& registry);

 protected:
  void do_setup(Module& module) override;
  void do_teardown() override;

 private:
  ShardedParameters* sharded_for(const torch::optim::Optimizer& optimizer) const;
  void reduce_gradients();

  FSDPOptions options_;
  std::string name_;
  bool sync_ = true;
  std::vector<std::pair<const torch::optim::Optimizer*, std::unique_ptr<ShardedParameters>>>
      sharded_;
};

}  // namespace fulgur
