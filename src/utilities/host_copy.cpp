#include "utilities/host_copy.h"

#include <ATen/ops/empty.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <thread>

namespace fulgur::detail {

void AsyncHostCopy::start(const at::Tensor& values) {
  unread_ = true;
  if (!values.is_cuda()) {
    host_ = values;  // on the CPU already, or copied by read()
    pinned_ = false;
    return;
  }
  if (!pinned_ || host_.numel() != values.numel() || host_.dtype() != values.dtype()) {
    host_ =
        at::empty({values.numel()}, at::TensorOptions(values.scalar_type()).pinned_memory(true));
  }
  pinned_ = true;
  if (!copied_ || copied_->device_type() != values.device().type()) {
    copied_.emplace(values.device().type());
  }
  host_.copy_(values.reshape({values.numel()}), /*non_blocking=*/true);
  copied_->record(
      c10::impl::getDeviceGuardImpl(values.device().type())->getStream(values.device()));
}

const at::Tensor& AsyncHostCopy::read() {
  if (!unread_) return host_;
  if (pinned_) {
    while (!copied_->query()) std::this_thread::yield();
  } else if (host_.defined() && !host_.is_cpu()) {
    host_ = host_.cpu();
  }
  unread_ = false;
  return host_;
}

}  // namespace fulgur::detail
