// File: fulgur/nn/functional.h
//
// Collectives that autograd can differentiate through, for Modules that own
// their parallelism (the `manual` strategy) and for fulgur's own layers.
//
//   // Every rank's partial result, summed; gradients flow back to each rank.
//   at::Tensor full = fulgur::nn::all_reduce_sum(partial, group);
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>

namespace fulgur {
class ProcessGroup;
}

namespace fulgur::nn {

/// Sums a tensor over every rank, in place.
using AllReduceSum = std::function<void(at::Tensor&)>;

/// The sum of `x` over every rank. Differentiable: each rank's output
/// depends on every rank's input, so the gradient reaching `x` is the sum
/// over ranks of the gradients of the outputs. Every rank calls it (and runs
/// its backward) the same number of times, in the same order.
at::Tensor all_reduce_sum(const at::Tensor& x, AllReduceSum all_reduce);
/// The same over a process group.
at::Tensor all_reduce_sum(const at::Tensor& x, std::shared_ptr<ProcessGroup> group);

}  // namespace fulgur::nn
