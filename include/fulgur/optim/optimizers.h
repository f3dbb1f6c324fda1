// File: fulgur/optim/optimizers.h
//
// SGD, Adam and AdamW whose step updates every parameter of a parameter group
// with a few multi-tensor ATen operators (`at::_foreach_*`) instead of
// LibTorch's loop of several operators per parameter.
//
// Each is a drop-in for its torch::optim namesake and derives from it: the
// same options (torch::optim::SGDOptions, AdamOptions, AdamWOptions), the
// same parameter groups, the same per-parameter state (SGDParamState,
// AdamParamState, AdamWParamState, keyed as torch::optim keys it), and
// save/load inherited unchanged. A checkpoint written by one loads into the
// other, LibTorch's LR schedulers and fulgur's work on them, and code that
// dynamic_casts to torch::optim::Adam still finds one.
//
// Numerics: the same operations, in the same order, with the same scalars as
// torch::optim's step (LibTorch 1.13 to 2.x; their arithmetic did not change),
// so on the CPU, where a multi-tensor operator runs the per-tensor kernel on
// each tensor, every parameter and state tensor is bit-identical to
// torch::optim's. On CUDA the multi-tensor kernels compute the same
// expressions in registers (equal within float rounding).
//
//   fulgur::OptimizerConfig configure_optimizers() override {
//     return fulgur::OptimizerConfig(
//         std::make_shared<fulgur::optim::Adam>(parameters(), torch::optim::AdamOptions(1e-3)));
//   }
//
// What differs from torch::optim, on purpose:
//   - Adam and AdamW check every gradient for sparseness before they change
//     anything (torch::optim throws on the first sparse one it meets, after
//     stepping the parameters before it); the message is the same.
//   - SGD supports sparse gradients as torch::optim::SGD does, by running
//     torch::optim::SGD's own per-parameter step for a step in which any
//     gradient is sparse (the closure is still called once).
//   - A tensor listed twice in one parameter group is stepped twice in a row
//     by torch::optim (its state is shared), which one multi-tensor batch
//     cannot do: a step that finds such a group runs the parent's
//     per-parameter step instead (same result, LibTorch's speed).
#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace fulgur::optim {

/// torch::optim::SGD (momentum, dampening, nesterov, weight_decay) stepped
/// with multi-tensor operators; bit-identical to it on the CPU.
class SGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;

  /// One step of every parameter with a gradient; calls `closure` first
  /// (with gradients enabled) and returns its loss, as torch::optim does.
  at::Tensor step(LossClosure closure = nullptr) override;
};

/// torch::optim::Adam (betas, eps, weight_decay as L2, amsgrad) stepped with
/// multi-tensor operators; bit-identical to it on the CPU. Parameters whose
/// step counts differ (one had no gradient on some steps) are stepped in one
/// batch per step count. Throws c10::Error on a sparse gradient, as Adam does.
class Adam : public torch::optim::Adam {
 public:
  using torch::optim::Adam::Adam;

  /// One step of every parameter with a gradient; calls `closure` first
  /// (with gradients enabled) and returns its loss, as torch::optim does.
  at::Tensor step(LossClosure closure = nullptr) override;
};

/// torch::optim::AdamW (betas, eps, decoupled weight_decay, amsgrad) stepped
/// with multi-tensor operators; bit-identical to it on the CPU. As Adam for
/// step counts and sparse gradients.
class AdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;

  /// One step of every parameter with a gradient; calls `closure` first
  /// (with gradients enabled) and returns its loss, as torch::optim does.
  at::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace fulgur::optim
