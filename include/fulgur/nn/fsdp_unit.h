// File: fulgur/nn/fsdp_unit.h
//
// A unit of sharding for strategy = "fsdp" (FULL_SHARD): the parameters of
// the module it holds are sharded across the ranks between their uses,
// gathered just before the unit's forward, freed after it, gathered again
// just before its backward, and freed once its gradients are
// reduce-scattered, so a rank holds one unit's full parameters at a time
// (plus those outside every unit).
//
// LibTorch's C++ modules have no forward hooks, and a module's typed
// members (`torch::nn::Linear fc1;`) cannot be swapped behind the user's
// back, so units are declared, around any module whose forward they call:
//
//   fulgur::nn::FSDPUnit<torch::nn::Linear> fc1{nullptr};
//   ...
//   fc1 = register_module("fc1", fulgur::nn::FSDPUnit(torch::nn::Linear(784, 4096)));
//   ...
//   x = fc1->forward(x);         // the Linear's forward, with the gathers around it
//   fc1->module->weight;         // the Linear itself
//
// A unit adds no level to the names: the Linear's parameters stay
// "fc1.weight" and "fc1.bias", so checkpoints move between a model with
// units and one without. Outside "fsdp" (one process, ddp, evaluation
// after fit) a unit is the module it holds, at no cost.
//
// With activation checkpointing (fulgur/nn/checkpoint.h), either way round:
// a unit around a Checkpoint gathers around the block as around any layer;
// units inside a checkpointed block are gathered once for the block's second
// run and their backward, and stay whole until their gradients are reduced
// (so one unit per block holds one unit's parameters at a time).
//
// The unit's forward may return a tensor, a vector or a tuple of tensors:
// their backward is where the parameters are gathered again. For any other
// result, the parameters stay gathered from the forward to the backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <ostream>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fulgur::nn {

/// What the sharding strategy attaches to a unit at setup (users do not).
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  /// Before the unit's forward: its parameters are gathered.
  virtual void before_forward() = 0;
  /// After it, with the tensors it returned (empty: a result with none
  /// the unit can see).
  virtual void after_forward(const std::vector<at::Tensor>& outputs) = 0;
};

/// The part of every FSDPUnit<M> that does not depend on M.
class FSDPUnitBase : public torch::nn::Module {
 public:
  void set_unit_hooks(std::shared_ptr<UnitHooks> hooks) { hooks_ = std::move(hooks); }
  bool has_unit_hooks() const { return hooks_ != nullptr; }
  /// The module the unit holds.
  const std::shared_ptr<torch::nn::Module>& held_module() const { return contained_; }
  /// The held module's own training flag follows too (its children are
  /// the unit's children).
  void train(bool on = true) override;
  void pretty_print(std::ostream& stream) const override;

 protected:
  explicit FSDPUnitBase(std::shared_ptr<torch::nn::Module> contained);

  template <typename Result>
  static void collect(const Result& result, std::vector<at::Tensor>& tensors) {
    if constexpr (std::is_same_v<Result, at::Tensor>) {
      tensors.push_back(result);
    } else if constexpr (std::is_same_v<Result, std::vector<at::Tensor>>) {
      tensors.insert(tensors.end(), result.begin(), result.end());
    } else if constexpr (is_tuple<Result>::value) {
      std::apply([&](const auto&... item) { (collect(item, tensors), ...); }, result);
    }
  }

  std::shared_ptr<UnitHooks> hooks_;

 private:
  template <typename T>
  struct is_tuple : std::false_type {};
  template <typename... T>
  struct is_tuple<std::tuple<T...>> : std::true_type {};

  std::shared_ptr<torch::nn::Module> contained_;
};

template <typename Contained>
class FSDPUnitImpl : public FSDPUnitBase {
 public:
  explicit FSDPUnitImpl(Contained contained)
      : FSDPUnitBase(contained.is_empty() ? nullptr : contained.ptr()),
        module(std::move(contained)) {}

  /// The held module's forward, with the parameters gathered around it
  /// under "fsdp".
  template <typename... Args>
  auto forward(Args&&... args) {
    if (!hooks_) return module->forward(std::forward<Args>(args)...);
    hooks_->before_forward();
    auto result = module->forward(std::forward<Args>(args)...);
    std::vector<at::Tensor> tensors;
    collect(result, tensors);
    hooks_->after_forward(tensors);
    return result;
  }

  Contained module;
};

/// The holder, as TORCH_MODULE makes for a layer: `FSDPUnit(torch::nn::Linear(4, 8))`
/// deduces FSDPUnit<torch::nn::Linear>.
template <typename Contained>
class FSDPUnit : public torch::nn::ModuleHolder<FSDPUnitImpl<Contained>> {
 public:
  using torch::nn::ModuleHolder<FSDPUnitImpl<Contained>>::ModuleHolder;
  explicit FSDPUnit(Contained contained)
      : torch::nn::ModuleHolder<FSDPUnitImpl<Contained>>(
            std::make_shared<FSDPUnitImpl<Contained>>(std::move(contained))) {}
  /// unit(x) is unit->forward(x) (ModuleHolder's own operator() cannot see
  /// a forward that is a template).
  template <typename... Args>
  auto operator()(Args&&... args) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
};

template <typename Contained>
FSDPUnit(Contained) -> FSDPUnit<Contained>;

}  // namespace fulgur::nn
