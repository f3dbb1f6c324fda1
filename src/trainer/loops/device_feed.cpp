#include "trainer/loops/device_feed.h"

#include <ATen/core/Tensor.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/strategies/strategy.h"
#include "strategies/strategy_driver.h"

namespace fulgur::detail {

namespace {
// The tensors' implementations, in order: what identifies a batch object
// (a copy of a Batch shares them).
std::vector<const c10::TensorImpl*> identity(const Batch& batch) {
  std::vector<const c10::TensorImpl*> impls;
  batch.for_each([&](const at::Tensor& t) { impls.push_back(t.unsafeGetTensorImpl()); });
  return impls;
}
}  // namespace

void DeviceFeed::reset(Strategy& strategy, std::optional<bool> prefetch_to_device, Module& module) {
  in_flight_.clear();
  strategy_ = &strategy;
  module_ = &module;
  const c10::Device device = strategy.root_device();
  enabled_ = prefetch_to_device.value_or(device.is_cuda());
  if (device != device_) side_.reset();
  device_ = device;
  // Streams through the device-guard interface that CUDA builds register:
  // no CUDA header here, and CPU-only builds compile the same code.
  streams_ = enabled_ && device.is_cuda();
}

void DeviceFeed::put(const Batch& host) {
  if (!enabled_) return;
  FULGUR_ASSERT(strategy_ != nullptr, "DeviceFeed::put before reset");
  InFlight entry{.host = host, .device = Batch(), .ready = std::nullopt};
  if (!streams_) {
    entry.device = to_device(host);
    in_flight_.push_back(std::move(entry));
    return;
  }
  const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
  if (!side_) side_ = impl->getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
  // What is moved: the hook runs on the host, before the copy is queued.
  const Batch moved = module_->on_before_batch_transfer(host);
  // A tensor already on the device may still be written by work queued on
  // the current stream: the side stream reads it only after that work.
  bool reads_device_memory = false;
  moved.for_each(
      [&](const at::Tensor& t) { reads_device_memory |= t.defined() && t.device() == device_; });
  if (reads_device_memory) {
    c10::Event queued(device_.type());
    queued.record(impl->getStream(device_));
    queued.block(*side_);
  }
  {
    c10::StreamGuard on_side(*side_);
    entry.device = drive(*strategy_).batch_to_device(moved);
  }
  entry.ready.emplace(device_.type());
  entry.ready->record(*side_);
  in_flight_.push_back(std::move(entry));
}

Batch DeviceFeed::take(const Batch& host) {
  FULGUR_ASSERT(strategy_ != nullptr, "DeviceFeed::take before reset");
  if (in_flight_.empty()) return module_->on_after_batch_transfer(to_device(host));
  InFlight entry = std::move(in_flight_.front());
  in_flight_.pop_front();
  FULGUR_ASSERT(identity(entry.host) == identity(host),
                "DeviceFeed::take: the batch taken is not the batch put first (", host.kind(),
                " of ", host.num_tensors(), " tensors, put: ", entry.host.kind(), " of ",
                entry.host.num_tensors(), ")");
  if (entry.ready) {
    const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
    const c10::Stream current = impl->getStream(device_);
    entry.ready->block(current);
    entry.device.for_each([&](const at::Tensor& t) {
      if (t.defined() && t.device() == device_ && t.has_storage()) {
        impl->recordDataPtrOnStream(t.storage().data_ptr(), current);
      }
    });
  }
  return module_->on_after_batch_transfer(std::move(entry.device));
}

Batch DeviceFeed::to_device(const Batch& host) const {
  return drive(*strategy_).batch_to_device(module_->on_before_batch_transfer(host));
}

}  // namespace fulgur::detail
