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
  bool in_parts() const { return strategy_ != nullptr; }

  /// Whole values (a checkpoint's), replacing any.
  void set_whole(std::vector<at::Tensor> values) {
    values_ = std::move(values);
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
    attach(strategy, module);
    torch::NoGradGuard no_grad;
    values_.clear();
    for (const auto& p : parameters_) values_.push_back(p.detach().clone());
  }

  /// The values in this fit's parts (nothing when empty). Whole ones are
  /// taken apart; parts left by an earlier fit in this process (which
  /// ended on an error, before they were made whole) are kept when they
  /// fit this fit's parts. ConfigError beginning with `who` when the
  /// values are of another model.
  void make_parts(Strategy& strategy, Module& module, const std::string& who) {
    if (values_.empty()) {
      attach(strategy, module);
      return;
    }
    if (in_parts() && !parameters_.empty()) return;  // already this fit's
    const bool earlier_fit = in_parts();
    std::vector<at::Tensor> parts = StrategyDriver(strategy).local_parameters(module);
    try {
      if (earlier_fit) {
        StrategyDriver::check_parameter_values(
            module, values_, [&](size_t i) { return parts[i].sizes().vec(); });
      } else {
        values_ = StrategyDriver(strategy).local_from_whole(module, values_);
      }
    } catch (const ConfigError& e) {
      const std::string what =
          earlier_fit ? str("the copy of the weights an earlier fit in this process left in "
                            "parts (it ended on an error) does not fit this fit's under strategy \"",
                            strategy.name(), "\"")
                      : std::string("the copy of the weights it holds (a checkpoint's, or an "
                                    "earlier fit's) does not fit this module");
      throw ConfigError(str(who, ": ", what, ": ", e.what(),
                            ". Resume from a checkpoint of this model, or start with a new "
                            "callback."));
    }
    strategy_ = &strategy;
    module_ = &module;
    parameters_ = std::move(parts);
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
    make_parts(strategy, module, who);
    StrategyDriver(strategy).assign_local_parameters(module, values_);
  }

  /// The values whole (gathered under fsdp while in parts: a collective).
  std::vector<at::Tensor> whole() const {
    if (!in_parts()) return values_;
    return StrategyDriver(*strategy_).whole_from_local(*module_, values_);
  }
  /// Whole again (at the end of fit).
  void make_whole() { set_whole(whole()); }

 private:
  void attach(Strategy& strategy, Module& module) {
    strategy_ = &strategy;
    module_ = &module;
    parameters_ = StrategyDriver(strategy).local_parameters(module);
  }

  std::vector<at::Tensor> values_;
  // While the values are parts: whose, and this fit's parts of the
  // parameters (empty after begin_fit, until the fit's first use).
  Strategy* strategy_ = nullptr;
  Module* module_ = nullptr;
  std::vector<at::Tensor> parameters_;
};

}  // namespace fulgur::detail
