// Private: training steps captured into a CUDA graph and replayed (Trainer
// option cuda_graph). Not installed.
//
// The fit loop hands each step's device work (training_step, backward,
// clipping, the optimizer steps) to run() as a function of the batch:
//   1. the first kWarmupSteps steps run it eagerly, on a side stream (lazy
//      initialisations, cuBLAS workspaces and the allocator's blocks happen
//      there, as PyTorch's capture recipe has it), and so does an epoch's
//      last batch before the capture (it may be a partial one);
//   2. the next step records it into an at::cuda::CUDAGraph on that stream,
//      with the batch in static input tensors, the gradients set to none (so
//      backward writes them afresh), the optimizers in device-scalar mode
//      (fulgur::optim::DeviceScalarSteps) and the module's log() calls
//      recorded, then replays it once;
//   3. every later step copies its batch into the static inputs, writes the
//      optimizers' per-step numbers (learning rate, bias corrections) into
//      their device tensors, replays the graph, and logs the recorded
//      tensors (the graph's outputs) again.
// No step of the three reads a value back to the host. A batch whose shapes
// or dtypes differ from the captured ones (a last partial batch) runs
// eagerly, with a note once; a change of an option that the graph uses as a
// constant (momentum, betas, ...) re-captures it, with a note.
//
// Only CUDA builds of LibTorch can capture; elsewhere check() refuses. On
// LibTorch 1.13 the capture is global (2.x: this thread's only), so loader
// worker threads that allocate page-locked memory during it fail it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fulgur/core/module.h"
#include "fulgur/data/batch.h"

namespace fulgur {
class Strategy;
}

namespace fulgur::detail {

class LogSink;

class CudaGraphStep {
 public:
  /// Eager steps before the capture.
  static constexpr int kWarmupSteps = 3;

  CudaGraphStep();
  ~CudaGraphStep();
  CudaGraphStep(const CudaGraphStep&) = delete;
  CudaGraphStep& operator=(const CudaGraphStep&) = delete;

  /// Whether this LibTorch can capture CUDA graphs (a CUDA build).
  static bool supported();

  /// Refuses, with a ConfigError naming the setting and what to do instead,
  /// what a captured step cannot do: manual optimization, gradient
  /// accumulation, a loss scaler (16-mixed), a strategy other than
  /// single_device, optimizers without device-scalar steps (torch::optim's),
  /// a device other than a GPU, a LibTorch without CUDA.
  static void check(Strategy& strategy, const Module& module,
                    const OptimizerConfig& optimizers, int64_t accumulate_grad_batches);

  /// Nothing captured; the next steps warm up again.
  void reset();
  /// Frees the graph and puts `optimizers` (when given) back on host
  /// scalars: the end of a fit, whatever way it ended.
  void release(const OptimizerConfig* optimizers);

  using Body = std::function<at::Tensor(Batch&)>;
  /// One training step (see the file comment); returns its loss (after a
  /// replay, the graph's static output: its value is this step's until the
  /// next step).
  at::Tensor run(Batch& batch, bool last_batch, const Body& body, Module& module, LogSink& sink,
                 const OptimizerConfig& optimizers, bool global_zero);

  /// Steps run so far by replaying a graph, eagerly, and captures made.
  int64_t replayed_steps() const { return replayed_; }
  int64_t eager_steps() const { return eager_; }
  int64_t captures() const { return captures_; }

 private:
  struct State;  // CUDA objects, in the .cpp
  std::unique_ptr<State> state_;
  int64_t replayed_ = 0;
  int64_t eager_ = 0;
  int64_t captures_ = 0;
};

}  // namespace fulgur::detail
