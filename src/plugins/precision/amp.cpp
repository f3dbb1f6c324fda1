#include "fulgur/plugins/precision/amp.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "fulgur/accelerators/accelerator.h"
#include "fulgur/core/errors.h"
#include "fulgur/utilities/torch_compat.h"

namespace fulgur {

// ---- AutocastScope.
using compat::autocast_dtype;
using compat::autocast_enabled;
using compat::set_autocast_dtype;
using compat::set_autocast_enabled;

AutocastScope::AutocastScope(c10::DeviceType device_type, c10::ScalarType dtype)
    : device_type_(device_type),
      previous_enabled_(autocast_enabled(device_type)),
      previous_dtype_(autocast_dtype(device_type)) {
  set_autocast_enabled(device_type_, true);
  set_autocast_dtype(device_type_, dtype);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  // The cache of casted weights lives for the outermost scope only.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_autocast_enabled(device_type_, previous_enabled_);
  set_autocast_dtype(device_type_, previous_dtype_);
}

// ---- MixedPrecision.
MixedPrecision::MixedPrecision(c10::ScalarType dtype, std::shared_ptr<GradScaler> scaler)
    : dtype_(dtype), scaler_(std::move(scaler)) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) {
    throw ConfigError(str("MixedPrecision(", c10::toString(dtype),
                          "): mixed precision runs in BFloat16 (bf16-mixed) or Half (16-mixed)."));
  }
  if (dtype == at::kHalf && !scaler_) scaler_ = std::make_shared<GradScaler>();
}

std::string_view MixedPrecision::name() const {
  return dtype_ == at::kHalf ? "16-mixed" : "bf16-mixed";
}

void MixedPrecision::check_accelerator(const Accelerator& accelerator) const {
  if (dtype_ == at::kHalf && !accelerator.supports_float16()) {
    throw ConfigError(str("precision=\"16-mixed\" with accelerator=\"", accelerator.name(),
                          "\": LibTorch's CPU autocast runs in bfloat16 only. Pass "
                          "precision=\"bf16-mixed\" on the CPU, or accelerator=\"cuda\"."));
  }
}

std::unique_ptr<PrecisionScope> MixedPrecision::forward_scope(c10::DeviceType device_type) const {
  return std::make_unique<AutocastScope>(device_type, dtype_);
}

void MixedPrecision::backward(const at::Tensor& loss) {
  if (scaler_ && scaler_->any_unscaled()) {
    // The step's gradients are true-scale already: scaled ones added now
    // would be stepped as they are (the unscale is once per step).
    throw ConfigError(
        "precision=\"16-mixed\": a backward after gradients were unscaled for their optimizer "
        "step (clip_gradients, or GradScaler::unscale) and before it: the new gradients would "
        "be stepped still scaled. Clip after the step's last backward (in "
        "configure_gradient_clipping, or under manual optimization right before "
        "optimizer_step).");
  }
  if (scaler_) {
    scaler_->scale(loss).backward();
  } else {
    loss.backward();
  }
}

void MixedPrecision::unscale_gradients(torch::optim::Optimizer& optimizer) {
  if (scaler_ && !scaler_->unscaled(optimizer)) scaler_->unscale(optimizer);
}

bool MixedPrecision::gradients_unscaled(const torch::optim::Optimizer& optimizer) const {
  return scaler_ && scaler_->unscaled(optimizer);
}

void MixedPrecision::forget_unscaled() {
  if (scaler_) scaler_->forget_unscaled();
}

bool MixedPrecision::optimizer_step(torch::optim::Optimizer& optimizer) {
  if (scaler_) return scaler_->step(optimizer);
  optimizer.step();
  return true;
}

void MixedPrecision::update() {
  if (scaler_) scaler_->update();
}

StateDict MixedPrecision::state_dict() const {
  return scaler_ ? scaler_->state_dict() : StateDict();
}

void MixedPrecision::load_state_dict(const StateDict& state) {
  if (scaler_) scaler_->load_state_dict(state);
}

}  // namespace fulgur
