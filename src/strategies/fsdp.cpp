#include "fulgur/strategies/fsdp.h"

#include <torch/torch.h>

#include <cmath>
#include <set>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/plugins/precision/amp.h"
#include "fulgur/strategies/checkpoint_layout.h"
#include "fulgur/strategies/process_group.h"
#include "fulgur/strategies/sharded_parameters.h"

namespace fulgur {

FSDPStrategy::FSDPStrategy(FSDPOptions options, std::string name)
    : ParallelStrategy(options.parallel, "FSDPStrategy"),
      options_(std::move(options)),
      name_(std::move(name)) {
  check_start_method(options_.start_method, "FSDPStrategy");
  // Each rank's optimizer state is its own shard.
  set_checkpoint_layout(std::make_shared<ShardedCheckpoint>());
}

FSDPStrategy::~FSDPStrategy() = default;

void FSDPStrategy::configure_launcher() { configure_launcher_for(options_.start_method.value()); }

void FSDPStrategy::do_setup(Module& module) {
  module.to(root_device());
  // Every rank starts from rank 0's parameters and buffers.
  broadcast_parameters_from_rank_zero(module);
  torch::NoGradGuard no_grad;
  for (auto& b : module.buffers()) {
    if (b.defined() && b.numel() > 0) process_group().broadcast_(b, 0);
  }
}

void FSDPStrategy::do_teardown() {
  sharded_.clear();
  ParallelStrategy::do_teardown();
}

OptimizerConfig FSDPStrategy::setup_optimizers(Module& module) {
  // The loss scaler decides from the gradients it sees whether to skip a
  // step; each rank sees only its shard, so an inf in one shard would make
  // that rank alone skip. A scaler that agrees across ranks is not here yet.
  if (auto* mixed = dynamic_cast<MixedPrecision*>(&precision()); mixed && mixed->scaler()) {
    throw ConfigError(str("strategy \"", name(), "\" with precision=\"", precision().name(),
                          "\": its loss scaler would judge each rank's shard of the gradients "
                          "alone, and ranks could disagree on skipping a step. Use "
                          "precision=\"bf16-mixed\" (no loss scaler), or strategy \"ddp\"."));
  }
  OptimizerConfig config = ParallelStrategy::setup_optimizers(module);
  sharded_.clear();
  std::set<const c10::TensorImpl*> taken;
  for (size_t o = 0; o < config.optimizers.size(); ++o) {
    torch::optim::Optimizer& optimizer = *config.optimizers[o];
    if (!optimizer.state().empty()) {
      throw ConfigError(str("strategy \"", name(), "\": optimizer ", o,
                            " of configure_optimizers() already has state; under sharded data "
                            "parallel its state is built on this rank's shards. Return a fresh "
                            "optimizer (a checkpoint restores its state)."));
    }
    std::vector<at::Tensor> params;
    for (auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        if (!p.requires_grad()) continue;  // frozen: stays whole, never stepped
        if (!taken.insert(p.unsafeGetTensorImpl()).second) {
          throw ConfigError(
              fulgur::str("strategy \"", name(), "\": a parameter of shape ", p.sizes(),
                          " is in two optimizers (or twice in one). Under sharded data "
                          "parallel each parameter is sharded for one optimizer: give "
                          "each parameter to one optimizer, once."));
        }
        params.push_back(p);
      }
    }
    if (params.empty()) continue;
    auto sharded = std::make_unique<ShardedParameters>(params, shared_process_group());
    // The optimizer steps the shards, in the parameters' places (each keeps
    // its group's options).
    size_t k = 0;
    for (auto& group : optimizer.param_groups()) {
      for (auto& p : group.params()) {
        if (p.requires_grad()) p = sharded->shards()[k++];
      }
    }
    sharded_.emplace_back(&optimizer, std::move(sharded));
  }
  return config;
}

ShardedParameters* FSDPStrategy::sharded_for(const torch::optim::Optimizer& optimizer) const {
  for (const auto& [opt, sharded] : sharded_) {
    if (opt == &optimizer) return sharded.get();
  }
  return nullptr;
}

