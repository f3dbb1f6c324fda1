// File: fulgur/plugins/precision/amp.h
//
// Mixed precision: parameters stay float32, forward and loss run under
// LibTorch's autocast, which computes matmuls and convolutions in the lower
// precision and keeps reductions in float32.
//   "bf16-mixed": bfloat16 autocast, CPU and CUDA, no loss scaling needed.
//   "16-mixed":   float16 autocast on CUDA with a dynamic GradScaler; its
//                 state travels in checkpoints. CPU autocast has no float16:
//                 rejected there with a pointer to bf16-mixed.
#pragma once

#include <c10/core/ScalarType.h>

#include <memory>

#include "fulgur/plugins/precision/grad_scaler.h"
#include "fulgur/plugins/precision/precision.h"

namespace fulgur {

class MixedPrecision : public Precision {
 public:
  /// `dtype`: at::kBFloat16 or at::kHalf. 16-mixed gets a GradScaler with
  /// default options unless one is passed.
  explicit MixedPrecision(c10::ScalarType dtype, std::shared_ptr<GradScaler> scaler = nullptr);

  std::string_view name() const override;
  void check_accelerator(const Accelerator& accelerator) const override;
  std::unique_ptr<PrecisionScope> forward_scope(c10::DeviceType device_type) const override;
  void backward(const at::Tensor& loss) override;
  void unscale_gradients(torch::optim::Optimizer& optimizer) override;
  bool gradients_unscaled(const torch::optim::Optimizer& optimizer) const override;
  void forget_unscaled() override;
  bool optimizer_step(torch::optim::Optimizer& optimizer) override;
  void update() override;
  /// The GradScaler's state (16-mixed); nothing for bf16-mixed.
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;

  c10::ScalarType dtype() const { return dtype_; }
  /// Null for bf16-mixed.
  GradScaler* scaler() const { return scaler_.get(); }

 private:
  c10::ScalarType dtype_;
  std::shared_ptr<GradScaler> scaler_;
};

/// Turns autocast on for `device_type` with `dtype` while it lives, and
/// restores the previous state (nesting allowed).
class AutocastScope : public PrecisionScope {
 public:
  AutocastScope(c10::DeviceType device_type, c10::ScalarType dtype);
  ~AutocastScope() override;
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  c10::DeviceType device_type_;
  bool previous_enabled_;
  c10::ScalarType previous_dtype_;
};

}  // namespace fulgur
