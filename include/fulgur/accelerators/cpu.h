// File: fulgur/accelerators/cpu.h
#pragma once

#include "fulgur/accelerators/accelerator.h"

namespace fulgur {

/// The CPU. `devices` is a number of processes (N, or -1 for one per core);
/// index lists make no sense for the CPU and are rejected.
class CPUAccelerator : public Accelerator {
 public:
  std::string_view name() const override { return "cpu"; }
  bool is_available() const override { return true; }
  int auto_device_count() const override { return 1; }
  std::vector<c10::Device> parse_devices(const DevicesSpec& spec) const override;
  std::map<std::string, double> device_stats(c10::Device device) const override;
  bool supports_float16() const override { return false; }
};

}  // namespace fulgur
