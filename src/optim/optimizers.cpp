// Multi-tensor steps for torch::optim's SGD, Adam and AdamW.
//
// Each step below is LibTorch's (torch/csrc/api/src/optim/{sgd,adam,adamw}.cpp,
// the same in 1.13 and 2.x) with its per-parameter loop turned inside out:
// every operator LibTorch applies to one parameter is applied here to the
// list of a group's parameters at once, in the same order, with the same
// scalars computed by the same expressions. On the CPU an `_foreach_` operator
// runs the per-tensor kernel on each tensor, so the results are bit-identical.
#include "fulgur/optim/optimizers.h"

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_addcdiv.h>
#include <ATen/ops/_foreach_addcmul.h>
#include <ATen/ops/_foreach_div.h>
#include <ATen/ops/_foreach_maximum.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_sqrt.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "fulgur/utilities/torch_compat.h"

namespace fulgur::optim {
namespace {

using TensorVector = std::vector<at::Tensor>;

/// The parameters of one group that have a gradient, in the group's order,
/// and their gradients.
struct WithGrad {
  TensorVector params;
  TensorVector grads;
};

std::vector<WithGrad> parameters_with_grad(
    const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  std::vector<WithGrad> out(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    out[g].params.reserve(params.size());
    out[g].grads.reserve(params.size());
    for (const auto& p : params) {
      const auto& grad = p.grad();
      if (!grad.defined()) continue;
      out[g].params.push_back(p);
      out[g].grads.push_back(grad);
    }
  }
  return out;
}

bool any_sparse_grad(const std::vector<WithGrad>& groups) {
  for (const auto& group : groups) {
    for (const auto& grad : group.grads) {
      if (grad.is_sparse()) return true;
    }
  }
  return false;
}

/// Whether one tensor appears twice among a group's parameters (torch::optim
/// steps it twice, one update after the other; see the header).
bool any_group_lists_a_tensor_twice(const std::vector<WithGrad>& groups) {
  std::vector<const void*> impls;
  for (const auto& group : groups) {
    impls.clear();
    for (const auto& p : group.params) impls.push_back(p.unsafeGetTensorImpl());
    std::sort(impls.begin(), impls.end());
    if (std::adjacent_find(impls.begin(), impls.end()) != impls.end()) return true;
  }
  return false;
}

template <class ParamState, class StateMap>
ParamState* find_state(StateMap& state, const at::Tensor& param) {
  auto it = state.find(compat::optimizer_state_key(param));
  return it == state.end() ? nullptr : static_cast<ParamState*>(it->second.get());
}

/// The tensors of the Adam parameters that share one step count.
struct AdamBatch {
  TensorVector params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
};

/// Adam's (kDecoupled = false) or AdamW's update of a batch of parameters
/// whose step counts, already incremented, all equal `step`: torch::optim's
/// per-parameter arithmetic after the state's initialisation, operator by
/// operator.
template <bool kDecoupled, class Options>
void adam_update(const Options& options, int64_t step, AdamBatch& b) {
  const double lr = options.lr();
  const double beta1 = std::get<0>(options.betas());
  const double beta2 = std::get<1>(options.betas());
  const double weight_decay = options.weight_decay();

  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);

  // Adam: grad = grad.add(p, weight_decay) (AdamW decayed p before).
  TensorVector decayed;
  if (!kDecoupled && weight_decay != 0) decayed = at::_foreach_add(b.grads, b.params, weight_decay);
  const TensorVector& grads = decayed.empty() ? b.grads : decayed;

  // exp_avg.mul_(beta1).add_(grad, 1 - beta1);
  at::_foreach_mul_(b.exp_avgs, beta1);
  at::_foreach_add_(b.exp_avgs, grads, 1 - beta1);
  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  at::_foreach_mul_(b.exp_avg_sqs, beta2);
  at::_foreach_addcmul_(b.exp_avg_sqs, grads, grads, 1 - beta2);

  // denom = (sq.sqrt() / sqrt(bias_correction2)).add_(eps), where sq is
  // max_exp_avg_sq = max(exp_avg_sq, max_exp_avg_sq) under amsgrad.
  TensorVector denom;
  if (options.amsgrad()) {
    at::_foreach_maximum_(b.max_exp_avg_sqs, b.exp_avg_sqs);
    denom = at::_foreach_sqrt(b.max_exp_avg_sqs);
  } else {
    denom = at::_foreach_sqrt(b.exp_avg_sqs);
  }
  at::_foreach_div_(denom, std::sqrt(bias_correction2));
  at::_foreach_add_(denom, options.eps());

