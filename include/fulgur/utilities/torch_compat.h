// File: fulgur/utilities/torch_compat.h
//
// The differences between the LibTorch lines fulgur builds against — Debian
// 12's 1.13 and 2.x (Debian 13's 2.6, pytorch.org's zips) — in one place.
// Nothing else in fulgur tests TORCH_VERSION; code that needs an API that
// moved calls the function here, whose source (src/utilities/torch_compat.cpp)
// picks the spelling of the LibTorch it is compiled against.
//
//   if (fulgur::compat::autocast_enabled(c10::kCPU)) ...
//   auto key = fulgur::compat::optimizer_state_key(param);
//   auto it = optimizer.state().find(key);
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/version.h>

#include <chrono>
#include <string>

/// True when the LibTorch compiled against is `major`.`minor` or newer.
#define FULGUR_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

/// c10d::Store::clone() is a pure virtual from LibTorch 2.8: a store's clone()
/// is declared `clone() FULGUR_STORE_CLONE_OVERRIDE`.
#if FULGUR_TORCH_AT_LEAST(2, 8)
#define FULGUR_STORE_CLONE_OVERRIDE override
#else
#define FULGUR_STORE_CLONE_OVERRIDE
#endif

/// at::cuda::CUDAGraph::capture_begin takes a stream capture mode from
/// LibTorch 2.0 (1.13: global capture only).
#define FULGUR_CUDA_GRAPH_CAPTURE_MODE FULGUR_TORCH_AT_LEAST(2, 0)

namespace c10d {
class ProcessGroup;
class Backend;
class Store;
}  // namespace c10d

namespace fulgur::compat {

/// The c10d object collectives run on: the backend's process group in 1.x;
/// in 2.x the backend itself (ProcessGroupGloo, ProcessGroupNCCL and
/// ProcessGroupMPI became c10d::Backends behind a c10d::ProcessGroup).
#if FULGUR_TORCH_AT_LEAST(2, 0)
using C10dGroup = c10d::Backend;
#else
using C10dGroup = c10d::ProcessGroup;
#endif

/// "1.13.1", "2.6.0": the LibTorch fulgur was compiled against.
std::string torch_version();

// ---- Autocast: 1.13 has one API per device family (CPU, CUDA); 2.4 made it
// take the device type and deprecated the old names.
bool autocast_enabled(c10::DeviceType device_type);
void set_autocast_enabled(c10::DeviceType device_type, bool enabled);
c10::ScalarType autocast_dtype(c10::DeviceType device_type);
void set_autocast_dtype(c10::DeviceType device_type, c10::ScalarType dtype);

// ---- torch::optim: the key of a parameter's entry in Optimizer::state() —
// its TensorImpl's address printed as a string in 1.13, the address itself
// in 2.x.
#if FULGUR_TORCH_AT_LEAST(2, 0)
using OptimizerStateKey = void*;
#else
using OptimizerStateKey = std::string;
#endif
OptimizerStateKey optimizer_state_key(const at::Tensor& parameter);

// ---- Fused optimizer steps: ATen's _fused_sgd_, _fused_adam_ and
// _fused_adamw_, one kernel per step for CPU (from 2.4) and CUDA tensors,
// which do nothing at all when `found_inf` (float32, one element, on the
// parameters' device) holds 1: the loss scaler's verdict, read by the
// kernel, not by the host. Used from LibTorch 2.6, the version fulgur tests
// them on; never with `maximize` or a scale of their own (the gradients
// arrive unscaled).
bool has_fused_optimizer_steps();
/// torch::optim::SGD's arithmetic; `is_first_step`: each momentum buffer
/// becomes the (decayed) gradient. Throws std::logic_error where
/// has_fused_optimizer_steps() is false.
void fused_sgd_(c10::ArrayRef<at::Tensor> params, c10::ArrayRef<at::Tensor> grads,
                c10::ArrayRef<at::Tensor> momentum_buffers, double weight_decay, double momentum,
                double lr, double dampening, bool nesterov, bool is_first_step,
                const at::Tensor& found_inf);
/// torch::optim::Adam's (AdamW's when `decoupled_weight_decay`) arithmetic,
/// with each step count (float32, one element) already advanced. Throws
/// std::logic_error where has_fused_optimizer_steps() is false.
void fused_adam_(bool decoupled_weight_decay, c10::ArrayRef<at::Tensor> params,
                 c10::ArrayRef<at::Tensor> grads, c10::ArrayRef<at::Tensor> exp_avgs,
                 c10::ArrayRef<at::Tensor> exp_avg_sqs, c10::ArrayRef<at::Tensor> max_exp_avg_sqs,
                 c10::ArrayRef<at::Tensor> state_steps, double lr, double beta1, double beta2,
                 double weight_decay, double eps, bool amsgrad, const at::Tensor& found_inf);

// ---- c10d: the process-group backends whose options moved.
/// ProcessGroupNCCL for `rank` of `world_size` over `store`, with every
/// collective bounded by `timeout` (asynchronous error handling on, so that a
/// stuck collective fails instead of blocking). Throws where the build has
/// no NCCL.
c10::intrusive_ptr<C10dGroup> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int world_size,
                                              std::chrono::milliseconds timeout);
/// A client of the c10d TCPStore that listens at `host`:`port` (torchrun's
/// agent hosts one), waiting up to `timeout` to connect. Never starts a
/// server; never asks for the libuv transport (Debian 13's PyTorch is
/// built without it).
c10::intrusive_ptr<c10d::Store> connect_tcp_store(const std::string& host, int port,
                                                  std::chrono::milliseconds timeout);
/// Shuts an NCCL group down before it is destroyed (2.4 warns otherwise);
/// a no-op for other backends and older LibTorch. Never throws.
void shutdown_group(C10dGroup& group, const std::string& backend) noexcept;

}  // namespace fulgur::compat
