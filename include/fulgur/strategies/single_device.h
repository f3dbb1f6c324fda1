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
  explicit SingleDeviceStrategy(std::optional<c10::Device> device = std::nullopt)
      : device_(device) {}

  std::string_view name() const override { return "single_device"; }
  int max_processes() const override { return 1; }
  std::string sync_batchnorm_unsupported_reason() const override {
    return "one process has no peers";
  }
  c10::Device root_device() const override;

  void barrier(std::string_view name = {}) override;
  at::Tensor broadcast(const at::Tensor& tensor, int src = 0) override;
  std::string broadcast_bytes(const std::string& value, int /*src*/ = 0) override { return value; }
  at::Tensor all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::Mean) override;
  at::Tensor all_gather(const at::Tensor& tensor) override;

  /// Registers "single_device".
  static void register_strategies(StrategyRegistry& registry);

 private:
  std::optional<c10::Device> device_;
};

}  // namespace fulgur
