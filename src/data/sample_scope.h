// Internal: what sample_generator() seeds from, set by a loader on the
// thread that loads a batch.
#pragma once

#include <cstdint>

namespace fulgur::detail {

class SampleScope {
 public:
  SampleScope(uint64_t seed, int64_t epoch);
  ~SampleScope();
  SampleScope(const SampleScope&) = delete;
  SampleScope& operator=(const SampleScope&) = delete;

 private:
  uint64_t previous_seed_;
  int64_t previous_epoch_;
};

}  // namespace fulgur::detail
