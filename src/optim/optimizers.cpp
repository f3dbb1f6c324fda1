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
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "fulgur/utilities/torch_compat.h"
#include "utilities/host_copy.h"

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

/// "" when every gradient has its parameter's dtype; else which does not
/// (Adam's kernels fail an internal assert on it, torch::optim's too).
std::string gradient_dtype_mismatch(const std::vector<WithGrad>& groups) {
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].params.size(); ++i) {
      const at::Tensor& p = groups[g].params[i];
      const at::Tensor& grad = groups[g].grads[i];
      if (grad.scalar_type() == p.scalar_type()) continue;
      return c10::str("a parameter of shape ", p.sizes(), " and dtype ", p.scalar_type(),
                      " (group ", g, ") has a gradient of dtype ", grad.scalar_type());
    }
  }
  return "";
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

// ---- Device-skipped steps (DeviceSkippedSteps): the fused kernels.

/// A parameter's state that the host changes when it learns a
/// device-skipped step's verdict: its key, and the object it was then (a
/// load may have replaced it since).
struct StateRef {
  compat::OptimizerStateKey key;
  const void* state;
};

/// Whether a gradient or state tensor can go into a fused step beside its
/// parameter: the kernels walk them in memory order together.
bool beside(const at::Tensor& t, const at::Tensor& param) {
  return t.defined() && t.device() == param.device() && t.scalar_type() == param.scalar_type() &&
         t.sizes() == param.sizes() && t.strides() == param.strides();
}

/// Whether the fused kernels can step these parameters, deciding on
/// `found_inf` themselves (see DeviceSkippedSteps::step_unless).
bool fusable(const std::vector<WithGrad>& groups, const at::Tensor& found_inf) {
  if (!compat::has_fused_optimizer_steps()) return false;
  const c10::Device device = found_inf.device();
  if (!(device.is_cpu() || device.is_cuda()) || found_inf.scalar_type() != at::kFloat ||
      found_inf.numel() != 1) {
    return false;
  }
  std::vector<const void*> impls;
  for (const auto& group : groups) {
    for (size_t i = 0; i < group.params.size(); ++i) {
      const at::Tensor& p = group.params[i];
      // The CPU kernels read the tensors as flat arrays; the CUDA ones take
      // any dense layout (channels_last) that the tensors share.
      const bool layout = device.is_cpu() ? p.is_contiguous() : p.is_non_overlapping_and_dense();
      if (group.grads[i].is_sparse() || p.device() != device || !p.is_floating_point() || !layout ||
          !beside(group.grads[i], p)) {
        return false;
      }
      impls.push_back(p.unsafeGetTensorImpl());
    }
  }
  // Listed twice, in one group or in two: torch::optim steps it twice, with
  // the state of the first step in the second.
  std::sort(impls.begin(), impls.end());
  return std::adjacent_find(impls.begin(), impls.end()) == impls.end();
}

/// Where the fused kernels cannot take the step: the host reads the
/// verdict, then steps as usual (see DeviceSkippedSteps::step_unless).
bool read_then_step(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf) {
  if (found_inf.item<float>() == 1.0f) return false;  // as the kernels decide
  optimizer.step();
  return true;
}

