// Private: what a Module asks of the Trainer running it beyond Trainer's
// public API: its optimizers and manual optimization. Trainer::Impl
// implements it; Module holds it only while attached. Not installed.
#pragma once

#include <ATen/core/Tensor.h>

#include "fulgur/core/module.h"

namespace fulgur::detail {

class TrainerLink {
 public:
  /// What configure_optimizers() returned for this run.
  virtual const OptimizerConfig& configured_optimizers() const = 0;
  /// Backward through the strategy (precision, gradient sync).
  virtual void manual_backward(Module& module, const at::Tensor& loss) = 0;
  /// Steps `optimizer` through the strategy and counts a global step.
  virtual void manual_optimizer_step(Module& module, torch::optim::Optimizer& optimizer) = 0;

 protected:
  ~TrainerLink() = default;
};

}  // namespace fulgur::detail
