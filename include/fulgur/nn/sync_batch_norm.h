// File: fulgur/nn/sync_batch_norm.h
//
// Batch normalisation whose training statistics can span every rank.
//
// LibTorch has no SyncBatchNorm, and a C++ module's typed members
// (`torch::nn::BatchNorm2d bn1;`) cannot be swapped behind the user's back
// the way Python's convert_sync_batchnorm swaps attributes. So the layer is
// declared by the user, in place of torch::nn::BatchNorm{1,2,3}d:
//
//   bn1 = register_module("bn1", fulgur::nn::SyncBatchNorm(32));
//
// With Trainer(sync_batchnorm = true) under DDP, the strategy connects each
// such layer to the process group at setup: in training, the mean and
// variance are computed over the batches of all ranks (one all-reduce of
// 2C+1 numbers per layer in forward, one in backward), exactly as one process
// would over the concatenated batch. Otherwise (one process, evaluation,
// sync_batchnorm = false) it is torch::nn::BatchNorm: same options, same
// parameter and buffer names, so checkpoints move between the two.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <ostream>

namespace fulgur::nn {

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  /// Sums a tensor over every rank, in place. Every rank calls it the same
  /// number of times, in the same order.
  using AllReduceSum = std::function<void(at::Tensor&)>;

  explicit SyncBatchNormImpl(int64_t num_features)
      : SyncBatchNormImpl(torch::nn::BatchNormOptions(num_features)) {}
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options);

  void reset() override;
  void reset_running_stats();
  void reset_parameters();
  /// Input of shape [N, C, *] (1d, 2d and 3d batch norm alike).
  at::Tensor forward(const at::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  /// Connects the layer to the ranks (null: local statistics). Called by
  /// the strategy at setup when sync_batchnorm is on.
  void set_all_reduce(AllReduceSum all_reduce);
  bool is_synchronized() const { return static_cast<bool>(all_reduce_); }

  torch::nn::BatchNormOptions options;
  at::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  at::Tensor synchronized_forward(const at::Tensor& input, double momentum);
  AllReduceSum all_reduce_;
};

TORCH_MODULE(SyncBatchNorm);

}  // namespace fulgur::nn
