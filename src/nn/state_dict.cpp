#include "fulgur/nn/state_dict.h"

#include <torch/nn/module.h>

#include <set>
#include <utility>
#include <vector>

#include "fulgur/core/errors.h"

namespace fulgur {
namespace {

void collect_module_state(const torch::nn::Module& module, StateDict& out) {
  for (const auto& p : module.named_parameters(/*recurse=*/false)) out.set(p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/false)) out.set_buffer(b.key(), b.value());
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;  // as nn::Module::save
    collect_module_state(*child.value(), out.section(child.key()));
  }
}

// The precision flag whose weights have `dtype`.
std::string saved_by(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return "precision \"64-true\" keeps Double weights";
    case at::kHalf: return "precision \"16-true\" keeps Half weights";
    case at::kBFloat16: return "precision \"bf16-true\" keeps BFloat16 weights";
    default: return "the precisions other than 64-true, 16-true and bf16-true keep Float weights";
  }
}

// Each target tensor with the saved tensor to copy into it, all checked
// before the first copy.
using Copies = std::vector<std::pair<at::Tensor, at::Tensor>>;

void match_module_state(torch::nn::Module& module, const StateDict& state,
                        const std::string& prefix, Copies& copies) {
  std::set<std::string> expected;
  auto match = [&](const std::string& name, const at::Tensor& target, bool is_buffer) {
    expected.insert(name);
    const char* kind = is_buffer ? "buffer \"" : "parameter \"";
    const c10::IValue* saved = state.find(name);
    if (saved == nullptr || !saved->isTensor()) {
      throw CheckpointError(str(kind, prefix, name, "\" is missing from the checkpoint"));
    }
    const at::Tensor& value = saved->toTensor();
    if (value.sizes() != target.sizes() || value.scalar_type() != target.scalar_type()) {
      // The same shape in another floating dtype: the precision changed.
      const bool precision = value.sizes() == target.sizes() &&
                             at::isFloatingType(value.scalar_type()) &&
                             at::isFloatingType(target.scalar_type());
      throw CheckpointError(::fulgur::str(
          kind, prefix, name, "\" is ", c10::toString(target.scalar_type()), target.sizes(),
          " in the module but ", c10::toString(value.scalar_type()), value.sizes(),
          " in the checkpoint",
          precision ? str(": the same shape in another dtype, so it was ", kPrecisionChanged,
                          " (", saved_by(value.scalar_type()), ")")
                    : std::string()));
    }
    copies.emplace_back(target, value);
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false)) match(p.key(), p.value(), false);
  for (const auto& b : module.named_buffers(/*recurse=*/false)) match(b.key(), b.value(), true);
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;
    expected.insert(child.key());
    const StateDict* nested = state.find_section(child.key());
    if (nested == nullptr) {
      throw CheckpointError(
          str("submodule \"", prefix, child.key(), "\" is missing from the checkpoint"));
    }
    match_module_state(*child.value(), *nested, prefix + child.key() + ".", copies);
  }
  for (const auto& key : state.keys()) {
    if (expected.count(key) == 0) {
      throw CheckpointError(
          str("the checkpoint has \"", prefix, key, "\", which the module does not"));
    }
  }
}

}  // namespace

StateDict module_state_dict(const torch::nn::Module& module) {
  StateDict out;
  collect_module_state(module, out);
  return out;
}

void load_module_state_dict(torch::nn::Module& module, const StateDict& state) {
  Copies copies;
  match_module_state(module, state, "", copies);
  torch::NoGradGuard no_grad;
  for (auto& [target, value] : copies) target.copy_(value);
}

}  // namespace fulgur
