// Private: one unit of the fsdp strategy (FSDPStrategy::Unit), the role of
// FSDP2's _fsdp_param_group: a declared fulgur::nn::FSDPUnit (or an
// auto-wrapped layer) whose parameters it gathers before the unit's forward
// and backward and releases after them, reduce-scattering the gradients as
// they complete. The strategy keeps the units (unit.cpp) and the sharded
// parameters they draw from (parameters.cpp). Not installed.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "fulgur/distributed/sharded_parameters.h"
#include "fulgur/nn/checkpoint.h"
#include "fulgur/nn/fsdp_unit.h"
#include "fulgur/strategies/fsdp.h"

namespace fulgur {

// One declared fulgur::nn::FSDPUnit under FULL_SHARD: which shards hold its
// parameters, whether their full values are here, and how many of its
// gradients this backward has completed.
class FSDPStrategy::Unit : public nn::UnitHooks, public std::enable_shared_from_this<Unit> {
 public:
  /// `shards`: FULL_SHARD (its parameters are released between uses);
  /// under SHARD_GRAD_OP a unit only reduce-scatters its gradients in
  /// backward (prefetch).
  Unit(FSDPStrategy& strategy, bool shards) : strategy_(strategy), shards_(shards) {}
  ~Unit() override {
    for (size_t k = 0; k < accumulators_.size(); ++k) {
      accumulators_[k]->del_post_hook(hook_keys_[k]);
    }
  }

  void attach_module(std::shared_ptr<torch::nn::Module> module) {
    module_ = std::move(module);
    static_cast<nn::FSDPUnitBase&>(*module_).set_unit_hooks(shared_from_this());
  }
  void detach_module() {
    if (module_) static_cast<nn::FSDPUnitBase&>(*module_).set_unit_hooks(nullptr);
    module_.reset();
  }
  /// (ShardedParameters, its indices) of this unit's parameters.
  std::vector<std::pair<ShardedParameters*, std::vector<size_t>>> members;

  void watch_gradients();
  /// Starts gathering the parameters (a prefetch); gather() ends it.
  void start_gather() {
    if (!shards_ || gathered_ || !gathering_.empty()) return;
    for (auto& [sharded, indices] : members) {
      gathering_.push_back(sharded->start_all_gather_parameters(indices));
    }
    ++strategy_.unit_gathers_;
    strategy_.note_held_parameters();
  }
  void gather() {
    if (gathered_) return;
    start_gather();
    for (auto& exchange : gathering_) exchange.wait();
    gathering_.clear();
    gathered_ = true;
    strategy_.note_held_parameters();
  }
  void release() {
    if (!shards_) return;
    if (!gathering_.empty()) gather();  // a prefetch under way ends first
    if (!gathered_) return;
    for (auto& [sharded, indices] : members) sharded->release_parameters(indices);
    gathered_ = false;
  }
  void start_backward() {
    ready_ = 0;
    reduced_ = false;
  }
  bool reduced() const { return reduced_; }

  void before_forward() override {
    if (!shards_) return;
    gather();
    if (nn::in_checkpoint_recomputation()) {
      // Inside a checkpointed block run again in backward (or a block
      // nested in it): this unit's backward follows in this backward.
      strategy_.unit_backward_started(this);
    } else if (at::GradMode::is_enabled() ||
               nn::current_checkpoint_run() == nn::CheckpointRun::kFirst) {
      strategy_.unit_forward_started(this);
    }
  }
  void after_forward(const std::vector<at::Tensor>& outputs) override {
    if (!shards_) return;
    // The second run's backward needs the parameters it just used: they
    // stay gathered until their gradients are reduced (gradient_ready), or
    // the backward ends. So does a nested block's first run inside it,
    // whose own second run and backward come later in this backward.
    if (nn::in_checkpoint_recomputation()) return;
    if (!at::GradMode::is_enabled()) {
      release();
      return;
    }
    if (outputs.empty()) return;  // unseen results: whole until the backward
    std::weak_ptr<Unit> self = weak_from_this();
    for (const auto& out : outputs) {
      if (!out.defined() || !out.requires_grad()) continue;
      // Runs when the output's gradient arrives, before any of the unit's
      // own backward: the parameters its graph saved are needed again.
      out.register_hook([self](const at::Tensor&) {
        if (auto unit = self.lock()) {
          unit->gather();
          unit->strategy_.unit_backward_started(unit.get());
        }
      });
    }
    release();
  }
  void gradient_ready() {
    if (++ready_ < static_cast<int>(accumulators_.size())) return;
    // Autograd calls the hook also for a gradient that arrived undefined
    // (a custom function's, say): such a unit is reduced with the rest
    // after the backward, whose agreement leaves that parameter without
    // one (as on every rank: their graphs are the same).
    for (auto& [sharded, indices] : members) {
      for (size_t i : indices) {
        if (!sharded->parameters()[i].grad().defined()) return;
      }
    }
    if (strategy_.gradient_sync()) {
      // With prefetch, the reduce-scatter runs while the rest of backward
      // does (one unit's under way at a time); without, now.
      if (strategy_.options_.prefetch) strategy_.finish_reductions();
      for (auto& [sharded, indices] : members) {
        // Every rank runs this backward (agree_on_backward), so every rank
        // has these gradients and contributes: nothing to agree on before
        // the reduce-scatter (no all-reduce read back within backward).
        ShardedParameters::GradientAgreement agreed;
        agreed.anywhere.assign(indices.size(), 1);
        agreed.contributors = strategy_.world_size();
        ShardedExchange exchange = sharded->start_reduce_scatter_gradients(indices, agreed);
        if (strategy_.options_.prefetch) {
          strategy_.reducing_.push_back(std::move(exchange));
        } else {
          exchange.wait();
        }
      }
      reduced_ = true;
    }
    release();
  }

 private:
  FSDPStrategy& strategy_;
  const bool shards_;
  std::shared_ptr<torch::nn::Module> module_;
  bool gathered_ = true;
  std::vector<ShardedExchange> gathering_;  // a prefetch under way
  bool reduced_ = false;
  int ready_ = 0;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
};

}  // namespace fulgur
