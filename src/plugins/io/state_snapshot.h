// File: src/plugins/io/state_snapshot.h (internal)
//
// A snapshot of the tensors a StateDict holds: each tensor, in sections and
// in lists, tuples and dicts too, is replaced by a copy in a buffer kept
// between snapshots, so the state no longer shares memory with the live
// training state and can be serialized on another thread while training
// changes it. A copy is a memcpy (on the tensor's own device; those of CPU
// tensors split between the caller and a helper thread, idle then as the
// writer is); the serialization it spares the caller (pickling, a CRC-32
// per record) costs about four times as much.
//
//   StateSnapshot snapshot;         // kept between saves
//   snapshot.take(state);           // the state now holds copies
//   // ... a writer thread serializes the state; once it is written, the
//   // next take() reuses the buffers ...
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <memory>
#include <unordered_map>
#include <vector>

namespace fulgur {
class StateDict;
}

namespace fulgur::detail {

class HelperThread;

class StateSnapshot {
 public:
  StateSnapshot();
  ~StateSnapshot();
  StateSnapshot(StateSnapshot&&) noexcept;
  StateSnapshot& operator=(StateSnapshot&&) noexcept;
  /// Replaces every tensor of `state` with a copy (one copy for a tensor it
  /// holds twice); returns the bytes copied. The buffers of the previous
  /// take() are reused where the n-th tensor has the same shape, dtype and
  /// device; take() must not be called again before the state it last
  /// snapshotted is written.
  size_t take(StateDict& state);
  /// Bytes held by the buffers (kept between snapshots).
  size_t capacity_bytes() const;
  /// The buffers, in the order take() met the tensors.
  const std::vector<at::Tensor>& buffers() const { return buffers_; }

 private:
  /// The copy of each tensor met during one take(), by its impl.
  using Seen = std::unordered_map<const c10::TensorImpl*, at::Tensor>;
  at::Tensor copy(const at::Tensor& tensor, Seen& seen);
  /// The memcpys copy() left for the end of take(): split between this
  /// thread and a helper.
  void run_pending_copies();
  struct PendingCopy {
    at::Tensor source;  // kept alive: the state may have held the only reference
    char* to;
    size_t bytes;
  };
  std::vector<PendingCopy> pending_;
  std::unique_ptr<HelperThread> helper_;
  std::vector<at::Tensor> buffers_;
  size_t next_ = 0;
  size_t copied_ = 0;
};

}  // namespace fulgur::detail
