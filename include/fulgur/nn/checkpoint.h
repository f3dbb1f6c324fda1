// File: fulgur/nn/checkpoint.h
//
// Activation checkpointing, which PyTorch has in Python (torch.utils.checkpoint)
// and LibTorch's C++ API lacks: a block's forward keeps none of its
// activations for backward; backward runs that forward again and
// differentiates the second run. Compute traded for memory, the standard way a
// large model fits (with the fsdp strategy, or alone).
//
//   // A wrapped block: the same parameters and results, its activations freed.
//   fulgur::nn::Checkpoint block(torch::nn::Sequential(
//       torch::nn::Linear(4096, 4096), torch::nn::GELU(), torch::nn::Linear(4096, 4096)));
//   at::Tensor y = block->forward(x);
//
//   // Or any function of tensors, given the parameters it uses:
//   auto out = fulgur::nn::checkpoint(
//       [&](const std::vector<at::Tensor>& in) { return std::vector{mlp->forward(in[0])}; },
//       {x}, mlp->parameters());
//
// Gradients are those of the block run without checkpointing: bitwise on the
// CPU, dropout included (the random generators of the CPU and of the inputs'
// GPUs are set back for the second run), and under autocast (its state at the
// first run is the state of the second). A Checkpoint's buffers (BatchNorm's
// running statistics) are updated once, by the first run. Without gradients
// (validation, test, predict, torch::NoGradGuard) the block simply runs once.
// The function must compute the same thing twice: no side effects beyond its
// outputs and the buffers of a Checkpoint.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <vector>

namespace fulgur::nn {

struct CheckpointOptions {
  /// The second run draws the same random numbers as the first (dropout).
  /// Off: faster, and right only for a block that draws none.
  bool preserve_rng_state = true;
};

/// Which run of a checkpointed block this thread is in: the first (autograd
/// off, nothing kept), the second (in backward, run again for the
/// gradients), or neither. For modules that act around their forward: a
/// fulgur::nn::FSDPUnit inside a block keeps its parameters gathered from
/// the second run to its gradients, instead of gathering them twice.
enum class CheckpointRun { kNone, kFirst, kSecond };
CheckpointRun current_checkpoint_run();
/// Whether a block's second run is under way on this thread, at any depth:
/// in it, and in the first run of a block nested in it. What runs then has
/// its backward later in the same backward pass.
bool in_checkpoint_recomputation();

/// A function of tensors to checkpoint: its outputs must be floating-point
/// tensors (the ones gradients flow back through).
using CheckpointedFunction =
    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

/// `fn(inputs)`, keeping only `inputs` for backward. `parameters`: every
/// tensor `fn` uses that needs a gradient besides its inputs (a module's
/// parameters()); their gradients come from the second run.
std::vector<at::Tensor> checkpoint(CheckpointedFunction fn, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& parameters,
                                   CheckpointOptions options = {});

/// A module whose forward is checkpointed: `module` (a torch::nn::Sequential,
/// any module holder or std::shared_ptr to a module whose forward takes and
/// returns one tensor, or an AnyModule) is registered as its child "module",
/// so its parameters keep their names under that prefix.
class CheckpointImpl : public torch::nn::Module {
 public:
  using Forward = std::function<at::Tensor(const at::Tensor&)>;
  CheckpointImpl(std::shared_ptr<torch::nn::Module> module, Forward forward,
                 CheckpointOptions options = {});
  explicit CheckpointImpl(torch::nn::AnyModule module, CheckpointOptions options = {});
  template <typename Impl>
  explicit CheckpointImpl(torch::nn::ModuleHolder<Impl> module, CheckpointOptions options = {})
      : CheckpointImpl(module.ptr(), forward_of(module.ptr()), options) {}
  template <typename Impl>
  explicit CheckpointImpl(std::shared_ptr<Impl> module, CheckpointOptions options = {})
      : CheckpointImpl(module, forward_of(module), options) {}

  at::Tensor forward(const at::Tensor& x);
  /// The wrapped module.
  std::shared_ptr<torch::nn::Module> module() const { return module_; }

 private:
  template <typename Impl>
  static Forward forward_of(std::shared_ptr<Impl> module) {
    return [module](const at::Tensor& x) -> at::Tensor { return module->forward(x); };
  }
  std::shared_ptr<torch::nn::Module> module_;
  Forward forward_;
  CheckpointOptions options_;
};
TORCH_MODULE(Checkpoint);

}  // namespace fulgur::nn
