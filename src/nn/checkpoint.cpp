#include "fulgur/nn/checkpoint.h"

#include <ATen/core/Generator.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <utility>

#include "fulgur/core/errors.h"
#include "fulgur/utilities/torch_compat.h"

namespace fulgur::nn {

namespace {

// The random generators a block draws from: the CPU's, and those of the GPUs
// its inputs are on.
struct RngStates {
  std::vector<std::pair<at::Generator, at::Tensor>> states;

  static RngStates of(const std::vector<at::Tensor>& inputs) {
    RngStates r;
    r.add(at::detail::getDefaultCPUGenerator());
    std::vector<c10::Device> devices;
    for (const auto& t : inputs) {
      if (!t.defined() || t.device().is_cpu()) continue;
      if (std::find(devices.begin(), devices.end(), t.device()) != devices.end()) continue;
      devices.push_back(t.device());
      r.add(at::globalContext().defaultGenerator(t.device()));
    }
    return r;
  }
  void add(at::Generator generator) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    at::Tensor state = generator.get_state();
    states.emplace_back(std::move(generator), std::move(state));
  }
  void restore() {
    for (auto& [generator, state] : states) {
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(state);
    }
  }
};

// Autocast as the first run saw it (it is thread-local, and backward may run
// on another thread).
struct AutocastState {
  struct One {
    c10::DeviceType type;
    bool enabled;
    c10::ScalarType dtype;
  };
  std::vector<One> devices;

  static AutocastState now() {
    AutocastState s;
    for (auto type : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
      s.devices.push_back({type, compat::autocast_enabled(type), compat::autocast_dtype(type)});
    }
    return s;
  }
  void apply() const {
    for (const auto& d : devices) {
      compat::set_autocast_enabled(d.type, d.enabled);
      compat::set_autocast_dtype(d.type, d.dtype);
    }
  }
};

// Runs its function when it goes out of scope (restores state on every path).
struct OnExit {
  std::function<void()> fn;
  ~OnExit() {
    if (fn) fn();
  }
};

// Autocast keeps the low-precision copies of the weights it casts in a cache;
// a copy made by the first run (without gradients) would be reused by the
// second and cut the weights off their gradients. Neither run uses it.
struct NoAutocastCache {
  bool was = at::autocast::is_autocast_cache_enabled();
  NoAutocastCache() { at::autocast::set_autocast_cache_enabled(false); }
  ~NoAutocastCache() { at::autocast::set_autocast_cache_enabled(was); }
  NoAutocastCache(const NoAutocastCache&) = delete;
  NoAutocastCache& operator=(const NoAutocastCache&) = delete;
};

thread_local CheckpointRun current_run = CheckpointRun::kNone;
thread_local int second_runs_under_way = 0;

// The run a block's function is in, for its duration (backward runs the
// second on the thread executing the checkpoint's node).
struct RunScope {
  CheckpointRun was = current_run;
  bool second;
  explicit RunScope(CheckpointRun run) : second(run == CheckpointRun::kSecond) {
    current_run = run;
    if (second) ++second_runs_under_way;
  }
  ~RunScope() {
    current_run = was;
    if (second) --second_runs_under_way;
  }
  RunScope(const RunScope&) = delete;
  RunScope& operator=(const RunScope&) = delete;
};

// Carries the function and what its second run needs to backward
// (saved_data holds only IValues).
struct CheckpointHolder : torch::CustomClassHolder {
  CheckpointedFunction fn;
  CheckpointOptions options;
  size_t num_inputs = 0;
  std::vector<at::Tensor> parameters;
  std::optional<RngStates> rng;
  AutocastState autocast;
  /// Around the second run (a Checkpoint keeps its buffers as they were).
  std::function<std::function<void()>()> before_second_run;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<CheckpointHolder> holder,
                                                at::TensorList inputs) {
    const std::vector<at::Tensor> own(inputs.begin(),
                                      inputs.begin() + static_cast<long>(holder->num_inputs));
    if (holder->options.preserve_rng_state) holder->rng = RngStates::of(own);
    holder->autocast = AutocastState::now();
    // Autograd is off here: nothing of the block is kept.
    std::vector<at::Tensor> outputs;
    {
      const RunScope first(CheckpointRun::kFirst);
      NoAutocastCache no_cache;
      outputs = holder->fn(own);
    }
    for (size_t k = 0; k < outputs.size(); ++k) {
      if (!outputs[k].defined() || !outputs[k].is_floating_point()) {
        throw ConfigError(str("fulgur::nn::checkpoint: output ", k, " of the checkpointed function ",
                              outputs[k].defined() ? "is not a floating-point tensor (" +
                                                         std::string(c10::toString(
                                                             outputs[k].scalar_type())) +
                                                         ")"
                                                   : "is undefined",
                              ". Return only the tensors gradients flow back through, and compute "
                              "the others outside the checkpointed block."));
      }
    }
    ctx->save_for_backward(own);
    ctx->saved_data["holder"] = c10::IValue::make_capsule(holder);
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto holder = c10::static_intrusive_pointer_cast<CheckpointHolder>(
        ctx->saved_data["holder"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    for (const auto& t : saved) {
      inputs.push_back(t.defined() ? t.detach().requires_grad_(t.requires_grad()) : t);
    }
    // The second run, with the first run's random numbers and autocast.
    // Buffers it changes are set back once its gradients are taken (autograd
    // checks that what it saved, running statistics included, is unchanged).
    OnExit restore_buffers;
    if (holder->before_second_run) restore_buffers.fn = holder->before_second_run();
    std::vector<at::Tensor> outputs;
    {
      std::optional<RngStates> current;
      if (holder->rng) current = RngStates::of(inputs);
      OnExit restore_rng{[&] {
        if (current) current->restore();
      }};
      if (holder->rng) holder->rng->restore();
      const AutocastState autocast_now = AutocastState::now();
      OnExit restore_autocast{[&] { autocast_now.apply(); }};
      holder->autocast.apply();
      NoAutocastCache no_cache;
      torch::AutoGradMode enable_grad(true);
      const RunScope second(CheckpointRun::kSecond);
      outputs = holder->fn(inputs);
    }
    // Differentiate the second run: the gradients of the inputs and
    // parameters are this node's, so that autograd accumulates them (and
    // the hooks on them run) as for any other node.
    std::vector<at::Tensor> roots, root_grads;
    for (size_t k = 0; k < outputs.size() && k < grad_outputs.size(); ++k) {
      if (outputs[k].requires_grad() && grad_outputs[k].defined()) {
        roots.push_back(outputs[k]);
        root_grads.push_back(grad_outputs[k]);
      }
    }
    std::vector<at::Tensor> wrt;
    std::vector<size_t> slot;  // where each gradient goes in the result
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].defined() && inputs[i].requires_grad()) {
        wrt.push_back(inputs[i]);
        slot.push_back(1 + i);
      }
    }
    for (size_t p = 0; p < holder->parameters.size(); ++p) {
      if (holder->parameters[p].requires_grad()) {
        wrt.push_back(holder->parameters[p]);
        slot.push_back(1 + inputs.size() + p);
      }
    }
    // One gradient per argument of forward: the holder, then each tensor.
    torch::autograd::variable_list result(1 + inputs.size() + holder->parameters.size());
    if (roots.empty() || wrt.empty()) return result;
    auto grads = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t k = 0; k < grads.size(); ++k) result[slot[k]] = grads[k];
    return result;
  }
};

