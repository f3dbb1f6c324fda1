// File: src/utilities/host_copy.h (internal)
//
// A small tensor's values brought to the host without the host waiting at
// the copy: from CUDA, the copy goes into page-locked memory in stream order
// and an event is recorded after it; the host waits only when it reads, by
// when the work queued behind the copy keeps the device busy. Used for the
// numbers a step decides on the device and the host needs later (DDP's
// contributing ranks and stop votes, the loss scaler's inf verdict):
//
//   AsyncHostCopy copy;
//   copy.start(found_inf);               // queued; the host goes on
//   ... queue more work ...
//   float found = copy.read().item<float>();  // waits for the copy only
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <optional>

namespace fulgur::detail {

class AsyncHostCopy {
 public:
  /// Starts bringing `values` to the host: from CUDA into a page-locked
  /// buffer (kept for the next start() of the same size and dtype) with an
  /// event after the copy; a CPU tensor is kept as it is (not copied: the
  /// caller must not change it before reading); another device's is copied
  /// by read().
  void start(const at::Tensor& values);
  /// Whether a start() has not been read yet.
  bool unread() const { return unread_; }
  /// The values of the last start(), as a CPU tensor, after waiting for
  /// their copy (by polling its event: c10::Event has no wait of its own
  /// before LibTorch 2.4). Undefined before the first start().
  const at::Tensor& read();

 private:
  at::Tensor host_;
  // host_ is the page-locked buffer and the last start() copied into it
  // from CUDA: read after copied_.
  bool pinned_ = false;
  std::optional<c10::Event> copied_;
  bool unread_ = false;
};

}  // namespace fulgur::detail
