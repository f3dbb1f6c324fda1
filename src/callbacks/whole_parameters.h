// Private: the module's parameters whole, for the callbacks that keep a
// copy of the weights (EMA, StochasticWeightAveraging) under any strategy.
// Under fsdp the optimizer steps each rank's shard, and FULL_SHARD frees a
// unit's parameters between their uses: reading gathers them
// (Strategy::with_full_parameters), and writing goes through the module's
// state (load_module_state), from which every rank takes its shards again.
// Elsewhere both are the parameters themselves. Under fsdp each call is a
// collective: every rank makes it at the same point (the callbacks' hooks
// run on every rank at the same step). The cost there, under FULL_SHARD:
// reading gathers every unit at once; writing gathers them unit by unit for
// the state, then all at once to load it (they stay whole until their next
// forward), so the peak is the whole model on every rank, as when a
// checkpoint is loaded. Not installed.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/core/state_dict.h"
#include "fulgur/strategies/fsdp.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"
#include "strategies/strategy_driver.h"

namespace fulgur::detail {

/// Whether the strategy shards the parameters (FSDPStrategy, under any
/// name it was registered with).
inline bool shards_parameters(const Strategy& strategy) {
  return dynamic_cast<const FSDPStrategy*>(&strategy) != nullptr;
}

/// Runs `body` with every parameter of `module` whole.
inline void with_whole_parameters(Strategy& strategy, Module& module,
                                  const std::function<void()>& body) {
  StrategyDriver(strategy).with_full_parameters(module, body);
}

/// Sets each parameter of `module` (in parameters() order) to values[i].
inline void assign_parameters(Strategy& strategy, Module& module,
                              const std::vector<at::Tensor>& values) {
  torch::NoGradGuard no_grad;
  if (!shards_parameters(strategy)) {
    const auto parameters = module.parameters();
    for (size_t i = 0; i < parameters.size() && i < values.size(); ++i) {
      parameters[i].copy_(values[i]);
    }
    return;
  }
  StrategyDriver driver(strategy);
  StateDict state = driver.module_state(module);
  size_t i = 0;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (i == values.size()) break;
    // "a.b.weight": the entry "weight" of section "a", then "b".
    StateDict* section = &state;
    std::string_view name = item.key();
    for (size_t dot = name.find('.'); dot != std::string_view::npos; dot = name.find('.')) {
      section = section->find_section(std::string(name.substr(0, dot)));
      if (section == nullptr) {
        throw InternalError(
            str("assign_parameters: the module's state has no section for \"", item.key(), "\""));
      }
      name.remove_prefix(dot + 1);
    }
    const at::Tensor current = section->tensor(std::string(name));
    section->set(std::string(name), values[i].to(current.device(), current.scalar_type()));
    ++i;
  }
  driver.load_module_state(module, state);
}

}  // namespace fulgur::detail