/// The states a skipped step made, removed (a step torch::optim skips
/// makes none), unless a load replaced them since.
template <class StateMap>
void erase_states(StateMap& state, const std::vector<StateRef>& made) {
  for (const auto& ref : made) {
    auto it = state.find(ref.key);
    if (it != state.end() && it->second.get() == ref.state) state.erase(it);
  }
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

/// `n` copies of one 0-dim tensor: the scalar operand of a list-list
/// multi-tensor operator (each tensor broadcasts it).
TensorVector repeated(const at::Tensor& scalar, size_t n) { return TensorVector(n, scalar); }

/// Adam's or AdamW's update in device-scalar mode: the arithmetic of
/// adam_update with the per-step numbers read from 0-dim device tensors:
/// `neg_step_size` = -lr / bias_correction1, `sqrt_bc2` =
/// sqrt(bias_correction2) (the constants are the options').
template <bool kDecoupled, class Options>
void adam_update_device(const Options& options, const at::Tensor& neg_step_size,
                        const at::Tensor& sqrt_bc2, AdamBatch& b) {
  const size_t n = b.params.size();
  const double beta1 = std::get<0>(options.betas());
  const double beta2 = std::get<1>(options.betas());
  const double weight_decay = options.weight_decay();
  TensorVector decayed;
  if (!kDecoupled && weight_decay != 0) decayed = at::_foreach_add(b.grads, b.params, weight_decay);
  const TensorVector& grads = decayed.empty() ? b.grads : decayed;
  at::_foreach_mul_(b.exp_avgs, beta1);
  at::_foreach_add_(b.exp_avgs, grads, 1 - beta1);
  at::_foreach_mul_(b.exp_avg_sqs, beta2);
  at::_foreach_addcmul_(b.exp_avg_sqs, grads, grads, 1 - beta2);
  TensorVector denom;
  if (options.amsgrad()) {
    at::_foreach_maximum_(b.max_exp_avg_sqs, b.exp_avg_sqs);
    denom = at::_foreach_sqrt(b.max_exp_avg_sqs);
  } else {
    denom = at::_foreach_sqrt(b.exp_avg_sqs);
  }
  at::_foreach_div_(denom, repeated(sqrt_bc2, n));
  at::_foreach_add_(denom, options.eps());
  TensorVector update = at::_foreach_div(b.exp_avgs, denom);
  at::_foreach_mul_(update, repeated(neg_step_size, n));
  at::_foreach_add_(b.params, update);
}

/// One Adam/AdamW step of a group in device-scalar mode: every parameter
/// with a gradient has a state, and all share one step count (checked by
/// why_not_device_scalars); `slots` = {-step_size, sqrt(bias_correction2),
/// 1 - lr * weight_decay}.
template <bool kDecoupled, class Options, class ParamState, class StateMap>
void adam_group_step_device(const char* optimizer, const Options& options, WithGrad& group,
                            StateMap& state, const at::Tensor* slots, TensorVector& stepped) {
  const size_t n = group.params.size();
  if (n == 0) return;
  AdamBatch b;
  for (size_t i = 0; i < n; ++i) {
    auto* s = find_state<ParamState>(state, group.params[i]);
    TORCH_CHECK(s != nullptr, "fulgur::optim::", optimizer,
                ": in device-scalar mode (a CUDA-graph step) a parameter has a gradient but no "
                "state: it had no gradient in the steps before the capture. Give every trained "
                "parameter a gradient in the warm-up steps.");
    b.params.push_back(group.params[i]);
    b.grads.push_back(group.grads[i]);
    b.exp_avgs.push_back(s->exp_avg());
    b.exp_avg_sqs.push_back(s->exp_avg_sq());
    if (options.amsgrad()) b.max_exp_avg_sqs.push_back(s->max_exp_avg_sq());
    stepped.push_back(group.params[i]);
  }
  if (kDecoupled && options.weight_decay() != 0) {
    at::_foreach_mul_(b.params, repeated(slots[2], n));
  }
  adam_update_device<kDecoupled>(options, slots[0], slots[1], b);
}

/// Adam's and AdamW's step (`Parent`: torch::optim's class, whose own step
/// runs where a group lists a tensor twice): the closure, the sparse check
/// before anything changes, then every group's adam_group_step (or, in
/// device-scalar mode, adam_group_step_device).
template <bool kDecoupled, class Options, class ParamState, class Parent>
at::Tensor adam_family_step(Parent& self, const char* name,
                            const torch::optim::Optimizer::LossClosure& closure,
                            const TensorVector* slots, TensorVector* stepped) {
  at::NoGradGuard no_grad;
  at::Tensor loss = run_closure(closure);
  auto groups = parameters_with_grad(self.param_groups());
  TORCH_CHECK(!any_sparse_grad(groups), "fulgur::optim::", name,
              " does not support sparse gradients (nor does torch::optim::", name, ")");
  if (const std::string mismatch = gradient_dtype_mismatch(groups); !mismatch.empty()) {
    TORCH_CHECK(false, "fulgur::optim::", name, ": ", mismatch,
                ". Give each gradient its parameter's dtype (a gradient set by hand: "
                "grad.to(param.scalar_type())).");
  }
  if (slots != nullptr) {
    TORCH_CHECK(!any_group_lists_a_tensor_twice(groups), "fulgur::optim::", name,
                ": a parameter group lists a tensor twice, which a device-scalar step (a "
                "CUDA-graph step) cannot update twice. List each tensor once.");
    stepped->clear();
    for (size_t g = 0; g < groups.size(); ++g) {
      const auto& options = static_cast<const Options&>(self.param_groups()[g].options());
      adam_group_step_device<kDecoupled, Options, ParamState>(
          name, options, groups[g], self.state(), &(*slots)[3 * g], *stepped);
    }
    return loss;
  }
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
  settle();
  at::NoGradGuard no_grad;
  at::Tensor loss = run_closure(closure);
  auto groups = parameters_with_grad(param_groups_);
  const bool device_scalars = uses_device_scalars();
  if (device_scalars) {
    TORCH_CHECK(!any_sparse_grad(groups) && !any_group_lists_a_tensor_twice(groups),
                "fulgur::optim::SGD: a device-scalar step (a CUDA-graph step) needs dense "
                "gradients and parameter groups that list each tensor once.");
  } else if (any_sparse_grad(groups) || any_group_lists_a_tensor_twice(groups)) {
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
        // A new buffer in a captured step would be set again at each replay.
        TORCH_CHECK(s != nullptr || !device_scalars,
                    "fulgur::optim::SGD: in device-scalar mode (a CUDA-graph step) a parameter "
                    "has a gradient but no momentum buffer: it had no gradient in the steps "
                    "before the capture. Give every trained parameter a gradient in the warm-up "
                    "steps.");
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
    if (device_scalars) {
      const at::Tensor& neg_lr = (*DeviceScalarSteps::device_scalars(param_groups_.size()))[g];
      at::_foreach_add_(data, at::_foreach_mul(d_p, repeated(neg_lr, d_p.size())));
    } else {
      at::_foreach_add_(data, d_p, -1 * options.lr());
    }
  }
  return loss;
}

namespace {

/// Why Adam's or AdamW's state cannot take a device-scalar step, or "".
template <class ParamState, class Parent>
std::string adam_why_not_device_scalars(const Parent& self, const char* name) {
  for (size_t g = 0; g < self.param_groups().size(); ++g) {
    std::optional<int64_t> step;
    for (const auto& p : self.param_groups()[g].params()) {
      if (!p.requires_grad()) continue;  // frozen: not stepped
      auto it = self.state().find(compat::optimizer_state_key(p));
      if (it == self.state().end()) continue;
      const int64_t count = static_cast<const ParamState&>(*it->second).step();
      if (step && *step != count) {
        return c10::str(name, ": parameter group ", g,
                        " holds parameters with different step counts (", *step, " and ", count,
                        "; some had no gradient on some steps), whose bias "
                        "corrections differ: a captured step has one per group");
      }
      step = count;
    }
  }
  return "";
}

/// The step count of a group's parameters that the next device-scalar step
/// steps (those of the last such step, else any with a state).
template <class ParamState, class Parent>
int64_t adam_group_step_count(const Parent& self, size_t g, const TensorVector& stepped) {
  std::vector<const void*> in_group;
  for (const auto& p : self.param_groups()[g].params()) {
    in_group.push_back(p.unsafeGetTensorImpl());
  }
  auto count_of = [&](const at::Tensor& p) -> std::optional<int64_t> {
    auto it = self.state().find(compat::optimizer_state_key(p));
    if (it == self.state().end()) return std::nullopt;
    return static_cast<const ParamState&>(*it->second).step();
  };
  for (const auto& p : stepped) {
    if (std::find(in_group.begin(), in_group.end(), p.unsafeGetTensorImpl()) == in_group.end()) {
      continue;
    }
    if (auto count = count_of(p)) return *count;
  }
  for (const auto& p : self.param_groups()[g].params()) {
    if (auto count = count_of(p)) return *count;
  }
  return 0;
}

/// The per-step numbers of Adam or AdamW for the next step, three per
/// group: -lr / bias_correction1, sqrt(bias_correction2), 1 - lr * weight_decay.
template <class Options, class ParamState, class Parent>
std::vector<double> adam_step_scalars(const Parent& self, const TensorVector& stepped) {
  std::vector<double> values;
  for (size_t g = 0; g < self.param_groups().size(); ++g) {
    const auto& options = static_cast<const Options&>(self.param_groups()[g].options());
    const int64_t step = adam_group_step_count<ParamState>(self, g, stepped) + 1;
    const double bias_correction1 = 1 - std::pow(std::get<0>(options.betas()), step);
    const double bias_correction2 = 1 - std::pow(std::get<1>(options.betas()), step);
    values.push_back(-(options.lr() / bias_correction1));
    values.push_back(std::sqrt(bias_correction2));
    values.push_back(1 - options.lr() * options.weight_decay());
  }
  return values;
}

template <class ParamState, class StateMap>
void advance_step_counts(StateMap& state, const TensorVector& stepped) {
  for (const auto& p : stepped) {
    if (auto* s = find_state<ParamState>(state, p)) s->step(s->step() + 1);
  }
}

/// Which of a group's parameters are trainable, as one number (a graph
/// steps those that had gradients at its capture).
double trainable_mask(const torch::optim::OptimizerParamGroup& group) {
  double mask = 0;
  double weight = 1;
  for (const auto& p : group.params()) {
    if (p.requires_grad()) mask += weight;
    weight = weight * 2 > 1e15 ? 1 : weight * 2;
  }
  return mask;
}

template <class Options, class Parent>
std::vector<double> adam_baked_options(const Parent& self) {
  std::vector<double> baked;
  for (const auto& group : self.param_groups()) {
    const auto& options = static_cast<const Options&>(group.options());
    baked.insert(baked.end(), {std::get<0>(options.betas()), std::get<1>(options.betas()),
                               options.eps(), options.weight_decay(), options.amsgrad() ? 1.0 : 0.0,
                               static_cast<double>(group.params().size()), trainable_mask(group)});
  }
  return baked;
}

}  // namespace

void DeviceScalarSteps::set_device_scalars(std::optional<c10::Device> device) {
  // Host scalars for a while (an eager step between replays) keep the
  // tensors: a captured graph still reads them at their addresses.
  if (device && scalars_.defined() && scalars_.device() != *device) {
    scalars_ = at::Tensor();
    views_.clear();
  }
  device_ = device;
}

const std::vector<at::Tensor>& DeviceScalarSteps::write_scalars(const std::vector<double>& values) {
  TORCH_CHECK(device_.has_value(), "DeviceScalarSteps::write_scalars outside device-scalar mode");
  const auto n = static_cast<int64_t>(values.size());
  if (!scalars_.defined() || scalars_.numel() != n) {
    scalars_ = at::zeros({n}, at::TensorOptions().dtype(at::kDouble).device(*device_));
    views_.clear();
    for (int64_t i = 0; i < n; ++i) views_.push_back(scalars_[i]);
  }
  // From page-locked memory where the device is a GPU: the copy is queued
  // on the current stream and the host never waits; the caching host
  // allocator keeps the buffer until the copy has run.
  at::Tensor host =
      at::empty({n}, at::TensorOptions().dtype(at::kDouble).pinned_memory(device_->is_cuda()));
  std::copy(values.begin(), values.end(), host.data_ptr<double>());
  scalars_.copy_(host, /*non_blocking=*/device_->is_cuda());
  return views_;
}

const std::vector<at::Tensor>* DeviceScalarSteps::device_scalars(size_t expected) const {
  if (!device_.has_value()) return nullptr;
  TORCH_CHECK(views_.size() == expected, "DeviceScalarSteps: ", views_.size(),
              " device scalars where the step needs ", expected,
              " (prepare_step() was not called since the parameter groups changed)");
  return &views_;
}

std::string SGD::why_not_device_scalars() const {
  // Nothing to refuse up front: a parameter without a momentum buffer may
  // be one that never gets a gradient (frozen); one that gets a gradient in
  // a device-scalar step without having a buffer is refused by step().
  return "";
}

void SGD::prepare_step() {
  settle();
  std::vector<double> values;
  for (const auto& group : param_groups_) values.push_back(-1 * group.options().get_lr());
  write_scalars(values);
}

std::vector<double> SGD::baked_options() const {
  std::vector<double> baked;
  for (const auto& group : param_groups_) {
    const auto& options = static_cast<const torch::optim::SGDOptions&>(group.options());
    baked.insert(baked.end(), {options.momentum(), options.dampening(), options.weight_decay(),
                               options.nesterov() ? 1.0 : 0.0,
                               static_cast<double>(group.params().size()), trainable_mask(group)});
  }
  return baked;
}

at::Tensor Adam::step(LossClosure closure) {
  settle();
  return adam_family_step<false, torch::optim::AdamOptions, torch::optim::AdamParamState,
                          torch::optim::Adam>(
      *this, "Adam", closure, device_scalars(3 * param_groups_.size()), &device_stepped_);
}

std::string Adam::why_not_device_scalars() const {
  return adam_why_not_device_scalars<torch::optim::AdamParamState>(*this, "Adam");
}

void Adam::prepare_step() {
  settle();
  write_scalars(adam_step_scalars<torch::optim::AdamOptions, torch::optim::AdamParamState>(
      *this, device_stepped_));
}

void Adam::finish_step() {
  advance_step_counts<torch::optim::AdamParamState>(state_, device_stepped_);
}

std::vector<double> Adam::baked_options() const {
  return adam_baked_options<torch::optim::AdamOptions>(*this);
}

at::Tensor AdamW::step(LossClosure closure) {
  settle();
  return adam_family_step<true, torch::optim::AdamWOptions, torch::optim::AdamWParamState,
                          torch::optim::AdamW>(
      *this, "AdamW", closure, device_scalars(3 * param_groups_.size()), &device_stepped_);
}

std::string AdamW::why_not_device_scalars() const {
  return adam_why_not_device_scalars<torch::optim::AdamWParamState>(*this, "AdamW");
}

void AdamW::prepare_step() {
  settle();
  write_scalars(adam_step_scalars<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      *this, device_stepped_));
}

