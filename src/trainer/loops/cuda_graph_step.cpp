#include "trainer/loops/cuda_graph_step.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <optional>
#include <string_view>
#include <utility>

#include "fulgur/core/errors.h"
#include "fulgur/metrics/metric.h"
#include "fulgur/optim/lr_scheduler.h"
#include "fulgur/optim/optimizers.h"
#include "fulgur/plugins/precision/precision.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/utilities/torch_compat.h"
#include "trainer/connectors/logger_connector.h"
#include "trainer/trainer_impl.h"

#ifdef FULGUR_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fulgur::detail {

namespace graph_step {

/// The precisions whose steps a graph can hold: no loss scaler deciding on
/// the host whether to step.
bool precision_is_capturable(std::string_view name) {
  return name == "32-true" || name == "64-true" || name == "bf16-mixed" || name == "bf16-true" ||
         name == "16-true";
}

std::string optimizer_type_name(const torch::optim::Optimizer& optimizer) {
  return c10::demangle(typeid(optimizer).name());
}

}  // namespace graph_step

void CudaGraphStep::check(Strategy& strategy,
                          const Module& module, const OptimizerConfig& optimizers,
                          int64_t accumulate_grad_batches) {
  if (!module.automatic_optimization()) {
    throw ConfigError(
        "cuda_graph=true with manual optimization: a captured step is the loop's own "
        "forward, backward and optimizer step. Pass cuda_graph=false, or let the Trainer "
        "optimize (automatic_optimization).");
  }
  if (accumulate_grad_batches != 1) {
    throw ConfigError(str("cuda_graph=true with accumulate_grad_batches=", accumulate_grad_batches,
                          ": a captured step steps the optimizers every batch. Pass "
                          "accumulate_grad_batches=1 (a larger batch does the same work in "
                          "fewer launches), or cuda_graph=false."));
  }
  const std::string precision(strategy.precision().name());
  if (!graph_step::precision_is_capturable(precision)) {
    throw ConfigError(str("cuda_graph=true with precision=\"", precision,
                          "\": a captured step holds only precisions without a loss scaler "
                          "(32-true, 64-true, bf16-mixed, bf16-true, 16-true); a scaler (16-mixed) "
                          "reads on the host, every step, whether the gradients are finite. Use "
                          "precision=\"bf16-mixed\" (no scaler needed) or cuda_graph=false."));
  }
  if (strategy.traits().max_processes != 1) {  // single_device, or a subclass of it
    throw ConfigError(str("cuda_graph=true with strategy=\"", strategy.name(),
                          "\": captured steps run on one device (strategy \"single_device\", "
                          "which \"auto\" picks for devices=1) for now; collectives are not "
                          "captured. Pass strategy=\"single_device\" with devices=1, or "
                          "cuda_graph=false."));
  }
  for (size_t i = 0; i < optimizers.optimizers.size(); ++i) {
    const auto& opt = optimizers.optimizers[i];
    if (dynamic_cast<const optim::DeviceScalarSteps*>(opt.get()) == nullptr) {
      throw ConfigError(str(
          "cuda_graph=true: optimizer ", i, " is a ", graph_step::optimizer_type_name(*opt),
          ", whose step passes the learning rate (and Adam's bias corrections) to its kernels as "
          "numbers, which a captured step would keep at their first values. Use "
          "fulgur::optim::SGD, Adam or AdamW (the same options and state; "
          "fulgur/optim/optimizers.h), which take them from device tensors."));
    }
  }
  for (size_t i = 0; i < optimizers.schedulers.size(); ++i) {
    const auto* cycle = dynamic_cast<const OneCycleLR*>(optimizers.schedulers[i].scheduler.get());
    if (cycle != nullptr && cycle->options().cycle_momentum) {
      throw ConfigError(str("cuda_graph=true: scheduler ", i,
                            " is a OneCycleLR with cycle_momentum=true, which changes the "
                            "momentum every step; a captured step keeps it as a constant, so "
                            "every step would be captured again. Pass cycle_momentum=false "
                            "(the rate still cycles), or cuda_graph=false."));
    }
  }
  if (!supported()) {
    throw ConfigError(
        "cuda_graph=true: this LibTorch has no CUDA (a CPU build), so there are no CUDA graphs "
        "to capture. Build fulgur against a CUDA LibTorch, or pass cuda_graph=false.");
  }
  if (!strategy.root_device().is_cuda()) {
    throw ConfigError(str("cuda_graph=true on device ", strategy.root_device().str(),
                          ": CUDA graphs capture GPU work. Pass accelerator=\"cuda\", or "
                          "cuda_graph=false."));
  }
}

