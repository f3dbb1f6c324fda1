// File: fulgur/optim/optimizers.h
//
// SGD, Adam and AdamW whose step updates every parameter of a parameter group
// with a few multi-tensor ATen operators (`at::_foreach_*`) instead of
// LibTorch's loop of several operators per parameter.
//
// Each is a drop-in for its torch::optim namesake and derives from it: the
// same options (torch::optim::SGDOptions, AdamOptions, AdamWOptions), the
// same parameter groups, the same per-parameter state (SGDParamState,
// AdamParamState, AdamWParamState, keyed as torch::optim keys it), and
// torch::optim's save/load (after settle(): see DeviceSkippedSteps). A checkpoint written by one
// loads into the other, LibTorch's LR schedulers and fulgur's work on them, and code that
// dynamic_casts to torch::optim::Adam still finds one.
//
// Numerics: the same operations, in the same order, with the same scalars as
// torch::optim's step (LibTorch 1.13 to 2.x; their arithmetic did not change),
// so on the CPU, where a multi-tensor operator runs the per-tensor kernel on
// each tensor, every parameter and state tensor is bit-identical to
// torch::optim's. On CUDA the multi-tensor kernels compute the same
// expressions in registers (equal within float rounding). A 16-mixed step
// through the fused kernels (DeviceSkippedSteps) is equal within float
// rounding on both.
//
//   fulgur::OptimizerConfig configure_optimizers() override {
//     return fulgur::OptimizerConfig(
//         std::make_shared<fulgur::optim::Adam>(parameters(), torch::optim::AdamOptions(1e-3)));
//   }
//
// What differs from torch::optim, on purpose:
//   - Adam and AdamW check every gradient for sparseness before they change
//     anything (torch::optim throws on the first sparse one it meets, after
//     stepping the parameters before it); the message is the same.
//   - SGD supports sparse gradients as torch::optim::SGD does, by running
//     torch::optim::SGD's own per-parameter step for a step in which any
//     gradient is sparse (the closure is still called once).
//   - A tensor listed twice in one parameter group is stepped twice in a row
//     by torch::optim (its state is shared), which one multi-tensor batch
//     cannot do: a step that finds such a group runs the parent's
//     per-parameter step instead (same result, LibTorch's speed).
//
// Graph-capturable steps (Trainer option cuda_graph): a step recorded into a
// CUDA graph replays the same kernels with the same arguments, so a number
// passed to a kernel as a scalar (the learning rate a scheduler changes,
// Adam's bias corrections, which change with the step count) would stay the
// one of the captured step. In device-scalar mode (set_device_scalars) the
// step takes those numbers from a small tensor on the parameters' device,
// which prepare_step() rewrites before each step, in stream order, without
// waiting for the device; the step counts advance on the host
// (finish_step()). The numbers that stay constant (momentum, dampening,
// betas, eps, weight decay, nesterov, amsgrad, which parameters are
// trainable) are read at capture: baked_options() lists them so a captured
// step can be re-captured when one changes. Numerics in that mode: the same
// operations, with a scaled add (add(x, alpha), addcdiv) done as a product
// and a sum, so equal to torch::optim within the rounding of the
// parameters' dtype (one more rounding per update), not bitwise.
#pragma once

#include <c10/core/Device.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace fulgur::detail {
struct SkipVerdict;
}

namespace fulgur::optim {

/// What a CUDA-graph step needs from an optimizer: its per-step numbers in
/// device tensors (see the file comment). fulgur's SGD, Adam and AdamW
/// implement it; torch::optim's optimizers do not.
class DeviceScalarSteps {
 public:
  /// On: from now on step() reads its per-step numbers from tensors on
  /// `device`, which prepare_step() writes, and leaves the step counts to
  /// finish_step(). nullopt: back to LibTorch's host scalars. The tensors
  /// stay allocated, also in host mode (a captured graph keeps their
  /// addresses); only another device replaces them.
  void set_device_scalars(std::optional<c10::Device> device);
  bool uses_device_scalars() const { return device_.has_value(); }

