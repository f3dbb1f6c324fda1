#include "fulgur/utilities/host_allocator.h"

#include <climits>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "fulgur/core/errors.h"

namespace fulgur {

namespace {

// The environment variables and GLIBC_TUNABLES names that set, at start-up,
// what this tuning changes (mallopt(3); glibc's manual, "Memory Allocation
// Tunables"). Other tunables (glibc.malloc.hugetlb, the thread caches, the
// arenas) are independent of it and stay as the user set them.
constexpr const char* kMallocVariables[] = {"MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_",
                                            "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"};
constexpr const char* kMallocTunables[] = {"glibc.malloc.mmap_max", "glibc.malloc.mmap_threshold",
                                           "glibc.malloc.trim_threshold", "glibc.malloc.top_pad"};

/// The first of kMallocTunables that `tunables` (GLIBC_TUNABLES's
/// name=value:name=value list) sets; empty when none. An entry without "="
/// sets nothing (glibc skips it).
std::string conflicting_tunable(const std::string& tunables) {
  for (const std::string& item : split_list(tunables, ':')) {
    const size_t equals = item.find('=');
    if (equals == std::string::npos) continue;
    const std::string name = item.substr(0, equals);
    for (const char* known : kMallocTunables) {
      if (name == known) return name;
    }
  }
  return "";
}

}  // namespace

HostAllocatorTuning tune_host_allocator(const EnvView& env) {
  const std::string choice = env.get("FULGUR_HOST_ALLOCATOR").value_or("cached");
  if (choice != "cached" && choice != "system") {
    throw ConfigError(str("environment variable FULGUR_HOST_ALLOCATOR=\"", choice,
                          "\" is not known. Set it to \"cached\" (keep freed CPU memory for "
                          "the next step; the default) or \"system\" (glibc's own "
                          "settings), or unset it."));
  }
  if (choice == "system") return {false, "FULGUR_HOST_ALLOCATOR=system"};
  if (auto tunables = env.get("GLIBC_TUNABLES")) {
    if (auto name = conflicting_tunable(*tunables); !name.empty()) {
      return {false, str("GLIBC_TUNABLES sets ", name)};
    }
  }
  for (const char* name : kMallocVariables) {
    if (env.has(name)) return {false, str(name, " is set")};
  }
#if defined(__GLIBC__)
  // No block is mapped on its own (mmap as a fallback stays: a thread's
  // arena that cannot grow still maps), and up to 2 GiB free at the top of
  // the heap stays with the process. mallopt takes an int.
  const bool ok = mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
  if (!ok) return {false, "mallopt refused the settings"};
  return {true, ""};
#else
  return {false, "not glibc"};
#endif
}

}  // namespace fulgur