#ifndef FULGUR_WITH_CUDA

struct CudaGraphStep::State {};

bool CudaGraphStep::supported() { return false; }

at::Tensor CudaGraphStep::run(Batch&, bool, const Body&, Module&, LogSink&,
                              const OptimizerConfig&, bool) {
  throw ConfigError("cuda_graph=true: this LibTorch has no CUDA graphs (a CPU build).");
}

void CudaGraphStep::release(const OptimizerConfig*) { state_.reset(); }

#else  // FULGUR_WITH_CUDA

namespace graph_step {

/// What log() was called with while the step was captured: logged again,
/// from the graph's outputs, after every replay.
struct Logged {
  std::string name;
  at::Tensor value;
  LogOptions options;
};

/// The module's log sink during the capture: it keeps the calls. A number
/// (not a tensor) logged there would be the captured step's forever.
class RecordingSink final : public ModuleLogSink {
 public:
  void log(std::string_view name, double, const LogOptions&) override {
    throw ConfigError(str(
        "cuda_graph=true: training_step logged \"", name,
        "\" as a number while its step was being captured. Host code in training_step runs "
        "only then, so the number would never change. Log a tensor (it is read from the "
        "graph's output after every replay), or log the number from a hook that runs every "
        "batch (on_train_batch_end)."));
  }
  void log(std::string_view name, const at::Tensor& value, const LogOptions& options) override {
    logged.push_back(Logged{std::string(name), value, options});
  }
  void log(std::string_view name, metrics::Metric&, const LogOptions&) override {
    refuse_metric(name);
  }
  void log_dict(metrics::MetricCollection&, const LogOptions&) override {
    refuse_metric("of a MetricCollection");
  }
  [[noreturn]] static void refuse_metric(std::string_view name) {
    throw ConfigError(str(
        "cuda_graph=true: training_step logged the metric \"", name,
        "\" while its step was being captured. Host code in training_step runs only then, so "
        "its update() would count one batch. Update and log the metric from a hook that runs "
        "every batch (on_train_batch_end), or in validation_step."));
  }
  std::vector<Logged> logged;
};

/// Shapes, dtypes and devices of a batch's tensors: what a graph's static
/// inputs must match.
std::string signature(const Batch& batch) {
  std::string text;
  batch.for_each([&](const at::Tensor& t) {
    text += c10::str(t.scalar_type(), t.sizes(), "@", t.device(), " ");
  });
  return text;
}

/// While a step is captured: the module logs into `recorder`, autocast
/// keeps no weight cache (a cached cast would be made once, at capture),
/// and a metric's update() is refused (it would count one batch).
class CaptureScope {
 public:
  CaptureScope(Module& module, ModuleLogSink* recorder, ModuleLogSink* sink)
      : module_(module), sink_(sink), cache_was_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
    Trainer::Impl::set_log_sink(module_, recorder);
    metrics::Metric::set_capturing(true);
  }
  ~CaptureScope() {
    metrics::Metric::set_capturing(false);
    Trainer::Impl::set_log_sink(module_, sink_);
    at::autocast::set_autocast_cache_enabled(cache_was_);
  }
  CaptureScope(const CaptureScope&) = delete;
  CaptureScope& operator=(const CaptureScope&) = delete;

 private:
  Module& module_;
  ModuleLogSink* sink_;
  bool cache_was_;
};

/// Ends a capture that failed midway (if it began), keeping nothing.
void end_failed_capture(at::cuda::CUDAGraph& graph) {
  try {
    graph.capture_end();
  } catch (const std::exception&) {
    // Invalidated by the failure, or never begun.
  }
}

std::vector<optim::DeviceScalarSteps*> device_scalar_steps(const OptimizerConfig& optimizers) {
  std::vector<optim::DeviceScalarSteps*> out;
  for (const auto& opt : optimizers.optimizers) {
    auto* steps = dynamic_cast<optim::DeviceScalarSteps*>(opt.get());
    FULGUR_ASSERT(steps != nullptr, "cuda_graph: an optimizer without device-scalar steps");
    out.push_back(steps);
  }
  return out;
}

void clear_grads(const OptimizerConfig& optimizers) {
  for (const auto& opt : optimizers.optimizers) {
    for (auto& group : opt->param_groups()) {
      for (auto& p : group.params()) p.mutable_grad() = at::Tensor();
    }
  }
}

}  // namespace graph_step

