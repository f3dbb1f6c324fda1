// Private: a copy of a module's weights, for the callbacks that keep one
// (EMA's and StochasticWeightAveraging's averages, the training weights
// while an average is swapped in). During a fit the copy is held as the
// strategy holds the parameters for its optimizers
// (Strategy::local_parameters): under fsdp this rank's shard of each
// parameter, so it costs 1/N of the model per rank and an element-wise
// update reads no peer and gathers nothing; elsewhere whole tensors. Whole
// values come in from checkpoints and go out to them, and the copy is whole
// again at the end of fit. Under fsdp, assign_to() and whole() (while the
// copy is in parts) are collectives: every rank calls them at the same
// point (the callbacks' hooks and a checkpoint's save run on every rank at
// the same step). Not installed.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/strategies/fsdp.h"
#include "fulgur/strategies/strategy.h"
#include "strategies/strategy_driver.h"

namespace fulgur::detail {

/// Whether the strategy shards the parameters (FSDPStrategy, under any
/// name it was registered with).
inline bool shards_parameters(const Strategy& strategy) {
  return dynamic_cast<const FSDPStrategy*>(&strategy) != nullptr;
}

class ParameterCopy {
 public:
  bool empty() const { return values_.empty(); }
  size_t size() const { return values_.size(); }
  /// The values, in the module's parameters() order: this rank's parts of
  /// them while in_parts(), whole otherwise.
  const std::vector<at::Tensor>& values() const { return values_; }
  bool in_parts() const { return split_; }

  /// Whole values (a checkpoint's), replacing any.
  void set_whole(std::vector<at::Tensor> values) {
    values_ = std::move(values);
    split_ = false;
    strategy_ = nullptr;
    module_ = nullptr;
    parameters_.clear();
  }
  void clear() { set_whole({}); }

  /// A fit starts (on_fit_start): the strategy's parts of the parameters
  /// are new objects in each fit.
  void begin_fit() { parameters_.clear(); }

  /// A copy of the module's parameters as they are now.
  void copy_parameters(Strategy& strategy, Module& module) {
    clear();
    adopt(strategy, module, StrategyDriver(strategy).local_parameters(module), "");
    torch::NoGradGuard no_grad;
    for (const auto& p : parameters_) values_.push_back(p.detach().clone());
  }

  /// The values in this fit's parts, once per fit (cheap after the first
  /// call: the per-step path). Whole values are taken apart; parts left by
  /// an earlier stage in this process (a fit that ended on an error before
  /// they were made whole) are kept when they fit this fit's parts.
  /// ConfigError beginning with `who` when the values are of another
  /// model.
  void make_parts(Strategy& strategy, Module& module, const std::string& who) {
    if (parameters_.empty()) {
      adopt(strategy, module, StrategyDriver(strategy).local_parameters(module), who);
    }
  }
  /// The same, also noticing a stage that began without begin_fit (a
  /// validate() after a fit): for the calls that are not made every step.
  void make_parts_checked(Strategy& strategy, Module& module, const std::string& who) {
    std::vector<at::Tensor> parts = StrategyDriver(strategy).local_parameters(module);
    bool same = parts.size() == parameters_.size();
    for (size_t i = 0; same && i < parts.size(); ++i) {
      same = parts[i].unsafeGetTensorImpl() == parameters_[i].unsafeGetTensorImpl();
    }
    if (!same) adopt(strategy, module, std::move(parts), who);
  }

  /// Calls `update(value_i, part_i)` for each value and this rank's part of
  /// parameter i (no gradients recorded). make_parts first.
  void update(const std::function<void(at::Tensor&, const at::Tensor&)>& update) {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < values_.size() && i < parameters_.size(); ++i) {
      update(values_[i], parameters_[i].detach());
    }
  }

  /// The module's parameters take these values (a collective under fsdp).
  void assign_to(Strategy& strategy, Module& module, const std::string& who) {
    make_parts_checked(strategy, module, who);
    StrategyDriver(strategy).assign_local_parameters(module, values_);
  }

  /// The values whole (gathered under fsdp while in parts: a collective).
  std::vector<at::Tensor> whole() const {
    if (!split_) return values_;
    return StrategyDriver(*strategy_).whole_from_local(*module_, values_);
  }
  /// Whole again (at the end of fit).
  void make_whole() { set_whole(whole()); }

 private:
  /// Takes `parts` (local_parameters) as this stage's, bringing the values
  /// into them.
  void adopt(Strategy& strategy, Module& module, std::vector<at::Tensor> parts,
             const std::string& who) {
    const std::vector<at::Tensor> parameters = module.parameters();
    bool split = false;
    for (size_t i = 0; i < parts.size() && i < parameters.size(); ++i) {
      split = split || parts[i].unsafeGetTensorImpl() != parameters[i].unsafeGetTensorImpl();
    }
    if (!values_.empty()) {
      try {
        if (split_) {
          StrategyDriver::check_parameter_values(
              module, values_, [&](size_t i) { return parts[i].sizes().vec(); });
        } else {
          values_ = StrategyDriver(strategy).local_from_whole(module, values_);
        }
      } catch (const ConfigError& e) {
        const std::string what =
            split_ ? str("the copy of the weights an earlier fit in this process left in parts "
                         "(it ended on an error) does not fit this stage's under strategy \"",
                         strategy.name(), "\"")
                   : std::string("the copy of the weights it holds (a checkpoint's, or an "
                                 "earlier fit's) does not fit this module");
        throw ConfigError(str(who, ": ", what, ": ", e.what(),
                              ". Resume from a checkpoint of this model, or start with a new "
                              "callback."));
      }
    }
    strategy_ = &strategy;
    module_ = &module;
    parameters_ = std::move(parts);
    split_ = split;
  }

  std::vector<at::Tensor> values_;
  // Whether the values are this rank's parts (under fsdp), and whose.
  bool split_ = false;
  Strategy* strategy_ = nullptr;
  Module* module_ = nullptr;
  // This stage's parts of the parameters (empty after begin_fit, until the
  // fit's first use).
  std::vector<at::Tensor> parameters_;
};

}  // namespace fulgur::detail
