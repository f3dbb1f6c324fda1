#include "fulgur/nn/sync_batch_norm.h"

#include <torch/torch.h>

#include "fulgur/core/errors.h"
#include "fulgur/nn/functional.h"

namespace fulgur::nn {

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options_)
    : options(options_) {
  reset();
}

void SyncBatchNormImpl::reset() {
  if (options.affine()) {
    weight = register_parameter("weight", torch::empty({options.num_features()}));
    bias = register_parameter("bias", torch::empty({options.num_features()}));
  } else {
    weight = register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", torch::zeros({options.num_features()}));
    running_var = register_buffer("running_var", torch::ones({options.num_features()}));
    num_batches_tracked = register_buffer("num_batches_tracked", torch::tensor(0, torch::kLong));
  } else {
    running_mean = register_buffer("running_mean", at::Tensor());
    running_var = register_buffer("running_var", at::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", at::Tensor());
  }
  reset_parameters();
}

void SyncBatchNormImpl::reset_running_stats() {
  if (options.track_running_stats()) {
    running_mean.zero_();
    running_var.fill_(1);
    num_batches_tracked.zero_();
  }
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (options.affine()) {
    torch::nn::init::ones_(weight);
    torch::nn::init::zeros_(bias);
  }
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "fulgur::nn::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=";
  if (options.momentum()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats()
         << ", synchronized=" << is_synchronized() << ")";
}

void SyncBatchNormImpl::set_all_reduce(AllReduceSum all_reduce) {
  all_reduce_ = std::move(all_reduce);
}

at::Tensor SyncBatchNormImpl::forward(const at::Tensor& input) {
  if (input.dim() < 2 || input.size(1) != options.num_features()) {
    throw ConfigError(str("SyncBatchNorm(", options.num_features(),
                          "): expected an input of "
                          "shape [N, ",
                          options.num_features(), ", ...], got ", c10::str(input.sizes()), "."));
  }
  // The momentum as torch::nn::BatchNorm computes it (None: cumulative average).
  double momentum = options.momentum().value_or(0.0);
  if (is_training() && options.track_running_stats()) {
    num_batches_tracked.add_(1);
    if (!options.momentum()) momentum = 1.0 / num_batches_tracked.item<double>();
  }
  if (is_training() && all_reduce_) return synchronized_forward(input, momentum);
  return torch::batch_norm(input, weight, bias, running_mean, running_var,
                           is_training() || !options.track_running_stats(), momentum, options.eps(),
                           at::globalContext().userEnabledCuDNN());
}

at::Tensor SyncBatchNormImpl::synchronized_forward(const at::Tensor& input, double momentum) {
  const int64_t channels = input.size(1);
  std::vector<int64_t> reduce_dims = {0};
  std::vector<int64_t> shape(static_cast<size_t>(input.dim()), 1);
  shape[1] = channels;
  for (int64_t d = 2; d < input.dim(); ++d) reduce_dims.push_back(d);
  // Statistics in float32 at least (under autocast the input may be bf16).
  const auto stat_type = at::promote_types(input.scalar_type(), at::kFloat);
  at::Tensor x = input.to(stat_type);
  const double local_count = static_cast<double>(input.numel() / std::max<int64_t>(channels, 1));
  at::Tensor packed = torch::cat(
      {x.sum(reduce_dims), (x * x).sum(reduce_dims), torch::full({1}, local_count, x.options())});
  at::Tensor global = all_reduce_sum(packed, all_reduce_);
  at::Tensor count = global.narrow(0, 2 * channels, 1);
  at::Tensor mean = global.narrow(0, 0, channels) / count;
  at::Tensor var = (global.narrow(0, channels, channels) / count - mean * mean).clamp_min(0.0);
  at::Tensor y = (x - mean.view(shape)) * torch::rsqrt(var + options.eps()).view(shape);
  if (options.affine()) y = y * weight.view(shape) + bias.view(shape);
  if (options.track_running_stats()) {
    torch::NoGradGuard no_grad;
    // n / (n - 1) on the device: reading the count back would make every
    // step wait for the GPU.
    at::Tensor unbiased = var.detach() * (count / (count - 1.0).clamp_min(1.0));
    running_mean.mul_(1.0 - momentum).add_(mean.detach().to(running_mean.scalar_type()), momentum);
    running_var.mul_(1.0 - momentum).add_(unbiased.to(running_var.scalar_type()), momentum);
  }
  return y.to(input.scalar_type());
}

}  // namespace fulgur::nn
