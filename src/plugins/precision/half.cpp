#include "fulgur/plugins/precision/half.h"

#include <torch/torch.h>

#include "fulgur/accelerators/accelerator.h"
#include "fulgur/core/errors.h"

namespace fulgur {

TruePrecision::TruePrecision(c10::ScalarType dtype) : dtype_(dtype) {
  if (dtype != at::kDouble && dtype != at::kBFloat16 && dtype != at::kHalf) {
    throw ConfigError(
        str("TruePrecision(", c10::toString(dtype),
            "): pass Double (64-true), "
            "BFloat16 (bf16-true) or Half (16-true); float32 is the base Precision."));
  }
}

std::string_view TruePrecision::name() const {
  switch (dtype_) {
    case at::kDouble: return "64-true";
    case at::kBFloat16: return "bf16-true";
    default: return "16-true";
  }
}

void TruePrecision::check_accelerator(const Accelerator& accelerator) const {
  if (dtype_ == at::kHalf && !accelerator.supports_float16()) {
    throw ConfigError(str("precision=\"16-true\" with accelerator=\"", accelerator.name(),
                          "\": LibTorch's CPU kernels lack float16 for most operations. Pass "
                          "precision=\"bf16-true\" or \"bf16-mixed\" on the CPU, or "
                          "accelerator=\"cuda\"."));
  }
}

void TruePrecision::convert_module(torch::nn::Module& module) { module.to(dtype_); }

at::Tensor TruePrecision::convert_input(const at::Tensor& tensor) const {
  // Labels and indices stay integers; only floating-point data changes.
  return tensor.is_floating_point() && tensor.scalar_type() != dtype_ ? tensor.to(dtype_) : tensor;
}

}  // namespace fulgur
