#include "fulgur/plugins/precision/precision.h"

#include <torch/torch.h>

#include "fulgur/plugins/precision/amp.h"
#include "fulgur/plugins/precision/half.h"

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
    r.add("64-true", "Module and inputs in float64",
          [] { return std::make_unique<TruePrecision>(at::kDouble); });
    r.add("bf16-mixed", "float32 weights, bfloat16 autocast (CPU and CUDA)",
          [] { return std::make_unique<MixedPrecision>(at::kBFloat16); });
    r.add("16-mixed", "float32 weights, float16 autocast and a dynamic loss scaler (CUDA)",
          [] { return std::make_unique<MixedPrecision>(at::kHalf); });
    r.add("bf16-true", "Module and inputs in bfloat16",
          [] { return std::make_unique<TruePrecision>(at::kBFloat16); });
    r.add("16-true", "Module and inputs in float16 (CUDA)",
          [] { return std::make_unique<TruePrecision>(at::kHalf); });
    return r;
  }();
  return registry;
}

}  // namespace fulgur
