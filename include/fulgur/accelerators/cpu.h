// File: fulgur/accelerators/cpu.h
#pragma once

#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "fulgur/accelerators/accelerator.h"

namespace fulgur {

/// The host's statistics, for logging (DeviceStatsMonitor; the CPU
/// accelerator's device_stats), read from /proc and getrusage:
///   cpu_rss_bytes, cpu_rss_peak_bytes  this process's resident memory, and
///                                      its most so far;
///   cpu_vm_percent, cpu_swap_percent   the machine's memory in use
///                                      (MemTotal - MemAvailable) and swap
///                                      in use, in percent (0 without swap);
/// and from its second read() on, over the time since the read before:
///   cpu_percent                        the machine's CPU time that was busy,
///                                      in percent of all its cores (left
///                                      out when the kernel's 10 ms count
///                                      has not moved since: the next
///                                      read then spans both);
///   cpu_process_percent                this process's CPU time per wall
///                                      time, in percent (100 per busy core).
/// A value /proc does not give (another kernel) is left out.
class HostStats {
 public:
  std::map<std::string, double> read();

 private:
  std::mutex mutex_;
  struct Times {
    double machine_busy = 0, machine_total = 0;  // clock ticks, /proc/stat
    double process_cpu_s = 0;
    std::chrono::steady_clock::time_point wall;
  };
  std::optional<Times> last_;
};

/// The CPU. `devices` is a number of processes (N, or -1 for one per core);
/// index lists make no sense for the CPU and are rejected.
class CPUAccelerator : public Accelerator {
 public:
  std::string_view name() const override { return "cpu"; }
  bool is_available() const override { return true; }
  int auto_device_count() const override { return 1; }
  std::vector<c10::Device> parse_devices(const DevicesSpec& spec) const override;
  /// HostStats: the process's and the machine's memory and CPU use.
  std::map<std::string, double> device_stats(c10::Device device) const override;
  bool supports_float16() const override { return false; }

 private:
  mutable HostStats host_stats_;
};

}  // namespace fulgur
