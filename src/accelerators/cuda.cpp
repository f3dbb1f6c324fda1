#include "fulgur/accelerators/cuda.h"

#include <cstdlib>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/torch.h>

#include <set>

#ifdef FULGUR_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

#include "fulgur/core/errors.h"

namespace fulgur {

bool CUDAAccelerator::is_available() const { return torch::cuda::is_available(); }

std::string CUDAAccelerator::unavailable_reason() const {
  if (torch::cuda::is_available()) return {};
  return "torch::cuda::is_available() is false: this LibTorch has no CUDA support or no GPU "
         "is visible (found 0 CUDA devices)";
}

int CUDAAccelerator::auto_device_count() const {
  return static_cast<int>(torch::cuda::device_count());
}

std::vector<c10::Device> CUDAAccelerator::parse_devices(const DevicesSpec& spec) const {
  if (auto problem = spec.problem(); !problem.empty()) throw ConfigError(problem);
  int available = auto_device_count();
  std::vector<int> indices;
  if (spec.is_auto() || (spec.count() && *spec.count() == -1)) {
    for (int i = 0; i < available; ++i) indices.push_back(i);
  } else if (spec.count()) {
    if (*spec.count() < 1) {
      throw ConfigError(str("accelerator=\"cuda\", devices=", spec.text(),
                            ": pass a count >= 1, -1 for all GPUs, or indices."));
    }
    if (*spec.count() > available) {
      throw ConfigError(str("accelerator=\"cuda\", devices=", spec.text(), ": asked for ",
                            *spec.count(), " GPUs but ", available,
                            " are visible. Pass devices=", available, " or fewer."));
    }
    for (int i = 0; i < *spec.count(); ++i) indices.push_back(i);
  } else {
    std::set<int> seen;
    for (int i : spec.indices()) {
      if (i < 0 || i >= available) {
        throw ConfigError(str("accelerator=\"cuda\", devices=", spec.text(), ": GPU index ", i,
                              " does not exist; ", available, " GPU(s) are visible (indices 0..",
                              available - 1, ")."));
      }
      if (!seen.insert(i).second) {
        throw ConfigError(str("accelerator=\"cuda\", devices=", spec.text(), ": GPU index ", i,
                              " is listed twice. List each GPU once."));
      }
      indices.push_back(i);
    }
  }
  std::vector<c10::Device> out;
  for (int i : indices) out.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
  return out;
}

void CUDAAccelerator::setup_device(c10::Device device) {
  FULGUR_ASSERT(device.is_cuda(), "CUDAAccelerator::setup_device got ", device.str());
  // The rank's GPU becomes the current device, so that what is created
  // without a device (NCCL's communicators, the default stream's work)
  // lands there and not on GPU 0. Through the device-guard interface, which
  // CUDA builds register at load time: no CUDA header needed here.
  if (device.has_index()) c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);
}

std::map<std::string, double> CUDAAccelerator::device_stats(c10::Device device) const {
  std::map<std::string, double> stats;
#ifdef FULGUR_WITH_CUDA
  if (!device.is_cuda() || !torch::cuda::is_available()) return stats;
  const c10::DeviceIndex index = device.has_index() ? device.index() : 0;
  // The caching allocator's counters, under torch.cuda.memory_stats()'s
  // names; [0] is every pool together (StatType::AGGREGATE in each version).
  // Before CUDA's lazy initialisation it has none (and would throw).
  if (!c10::cuda::CUDACachingAllocator::get()->initialized()) return stats;
  const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  auto add = [&](const char* name, const auto& array) {
    stats[std::string(name) + ".all.current"] = static_cast<double>(array[0].current);
    stats[std::string(name) + ".all.peak"] = static_cast<double>(array[0].peak);
  };
  add("allocated_bytes", s.allocated_bytes);
  add("reserved_bytes", s.reserved_bytes);
  add("active_bytes", s.active_bytes);
  add("allocation", s.allocation);
  stats["num_alloc_retries"] = static_cast<double>(s.num_alloc_retries);
  stats["num_ooms"] = static_cast<double>(s.num_ooms);
  // The whole device's, other processes' memory included (no stream waits).
  const c10::cuda::CUDAGuard guard(index);
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) == cudaSuccess) {
    stats["device_free_bytes"] = static_cast<double>(free);
    stats["device_total_bytes"] = static_cast<double>(total);
  } else {
    (void)cudaGetLastError();  // not left for the next kernel launch to report
  }
#else
  (void)device;
#endif
  return stats;
}

void CUDAAccelerator::prepare_determinism() {
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
}

}  // namespace fulgur
