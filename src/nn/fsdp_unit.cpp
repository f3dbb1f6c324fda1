#include "fulgur/nn/fsdp_unit.h"

#include "fulgur/core/errors.h"

namespace fulgur::nn {

FSDPUnitBase::FSDPUnitBase(std::shared_ptr<torch::nn::Module> contained)
    : torch::nn::Module(contained ? "fulgur::nn::FSDPUnit<" + contained->name() + ">"
                                  : std::string("fulgur::nn::FSDPUnit")),
      contained_(std::move(contained)) {
  if (!contained_) {
    throw ConfigError(
        "fulgur::nn::FSDPUnit: the module to hold is empty (a holder made with nullptr); "
        "pass the module itself, e.g. FSDPUnit(torch::nn::Linear(784, 128)).");
  }
  // The held module's parameters, buffers and children become the unit's
  // own, under their own names: no level is added to the names.
  for (auto& p : contained_->named_parameters(/*recurse=*/false)) {
    register_parameter(p.key(), p.value(), p.value().requires_grad());
  }
  for (auto& b : contained_->named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());
  for (auto& c : contained_->named_children()) register_module(c.key(), c.value());
  Module::train(contained_->is_training());
}

void FSDPUnitBase::train(bool on) {
  Module::train(on);
  contained_->train(on);
}

void FSDPUnitBase::pretty_print(std::ostream& stream) const {
  stream << "fulgur::nn::FSDPUnit(";
  contained_->pretty_print(stream);
  stream << ")";
}

}  // namespace fulgur::nn
