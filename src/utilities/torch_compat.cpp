#include "fulgur/utilities/torch_compat.h"

#include <ATen/autocast_mode.h>
#include <c10/util/StringUtil.h>
#if FULGUR_TORCH_AT_LEAST(2, 6)
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#endif
#if FULGUR_TORCH_AT_LEAST(2, 0)
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <cstdlib>
#include <stdexcept>

namespace fulgur::compat {

std::string torch_version() { return TORCH_VERSION; }

#if FULGUR_TORCH_AT_LEAST(2, 6)
bool has_fused_optimizer_steps() { return true; }

void fused_sgd_(c10::ArrayRef<at::Tensor> params, c10::ArrayRef<at::Tensor> grads,
                c10::ArrayRef<at::Tensor> momentum_buffers, double weight_decay, double momentum,
                double lr, double dampening, bool nesterov, bool is_first_step,
                const at::Tensor& found_inf) {
  at::_fused_sgd_(params, grads, momentum_buffers, weight_decay, momentum, lr, dampening, nesterov,
                  /*maximize=*/false, is_first_step, /*grad_scale=*/std::nullopt, found_inf);
}

void fused_adam_(bool decoupled_weight_decay, c10::ArrayRef<at::Tensor> params,
                 c10::ArrayRef<at::Tensor> grads, c10::ArrayRef<at::Tensor> exp_avgs,
                 c10::ArrayRef<at::Tensor> exp_avg_sqs, c10::ArrayRef<at::Tensor> max_exp_avg_sqs,
                 c10::ArrayRef<at::Tensor> state_steps, double lr, double beta1, double beta2,
                 double weight_decay, double eps, bool amsgrad, const at::Tensor& found_inf) {
  if (decoupled_weight_decay) {
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1,
                      beta2, weight_decay, eps, amsgrad, /*maximize=*/false,
                      /*grad_scale=*/std::nullopt, found_inf);
  } else {
    at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1,
                     beta2, weight_decay, eps, amsgrad, /*maximize=*/false,
                     /*grad_scale=*/std::nullopt, found_inf);
  }
}
#else
bool has_fused_optimizer_steps() { return false; }

void fused_sgd_(c10::ArrayRef<at::Tensor>, c10::ArrayRef<at::Tensor>, c10::ArrayRef<at::Tensor>,
                double, double, double, double, bool, bool, const at::Tensor&) {
  throw std::logic_error("fused_sgd_: LibTorch " TORCH_VERSION " has no fused SGD step in fulgur");
}

void fused_adam_(bool, c10::ArrayRef<at::Tensor>, c10::ArrayRef<at::Tensor>,
                 c10::ArrayRef<at::Tensor>, c10::ArrayRef<at::Tensor>, c10::ArrayRef<at::Tensor>,
                 c10::ArrayRef<at::Tensor>, double, double, double, double, double, bool,
                 const at::Tensor&) {
  throw std::logic_error("fused_adam_: LibTorch " TORCH_VERSION
                         " has no fused Adam step in fulgur");
}
#endif

#if FULGUR_TORCH_AT_LEAST(2, 4)
bool autocast_enabled(c10::DeviceType t) { return at::autocast::is_autocast_enabled(t); }
void set_autocast_enabled(c10::DeviceType t, bool on) { at::autocast::set_autocast_enabled(t, on); }
c10::ScalarType autocast_dtype(c10::DeviceType t) { return at::autocast::get_autocast_dtype(t); }
void set_autocast_dtype(c10::DeviceType t, c10::ScalarType d) {
  at::autocast::set_autocast_dtype(t, d);
}
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
  t == c10::kCUDA ? at::autocast::set_autocast_gpu_dtype(d)
                  : at::autocast::set_autocast_cpu_dtype(d);
}
#endif

OptimizerStateKey optimizer_state_key(const at::Tensor& parameter) {
#if FULGUR_TORCH_AT_LEAST(2, 0)
  return parameter.unsafeGetTensorImpl();
#else
  return c10::guts::to_string(parameter.unsafeGetTensorImpl());
#endif
}

c10::intrusive_ptr<C10dGroup> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int world_size,
                                              std::chrono::milliseconds timeout) {
#ifdef USE_C10D_NCCL
#if !FULGUR_TORCH_AT_LEAST(2, 2)
  // Without asynchronous error handling a collective that never completes
  // blocks forever; with it, NCCL's watchdog aborts it at the timeout and
  // the rank fails (its launcher then names it). The user's setting wins.
  // From 2.2 it is on by default (and the old name is deprecated).
  ::setenv("NCCL_ASYNC_ERROR_HANDLING", "1", /*overwrite=*/0);
  ::setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", /*overwrite=*/0);
#endif
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, options);
#else
  (void)store, (void)rank, (void)world_size, (void)timeout;
  throw std::logic_error("make_nccl_group: this LibTorch was built without NCCL");
#endif
}

c10::intrusive_ptr<c10d::Store> connect_tcp_store(const std::string& host, int port,
                                                  std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = timeout;
#if FULGUR_TORCH_AT_LEAST(2, 4)
  // libuv became the default in 2.4; a client speaks the same protocol
  // either way, and Debian 13's build has no libuv.
  options.useLibUV = false;
#endif
  return c10::make_intrusive<c10d::TCPStore>(host, options);
}

void shutdown_group(C10dGroup& group, const std::string& backend) noexcept {
#if defined(USE_C10D_NCCL) && FULGUR_TORCH_AT_LEAST(2, 4)
  if (backend != "nccl") return;
  try {
    static_cast<c10d::ProcessGroupNCCL&>(group).shutdown();
  } catch (const std::exception&) {
    // Tearing down after a failed collective: the error was reported.
  }
#else
  (void)group, (void)backend;
#endif
}

}  // namespace fulgur::compat
