// Private: what a Module asks of the Trainer running it beyond its own
// state: the run's progress, its optimizers, manual optimization and the
// strategy's process group. The Trainer implements it (Trainer::Impl); the
// core knows only this interface, so it depends on nothing above it. A
// Module holds it only while attached. Not installed.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string_view>

#include "fulgur/core/module.h"

namespace fulgur {

class ProcessGroup;

namespace detail {

class ModuleLogSink;

class TrainerLink {
 public:
  /// The Trainer running the module.
  virtual Trainer& trainer() const = 0;
  virtual int64_t current_epoch() const = 0;
  virtual int64_t global_step() const = 0;
  /// What configure_optimizers() returned for this run.
  virtual const OptimizerConfig& configured_optimizers() const = 0;
  /// Backward through the strategy (precision, gradient sync).
  virtual void manual_backward(Module& module, const at::Tensor& loss) = 0;
  /// Steps `optimizer` through the strategy and counts a global step.
  virtual void manual_optimizer_step(Module& module, torch::optim::Optimizer& optimizer) = 0;
  /// Unscales (once per step) and clips `optimizer`'s gradients through
  /// the strategy.
  virtual void clip_gradients(torch::optim::Optimizer& optimizer, double value,
                              GradientClipAlgorithm algorithm) = 0;
  /// The strategy's group of the ranks (Strategy::shared_process_group()):
  /// null when it runs one process without one.
  virtual std::shared_ptr<ProcessGroup> process_group() const = 0;
  /// The strategy's registered name, for messages.
  virtual std::string_view strategy_name() const = 0;

 protected:
  ~TrainerLink() = default;
  /// Attaches `module` to `link` (nullptr: detaches it, and its log sink).
  static void attach(Module& module, TrainerLink* link) {
    module.link_ = link;
    if (link == nullptr) module.log_sink_ = nullptr;
  }
  /// Where the module's log() goes (null: nowhere).
  static void set_log_sink(Module& module, ModuleLogSink* sink) { module.log_sink_ = sink; }
};

}  // namespace detail
}  // namespace fulgur
