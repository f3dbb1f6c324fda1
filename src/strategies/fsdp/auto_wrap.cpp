#include "strategies/fsdp/auto_wrap.h"

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <map>
#include <utility>

#include "fulgur/core/errors.h"

namespace fulgur::detail {

namespace {

// A unit around a Sequential's entry: the entry's forward with the
// parameters gathered around it.
class AutoUnitImpl : public nn::FSDPUnitBase {
 public:
  explicit AutoUnitImpl(torch::nn::AnyModule layer)
      : FSDPUnitBase(layer.ptr()), layer_(std::move(layer)) {}

  at::Tensor forward(at::Tensor input) {
    if (!hooks_) return layer_.forward(std::move(input));
    hooks_->before_forward();
    at::Tensor output = layer_.forward(std::move(input));
    hooks_->after_forward({output});
    return output;
  }

 private:
  torch::nn::AnyModule layer_;
};

// Whether `module` is a layer whose forward takes and returns one tensor
// (the types an entry can be wrapped for).
bool is_wrappable_layer(const torch::nn::Module& module) {
  const auto* m = &module;
  return dynamic_cast<const torch::nn::LinearImpl*>(m) ||
         dynamic_cast<const torch::nn::Conv1dImpl*>(m) ||
         dynamic_cast<const torch::nn::Conv2dImpl*>(m) ||
         dynamic_cast<const torch::nn::Conv3dImpl*>(m) ||
         dynamic_cast<const torch::nn::EmbeddingImpl*>(m) ||
         dynamic_cast<const torch::nn::BatchNorm1dImpl*>(m) ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(m) ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(m) ||
         dynamic_cast<const torch::nn::InstanceNorm1dImpl*>(m) ||
         dynamic_cast<const torch::nn::InstanceNorm2dImpl*>(m) ||
         dynamic_cast<const torch::nn::InstanceNorm3dImpl*>(m) ||
         dynamic_cast<const torch::nn::LayerNormImpl*>(m) ||
         dynamic_cast<const torch::nn::GroupNormImpl*>(m);
}

int64_t parameter_count(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

}  // namespace

SequentialAutoWrap::SequentialAutoWrap(torch::nn::Module& root, int64_t min_parameters) {
  if (min_parameters <= 0) {
    throw ConfigError(str("FSDPOptions::auto_wrap_min_params is ", min_parameters,
                          ": pass a positive number of parameters (0 turns auto-wrap off)."));
  }
  try {
    wrap(root, min_parameters);
  } catch (...) {
    restore();  // a constructor that throws runs no destructor
    throw;
  }
}

void SequentialAutoWrap::wrap(torch::nn::Module& root, int64_t min_parameters) {
  // One unit per layer, even where a layer is an entry of several
  // Sequentials (or twice of one): every entry runs it.
  std::map<const torch::nn::Module*, std::shared_ptr<AutoUnitImpl>> units;
  // Not the root itself (a fulgur::Module, which may live on the stack).
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    std::shared_ptr<torch::nn::Module> candidate = item.value();
    // A declared unit around a Sequential: its entries are the unit's
    // children, and the Sequential is held, not registered.
    if (auto* declared = dynamic_cast<nn::FSDPUnitBase*>(candidate.get())) {
      candidate = declared->held_module();
    }
    auto sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(candidate);
    if (!sequential) continue;
    const auto children = sequential->named_children();
    size_t index = 0;
    for (auto entry = sequential->begin(); entry != sequential->end(); ++entry, ++index) {
      const std::shared_ptr<torch::nn::Module> layer = entry->ptr();
      if (!is_wrappable_layer(*layer)) continue;
      auto& unit = units[layer.get()];
      if (!unit) {
        const int64_t count = parameter_count(*layer);
        if (count < min_parameters) continue;
        std::string name;
        for (const auto& child : children) {
          if (child.value().get() == layer.get()) {
            name = child.key();  // its first name there
            break;
          }
        }
        std::string type = layer->name();  // "torch::nn::LinearImpl": the holder's name
        if (type.size() > 4 && type.compare(type.size() - 4, 4, "Impl") == 0) {
          type.resize(type.size() - 4);
        }
        unit = std::make_shared<AutoUnitImpl>(*entry);
        layers_.push_back({item.key() + "." + name, type, count, unit});
      }
      swapped_.push_back({sequential, index, *entry});
      *entry = torch::nn::AnyModule(unit);
    }
  }
}

void SequentialAutoWrap::restore() {
  // Last swapped first: an entry swapped twice gets its first original.
  for (auto swap = swapped_.rbegin(); swap != swapped_.rend(); ++swap) {
    *(swap->sequential->begin() + static_cast<std::ptrdiff_t>(swap->index)) =
        std::move(swap->original);
  }
  swapped_.clear();
}

SequentialAutoWrap::~SequentialAutoWrap() { restore(); }

std::string SequentialAutoWrap::describe() const {
  std::string text;
  for (const auto& layer : layers_) {
    text += str(text.empty() ? "" : ", ", layer.name, " (", layer.type, ", ", layer.parameters,
                " parameters)");
  }
  return text;
}

}  // namespace fulgur::detail
