#include "fulgur/plugins/precision/amp.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "fulgur/accelerators/accelerator.h"
#include "fulgur/core/errors.h"

namespace fulgur {

// ---- AutocastScope. LibTorch 1.13's API is per device family; 2.4 made it
// take the device type (the old names are deprecated there).
namespace {

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
bool autocast_enabled(c10::DeviceType t) { return at::autocast::is_autocast_enabled(t); }
void set_autocast_enabled(c10::DeviceType t, bool on) { at::autocast::set_autocast_enabled(t, on); }
c10::ScalarType autocast_dtype(c10::DeviceType t) { return at::autocast::get_autocast_dtype(t); }
void set_autocast_dtype(c10::DeviceType t, c10::ScalarType d) { at::autocast::set_autocast_dtype(t, d); }
#else
bool autocast_enabled(c10::DeviceType t) {
  return t == c10::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
}
void set_autocast_enabled(c10::DeviceType t, bool on) {
  t == c10::kCUDA ? at::autocast::set_enabled(on) : at::autocast::set_cpu_enabled(on);
}
c10::ScalarType autocast_dtype(c10::DeviceType t) {
  return t == c10::kCUDA ? at::autocast::get_autocast_gpu_dtype()
                         : at::autocast::get_autocast_cpu_dtype();
}
void set_autocast_dtype(c10::DeviceType t, c10::ScalarType d) {
  t == c10::kCUDA ? at::autocast::set_autocast_gpu_dtype(d) : at::autocast::set_autocast_cpu_dtype(d);
}
#endif

}  // namespace

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
  if (dtype_ == at::kHalf && accelerator.name() == "cpu") {
    throw ConfigError("precision=\"16-mixed\" with accelerator=\"cpu\": LibTorch's CPU autocast "
                      "runs in bfloat16 only. Pass precision=\"bf16-mixed\" on the CPU, or "
                      "accelerator=\"cuda\".");
  }
}

std::unique_ptr<PrecisionScope> MixedPrecision::forward_scope(c10::DeviceType device_type) const {
  return std::make_unique<AutocastScope>(device_type, dtype_);
}

void MixedPrecision::backward(const at::Tensor& loss) {
  if (scaler_) {
    scaler_->scale(loss).backward();
  } else {
    loss.backward();
  }
}

void MixedPrecision::unscale_gradients(torch::optim::Optimizer& optimizer) {
  if (scaler_) scaler_->unscale(optimizer);
}

bool MixedPrecision::optimizer_step(torch::optim::Optimizer& optimizer) {
  if (scaler_) return scaler_->step(optimizer);
  optimizer.step();
  return true;
}

void MixedPrecision::update() {
  if (scaler_) scaler_->update();
}

void MixedPrecision::save_state(torch::serialize::OutputArchive& archive) const {
  if (scaler_) scaler_->save(archive);
}

void MixedPrecision::load_state(torch::serialize::InputArchive& archive) {
  if (scaler_) scaler_->load(archive);
}

}  // namespace fulgur