  /// Why this optimizer's state cannot take device-scalar steps (empty
  /// when it can): trainable Adam parameters of one group whose step counts
  /// differ.
  /// What only the step can see (a sparse gradient, a tensor listed twice,
  /// a gradient for a parameter without state) step() refuses.
  virtual std::string why_not_device_scalars() const = 0;
  /// Writes the numbers of the next step (its learning rates, bias
  /// corrections) into the device tensors, asynchronously in stream order.
  virtual void prepare_step() = 0;
  /// The host's part of a step done in device-scalar mode: Adam's and
  /// AdamW's step counts advance by one.
  virtual void finish_step() {}
  /// The options a captured step uses as constants, in a fixed order.
  virtual std::vector<double> baked_options() const = 0;

 protected:
  DeviceScalarSteps() = default;
  DeviceScalarSteps(const DeviceScalarSteps&) = default;
  DeviceScalarSteps& operator=(const DeviceScalarSteps&) = default;
  ~DeviceScalarSteps() = default;

  /// Writes `values` into the device tensor (allocated on first use or when
  /// the count changes) and returns one 0-dim view per value.
  const std::vector<at::Tensor>& write_scalars(const std::vector<double>& values);
  /// In device-scalar mode, the views of the last write_scalars (in the
  /// order written; `expected` of them, else c10::Error); else null.
  const std::vector<at::Tensor>* device_scalars(size_t expected) const;

  /// The parameters that the last step in device-scalar mode stepped (for
  /// finish_step's step counts).
  std::vector<at::Tensor> device_stepped_;

 private:
  std::optional<c10::Device> device_;
  at::Tensor scalars_;
  std::vector<at::Tensor> views_;
};

/// Steps that the device skips by itself when the loss scaler (16-mixed)
/// found inf/NaN gradients, so that the host never waits for a step's own
/// backward to read the verdict: GradScaler::step hands its found_inf to
/// step_unless(), and on LibTorch 2.6 and newer fused ATen kernels
/// (_fused_sgd_, _fused_adam_, _fused_adamw_; CPU and CUDA; one per group
/// and dtype, and for Adam per step count) step every parameter, or
/// nothing when found_inf holds 1. Numerics: torch::optim's arithmetic,
/// fused per element, so equal within float rounding, not bitwise.
///
/// What the host keeps of a step (Adam's step counts, the state a first
/// step makes) follows the verdict one step late: the next step, settle()
/// and save() read it and bring the state up to date; a skipped first step
/// leaves no state, as torch::optim's. The host thus waits for the previous
/// step's verdict (by then long computed), never for the current step's.
/// fulgur's optimizer_state_dict settles first; other code that reads
/// state() between steps calls settle() first.
class DeviceSkippedSteps {
 public:
  /// torch::optim's per-parameter state map.
  using ParamStates = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;
  /// What a step's verdict changes in the host's state once it is known.
  using Verdict = std::function<void(ParamStates&, bool skipped)>;

  /// Whether this LibTorch has the fused kernels (2.6 and newer).
  static bool available();

  /// One step of every parameter with a gradient, unless `found_inf` (a
  /// float32 tensor of one element on the parameters' device, 0 or 1) holds
  /// 1. Returns false only when the host read found_inf and skipped. The
  /// host reads it, and runs step() unless it is 1, where the kernels
  /// cannot take the step: on LibTorch before 2.6, in device-scalar mode, or
  /// when a gradient is sparse, a tensor (parameter, gradient, state) is not
  /// on found_inf's device (CPU or CUDA) with its parameter's dtype and
  /// layout (contiguous on the CPU; dense on CUDA), or a tensor is listed
  /// twice (in one group or in two).
  virtual bool step_unless(const at::Tensor& found_inf) = 0;

  /// Brings the state up to date with the last step_unless(), waiting for
  /// its verdict if it is still on its way. Nothing when none is pending.
  void settle();

