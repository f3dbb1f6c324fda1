// fulgur::nn::SyncBatchNorm in one process: unsynchronised it is LibTorch's
// BatchNorm; synchronised, two "ranks" (two threads sharing an all-reduce)
// with half the batch each compute what BatchNorm computes over the whole
// batch, forward and backward. The multi-process test is in
// tests/distributed/ddp_test.cpp (DDP.SyncBatchNormMatchesOneProcessBatchNorm).
#include "fulgur/nn/sync_batch_norm.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "support/test_support.h"

namespace {

::testing::AssertionResult close(const at::Tensor& a, const at::Tensor& b, double atol = 1e-5) {
  if (a.sizes() != b.sizes())
    return ::testing::AssertionFailure() << a.sizes() << " vs " << b.sizes();
  if (torch::allclose(a, b, 1e-4, atol)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "differ by up to " << (a - b).abs().max().item<double>();
}

TEST(SyncBatchNorm, UnsynchronisedIsLibTorchsBatchNorm) {
  torch::manual_seed(0);
  auto ours = fulgur::nn::SyncBatchNorm(torch::nn::BatchNormOptions(3).momentum(0.2));
  auto theirs = torch::nn::BatchNorm2d(torch::nn::BatchNormOptions(3).momentum(0.2));
  auto x = torch::randn({4, 3, 5, 5}) * 2 + 1;
  auto xa = x.clone().requires_grad_();
  auto xb = x.clone().requires_grad_();
  auto ya = ours(xa);
  auto yb = theirs(xb);
  EXPECT_TRUE(close(ya, yb));
  (ya * ya).sum().backward();
  (yb * yb).sum().backward();
  EXPECT_TRUE(close(xa.grad(), xb.grad()));
  EXPECT_TRUE(close(ours->weight.grad(), theirs->weight.grad()));
  EXPECT_TRUE(close(ours->running_var, theirs->running_var));
  ours->eval();
  theirs->eval();
  EXPECT_TRUE(close(ours(x), theirs(x)));
}

TEST(SyncBatchNorm, HasBatchNormsParameterAndBufferNames) {
  auto ours = fulgur::nn::SyncBatchNorm(8);
  auto theirs = torch::nn::BatchNorm1d(8);
  EXPECT_EQ(ours->named_parameters().keys(), theirs->named_parameters().keys());
  EXPECT_EQ(ours->named_buffers().keys(), theirs->named_buffers().keys());
}

TEST(SyncBatchNorm, CumulativeMomentumLikeBatchNorm) {
  auto ours = fulgur::nn::SyncBatchNorm(torch::nn::BatchNormOptions(2).momentum(c10::nullopt));
  auto theirs = torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(2).momentum(c10::nullopt));
  ours->set_all_reduce([](at::Tensor&) {});  // one rank: the sum is the tensor itself
  for (int i = 0; i < 3; ++i) {
    auto x = torch::arange(12, torch::kFloat).reshape({6, 2}) * (i + 1);
    ours(x);
    theirs(x);
  }
  EXPECT_TRUE(close(ours->running_mean, theirs->running_mean));
  EXPECT_TRUE(close(ours->running_var, theirs->running_var));
  EXPECT_EQ(ours->num_batches_tracked.item().toLong(), 3);
}

TEST(SyncBatchNorm, RejectsAnInputWithOtherChannels) {
  auto bn = fulgur::nn::SyncBatchNorm(4);
  EXPECT_THROWS_WITH(fulgur::ConfigError, bn(torch::ones({2, 3})),
                     {"SyncBatchNorm(4)", "[N, 4, ...]", "[2, 3]"});
}

// An all-reduce between two threads: each call waits for the other
// thread's call of the same generation and returns the sum.
class TwoThreadSum {
 public:
  void operator()(int rank, at::Tensor& t) {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t gen = generation_;
    parts_[rank] = t.clone();
    if (++arrived_ == 2) {
      sum_ = parts_[0] + parts_[1];
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != gen; });
    }
    t.copy_(sum_);
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  at::Tensor parts_[2], sum_;
  int arrived_ = 0;
  int64_t generation_ = 0;
};

TEST(SyncBatchNorm, TwoRanksWithHalfTheBatchEqualOneWithAll) {
  torch::manual_seed(1);
  auto x = torch::randn({8, 3, 4}) * 3 - 2;
  auto target = torch::randn({8, 3, 4});
  // The reference: BatchNorm over the whole batch.
  auto reference = torch::nn::BatchNorm1d(3);
  reference->weight.data().copy_(torch::tensor({0.5f, 1.5f, -1.0f}));
  auto x_ref = x.clone().requires_grad_();
  auto y_ref = reference(x_ref);
  ((y_ref - target).pow(2)).sum().backward();

  TwoThreadSum sum;
  at::Tensor outputs[2], input_grads[2], weight_grads[2], running_means[2], running_vars[2];
  auto rank_main = [&](int rank) {
    auto bn = fulgur::nn::SyncBatchNorm(3);
    bn->weight.data().copy_(torch::tensor({0.5f, 1.5f, -1.0f}));
    bn->set_all_reduce([&sum, rank](at::Tensor& t) { sum(rank, t); });
    auto xs = x.narrow(0, rank * 4, 4).clone().requires_grad_();
    auto y = bn(xs);
    ((y - target.narrow(0, rank * 4, 4)).pow(2)).sum().backward();
    outputs[rank] = y.detach();
    input_grads[rank] = xs.grad();
    weight_grads[rank] = bn->weight.grad().clone();
    running_means[rank] = bn->running_mean.clone();
    running_vars[rank] = bn->running_var.clone();
  };
  std::thread t0(rank_main, 0), t1(rank_main, 1);
  t0.join();
  t1.join();
  EXPECT_TRUE(close(torch::cat({outputs[0], outputs[1]}), y_ref.detach()));
  EXPECT_TRUE(close(torch::cat({input_grads[0], input_grads[1]}), x_ref.grad()));
  // Each rank's weight gradient is its share; DDP sums (averages) them.
  EXPECT_TRUE(close(weight_grads[0] + weight_grads[1], reference->weight.grad()));
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(close(running_means[r], reference->running_mean));
    EXPECT_TRUE(close(running_vars[r], reference->running_var));
  }
}

}  // namespace
