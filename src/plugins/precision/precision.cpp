#include "fulgur/plugins/precision/precision.h"

#include <torch/torch.h>

namespace fulgur {

void Precision::backward(const at::Tensor& loss) { loss.backward(); }

bool Precision::optimizer_step(torch::optim::Optimizer& optimizer) {
  optimizer.step();
  return true;
}

PrecisionRegistry& precision_registry() {
  static PrecisionRegistry registry = [] {
    PrecisionRegistry r("precision");
    r.add("32-true", "Full float32 precision", [] { return std::make_unique<Precision>(); });
    return r;
  }();
  return registry;
}

}  // namespace fulgur
