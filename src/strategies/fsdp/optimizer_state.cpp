// The fsdp strategy's optimizer state: its size, and its save and load as
// this rank's shards (state_dict_type "sharded", with a record of the whole
// shapes) or gathered whole ("full").
#include "strategies/fsdp/optimizer_state.h"

#include <torch/torch.h>

#include <map>

#include "fulgur/core/errors.h"
#include "fulgur/distributed/sharded_parameters.h"
#include "fulgur/strategies/fsdp.h"
#include "fulgur/utilities/torch_compat.h"

namespace fulgur {

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
  };
  for (const auto& [key, state] : optimizer.state()) {
    (void)key;
    // Only read: the visitor's setters go unused.
    const bool per_element =
        detail::visit_state_tensors(const_cast<torch::optim::OptimizerParamState&>(*state),
                                    [&](const at::Tensor& t, const auto&) { add(t); });
    if (per_element) continue;
    // LBFGS keeps one state for all its parameters, with its history.
    if (const auto* lbfgs = dynamic_cast<const torch::optim::LBFGSParamState*>(state.get())) {
      add(lbfgs->d());
      add(lbfgs->H_diag());
      add(lbfgs->prev_flat_grad());
      for (const auto* history : {&lbfgs->old_dirs(), &lbfgs->old_stps(), &lbfgs->ro()}) {
        for (const auto& t : *history) add(t);
      }
      if (lbfgs->al()) {
        for (const auto& t : *lbfgs->al()) add(t);
      }
    }
  }
  return bytes;
}

std::vector<torch::optim::OptimizerParamState*> detail::shard_states(
    torch::optim::Optimizer& optimizer, const ShardedParameters& sharded) {
  std::vector<torch::optim::OptimizerParamState*> states;
  for (const auto& shard : sharded.shards()) {
    auto it = optimizer.state().find(compat::optimizer_state_key(shard));
    states.push_back(it == optimizer.state().end() ? nullptr : it->second.get());
  }
  return states;
}

namespace {

// The shards' own state tensors back in place of the whole ones.
void put_back(const std::vector<torch::optim::OptimizerParamState*>& states,
              std::vector<std::vector<at::Tensor>>& kept) {
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i] == nullptr) continue;
    size_t k = 0;
    detail::change_state_tensors(*states[i], [&](const at::Tensor&) { return kept[i][k++]; });
  }
}

}  // namespace

void FSDPStrategy::write_shard_record(const torch::optim::Optimizer& optimizer,
                                      const ShardedParameters& sharded, StateDict& state) const {
  std::map<const c10::TensorImpl*, size_t> index;
  for (size_t i = 0; i < sharded.shards().size(); ++i) {
    index[sharded.shards()[i].unsafeGetTensorImpl()] = i;
  }
  StateDict& record = state.section(kShardRecordKey);
  record.set("world_size", static_cast<int64_t>(world_size()));
  record.set("rank", static_cast<int64_t>(global_rank()));
  int64_t position = 0;  // over the parameter groups, in order (the optimizer's own)
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (auto it = index.find(p.unsafeGetTensorImpl()); it != index.end()) {
        record.set(str("sizes/", position), sharded.full_sizes(it->second));
      }
      ++position;
    }
  }
  record.set("positions", position);
}

StateDict FSDPStrategy::optimizer_state(torch::optim::Optimizer& optimizer) {
  ShardedParameters* sharded = sharded_for(optimizer);
  if (sharded == nullptr) return ParallelStrategy::optimizer_state(optimizer);
  if (options_.state_dict_type.value() == StateDictType::kSharded) {
    StateDict state = ParallelStrategy::optimizer_state(optimizer);
    write_shard_record(optimizer, *sharded, state);
    return state;
  }
  // Every shard's state whole for the save (the state keeps the whole
  // tensors), then the shards' own again. Every rank gathers the same
  // tensors in the same order.
  auto states = detail::shard_states(optimizer, *sharded);
  std::vector<std::vector<at::Tensor>> kept(states.size());
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i] == nullptr) continue;
    const bool known = detail::change_state_tensors(*states[i], [&](const at::Tensor& t) {
      kept[i].push_back(t);
      return t.numel() == sharded->chunk(i) ? sharded->gather_whole(i, t) : t;
    });
    if (!known) {
      throw ConfigError(
          str("strategy \"", name(), "\" with state_dict_type=\"full\": the state of ",
              "this optimizer is not one fulgur can gather (torch::optim's Adam, AdamW, "
              "SGD, RMSprop and Adagrad are); use state_dict_type=\"sharded\"."));
    }
  }
  StateDict state;
  try {
    state = ParallelStrategy::optimizer_state(optimizer);
  } catch (...) {
    put_back(states, kept);
    throw;
  }
  put_back(states, kept);
  return state;
}

void FSDPStrategy::load_optimizer_state(torch::optim::Optimizer& optimizer,
                                        const StateDict& state) {
  ParallelStrategy::load_optimizer_state(optimizer, state);
  ShardedParameters* sharded = sharded_for(optimizer);
  if (sharded == nullptr) return;
  // A whole state (of the parameter's shape) becomes this rank's shard of
  // it; a shard's own state (a sharded checkpoint) is already one.
  auto states = detail::shard_states(optimizer, *sharded);
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i] == nullptr) continue;
    const c10::IntArrayRef whole(sharded->full_sizes(i));
    detail::change_state_tensors(*states[i], [&](const at::Tensor& t) {
      return t.sizes() == whole ? sharded->shard_of(i, t) : t;
    });
  }
}

}  // namespace fulgur