 protected:
  DeviceSkippedSteps() = default;
  DeviceSkippedSteps(const DeviceSkippedSteps&) = default;
  DeviceSkippedSteps& operator=(const DeviceSkippedSteps&) = default;
  ~DeviceSkippedSteps() = default;

  /// The optimizer's per-parameter state map (torch::optim's state_).
  virtual ParamStates& param_states() = 0;
  /// step_unless()'s end, once the kernels were queued (`apply` set) or
  /// could not be (`apply` empty). Set: starts bringing `found_inf` to the
  /// host, and settle() calls `apply(param_states(), skipped)` with what it
  /// held (`apply` keeps no pointer to the optimizer, which may have moved
  /// by then); returns true. Empty: reads found_inf and runs
  /// `optimizer.step()` unless it holds 1; returns whether it stepped.
  bool hand_on(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf, Verdict apply);

 private:
  std::shared_ptr<detail::SkipVerdict> verdict_;
};

/// torch::optim::SGD (momentum, dampening, nesterov, weight_decay) stepped
/// with multi-tensor operators; step() is bit-identical to it on the CPU.
class SGD : public torch::optim::SGD, public DeviceScalarSteps, public DeviceSkippedSteps {
 public:
  using torch::optim::SGD::SGD;

  /// One step of every parameter with a gradient; calls `closure` first
  /// (with gradients enabled) and returns its loss, as torch::optim does.
  at::Tensor step(LossClosure closure = nullptr) override;
  bool step_unless(const at::Tensor& found_inf) override;
  /// torch::optim's, after settle().
  void save(torch::serialize::OutputArchive& archive) const override;
  /// torch::optim's, after settle().
  void load(torch::serialize::InputArchive& archive) override;

  std::string why_not_device_scalars() const override;
  void prepare_step() override;
  std::vector<double> baked_options() const override;

 protected:
  ParamStates& param_states() override { return state_; }
};

/// torch::optim::Adam (betas, eps, weight_decay as L2, amsgrad) stepped with
/// multi-tensor operators; step() is bit-identical to it on the CPU.
/// Parameters whose
/// step counts differ (one had no gradient on some steps) are stepped in one
/// batch per step count. Throws c10::Error on a sparse gradient, as Adam does.
class Adam : public torch::optim::Adam, public DeviceScalarSteps, public DeviceSkippedSteps {
 public:
  using torch::optim::Adam::Adam;

  /// One step of every parameter with a gradient; calls `closure` first
  /// (with gradients enabled) and returns its loss, as torch::optim does.
  at::Tensor step(LossClosure closure = nullptr) override;
  bool step_unless(const at::Tensor& found_inf) override;
  /// torch::optim's, after settle().
  void save(torch::serialize::OutputArchive& archive) const override;
  /// torch::optim's, after settle().
  void load(torch::serialize::InputArchive& archive) override;

  std::string why_not_device_scalars() const override;
  void prepare_step() override;
  void finish_step() override;
  std::vector<double> baked_options() const override;

 protected:
  ParamStates& param_states() override { return state_; }
};

/// torch::optim::AdamW (betas, eps, decoupled weight_decay, amsgrad) stepped
/// with multi-tensor operators; step() is bit-identical to it on the CPU. As
/// Adam for
/// step counts and sparse gradients.
class AdamW : public torch::optim::AdamW, public DeviceScalarSteps, public DeviceSkippedSteps {
 public:
  using torch::optim::AdamW::AdamW;

  /// One step of every parameter with a gradient; calls `closure` first
  /// (with gradients enabled) and returns its loss, as torch::optim does.
  at::Tensor step(LossClosure closure = nullptr) override;
  bool step_unless(const at::Tensor& found_inf) override;
  /// torch::optim's, after settle().
  void save(torch::serialize::OutputArchive& archive) const override;
  /// torch::optim's, after settle().
  void load(torch::serialize::InputArchive& archive) override;

  std::string why_not_device_scalars() const override;
  void prepare_step() override;
  void finish_step() override;
  std::vector<double> baked_options() const override;

 protected:
  ParamStates& param_states() override { return state_; }
};

}  // namespace fulgur::optim