  // p.addcdiv_(exp_avg, denom, -step_size), step_size = lr / bias_correction1.
  const double step_size = lr / bias_correction1;
  at::_foreach_addcdiv_(b.params, b.exp_avgs, denom, -step_size);
}

/// One Adam/AdamW step of a parameter group's parameters with a gradient:
/// decoupled weight decay (AdamW), state initialisation and the step count's
/// increment as torch::optim does them, then one adam_update per step count.
template <bool kDecoupled, class Options, class ParamState, class StateMap>
void adam_group_step(const char* optimizer, const Options& options, WithGrad& group,
                     StateMap& state) {
  const size_t n = group.params.size();
  if (n == 0) return;
  const bool amsgrad = options.amsgrad();

  std::vector<ParamState*> states(n);
  for (size_t i = 0; i < n; ++i) {
    const auto& p = group.params[i];
    auto* s = find_state<ParamState>(state, p);
    if (s == nullptr) {
      auto fresh = std::make_unique<ParamState>();
      fresh->step(0);
      fresh->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
      fresh->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
      if (amsgrad) fresh->max_exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
      s = fresh.get();
      state[compat::optimizer_state_key(p)] = std::move(fresh);
    }
    TORCH_CHECK(!amsgrad || s->max_exp_avg_sq().defined(), "fulgur::optim::", optimizer,
                ": amsgrad=true, but the state of a parameter has no max_exp_avg_sq (it was "
                "made with amsgrad=false). Set amsgrad=true before the first step.");
    states[i] = s;
  }
  // AdamW: p.mul_(1 - lr * weight_decay). LibTorch does it before the state's
  // initialisation, which reads only the parameter's shape.
  if (kDecoupled && options.weight_decay() != 0) {
    at::_foreach_mul_(group.params, 1 - options.lr() * options.weight_decay());
  }
  for (auto* s : states) s->step(s->step() + 1);

  auto add_to = [&](AdamBatch& b, size_t i) {
    b.params.push_back(group.params[i]);
    b.grads.push_back(group.grads[i]);
    b.exp_avgs.push_back(states[i]->exp_avg());
    b.exp_avg_sqs.push_back(states[i]->exp_avg_sq());
    if (amsgrad) b.max_exp_avg_sqs.push_back(states[i]->max_exp_avg_sq());
  };
  const int64_t first_step = states[0]->step();
  const bool one_step_count = std::all_of(
      states.begin(), states.end(), [&](const ParamState* s) { return s->step() == first_step; });
  if (one_step_count) {
    AdamBatch b;
    for (size_t i = 0; i < n; ++i) add_to(b, i);
    adam_update<kDecoupled>(options, first_step, b);
    return;
  }
  // Parameters that missed steps (no gradient then) have smaller counts,
  // hence other bias corrections: one batch per count.
  std::map<int64_t, AdamBatch> by_step;
  for (size_t i = 0; i < n; ++i) add_to(by_step[states[i]->step()], i);
  for (auto& [step, b] : by_step) adam_update<kDecoupled>(options, step, b);
}

/// The closure's loss, computed with gradients on (as torch::optim's steps
/// do); undefined without a closure.
at::Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (closure == nullptr) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

/// Adam's and AdamW's step (`Parent`: torch::optim's class, whose own step
/// runs where a group lists a tensor twice): the closure, the sparse check
/// before anything changes, then every group's adam_group_step.
template <bool kDecoupled, class Options, class ParamState, class Parent>
at::Tensor adam_family_step(Parent& self, const char* name,
                            const torch::optim::Optimizer::LossClosure& closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss = run_closure(closure);
  auto groups = parameters_with_grad(self.param_groups());
  TORCH_CHECK(!any_sparse_grad(groups), "fulgur::optim::", name,
              " does not support sparse gradients (nor does torch::optim::", name, ")");
  if (any_group_lists_a_tensor_twice(groups)) {
    self.Parent::step(nullptr);
    return loss;
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& options = static_cast<const Options&>(self.param_groups()[g].options());
    adam_group_step<kDecoupled, Options, ParamState>(name, options, groups[g], self.state());
  }
  return loss;
}

}  // namespace

at::Tensor SGD::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss = run_closure(closure);
  auto groups = parameters_with_grad(param_groups_);
  if (any_sparse_grad(groups) || any_group_lists_a_tensor_twice(groups)) {
    torch::optim::SGD::step(nullptr);
    return loss;
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& [params, grads] = groups[g];
    if (params.empty()) continue;
    const auto& options = static_cast<const torch::optim::SGDOptions&>(param_groups_[g].options());
    const double weight_decay = options.weight_decay();
    const double momentum = options.momentum();
    const double dampening = options.dampening();

    // d_p = grad; if (weight_decay != 0) d_p = d_p.add(p, weight_decay);
    TensorVector d_p = weight_decay != 0 ? at::_foreach_add(grads, params, weight_decay) : grads;
    if (momentum != 0) {
      // A new buffer is a copy of d_p; an existing one is
      // buf.mul_(momentum).add_(d_p, 1 - dampening).
      TensorVector bufs(params.size());
      TensorVector old_bufs;
      TensorVector old_d_p;
      for (size_t i = 0; i < params.size(); ++i) {
        auto* s = find_state<torch::optim::SGDParamState>(state_, params[i]);
        if (s == nullptr) {
          bufs[i] = d_p[i].detach().clone();
          auto fresh = std::make_unique<torch::optim::SGDParamState>();
          fresh->momentum_buffer(bufs[i]);
          state_[compat::optimizer_state_key(params[i])] = std::move(fresh);
        } else {
          bufs[i] = s->momentum_buffer();
          old_bufs.push_back(bufs[i]);
          old_d_p.push_back(d_p[i]);
        }
      }
      if (!old_bufs.empty()) {
        at::_foreach_mul_(old_bufs, momentum);
        at::_foreach_add_(old_bufs, old_d_p, 1 - dampening);
      }
      // nesterov: d_p = d_p.add(buf, momentum); else d_p = buf.
      d_p = options.nesterov() ? at::_foreach_add(d_p, bufs, momentum) : std::move(bufs);
    }
    // p.data().add_(d_p, -1 * lr): through data(), as LibTorch does, so that
    // the parameters' version counters do not move.
    TensorVector data;
    data.reserve(params.size());
    for (const auto& p : params) data.push_back(p.data());
    at::_foreach_add_(data, d_p, -1 * options.lr());
  }
  return loss;
}

at::Tensor Adam::step(LossClosure closure) {
  return adam_family_step<false, torch::optim::AdamOptions, torch::optim::AdamParamState,
                          torch::optim::Adam>(*this, "Adam", closure);
}

at::Tensor AdamW::step(LossClosure closure) {
  return adam_family_step<true, torch::optim::AdamWOptions, torch::optim::AdamWParamState,
                          torch::optim::AdamW>(*this, "AdamW", closure);
}

}  // namespace fulgur::optim
