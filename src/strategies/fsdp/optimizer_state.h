// Private: the per-element tensors of a torch::optim optimizer's state, for
// the fsdp strategy to gather a shard's state whole (state_dict_type "full")
// and to take its shard back, and to count the state's bytes. Not installed.
#pragma once

#include <torch/optim.h>

#include <vector>

namespace fulgur {

class ShardedParameters;

namespace detail {

// Calls visit(tensor, set) for each per-element tensor of a torch::optim
// state (Adam's, AdamW's, SGD's, RMSprop's, Adagrad's) in a fixed order
// (every rank gathers the same ones), `set` replacing it in the state;
// false for the state of another optimizer.
template <typename Visit>
bool visit_state_tensors(torch::optim::OptimizerParamState& state, Visit&& visit) {
  auto one = [&](const at::Tensor& t, const auto& set) {
    if (t.defined()) visit(t, set);
  };
  auto moments = [&](auto* s) {  // Adam's and AdamW's
    one(s->exp_avg(), [&](const at::Tensor& v) { s->exp_avg(v); });
    one(s->exp_avg_sq(), [&](const at::Tensor& v) { s->exp_avg_sq(v); });
    one(s->max_exp_avg_sq(), [&](const at::Tensor& v) { s->max_exp_avg_sq(v); });
  };
  namespace optim = torch::optim;
  if (auto* adam = dynamic_cast<optim::AdamParamState*>(&state)) {
    moments(adam);
  } else if (auto* adamw = dynamic_cast<optim::AdamWParamState*>(&state)) {
    moments(adamw);
  } else if (auto* sgd = dynamic_cast<optim::SGDParamState*>(&state)) {
    one(sgd->momentum_buffer(), [&](const at::Tensor& v) { sgd->momentum_buffer(v); });
  } else if (auto* rms = dynamic_cast<optim::RMSpropParamState*>(&state)) {
    one(rms->square_avg(), [&](const at::Tensor& v) { rms->square_avg(v); });
    one(rms->momentum_buffer(), [&](const at::Tensor& v) { rms->momentum_buffer(v); });
    one(rms->grad_avg(), [&](const at::Tensor& v) { rms->grad_avg(v); });
  } else if (auto* ada = dynamic_cast<optim::AdagradParamState*>(&state)) {
    one(ada->sum(), [&](const at::Tensor& v) { ada->sum(v); });
  } else {
    return false;
  }
  return true;
}

// Replaces each per-element tensor of `state` with change(tensor).
template <typename Change>
bool change_state_tensors(torch::optim::OptimizerParamState& state, Change&& change) {
  return visit_state_tensors(state, [&](const at::Tensor& t, const auto& set) { set(change(t)); });
}

/// The optimizer's state of each of `sharded`'s shards, by shard index
/// (null for a shard without state yet).
std::vector<torch::optim::OptimizerParamState*> shard_states(torch::optim::Optimizer& optimizer,
                                                             const ShardedParameters& sharded);

}  // namespace detail
}  // namespace fulgur
