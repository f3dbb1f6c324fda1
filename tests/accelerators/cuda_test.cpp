// The CUDA accelerator: both outcomes of availability, and (with a GPU) its
// device counts and indices.
#include "fulgur/accelerators/cuda.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/callbacks/device_stats_monitor.h"
#include "fulgur/core/errors.h"
#include "fulgur/trainer/trainer.h"
#include "support/test_support.h"

namespace {

// ---- CUDAAccelerator: both outcomes of availability.

TEST(CUDAAccelerator, AvailabilityMatchesLibTorch) {
  fulgur::CUDAAccelerator cuda;
  EXPECT_EQ(cuda.name(), "cuda");
  EXPECT_EQ(cuda.is_available(), torch::cuda::is_available());
  if (!cuda.is_available()) {
    EXPECT_FALSE(cuda.unavailable_reason().empty());
  } else {
    EXPECT_TRUE(cuda.unavailable_reason().empty());
  }
}

TEST(CUDAAccelerator, AskingForMoreGpusThanVisibleIsAConfigError) {
  fulgur::CUDAAccelerator cuda;
  int visible = cuda.auto_device_count();
  EXPECT_THROWS_WITH(fulgur::ConfigError, cuda.parse_devices(fulgur::DevicesSpec(visible + 1)),
                     {"accelerator=\"cuda\"", fulgur::str("devices=", visible + 1)});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     cuda.parse_devices(fulgur::DevicesSpec(std::vector<int>{visible})),
                     {"GPU index", "does not exist"});
}

TEST(CUDAAccelerator, ParsesCountsAndIndices_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  fulgur::CUDAAccelerator cuda;
  EXPECT_EQ(cuda.parse_devices(fulgur::DevicesSpec(1)),
            std::vector<c10::Device>{c10::Device(c10::kCUDA, 0)});
  EXPECT_EQ(cuda.parse_devices(fulgur::DevicesSpec("0,")),
            std::vector<c10::Device>{c10::Device(c10::kCUDA, 0)});
  EXPECT_THROWS_WITH(fulgur::ConfigError, cuda.parse_devices(fulgur::DevicesSpec("0,0")),
                     {"listed twice"});
}

// The caching allocator's counters count a tensor the device holds, and
// the device's memory is there; reading them waits for no kernel. Through
// DeviceStatsMonitor with cpu_stats=true the host's are logged beside them.
TEST(CUDAAccelerator, DeviceStatsCountTheMemoryATensorHolds_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  fulgur::CUDAAccelerator cuda;
  const c10::Device device(c10::kCUDA, 0);
  // Before CUDA is initialised there is nothing to count (no error).
  (void)cuda.device_stats(device);
  auto first = torch::zeros({1}, torch::TensorOptions().device(device));
  const auto before = cuda.device_stats(device);
  ASSERT_EQ(before.count("allocated_bytes.all.current"), 1u);
  auto held = torch::ones({16, 1024, 1024}, torch::TensorOptions().device(device));  // 64 MiB
  const auto after = cuda.device_stats(device);
  EXPECT_GE(after.at("allocated_bytes.all.current"),
            before.at("allocated_bytes.all.current") + (64 << 20));
  EXPECT_GE(after.at("allocated_bytes.all.peak"), after.at("allocated_bytes.all.current"));
  EXPECT_GE(after.at("reserved_bytes.all.current"), after.at("allocated_bytes.all.current"));
  EXPECT_GE(after.at("active_bytes.all.current"), 64 << 20);
  EXPECT_GE(after.at("allocation.all.current"), 1);
  EXPECT_EQ(after.at("num_ooms"), 0);
  EXPECT_GT(after.at("device_total_bytes"), after.at("device_free_bytes"));
  EXPECT_GT(after.at("device_free_bytes"), 0);

  fulgur::test::TempDir dir;
  auto logger = std::make_shared<fulgur::test::RecordingLogger>();
  auto monitor = std::make_shared<fulgur::DeviceStatsMonitor>(
      fulgur::DeviceStatsMonitorOptions{.cpu_stats = true});
  auto options = fulgur::test::logged_options(dir, logger, monitor);
  options.accelerator = "cuda";
  options.devices = 1;
  fulgur::test::LinearRegression model;
  fulgur::Trainer trainer(options);
  trainer.fit(model, fulgur::test::regression_loader(2));
  const auto& logged = monitor->last_logged();
  EXPECT_EQ(logged.count("DeviceStatsMonitor.on_train_batch_end/allocated_bytes.all.peak"), 1u);
  EXPECT_EQ(logged.count("DeviceStatsMonitor.on_train_batch_end/cpu_rss_bytes"), 1u);
}

}  // namespace
