// AsyncHostCopy: a small tensor's values on the host, the copy from CUDA
// queued (page-locked buffer, event) and waited for only when read.
#include "utilities/host_copy.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "support/test_support.h"

namespace {

using fulgur::detail::AsyncHostCopy;

TEST(AsyncHostCopy, NothingToReadBeforeTheFirstStart) {
  AsyncHostCopy copy;
  EXPECT_FALSE(copy.unread());
  EXPECT_FALSE(copy.read().defined());
}

TEST(AsyncHostCopy, ACpuTensorIsReadOnceAsItWas) {
  AsyncHostCopy copy;
  copy.start(torch::tensor({1.5, -2.0, 3.0}, torch::kDouble));
  EXPECT_TRUE(copy.unread());
  const at::Tensor values = copy.read();
  EXPECT_FALSE(copy.unread());
  ASSERT_TRUE(values.is_cpu());
  EXPECT_TRUE(torch::equal(values, torch::tensor({1.5, -2.0, 3.0}, torch::kDouble)));
  // A second read returns the same values without a new start.
  EXPECT_TRUE(torch::equal(copy.read(), values));
  copy.start(torch::tensor({7.0f}));
  EXPECT_TRUE(copy.unread());
  EXPECT_EQ(copy.read().item<float>(), 7.0f);
}

TEST(AsyncHostCopy, ACudaTensorArrivesAfterTheWorkQueuedBeforeItIntoOneKeptBuffer_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  AsyncHostCopy copy;
  const auto cuda = torch::TensorOptions(torch::kFloat).device(torch::kCUDA, 0);
  // Enough queued work before the copy that it is not done at start().
  at::Tensor big = torch::ones({4096, 4096}, cuda);
  for (int i = 0; i < 8; ++i) big = big.matmul(big) / 4096.0;
  const at::Tensor sum = big.sum().reshape({1}) + 2.0f;  // 4096 * 4096 + 2
  copy.start(sum);
  const at::Tensor& first = copy.read();
  ASSERT_TRUE(first.is_cpu());
  EXPECT_TRUE(first.is_pinned());
  EXPECT_EQ(first.item<float>(), 4096.0f * 4096.0f + 2.0f);
  const void* buffer = first.data_ptr();
  copy.start(torch::full({1}, 5.0f, cuda));
  EXPECT_EQ(copy.read().data_ptr(), buffer) << "the page-locked buffer is kept";
  EXPECT_EQ(copy.read().item<float>(), 5.0f);
  copy.start(torch::full({3}, 6.0, cuda.dtype(torch::kDouble)));
  EXPECT_TRUE(torch::equal(copy.read(), torch::full({3}, 6.0, torch::kDouble)));
}

}  // namespace
