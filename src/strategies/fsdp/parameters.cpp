// The fsdp strategy's sharded parameters (the role of FSDP2's _fsdp_param):
// one ShardedParameters per optimizer, stepped by it in the parameters'
// places; which of them no unit holds; the gradients the units did not
// reduce; the memory they take.
#include "fulgur/strategies/fsdp.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <set>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/distributed/sharded_parameters.h"
#include "fulgur/plugins/precision/amp.h"
#include "strategies/fsdp/unit.h"

namespace fulgur {

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
    // SHARD_GRAD_OP keeps every parameter whole: the shards are views of
    // them (ZeRO 2's 4P + 12P/N). FULL_SHARD frees a unit's parameters
    // between uses, so its shards hold memory of their own.
    const bool whole = options_.sharding_strategy.value() == ShardingStrategy::kShardGradOp;
    auto sharded = std::make_unique<ShardedParameters>(params, shared_process_group(), whole);
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
  // Under SHARD_GRAD_OP the units matter only to reduce-scatter their
  // gradients during backward (prefetch).
  if (full_shard() || options_.prefetch) {
    attach_units(module);
  } else if (options_.auto_wrap_min_params > 0 && is_global_zero()) {
    detail::print_note(str("strategy \"", name(),
                           "\": auto_wrap_min_params = ", options_.auto_wrap_min_params,
                           " has no effect here: under SHARD_GRAD_OP every parameter stays "
                           "whole, and units only reduce-scatter their gradients early with "
                           "prefetch (FSDPOptions::prefetch)."));
  }
  index_whole_parameters();
  return config;
}

void FSDPStrategy::note_held_parameters() {
  int64_t held = 0;
  for (const auto& entry : sharded_) held += entry.second->held_parameter_bytes();
  peak_parameter_bytes_ = std::max(peak_parameter_bytes_, held);
}

void FSDPStrategy::index_whole_parameters() {
  whole_.clear();
  for (const auto& entry : sharded_) {
    std::vector<char> in_unit(entry.second->parameters().size(), 0);
    // Under SHARD_GRAD_OP every parameter stays whole, units' too.
    for (const auto& unit : full_shard() ? units_ : std::vector<std::shared_ptr<Unit>>()) {
      for (const auto& [s, indices] : unit->members) {
        if (s != entry.second.get()) continue;
        for (size_t i : indices) in_unit[i] = 1;
      }
    }
    std::vector<size_t>& whole = whole_[entry.second.get()];
    for (size_t i = 0; i < in_unit.size(); ++i) {
      if (in_unit[i] == 0) whole.push_back(i);
    }
  }
}

ShardedParameters* FSDPStrategy::sharded_for(const torch::optim::Optimizer& optimizer) const {
  for (const auto& [opt, sharded] : sharded_) {
    if (opt == &optimizer) return sharded.get();
  }
  return nullptr;
}

bool FSDPStrategy::reduce_gradients(bool contributes) {
  // What the units did not reduce in backward: the parameters outside every
  // unit, and units with a parameter that got no gradient.
  std::vector<std::vector<size_t>> rest(sharded_.size());
  std::vector<int> flags;
  for (size_t k = 0; k < sharded_.size(); ++k) {
    const ShardedParameters& sharded = *sharded_[k].second;
    std::vector<char> reduced(sharded.parameters().size(), 0);
    for (const auto& unit : units_) {
      if (!unit->reduced()) continue;
      for (const auto& [s, indices] : unit->members) {
        if (s != &sharded) continue;
        for (size_t i : indices) reduced[i] = 1;
      }
    }
    for (size_t i = 0; i < reduced.size(); ++i) {
      if (reduced[i] == 0) rest[k].push_back(i);
    }
    const std::vector<int> local = sharded.local_gradients(rest[k]);
    flags.insert(flags.end(), local.begin(), local.end());
  }
  if (flags.empty()) return false;  // every parameter is a unit's, reduced in backward
  // One all-reduce for every optimizer's parameters (which have a gradient
  // on some rank), the ranks that contribute and the stop votes.
  const auto n = static_cast<int64_t>(flags.size());
  flags.push_back(contributes ? 1 : 0);
  flags.push_back(stop_vote() ? 1 : 0);
  at::Tensor summed = torch::tensor(flags, torch::kInt);
  process_group().all_reduce_(summed, ReduceOp::kSum);
  const int* sums = summed.data_ptr<int>();
  votes_exchanged(sums[n + 1]);
  bool any = false;
  const int* next = sums;
  for (size_t k = 0; k < sharded_.size(); ++k) {
    ShardedParameters::GradientAgreement agreed;
    agreed.anywhere.assign(next, next + rest[k].size());
    agreed.contributors = sums[n];
    next += rest[k].size();
    // One optimizer's exchange at a time: its packed scratch is freed
    // before the next one's is made.
    ShardedExchange exchange = sharded_[k].second->start_reduce_scatter_gradients(rest[k], agreed);
    any = any || exchange.any_gradient();
    exchange.wait();
  }
  return any;
}

