#include "fulgur/strategies/single_device.h"

#include <torch/torch.h>

namespace fulgur {

c10::Device SingleDeviceStrategy::root_device() const {
  if (device_) return *device_;
  if (!parallel_devices().empty()) return parallel_devices().front();
  return c10::Device(c10::kCPU);
}

void SingleDeviceStrategy::barrier(std::string_view) {}
at::Tensor SingleDeviceStrategy::broadcast(const at::Tensor& tensor, int) { return tensor; }
at::Tensor SingleDeviceStrategy::all_reduce(const at::Tensor& tensor, ReduceOp) { return tensor; }
at::Tensor SingleDeviceStrategy::all_gather(const at::Tensor& tensor) {
  return tensor.unsqueeze(0);
}

}  // namespace fulgur
