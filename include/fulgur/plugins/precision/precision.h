// File: fulgur/plugins/precision/precision.h
//
// A Precision plugin owns everything dtype-related: converting the module,
// the autocast scope around forward, loss scaling in backward, skipping
// optimizer steps on inf/NaN gradients, and its own state in checkpoints.
// The base class is full float32 precision ("32-true"); mixed and half
// precisions override the hooks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include <memory>
#include <string_view>

#include "fulgur/core/registry.h"
#include "fulgur/core/state_dict.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace fulgur {

class Accelerator;

/// An RAII scope (autocast, ...) active while a step runs; empty for 32-true.
class PrecisionScope {
 public:
  virtual ~PrecisionScope() = default;
};

class Precision {
 public:
  virtual ~Precision() = default;
  /// The registered name ("32-true").
  virtual std::string_view name() const { return "32-true"; }
  /// Throws ConfigError when this precision cannot run on `accelerator`.
  virtual void check_accelerator(const Accelerator& /*accelerator*/) const {}
  /// Converts the module's parameters and buffers (dtype), once at setup.
  virtual void convert_module(torch::nn::Module& /*module*/) {}
  /// Converts an input batch tensor (e.g. to float64 for 64-true).
  virtual at::Tensor convert_input(const at::Tensor& tensor) const { return tensor; }
  /// The scope around forward/steps on `device_type` (autocast). Null when
  /// there is none.
  virtual std::unique_ptr<PrecisionScope> forward_scope(c10::DeviceType /*device_type*/) const {
    return nullptr;
  }
  /// Runs backward on `loss` (scaled, for 16-mixed).
  virtual void backward(const at::Tensor& loss);
  /// Makes gradients true-scale before clipping (unscale, for 16-mixed);
  /// once per optimizer step, however often it is called.
  virtual void unscale_gradients(torch::optim::Optimizer& /*optimizer*/) {}
  /// Whether unscale_gradients made `optimizer`'s gradients true-scale in
  /// the step under way (until update()).
  virtual bool gradients_unscaled(const torch::optim::Optimizer& /*optimizer*/) const {
    return false;
  }
  /// Forgets what a step that never finished unscaled (a fit starting).
  virtual void forget_unscaled() {}
  /// Steps `optimizer`; returns false if the host skipped the step (inf/NaN;
  /// a step the device may skip returns true: see GradScaler::step).
  virtual bool optimizer_step(torch::optim::Optimizer& optimizer);
  /// Called once after all optimizers stepped in an iteration (scaler update).
  virtual void update() {}
  /// Its state in a checkpoint, under "precision" (16-mixed: the loss
  /// scaler's). Default: nothing.
  virtual StateDict state_dict() const { return {}; }
  /// Restores what state_dict() returned, when the checkpoint holds a
  /// "precision" section.
  virtual void load_state_dict(const StateDict& /*state*/) {}
};

using PrecisionRegistry = Registry<Precision>;
/// The global precision registry, with the built-ins registered: 32-true,
/// 64-true, bf16-mixed, 16-mixed, bf16-true, 16-true.
PrecisionRegistry& precision_registry();

}  // namespace fulgur