std::vector<std::pair<ShardedParameters*, size_t>> FSDPStrategy::locate_parameters(
    Module& module) const {
  std::map<const c10::TensorImpl*, std::pair<ShardedParameters*, size_t>> where;
  for (const auto& entry : sharded_) {
    const auto& parameters = entry.second->parameters();
    for (size_t i = 0; i < parameters.size(); ++i) {
      where[parameters[i].unsafeGetTensorImpl()] = {entry.second.get(), i};
    }
  }
  std::vector<std::pair<ShardedParameters*, size_t>> located;
  for (const auto& p : module.parameters()) {
    auto it = where.find(p.unsafeGetTensorImpl());
    located.push_back(it != where.end() ? it->second : std::pair<ShardedParameters*, size_t>());
  }
  return located;
}

std::vector<at::Tensor> FSDPStrategy::local_parameters(Module& module) {
  const auto located = locate_parameters(module);
  std::vector<at::Tensor> local = module.parameters();
  for (size_t i = 0; i < local.size(); ++i) {
    if (located[i].first != nullptr) local[i] = located[i].first->shards()[located[i].second];
  }
  return local;
}

void FSDPStrategy::assign_local_parameters(Module& module, const std::vector<at::Tensor>& values) {
  const std::vector<at::Tensor> local = local_parameters(module);
  check_parameter_values(module, values, [&](size_t i) { return local[i].sizes().vec(); });
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < local.size(); ++i) local[i].copy_(values[i]);
  }
  // As after an optimizer step: the units' parameters are taken from the
  // shards at their next forward (one gathered now is stale: released), the
  // others gathered now.
  release_units();
  for (const auto& entry : sharded_) {
    entry.second->all_gather_parameters(whole_.at(entry.second.get()));
  }
  note_held_parameters();
}

std::vector<at::Tensor> FSDPStrategy::whole_from_local(Module& module,
                                                       const std::vector<at::Tensor>& local) {
  const auto located = locate_parameters(module);
  check_parameter_values(module, local, [&](size_t i) {
    const auto& [sharded, k] = located[i];
    return sharded != nullptr ? std::vector<int64_t>{sharded->chunk(k)} : local[i].sizes().vec();
  });
  std::vector<at::Tensor> whole;
  for (size_t i = 0; i < local.size(); ++i) {
    const auto& [sharded, k] = located[i];
    whole.push_back(sharded != nullptr ? sharded->gather_whole(k, local[i]) : local[i]);
  }
  return whole;
}

std::vector<at::Tensor> FSDPStrategy::local_from_whole(Module& module,
                                                       const std::vector<at::Tensor>& whole) {
  const auto located = locate_parameters(module);
  const auto parameters = module.parameters();
  check_parameter_values(module, whole, [&](size_t i) {
    const auto& [sharded, k] = located[i];
    return sharded != nullptr ? sharded->full_sizes(k) : parameters[i].sizes().vec();
  });
  std::vector<at::Tensor> local;
  for (size_t i = 0; i < whole.size(); ++i) {
    const auto& [sharded, k] = located[i];
    const at::Tensor& like = sharded != nullptr ? sharded->shards()[k] : parameters[i];
    const at::Tensor value = whole[i].to(like.device(), like.scalar_type());
    local.push_back(sharded != nullptr ? sharded->shard_of(k, value) : value);
  }
  return local;
}

FSDPStrategy::Memory FSDPStrategy::memory() const {
  Memory m;
  for (const auto& entry : sharded_) {
    const ShardedParameters& sharded = *entry.second;
    m.parameters += sharded.held_parameter_bytes();
    m.shards += sharded.shard_bytes();
    for (size_t i = 0; i < sharded.parameters().size(); ++i) {
      const at::Tensor& g = sharded.parameters()[i].grad();
      if (g.defined()) m.gradients += static_cast<int64_t>(g.nbytes());
      const at::Tensor& sg = sharded.shards()[i].grad();
      if (sg.defined()) m.gradients += static_cast<int64_t>(sg.nbytes());
    }
    m.optimizer_state += optimizer_state_bytes(*entry.first);
  }
  return m;
}

}  // namespace fulgur
