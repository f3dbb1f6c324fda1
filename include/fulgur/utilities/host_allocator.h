// File: fulgur/utilities/host_allocator.h
//
// How the C library serves LibTorch's CPU tensors. glibc's malloc maps every
// large block (above 128 KiB, a threshold it raises up to 32 MiB) with mmap
// and unmaps it on free, so a training step that allocates and frees the
// same large activations every step takes a page fault for every 4 KiB of
// them, every step. The Fashion-MNIST example spent 40% of its time in the
// kernel that way (2.2 million page faults in 30 steps; 26 s, and 6.4 s once
// freed memory is reused).
//
// tune_host_allocator() makes malloc keep freed memory in the process for the
// next step instead (what LibTorch's caching allocator does on a GPU): large
// blocks come from the heap rather than from mmap, and the heap's top is
// returned to the system only beyond 2 GiB free. The process's resident size
// stays near its peak instead of falling between steps. The Trainer calls it
// at the start of every fit, validate, test and predict, in every rank.
//
//   FULGUR_HOST_ALLOCATOR=cached   the default: tune (above)
//   FULGUR_HOST_ALLOCATOR=system   leave glibc's defaults
//
// Settings of the user's own win: when GLIBC_TUNABLES sets
// glibc.malloc.mmap_max, mmap_threshold, trim_threshold or top_pad, or
// MALLOC_MMAP_MAX_, MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or
// MALLOC_TOP_PAD_ is set, nothing is changed. Other malloc tunables (such as
// glibc.malloc.hugetlb, huge pages for the heap) do not touch what this
// changes, and the tuning applies with them. Without glibc it does nothing.
#pragma once

#include <string>

#include "fulgur/core/env.h"

namespace fulgur {

struct HostAllocatorTuning {
  /// Whether malloc's settings were changed by this call.
  bool applied = false;
  /// Why not, when not: "FULGUR_HOST_ALLOCATOR=system", "GLIBC_TUNABLES
  /// sets glibc.malloc.trim_threshold", "MALLOC_TOP_PAD_ is set", "not
  /// glibc", ...
  std::string reason;
};

/// Tunes malloc as described above, unless `env` says otherwise. Throws
/// ConfigError naming the value when FULGUR_HOST_ALLOCATOR is neither
/// "cached" nor "system". Safe to call more than once.
HostAllocatorTuning tune_host_allocator(const EnvView& env = EnvView());

}  // namespace fulgur
