// File: fulgur/plugins/precision/half.h
//
// "True" precisions: the whole module is converted to one dtype at setup and
// floating-point inputs are converted to it as they reach the device;
// optimizer state follows the parameters' dtype.
//   "64-true":  float64 everywhere (numerics checks, small scientific models).
//   "bf16-true": bfloat16 parameters and activations (memory halved; no
//               float32 master weights, so tiny updates can be lost).
//   "16-true":  float16 likewise, CUDA only (LibTorch's CPU kernels lack
//               float16 for most ops): rejected on the CPU with a pointer to
//               bf16-true / bf16-mixed.
#pragma once

#include <c10/core/ScalarType.h>

#include "fulgur/plugins/precision/precision.h"

namespace fulgur {

class TruePrecision : public Precision {
 public:
  /// `dtype`: at::kDouble, at::kBFloat16 or at::kHalf.
  explicit TruePrecision(c10::ScalarType dtype);

  std::string_view name() const override;
  void check_accelerator(const Accelerator& accelerator) const override;
  void convert_module(torch::nn::Module& module) override;
  at::Tensor convert_input(const at::Tensor& tensor) const override;

  c10::ScalarType dtype() const { return dtype_; }

 private:
  c10::ScalarType dtype_;
};

}  // namespace fulgur
