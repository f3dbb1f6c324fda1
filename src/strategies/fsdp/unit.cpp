// The fsdp strategy's units: each declared fulgur::nn::FSDPUnit (and each
// auto-wrapped layer) attached to the shards of its parameters, gathered
// and released around its uses, its next one prefetched.
#include "strategies/fsdp/unit.h"

#include <torch/torch.h>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <map>
#include <set>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "strategies/fsdp/auto_wrap.h"

namespace fulgur {

namespace {

// Runs after autograd accumulated a unit parameter's gradient.
class UnitGradientHook : public torch::autograd::FunctionPostHook {
 public:
  explicit UnitGradientHook(std::function<void()> ready) : ready_(std::move(ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    ready_();
    return outputs;
  }

 private:
  std::function<void()> ready_;
};

}  // namespace

void FSDPStrategy::Unit::watch_gradients() {
  std::weak_ptr<Unit> self = weak_from_this();
  for (auto& [sharded, indices] : members) {
    for (size_t i : indices) {
      auto accumulator = torch::autograd::impl::grad_accumulator(sharded->parameters()[i]);
      FULGUR_ASSERT(accumulator != nullptr, "a unit parameter is not a leaf");
      hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<UnitGradientHook>([self] {
        if (auto unit = self.lock()) unit->gradient_ready();
      })));
      accumulators_.push_back(std::move(accumulator));
    }
  }
}

void FSDPStrategy::attach_units(Module& module) {
  detach_units();
  // Which shard holds each trainable parameter.
  std::map<const c10::TensorImpl*, std::pair<ShardedParameters*, size_t>> where;
  for (auto& entry : sharded_) {
    const auto& params = entry.second->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      where[params[i].unsafeGetTensorImpl()] = {entry.second.get(), i};
    }
  }
  std::set<const c10::TensorImpl*> taken;
  auto add_unit = [&](const std::shared_ptr<torch::nn::Module>& unit_module) {
    auto unit = std::make_shared<Unit>(*this, full_shard());
    std::map<ShardedParameters*, std::vector<size_t>> members;
    for (const auto& p : unit_module->parameters()) {
      auto it = where.find(p.unsafeGetTensorImpl());
      if (it == where.end() || !taken.insert(it->first).second) continue;
      members[it->second.first].push_back(it->second.second);
    }
    for (auto& [sharded, indices] : members)
      unit->members.emplace_back(sharded, std::move(indices));
    unit->watch_gradients();
    unit->attach_module(unit_module);
    units_.push_back(std::move(unit));
  };
  // Innermost units first: a parameter belongs to the innermost unit
  // around it. The auto-wrapped layers hold no other unit.
  if (options_.auto_wrap_min_params != 0) {
    auto_wrap_ =
        std::make_unique<detail::SequentialAutoWrap>(module, options_.auto_wrap_min_params);
    for (const auto& layer : auto_wrap_->layers()) add_unit(layer.unit);
    if (is_global_zero()) {
      detail::print_note(
          auto_wrap_->layers().empty()
              ? str("strategy \"", name(),
                    "\": auto_wrap_min_params = ", options_.auto_wrap_min_params,
                    " made no unit: no torch::nn::Sequential of the module holds a layer "
                    "(Linear, Conv, Embedding, a norm) with that many parameters. Lower it, "
                    "or declare units with fulgur::nn::FSDPUnit.")
              : str("strategy \"", name(), "\": auto_wrap_min_params = ",
                    options_.auto_wrap_min_params, " made units of ", auto_wrap_->describe(), "."));
    }
  }
  auto named = module.named_modules(/*name_prefix=*/"", /*include_self=*/false);
  for (size_t m = named.size(); m-- > 0;) {
    if (dynamic_cast<nn::FSDPUnitBase*>(named[m].value().get()) != nullptr) {
      add_unit(named[m].value());
    }
  }
  if (units_.empty() && full_shard() && is_global_zero() && options_.auto_wrap_min_params == 0) {
    detail::print_note(
        str("strategy \"", name(),
            "\": the module declares no fulgur::nn::FSDPUnit, so every parameter stays "
            "whole between its uses (only the gradients and the optimizer state are "
            "sharded, as under fsdp_shard_grad_op). Wrap the large layers: "
            "register_module(\"fc1\", fulgur::nn::FSDPUnit(torch::nn::Linear(...))), or "
            "set FSDPOptions::auto_wrap_min_params for the layers of a torch::nn::Sequential."));
  }
  // The units stay whole until their first forward (the module came whole:
  // releasing them now would save nothing, and hooks such as the model
  // summary at fit start see every parameter).
  peak_parameter_bytes_ = 0;
  unit_gathers_ = 0;
}

void FSDPStrategy::detach_units() {
  // The module may outlive the strategy: its units forget the hooks.
  for (auto& unit : units_) unit->detach_module();
  auto_wrap_.reset();  // the Sequentials' own entries back
  forward_order_.clear();
  last_forward_order_.clear();
  reducing_.clear();
  units_.clear();
}

void FSDPStrategy::gather_units() {
  for (auto& unit : units_) unit->gather();
}

void FSDPStrategy::release_units() {
  for (auto& unit : units_) unit->release();
}

void FSDPStrategy::unit_forward_started(Unit* unit) {
  auto at = std::find(forward_order_.begin(), forward_order_.end(), unit);
  const auto position = static_cast<size_t>(at - forward_order_.begin());
  if (at == forward_order_.end()) forward_order_.push_back(unit);
  // The unit after this one in the last step's forward, when this step has
  // followed it so far (every rank has: their forwards are the same).
  if (!options_.prefetch || position + 1 >= last_forward_order_.size() ||
      last_forward_order_[position] != unit) {
    return;
  }
  last_forward_order_[position + 1]->start_gather();
}

void FSDPStrategy::unit_backward_started(Unit* unit) {
  if (!options_.prefetch) return;
  // Backward meets the units in the reverse of this step's forward.
  auto at = std::find(forward_order_.begin(), forward_order_.end(), unit);
  if (at != forward_order_.end() && at != forward_order_.begin()) (*(at - 1))->start_gather();
}

void FSDPStrategy::finish_reductions() {
  auto reducing = std::move(reducing_);
  reducing_.clear();
  for (auto& exchange : reducing) exchange.wait();
}

}  // namespace fulgur