struct CudaGraphStep::State {
  std::optional<c10::cuda::CUDAStream> side;
  int warmed_up = 0;
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  Batch inputs;  // the static inputs
  std::string inputs_signature;
  at::Tensor loss;  // the static output
  std::vector<graph_step::Logged> logged;
  std::vector<std::vector<double>> baked;  // per optimizer
  std::vector<std::pair<at::Tensor, at::Tensor>> grads;  // parameter, static gradient
  bool noted_eager = false;
};

bool CudaGraphStep::supported() { return true; }

void CudaGraphStep::release(const OptimizerConfig* optimizers) {
  if (optimizers != nullptr) {
    for (const auto& opt : optimizers->optimizers) {
      if (auto* steps = dynamic_cast<optim::DeviceScalarSteps*>(opt.get())) {
        steps->set_device_scalars(std::nullopt);
      }
    }
  }
  if (state_ && state_->graph) {
    // The graph's kernels may still run; its memory goes with it. After a
    // CUDA error (the fit's own, reported by it) the wait fails too.
    try {
      c10::cuda::getCurrentCUDAStream().synchronize();
    } catch (const std::exception&) {
    }
  }
  state_.reset();
}

at::Tensor CudaGraphStep::run(Batch& batch, bool last_batch, const Body& body, Module& module,
                              LogSink& sink, const OptimizerConfig& optimizers, bool global_zero) {
  if (!state_) state_ = std::make_unique<State>();
  State& s = *state_;
  auto steps = graph_step::device_scalar_steps(optimizers);
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream();
  if (!s.side) s.side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, current.device_index());

  auto host_scalars = [&] {
    for (auto* st : steps) st->set_device_scalars(std::nullopt);
  };
  auto on_side_stream = [&](const std::function<void()>& work) {
    c10::cuda::CUDAStream side = *s.side;
    c10::Event ready(c10::kCUDA);
    ready.record(current);
    ready.block(side);
    {
      c10::cuda::CUDAStreamGuard guard(side);
      work();
    }
    c10::Event done(c10::kCUDA);
    done.record(side);
    done.block(current);
  };

  // A change of an option a graph holds as a constant: warm up and capture
  // again (parameters made trainable, BaseFinetuning's, get their
  // optimizer state in an eager step, which a capture cannot allocate).
  if (s.graph) {
    for (size_t i = 0; i < steps.size(); ++i) {
      if (i < s.baked.size() && steps[i]->baked_options() == s.baked[i]) continue;
      if (global_zero) {
        print_note(str("cuda_graph: optimizer ", i,
                       "'s constant options (momentum, betas, eps, weight decay, its parameter "
                       "groups or which parameters are trainable) changed; warming up and "
                       "capturing the step again."));
      }
      current.synchronize();
      s.graph.reset();
      s.warmed_up = 0;
      break;
    }
  }

  // 1. Warm-up: eager steps on the side stream. An epoch's last batch is
  // not captured (it may be a partial one, whose shapes the graph would
  // then keep): it warms up once more.
  if (!s.graph && (s.warmed_up < kWarmupSteps || last_batch)) {
    ++s.warmed_up;
    ++eager_;
    host_scalars();
    at::Tensor loss;
    on_side_stream([&] {
      graph_step::clear_grads(optimizers);
      loss = body(batch);
    });
    // The batch's memory was read on the side stream; the loss, made
    // there, is read on this one (the hooks after the step).
    batch.for_each([&](const at::Tensor& t) {
      if (t.is_cuda() && t.has_storage()) {
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *s.side);
      }
    });
    if (loss.defined() && loss.is_cuda() && loss.has_storage()) {
      c10::cuda::CUDACachingAllocator::recordStream(loss.storage().data_ptr(), current);
    }
    return loss;
  }

  const std::string sig = graph_step::signature(batch);
  if (s.graph && sig != s.inputs_signature) {
    // 3'. A batch the graph cannot take (shapes differ): eagerly.
    if (!s.noted_eager && global_zero) {
      s.noted_eager = true;
      print_note(str("cuda_graph: a batch of ", sig, "differs from the captured step's ",
                     s.inputs_signature,
                     "and runs eagerly (so does every such batch; a last partial batch is one: "
                     "drop_last=true avoids it)."));
    }
    ++eager_;
    host_scalars();
    graph_step::clear_grads(optimizers);
    at::Tensor loss = body(batch);
    for (auto& [param, grad] : s.grads) param.mutable_grad() = grad;
    for (auto* st : steps) st->set_device_scalars(current.device());
    return loss;
  }

  if (!s.graph) {
    // 2. Capture.
    for (size_t i = 0; i < steps.size(); ++i) {
      const std::string why = steps[i]->why_not_device_scalars();
      if (!why.empty()) {
        throw ConfigError(str("cuda_graph=true: optimizer ", i, " cannot take a captured step: ",
                              why, "."));
      }
    }
    batch.for_each([&](const at::Tensor& t) {
      if (!t.is_cuda()) {
        const std::string where = t.device().str() + " (" + c10::str(t.sizes()) + ")";
        throw ConfigError(str("cuda_graph=true: the batch holds a tensor on ", where,
                              ", whose values a captured step would keep from the capture. Keep "
                              "every tensor of a batch on the GPU (the Trainer moves what the "
                              "loader gives), or pass cuda_graph=false."));
      }
    });
    s.inputs = batch.map_tensors([](const at::Tensor& t) { return t.clone(); });
    s.inputs_signature = sig;
    s.baked.clear();
    for (auto* st : steps) {
      st->set_device_scalars(current.device());
      st->prepare_step();  // allocates the scalars outside the graph
      s.baked.push_back(st->baked_options());
    }
    graph_step::clear_grads(optimizers);
    graph_step::RecordingSink recorder;
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    at::Tensor loss;
    on_side_stream([&] {
      // The module logs into the recorder and autocast keeps no cache
      // while the step is recorded; both are put back however it ends.
      graph_step::CaptureScope scope(module, &recorder, &sink);
      try {
#if FULGUR_CUDA_GRAPH_CAPTURE_MODE
        // Thread-local: the loader's workers may allocate page-locked
        // memory meanwhile, which a global capture would forbid.
        graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
#else
        graph->capture_begin();
#endif
        loss = body(s.inputs);
        graph->capture_end();
      } catch (const std::exception& e) {
        graph_step::end_failed_capture(*graph);
        for (auto* st : steps) st->set_device_scalars(std::nullopt);
        // The step's own errors (a refusal, out of memory, the user's) go
        // as they are; what only a capture forbids is explained.
        if (dynamic_cast<const ConfigError*>(&e) != nullptr ||
            std::string_view(e.what()).find("captur") == std::string_view::npos) {
          throw;
        }
        throw ConfigError(
            str("cuda_graph=true: the training step could not be captured into a CUDA graph: ",
                e.what(),
                "\nA captured step must not wait for the GPU or read a value back (.item(), "
                ".cpu(), printing a tensor, a shape that depends on the data, torch::nonzero), "
                "nor allocate page-locked memory. Move such code out of training_step and the "
                "step hooks (on_before_backward, on_after_backward, on_before_optimizer_step, "
                "configure_gradient_clipping), "
                "or pass cuda_graph=false."));
      }
    });
    s.loss = loss.detach();
    s.logged = std::move(recorder.logged);
    s.grads.clear();
    for (const auto& opt : optimizers.optimizers) {
      for (auto& group : opt->param_groups()) {
        for (auto& p : group.params()) {
          if (p.grad().defined()) s.grads.emplace_back(p, p.grad());
        }
      }
    }
    s.graph = std::move(graph);
    ++captures_;
    if (global_zero && captures_ == 1) {
      print_note(str("cuda_graph: the training step is captured after ", kWarmupSteps,
                     " warm-up steps and replayed from now on. Host code in training_step, "
                     "on_before_backward, on_after_backward, on_before_optimizer_step and "
                     "configure_gradient_clipping ran "
                     "for the capture and does not run again; their GPU work replays."));
    }
  } else {
    // 3. Replay: the batch into the static inputs, then the graph.
    std::vector<at::Tensor> from;
    batch.for_each([&](const at::Tensor& t) { from.push_back(t); });
    size_t i = 0;
    s.inputs.for_each([&](const at::Tensor& t) {
      t.copy_(from[i++], /*non_blocking=*/true);
    });
    for (auto* st : steps) st->prepare_step();
  }
  s.graph->replay();
  ++replayed_;
  for (auto* st : steps) st->finish_step();
  for (const auto& entry : s.logged) sink.log(entry.name, entry.value, entry.options);
  return s.loss;
}

#endif  // FULGUR_WITH_CUDA

CudaGraphStep::CudaGraphStep() = default;
CudaGraphStep::~CudaGraphStep() {
  try {
    release(nullptr);
  } catch (...) {
    // A destructor does not throw; the fit's own error, if any, is reported.
  }
}

void CudaGraphStep::reset() {
  release(nullptr);
  replayed_ = eager_ = captures_ = 0;
}

}  // namespace fulgur::detail
