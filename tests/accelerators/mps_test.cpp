// The MPS accelerator: unavailable on Linux, with the reason.
#include "fulgur/accelerators/mps.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/core/errors.h"
#include "support/test_support.h"

namespace {

// ---- MPSAccelerator: unavailable on Linux, with the reason.

TEST(MPSAccelerator, SaysWhyItIsNotAvailable) {
  fulgur::MPSAccelerator mps;
  EXPECT_EQ(mps.name(), "mps");
  if (mps.is_available()) {
    EXPECT_EQ(mps.parse_devices(fulgur::DevicesSpec()),
              std::vector<c10::Device>{c10::Device(c10::kMPS, 0)});
    EXPECT_THROWS_WITH(fulgur::ConfigError, mps.parse_devices(2), {"one MPS device"});
    return;
  }
  EXPECT_EQ(mps.auto_device_count(), 0);
  EXPECT_TRUE(fulgur::test::message_contains(mps.unavailable_reason(), {"no MPS backend"}));
}

}  // namespace
