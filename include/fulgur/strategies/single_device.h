// File: fulgur/strategies/single_device.h
#pragma once

#include <optional>

#include "fulgur/strategies/strategy.h"

namespace fulgur {

/// One process, one device. Collectives are identities.
class SingleDeviceStrategy : public Strategy {
 public:
  /// `device` defaults to the first of parallel_devices() (set by the
  /// connector), else the CPU.
  explicit SingleDeviceStrategy(std::optional<c10::Device> device = std::nullopt);

  std::string_view name() const override { return "single_device"; }
  c10::Device root_device() const override;
  /// The device given to the constructor, if any.
  const std::optional<c10::Device>& device() const { return device_; }

  /// Registers "single_device".
  static void register_strategies(StrategyRegistry& registry);

 private:
  std::optional<c10::Device> device_;
};

}  // namespace fulgur
