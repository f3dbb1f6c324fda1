// The CUDA accelerator: both outcomes of availability, and (with a GPU) its
// device counts and indices.
#include "fulgur/accelerators/cuda.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/core/errors.h"
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

}  // namespace
