#include "fulgur/strategies/single_device.h"

#include <torch/torch.h>

namespace fulgur {

SingleDeviceStrategy::SingleDeviceStrategy(std::optional<c10::Device> device) : device_(device) {
  set_traits({.max_processes = 1,
              .sync_batchnorm_unsupported_reason = "one process has no peers",
              .trainable_change_unsupported_reason = {}});
}

c10::Device SingleDeviceStrategy::root_device() const {
  if (device_) return *device_;
  if (!parallel_devices().empty()) return parallel_devices().front();
  return c10::Device(c10::kCPU);
}

}  // namespace fulgur
