// Internal: moves the loops' batches to the device ahead of the step that
// takes them (Trainer option prefetch_to_device).
//
// The loop puts each batch as soon as it has it from the loader, one batch
// ahead of the step it is running, and takes it when that batch's step
// starts. On a device with streams (CUDA) the copy is issued on a side
// stream from the device's pool and ordered by an event: the taking stream
// waits for that event on the device (the host never waits), and the
// batch's device memory is recorded on the taking stream, so the caching
// allocator does not give it to a later copy while the step still reads it.
// The host batch is kept until its batch is taken, which keeps its pinned
// memory alive for the copy. Elsewhere a put is the strategy's plain
// batch_to_device, made one batch early: the same batches in the same order,
// which is what the CPU tests check.
//
// Disabled, put() does nothing and take() is batch_to_device at the point
// of the call, exactly as without a feed.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <deque>
#include <optional>

#include "fulgur/data/batch.h"

namespace fulgur {
class Module;
class Strategy;
}  // namespace fulgur

namespace fulgur::detail {

class DeviceFeed {
 public:
  /// A feed for `strategy`'s root device, prefetching as the Trainer option
  /// prefetch_to_device says (unset: only where the device has streams to
  /// overlap the copy with, i.e. CUDA), through `module`'s batch transfer
  /// hooks (Module::on_before_batch_transfer before the move,
  /// on_after_batch_transfer when the batch is taken). Drops the batches put
  /// and not taken.
  void reset(Strategy& strategy, std::optional<bool> prefetch_to_device, Module& module);
  bool enabled() const { return enabled_; }

  /// Starts moving `host`, the batch after those already put, to the device.
  void put(const Batch& host);
  /// `host` on the device, ready for the current stream. With batches put,
  /// `host` must be the first of them (the feed checks that it is).
  Batch take(const Batch& host);
  /// Drops the batches put and not taken.
  void clear() { in_flight_.clear(); }

 private:
  struct InFlight {
    Batch host;
    Batch device;
    std::optional<c10::Event> ready;  // recorded on the side stream after the copy
  };

  /// `host` through the module's on_before_batch_transfer, moved.
  Batch to_device(const Batch& host) const;

  Strategy* strategy_ = nullptr;
  Module* module_ = nullptr;
  bool enabled_ = false;
  bool streams_ = false;  // the device orders work by streams (CUDA)
  c10::Device device_ = c10::Device(c10::kCPU);
  std::optional<c10::Stream> side_;
  std::deque<InFlight> in_flight_;
};

}  // namespace fulgur::detail
