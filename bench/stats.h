// What the benchmarks share: wall time, medians, and waiting for a device.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <vector>

namespace fulgur_bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// Nanoseconds since the epoch (CLOCK_REALTIME): comparable across processes.
inline long long now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// Waits until `device` has run the work queued on it (a read-back); nothing
// to wait for on the CPU.
inline void sync_device(c10::Device device) {
  if (device.is_cuda()) (void)torch::zeros({1}, device).cpu();
}

}  // namespace fulgur_bench
