// The CPU accelerator: device counts, and what it refuses.
#include "fulgur/accelerators/cpu.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <thread>

#include "fulgur/core/errors.h"
#include "support/test_support.h"

namespace {

// ---- CPUAccelerator.

TEST(CPUAccelerator, ParsesCounts) {
  fulgur::CPUAccelerator cpu;
  EXPECT_EQ(cpu.name(), "cpu");
  EXPECT_TRUE(cpu.is_available());
  EXPECT_EQ(cpu.auto_device_count(), 1);
  EXPECT_EQ(cpu.parse_devices(fulgur::DevicesSpec()),
            std::vector<c10::Device>{c10::Device(c10::kCPU)});
  EXPECT_EQ(cpu.parse_devices(fulgur::DevicesSpec(3)).size(), 3u);
  auto cores = std::max(1u, std::thread::hardware_concurrency());
  EXPECT_EQ(cpu.parse_devices(fulgur::DevicesSpec(-1)).size(), static_cast<size_t>(cores));
}

TEST(CPUAccelerator, RejectsIndicesAndNonPositiveCounts) {
  fulgur::CPUAccelerator cpu;
  EXPECT_THROWS_WITH(fulgur::ConfigError, cpu.parse_devices(fulgur::DevicesSpec("0,1")),
                     {"accelerator=\"cpu\"", "0,1", "devices=2"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, cpu.parse_devices(fulgur::DevicesSpec(0)),
                     {"devices=0", "selects no device"});
  // One process per device on this machine: no more than its kernel runs
  // (refused before a list of two billion devices is made).
  EXPECT_THROWS_WITH(fulgur::ConfigError, cpu.parse_devices(fulgur::DevicesSpec(2147483647)),
                     {"devices=2147483647", "runs at most", "kernel.pid_max", "num_nodes"});
}

}  // namespace
