// File: fulgur/plugins/precision/grad_scaler.h
//
// A dynamic loss scaler for float16 training, which LibTorch's C++ API does
// not have (Python's torch.cuda.amp.GradScaler). The loss is multiplied by
// `scale` before backward so that small float16 gradients do not flush to
// zero; before the optimizer step the gradients are divided by it again and
// checked for inf/NaN. A step whose gradients are not finite is skipped and
// the scale backs off; after `growth_interval` finite steps in a row it grows.
//
//   GradScaler scaler;
//   scaler.scale(loss).backward();
//   scaler.unscale(optimizer);          // optional: before clipping
//   bool stepped = scaler.step(optimizer);
//   scaler.update();                    // once per iteration, after every step
//
// On CUDA it runs ATen's fused kernels (_amp_foreach_non_finite_check_and_
// unscale_, _amp_update_scale_); on other devices the same arithmetic with
// ordinary tensor ops, so its logic is testable on the CPU. With
// fulgur::optim's optimizers (LibTorch 2.6+) the device skips a step by
// itself, so that the host never waits for the step's own backward: it
// learns the verdict one step later (DeviceSkippedSteps).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <unordered_map>

#include "fulgur/core/state_dict.h"

namespace torch::optim {
class Optimizer;
}

namespace fulgur {

struct GradScalerOptions {
  double init_scale = 65536.0;
  /// Multiplies the scale after growth_interval finite steps in a row.
  double growth_factor = 2.0;
  /// Multiplies the scale after a step with inf/NaN gradients.
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

class GradScaler {
 public:
  /// Throws ConfigError naming the option when a factor or interval is invalid.
  explicit GradScaler(GradScalerOptions options = {});

  /// `loss` times the current scale (the scale tensor follows the loss's device).
  at::Tensor scale(const at::Tensor& loss);
  /// Divides the gradients of `optimizer`'s parameters by the scale and
  /// records whether any is inf/NaN. Once per optimizer per iteration;
  /// a second call before update() throws ConfigError.
  void unscale(torch::optim::Optimizer& optimizer);
  /// Whether `optimizer`'s gradients (any optimizer's) were unscaled since
  /// the last update().
  bool unscaled(const torch::optim::Optimizer& optimizer) const {
    return found_inf_.count(&optimizer) != 0;
  }
  bool any_unscaled() const { return !found_inf_.empty(); }
  /// Forgets the unscaled gradients of a step that never finished (a failed
  /// fit), without judging them: the next fit unscales afresh.
  void forget_unscaled() { found_inf_.clear(); }
  /// Unscales if not done yet, then steps unless the gradients had inf/NaN.
  /// Returns false when the step was skipped. To decide, the host reads the
  /// verdict from the device (a wait for the backward on a GPU), except with
  /// fulgur::optim's SGD, Adam and AdamW on LibTorch 2.6 and newer, whose
  /// fused kernels read it themselves (DeviceSkippedSteps::step_unless):
  /// then it returns true, the step queued, and last_step_skipped() says
  /// after update() whether the device skipped it.
  bool step(torch::optim::Optimizer& optimizer);
  /// Adjusts the scale from this iteration's steps and forgets them.
  void update();

  double get_scale() const;
  /// Finite steps in a row since the scale last changed.
  int64_t growth_tracker() const;
  /// Whether the last update() saw inf/NaN gradients (the step was skipped).
  /// Read from the device when asked: update() itself does not wait for it.
  bool last_step_skipped() const;
  const GradScalerOptions& options() const { return options_; }

  /// The scale and growth tracker, as the CPU tensors "scale" (float32 [1])
  /// and "growth_tracker" (int32 [1]); before the first scale(), the initial
  /// ones.
  StateDict state_dict() const;
  /// Throws CheckpointError when `state` holds no scaler state, or holds
  /// something other than tensors there.
  void load_state_dict(const StateDict& state);

 private:
  void ensure_state(const at::Device& device);

  GradScalerOptions options_;
  at::Tensor scale_;           // float32 [1] on the loss's device
  at::Tensor growth_tracker_;  // int32 [1]
  // Per optimizer of the current iteration: its found_inf ([1] float32).
  std::unordered_map<const torch::optim::Optimizer*, at::Tensor> found_inf_;
  at::Tensor last_found_;  // the last update()'s found_inf, on the scale's device
};

}  // namespace fulgur
