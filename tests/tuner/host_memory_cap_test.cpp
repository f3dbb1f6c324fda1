// The cap on a trial's CPU tensors: what it counts (storage allocated while
// it lives, until freed; raw allocations too), the refusal (c10::OutOfMemoryError naming the
// sizes, recognised as the cap's), the peak, and LibTorch's own allocator
// back once it is gone.
#include <c10/core/CPUAllocator.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "fulgur/core/errors.h"
#include "fulgur/utilities/torch_compat.h"
#include "tuner/host_memory_cap.h"

namespace {

using fulgur::detail::HostMemoryCap;

TEST(HostMemoryCap, CountsTensorsAllocatedUnderItAndRefusesOnePastTheCap) {
  c10::Allocator* const before = c10::GetCPUAllocator();
  const at::Tensor old = torch::zeros({1024});  // not counted: allocated before
  EXPECT_EQ(old.numel(), 1024);
  at::Tensor kept;
  {
    HostMemoryCap cap(64 * 1024);
    EXPECT_NE(c10::GetCPUAllocator(), before);
    EXPECT_EQ(cap.live(), 0);
    {
      const at::Tensor a = torch::zeros({4096});  // 16 KiB
      EXPECT_EQ(cap.live(), 16384);
      kept = torch::ones({2048});  // 8 KiB
      EXPECT_EQ(cap.live(), 24576);
    }
    EXPECT_EQ(cap.live(), 8192) << "freed storage is given back";
    EXPECT_EQ(cap.peak(), 24576);
    try {
      const at::Tensor too_big = torch::zeros({16384});  // 64 KiB more
      FAIL() << "a tensor past the cap was allocated";
    } catch (const c10::OutOfMemoryError& e) {
      EXPECT_THAT(e.msg(), testing::HasSubstr("fulgur host_memory_cap: a tensor of 65536 bytes "
                                              "would bring the trial's CPU tensors to 73728 "
                                              "bytes, over the cap of 65536 bytes."));
      EXPECT_TRUE(HostMemoryCap::is_refusal(e));
    }
    // oneDNN and others allocate raw pointers (the data its own context):
    // counted alike, freed through the raw deleter.
    c10::Allocator* capped = c10::GetCPUAllocator();
    void* raw = capped->raw_allocate(4096);
    ASSERT_NE(raw, nullptr);
    EXPECT_EQ(cap.live(), 8192 + 4096);
    capped->raw_deleter()(raw);
    EXPECT_EQ(cap.live(), 8192);
    EXPECT_EQ(cap.refused(), 1);
    EXPECT_EQ(cap.live(), 8192) << "a refused allocation holds nothing";
    EXPECT_FALSE(HostMemoryCap::is_refusal(std::runtime_error("out of memory")));
    // Its text alone is enough: an error LibTorch rebuilt from it.
    EXPECT_TRUE(HostMemoryCap::is_refusal(
        std::runtime_error("worker: fulgur host_memory_cap: a tensor of 4 bytes ...")));
  }
  EXPECT_EQ(c10::GetCPUAllocator(), before) << "LibTorch's allocator is back";
  // Storage allocated under the cap outlives it: it still reads, grows
  // (resize_ asks the allocator that made it, which now passes the request
  // on) and is freed as usual.
  EXPECT_EQ(kept.sum().item<float>(), 2048.0f);
  kept.resize_({1 << 16});
  kept.fill_(1.0f);
  EXPECT_EQ(kept.sum().item<float>(), 65536.0f);
  kept = at::Tensor();
  const at::Tensor after = torch::zeros({1 << 20});  // 4 MiB: no cap now
  EXPECT_EQ(after.numel(), 1 << 20);
}

TEST(HostMemoryCap, ARawBlockFreedAcrossTheCapsLifeGoesToTheAllocatorThatMadeIt) {
  // oneDNN frees its raw blocks through the CPU allocator current at the
  // time: one made before the cap and freed under it is LibTorch's to free,
  // one made under the cap and freed after it gives its bytes back.
  void* before_cap = c10::GetCPUAllocator()->raw_allocate(1024);
  void* under_cap = nullptr;
  {
    HostMemoryCap cap(1 << 20);
    c10::GetCPUAllocator()->raw_deallocate(before_cap);
    EXPECT_EQ(cap.live(), 0) << "not the cap's";
    under_cap = c10::GetCPUAllocator()->raw_allocate(2048);
    EXPECT_EQ(cap.live(), 2048);
    // A second cap while one is in force is a bug in the caller.
    EXPECT_THROW(HostMemoryCap second(1), fulgur::InternalError);
  }
  // Freed after the cap by LibTorch's allocator (its own block inside).
  c10::GetCPUAllocator()->raw_deallocate(under_cap);
  // And a new cap starts from nothing.
  HostMemoryCap again(1 << 20);
  EXPECT_EQ(again.live(), 0);
  const at::Tensor t = torch::zeros({256});
  EXPECT_EQ(again.live(), 1024);
}

// A program's own CPU allocator (a pool, a tracker), passing every request
// to LibTorch's.
class ProgramAllocator final : public c10::Allocator {
 public:
  explicit ProgramAllocator(c10::Allocator* inner) : inner_(inner) {}
#if FULGUR_TORCH_AT_LEAST(2, 3)
  c10::DataPtr allocate(size_t n) override { return inner_->allocate(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count > 0) std::memcpy(dest, src, count);
  }
#else
  c10::DataPtr allocate(size_t n) const override { return inner_->allocate(n); }
#endif
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }

 private:
  c10::Allocator* inner_;
};

TEST(HostMemoryCap, AnAllocatorSetWithAHigherPriorityIsNamedNotSilentlyLeftUncapped) {
  // In a child process (started afresh: LibTorch has threads): an allocator
  // set above LibTorch's priority stays for the process's life.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        static ProgramAllocator program(c10::GetCPUAllocator());
        c10::SetCPUAllocator(&program, 1);
        int status = 1;  // no error
        try {
          HostMemoryCap cap(1 << 20);
        } catch (const fulgur::ConfigError& e) {
          const std::string text = e.what();
          status = text.find("replaced by one set with a higher priority") != std::string::npos &&
                           text.find("Find the batch size without that allocator") !=
                               std::string::npos
                       ? 2
                       : 3;
        }
        // The program's allocator is still the one in force, and serves.
        if (c10::GetCPUAllocator() != &program) status = 4;
        if (torch::ones({64}).sum().item<float>() != 64.0f) status = 5;
        std::exit(status);
      },
      testing::ExitedWithCode(2), "");
}

}  // namespace
