// The CPU accelerator: device counts, and what it refuses.
#include "fulgur/accelerators/cpu.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <thread>
#include <ctime>
#include <vector>

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

// The host's statistics: the process's resident memory holds memory it
// touches, the machine's memory and swap in use are percentages, and from
// the second reading on the CPU time since the one before is there (this
// process burned some).
TEST(CPUAccelerator, DeviceStatsAreTheProcessAndMachinesMemoryAndCpuUse) {
  fulgur::CPUAccelerator cpu;
  auto first = cpu.device_stats(c10::Device(c10::kCPU));
  for (const char* key :
       {"cpu_rss_bytes", "cpu_rss_peak_bytes", "cpu_vm_percent", "cpu_swap_percent"}) {
    ASSERT_EQ(first.count(key), 1u) << key;
  }
  EXPECT_EQ(first.count("cpu_percent"), 0u);
  EXPECT_EQ(first.count("cpu_process_percent"), 0u);
  EXPECT_GT(first["cpu_rss_bytes"], 0);
  EXPECT_GE(first["cpu_rss_peak_bytes"], first["cpu_rss_bytes"]);
  EXPECT_GT(first["cpu_vm_percent"], 0);
  EXPECT_LE(first["cpu_vm_percent"], 100);
  EXPECT_GE(first["cpu_swap_percent"], 0);
  EXPECT_LE(first["cpu_swap_percent"], 100);

  // 64 MiB written, and 50 ms of this process's CPU time.
  std::vector<char> touched(64u << 20, 1);
  const std::clock_t begin = std::clock();
  volatile uint64_t sum = 0;
  while (std::clock() - begin < CLOCKS_PER_SEC / 20) sum = sum + touched[sum % touched.size()];
  auto second = cpu.device_stats(c10::Device(c10::kCPU));
  // At least the memory just written is resident (the rest of the process
  // may have given some back meanwhile: no growth is asserted).
  EXPECT_GE(second["cpu_rss_bytes"], 64 << 20);
  EXPECT_GE(second["cpu_rss_peak_bytes"], second["cpu_rss_bytes"]);
  ASSERT_EQ(second.count("cpu_percent"), 1u);
  EXPECT_GT(second["cpu_percent"], 0);
  EXPECT_LE(second["cpu_percent"], 100);
  ASSERT_EQ(second.count("cpu_process_percent"), 1u);
  EXPECT_GT(second["cpu_process_percent"], 0);
}

}  // namespace
