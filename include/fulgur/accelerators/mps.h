// File: fulgur/accelerators/mps.h
#pragma once

#include "fulgur/accelerators/accelerator.h"

namespace fulgur {

/// Apple's Metal Performance Shaders, where LibTorch was built with them
/// (macOS on Apple silicon). One device: `devices` is 1, "auto" or [0].
class MPSAccelerator : public Accelerator {
 public:
  std::string_view name() const override { return "mps"; }
  bool is_available() const override;
  std::string unavailable_reason() const override;
  int auto_device_count() const override { return is_available() ? 1 : 0; }
  std::vector<c10::Device> parse_devices(const DevicesSpec& spec) const override;
};

}  // namespace fulgur