void AdamW::finish_step() {
  advance_step_counts<torch::optim::AdamWParamState>(state_, device_stepped_);
}

std::vector<double> AdamW::baked_options() const {
  return adam_baked_options<torch::optim::AdamWOptions>(*this);
}

}  // namespace fulgur::optim

// ---- Device-skipped steps.

namespace fulgur::detail {

/// The last device-skipped step's found_inf on its way to the host, and
/// what the host's state learns from it.
struct SkipVerdict {
  AsyncHostCopy found_inf;
  // Empty: nothing pending.
  std::function<void(optim::DeviceSkippedSteps::ParamStates&, bool skipped)> apply;
};

}  // namespace fulgur::detail

namespace fulgur::optim {

bool DeviceSkippedSteps::available() { return compat::has_fused_optimizer_steps(); }

void DeviceSkippedSteps::settle() {
  if (!verdict_ || !verdict_->apply) return;
  auto apply = std::move(verdict_->apply);
  verdict_->apply = nullptr;
  // From the host's copy (no operator: nothing that could wait on a
  // device); skipped as the kernels decide it.
  apply(param_states(), *verdict_->found_inf.read().data_ptr<float>() == 1.0f);
}

bool DeviceSkippedSteps::hand_on(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf,
                                 Verdict apply) {
  if (!apply) return read_then_step(optimizer, found_inf);
  if (!verdict_) verdict_ = std::make_shared<detail::SkipVerdict>();
  // Off CUDA the copy keeps the tensor itself: a copy of its own, which
  // the caller may change.
  verdict_->found_inf.start(found_inf.is_cuda() ? found_inf : found_inf.clone());
  verdict_->apply = std::move(apply);
  return true;
}

namespace {

using Verdict = DeviceSkippedSteps::Verdict;

/// A fresh state tensor laid out as its parameter (the kernels need the
/// same strides).
at::Tensor zeros_beside(const at::Tensor& param) {
  return torch::zeros_like(param, at::MemoryFormat::Preserve);
}

/// Adam's or AdamW's step as fused kernels deciding on `found_inf`; empty,
/// having changed nothing, where they cannot take it. Else what the
/// verdict changes: a skipped step's new states are removed, a step taken
/// advances the step counts of the parameters it stepped.
template <bool kDecoupled, class Options, class ParamState, class Parent>
Verdict adam_fused_step(Parent& self, const at::Tensor& found_inf) {
  auto groups = parameters_with_grad(self.param_groups());
  if (!fusable(groups, found_inf)) return nullptr;
  auto& state = self.state();
  for (size_t g = 0; g < groups.size(); ++g) {
    const bool amsgrad = static_cast<const Options&>(self.param_groups()[g].options()).amsgrad();
    for (const auto& p : groups[g].params) {
      const auto* s = find_state<ParamState>(state, p);
      if (s != nullptr && (!beside(s->exp_avg(), p) || !beside(s->exp_avg_sq(), p) ||
                           (amsgrad && !beside(s->max_exp_avg_sq(), p)))) {
        return nullptr;  // step() refuses a missing max_exp_avg_sq by name
      }
    }
  }
  at::NoGradGuard no_grad;
  std::vector<StateRef> made, stepped;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& options = static_cast<const Options&>(self.param_groups()[g].options());
    const auto& [params, grads] = groups[g];
    // One kernel per dtype (a kernel takes one) and step count (their bias
    // corrections differ).
    std::map<std::pair<at::ScalarType, int64_t>, AdamBatch> batches;
    for (size_t i = 0; i < params.size(); ++i) {
      const auto key = compat::optimizer_state_key(params[i]);
      auto* s = find_state<ParamState>(state, params[i]);
      if (s == nullptr) {
        auto fresh = std::make_unique<ParamState>();
        fresh->step(0);
        fresh->exp_avg(zeros_beside(params[i]));
        fresh->exp_avg_sq(zeros_beside(params[i]));
        if (options.amsgrad()) fresh->max_exp_avg_sq(zeros_beside(params[i]));
        s = fresh.get();
        made.push_back({key, s});
        state[key] = std::move(fresh);
      }
      stepped.push_back({key, s});
      AdamBatch& b = batches[{params[i].scalar_type(), s->step()}];
      b.params.push_back(params[i].data());
      b.grads.push_back(grads[i]);
      b.exp_avgs.push_back(s->exp_avg());
      b.exp_avg_sqs.push_back(s->exp_avg_sq());
      if (options.amsgrad()) b.max_exp_avg_sqs.push_back(s->max_exp_avg_sq());
    }
    for (auto& [dtype_and_count, b] : batches) {
      // The kernels read the advanced count from a float32 tensor per
      // parameter (a skipped step reads nothing).
      const TensorVector steps = at::full({static_cast<int64_t>(b.params.size())},
                                          static_cast<double>(dtype_and_count.second + 1),
                                          at::TensorOptions(at::kFloat).device(found_inf.device()))
                                     .unbind(0);
      compat::fused_adam_(kDecoupled, b.params, b.grads, b.exp_avgs, b.exp_avg_sqs,
                          b.max_exp_avg_sqs, steps, options.lr(), std::get<0>(options.betas()),
                          std::get<1>(options.betas()), options.weight_decay(), options.eps(),
                          options.amsgrad(), found_inf);
    }
  }
  return [made = std::move(made), stepped = std::move(stepped)](
             DeviceSkippedSteps::ParamStates& state, bool skipped) {
    if (skipped) {
      erase_states(state, made);
      return;
    }
    for (const auto& ref : stepped) {
      auto it = state.find(ref.key);
      if (it == state.end() || it->second.get() != ref.state) continue;
      auto& s = static_cast<ParamState&>(*it->second);
      s.step(s.step() + 1);
    }
  };
}

/// The parameters of one SGD group that one kernel steps: one dtype, and
/// either all with a momentum buffer or all on their first step.
struct SgdBatch {
  TensorVector params, grads, buffers;
};

}  // namespace