std::vector<at::Tensor> run_checkpointed(
    CheckpointedFunction fn, const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& parameters, CheckpointOptions options,
    std::function<std::function<void()>()> before_second_run) {
  if (!fn) throw ConfigError("fulgur::nn::checkpoint: the function to checkpoint is empty.");
  bool needs_grad = false;
  for (const auto& t : inputs) needs_grad = needs_grad || (t.defined() && t.requires_grad());
  for (const auto& p : parameters) needs_grad = needs_grad || p.requires_grad();
  // Without gradients there is nothing to keep: one plain run.
  if (!at::GradMode::is_enabled() || !needs_grad) return fn(inputs);
  auto holder = c10::make_intrusive<CheckpointHolder>();
  holder->fn = std::move(fn);
  holder->options = options;
  holder->num_inputs = inputs.size();
  holder->parameters = parameters;
  holder->before_second_run = std::move(before_second_run);
  // The parameters are arguments too, so that this node has edges to them
  // (their gradients flow even when no input needs one). A TensorList: what
  // autograd::Function counts as tensors (a std::vector would be one
  // non-tensor argument).
  torch::autograd::variable_list all(inputs.begin(), inputs.end());
  all.insert(all.end(), parameters.begin(), parameters.end());
  return CheckpointFunction::apply(holder, at::TensorList(all));
}

}  // namespace

CheckpointRun current_checkpoint_run() { return current_run; }

bool in_checkpoint_recomputation() { return second_runs_under_way > 0; }

std::vector<at::Tensor> checkpoint(CheckpointedFunction fn, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& parameters,
                                   CheckpointOptions options) {
  return run_checkpointed(std::move(fn), inputs, parameters, options, nullptr);
}

CheckpointImpl::CheckpointImpl(std::shared_ptr<torch::nn::Module> module, Forward forward,
                               CheckpointOptions options)
    : module_(std::move(module)), forward_(std::move(forward)), options_(options) {
  if (!module_ || !forward_) {
    throw ConfigError("fulgur::nn::Checkpoint: the module to checkpoint is empty.");
  }
  register_module("module", module_);
}

CheckpointImpl::CheckpointImpl(torch::nn::AnyModule module, CheckpointOptions options)
    : CheckpointImpl(module.is_empty() ? nullptr : module.ptr(),
                     [module](const at::Tensor& x) mutable { return module.forward(x); }, options) {
}

at::Tensor CheckpointImpl::forward(const at::Tensor& x) {
  auto inner = module_;
  // Buffers the first run updated (running statistics) are set back after
  // the second, which would update them again.
  auto keep_buffers = [inner]() -> std::function<void()> {
    std::vector<at::Tensor> buffers = inner->buffers();
    std::vector<at::Tensor> before;
    torch::NoGradGuard no_grad;
    for (const auto& b : buffers) before.push_back(b.clone());
    return [buffers, before] {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(before[i]);
    };
  };
  auto outputs = run_checkpointed(
      [f = forward_](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{f(in[0])}; },
      {x}, inner->parameters(), options_, keep_buffers);
  return outputs[0];
}

}  // namespace fulgur::nn
