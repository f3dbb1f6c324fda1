#include "fulgur/utilities/host_allocator.h"

#include <climits>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "fulgur/core/errors.h"

namespace fulgur {

namespace {

// The environment variables that set, at start-up, what this tuning changes
// (mallopt(3); glibc's manual, "Memory Allocation Tunables").
constexpr const char* kMallocVariables[] = {"MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_",
                                            "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"};

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
  if (auto tunables = env.get("GLIBC_TUNABLES");
      tunables && tunables->find("glibc.malloc.") != std::string::npos) {
    return {false, "GLIBC_TUNABLES sets glibc.malloc.*"};
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
