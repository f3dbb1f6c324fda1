// Private: a cap on the CPU tensor memory of a batch-size trial
// (Tuner::scale_batch_size on the CPU). While a HostMemoryCap lives,
// LibTorch's CPU allocator is wrapped by one that counts the bytes of the
// tensor storage allocated since, and refuses, with c10::OutOfMemoryError
// (what a GPU's caching allocator throws when its memory runs out), an
// allocation that would bring them above the cap. Storage allocated before
// (the model, data already loaded) is not counted; storage allocated under
// the cap is counted until it is freed, even after the cap is gone.
//
// One at a time, process-wide (LibTorch has one CPU allocator): create it
// while no other thread allocates tensors (before the trial's loader exists)
// and destroy it after the loader and the Trainer are gone. The wrapping
// allocator itself lives as long as the process: a storage allocated under
// the cap keeps it as its allocator (a resize_ asks it again), and once the
// cap is gone it passes every request to LibTorch's. Not installed.
#pragma once

#include <cstdint>
#include <memory>

namespace c10 {
struct Allocator;
}

namespace fulgur::detail {

class HostMemoryCap {
 public:
  explicit HostMemoryCap(int64_t bytes);
  ~HostMemoryCap();
  HostMemoryCap(const HostMemoryCap&) = delete;
  HostMemoryCap& operator=(const HostMemoryCap&) = delete;

  /// Bytes of counted storage alive now, and at most at once so far.
  int64_t live() const;
  int64_t peak() const;
  /// Allocations refused so far.
  int64_t refused() const;

  /// Whether `e` (or the exception it is) is this cap's refusal.
  static bool is_refusal(const std::exception& e);

  struct Ledger;

 private:
  std::shared_ptr<Ledger> ledger_;
  c10::Allocator* previous_ = nullptr;
};

}  // namespace fulgur::detail
