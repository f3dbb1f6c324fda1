// File: fulgur/accelerators/cuda.h
#pragma once

#include "fulgur/accelerators/accelerator.h"

namespace fulgur {

/// NVIDIA GPUs through LibTorch's CUDA build. Available only when
/// torch::cuda::is_available(); `devices` is a count, -1 (all) or indices.
class CUDAAccelerator : public Accelerator {
 public:
  std::string_view name() const override { return "cuda"; }
  bool is_available() const override;
  std::string unavailable_reason() const override;
  int auto_device_count() const override;
  std::vector<c10::Device> parse_devices(const DevicesSpec& spec) const override;
  void setup_device(c10::Device device) override;
  /// The caching allocator's counters under torch.cuda.memory_stats()'s
  /// names (allocated_bytes.all.current/.peak, reserved_bytes.…,
  /// active_bytes.…, allocation.…, num_alloc_retries, num_ooms) and the
  /// device's free and total memory (device_free_bytes, device_total_bytes).
  /// Nothing waits for the device. Before CUDA's lazy initialisation (no
  /// tensor on a GPU yet), none of the allocator's.
  std::map<std::string, double> device_stats(c10::Device device) const override;
  bool has_cudnn_autotuner() const override { return true; }
  /// Sets CUBLAS_WORKSPACE_CONFIG=:4096:8 unless the user set it: cuBLAS is
  /// deterministic only with a fixed workspace, read when its first handle
  /// is created.
  void prepare_determinism() override;
};

}  // namespace fulgur