bool SGD::step_unless(const at::Tensor& found_inf) {
  settle();
  auto groups = parameters_with_grad(param_groups_);
  bool fused = !uses_device_scalars() && fusable(groups, found_inf);
  for (size_t g = 0; fused && g < groups.size(); ++g) {
    const auto& options = static_cast<const torch::optim::SGDOptions&>(param_groups_[g].options());
    if (options.momentum() == 0) continue;
    for (const auto& p : groups[g].params) {
      const auto* s = find_state<torch::optim::SGDParamState>(state_, p);
      if (s != nullptr && !beside(s->momentum_buffer(), p)) fused = false;
    }
  }
  if (!fused) return hand_on(*this, found_inf, nullptr);
  at::NoGradGuard no_grad;
  std::vector<StateRef> made;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& [params, grads] = groups[g];
    const auto& options = static_cast<const torch::optim::SGDOptions&>(param_groups_[g].options());
    const bool momentum = options.momentum() != 0;
    // Per dtype, and whether it is the parameter's first step (which makes
    // its buffer the gradient; LibTorch: a clone of it).
    std::map<std::pair<at::ScalarType, bool>, SgdBatch> batches;
    for (size_t i = 0; i < params.size(); ++i) {
      auto* s = momentum ? find_state<torch::optim::SGDParamState>(state_, params[i]) : nullptr;
      const bool first = momentum && s == nullptr;
      SgdBatch& b = batches[{params[i].scalar_type(), first}];
      b.params.push_back(params[i].data());
      b.grads.push_back(grads[i]);
      if (!momentum) continue;
      if (first) {
        auto fresh = std::make_unique<torch::optim::SGDParamState>();
        fresh->momentum_buffer(zeros_beside(params[i]));
        s = fresh.get();
        const auto key = compat::optimizer_state_key(params[i]);
        made.push_back({key, s});
        state_[key] = std::move(fresh);
      }
      b.buffers.push_back(s->momentum_buffer());
    }
    for (auto& [dtype_and_first, b] : batches) {
      compat::fused_sgd_(b.params, b.grads, b.buffers, options.weight_decay(), options.momentum(),
                         options.lr(), options.dampening(), options.nesterov(),
                         /*is_first_step=*/dtype_and_first.second, found_inf);
    }
  }
  return hand_on(*this, found_inf, [made = std::move(made)](ParamStates& state, bool skipped) {
    if (skipped) erase_states(state, made);
  });
}