void FSDPStrategy::reduce_gradients() {
  for (auto& entry : sharded_) entry.second->reduce_scatter_gradients();
}

void FSDPStrategy::backward(const at::Tensor& loss, Module& module) {
  ParallelStrategy::backward(loss, module);
  if (sync_) reduce_gradients();
}

bool FSDPStrategy::backward_skipped(Module& /*module*/, bool accumulated) {
  if (!sync_) return accumulated;
  // The peers reduce-scatter now: join them with what this rank has
  // accumulated (or nothing). The flags are all-reduced, so every rank
  // comes to the same answer.
  reduce_gradients();
  for (const auto& entry : sharded_) {
    for (const auto& s : entry.second->shards()) {
      if (s.grad().defined()) return true;
    }
  }
  return false;
}

bool FSDPStrategy::optimizer_step(torch::optim::Optimizer& optimizer, Module& module) {
  const bool stepped = ParallelStrategy::optimizer_step(optimizer, module);
  if (ShardedParameters* sharded = sharded_for(optimizer)) sharded->all_gather_parameters();
  return stepped;
}

void FSDPStrategy::clip_gradients_norm(const std::vector<at::Tensor>& parameters, double max_norm) {
  // The 2-norm over every rank's shards: the sum of squares, all-reduced
  // (padding holds zeros). As torch::nn::utils::clip_grad_norm_ then does.
  // Summed on the gradients' device, read once (not once per parameter).
  at::Tensor total = torch::zeros({1}, torch::kDouble);
  for (const auto& p : parameters) {
    if (!p.grad().defined()) continue;
    if (total.device() != p.grad().device()) total = total.to(p.grad().device());
    total += p.grad().detach().to(torch::kDouble).pow(2).sum();
  }
  total = total.cpu();
  process_group().all_reduce_(total, ReduceOp::Sum);
  const double norm = std::sqrt(total.item<double>());
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1.0) return;
  torch::NoGradGuard no_grad;
  for (const auto& p : parameters) {
    if (p.grad().defined()) p.grad().mul_(coef);
  }
}

void FSDPStrategy::load_module_state(Module& module, torch::serialize::InputArchive& archive) {
  ParallelStrategy::load_module_state(module, archive);
  for (auto& entry : sharded_) entry.second->take_from_parameters();
}

void FSDPStrategy::register_strategies(StrategyRegistry& registry) {
  struct Variant {
    const char* name;
    const char* description;
    StartMethod start_method;
  };
  static constexpr Variant variants[] = {
      {"fsdp_shard_grad_op",
       "Sharded data parallel, SHARD_GRAD_OP (ZeRO 2): gradients and optimizer state sharded, "
       "parameters whole; one process per device, launched by re-executing the program",
       StartMethod::kPopen},
      {"fsdp_shard_grad_op_fork",
       "Sharded data parallel, SHARD_GRAD_OP (ZeRO 2), ranks forked at fit()", StartMethod::kFork},
  };
  // Lightning's spelling of FULL_SHARD: named, so that it says what to use.
  registry.add(
      "fsdp",
      "Sharded data parallel, FULL_SHARD (parameters sharded between uses too): not in this "
      "version; fsdp_shard_grad_op shards gradients and optimizer state",
      []() -> std::unique_ptr<Strategy> {
        throw ConfigError(
            "strategy=\"fsdp\" (FULL_SHARD: parameters sharded between their uses too) is not in "
            "this version of fulgur: LibTorch's C++ modules have no forward hooks to gather "
            "parameters around. Use strategy=\"fsdp_shard_grad_op\" (gradients and optimizer "
            "state sharded, ZeRO stage 2), or \"ddp\".");
      });
  for (const auto& v : variants) {
    FSDPOptions options;
    options.start_method = v.start_method;
    const std::string name = v.name;
    registry.add(
        name, v.description,
        [options, name] { return std::make_unique<FSDPStrategy>(options, name); },
        str("sharding_strategy=SHARD_GRAD_OP, start_method=", options.start_method.text(),
            describe_parallel_options(options.parallel)));
  }
}

}  // namespace fulgur