void SGD::save(torch::serialize::OutputArchive& archive) const {
  // What the host has not learnt yet belongs in what this writes.
  const_cast<SGD*>(this)->settle();
  torch::optim::SGD::save(archive);
}

void SGD::load(torch::serialize::InputArchive& archive) {
  settle();
  torch::optim::SGD::load(archive);
}

bool Adam::step_unless(const at::Tensor& found_inf) {
  settle();
  return hand_on(
      *this, found_inf,
      uses_device_scalars()
          ? nullptr
          : adam_fused_step<false, torch::optim::AdamOptions, torch::optim::AdamParamState>(
                *this, found_inf));
}

void Adam::save(torch::serialize::OutputArchive& archive) const {
  const_cast<Adam*>(this)->settle();  // as SGD::save
  torch::optim::Adam::save(archive);
}

void Adam::load(torch::serialize::InputArchive& archive) {
  settle();
  torch::optim::Adam::load(archive);
}

bool AdamW::step_unless(const at::Tensor& found_inf) {
  settle();
  return hand_on(
      *this, found_inf,
      uses_device_scalars()
          ? nullptr
          : adam_fused_step<true, torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
                *this, found_inf));
}

void AdamW::save(torch::serialize::OutputArchive& archive) const {
  const_cast<AdamW*>(this)->settle();  // as SGD::save
  torch::optim::AdamW::save(archive);
}

void AdamW::load(torch::serialize::InputArchive& archive) {
  settle();
  torch::optim::AdamW::load(archive);
}

}  // namespace fulgur::optim
