// File: src/strategies/clip_grad.h (internal)
//
// Gradient clipping by the total 2-norm without reading the norm back:
// LibTorch's clip_grad_norm_ returns the norm as a double, a host
// synchronisation per step on a GPU; this applies the same factor, computed
// and applied on the gradients' device, so eager steps (Strategy's
// clip_gradients_norm) and captured ones (cuda_graph) queue it without
// waiting.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace fulgur::detail {

/// Multiplies the gradients of `parameters` (those that have one) by
/// min(1, max_norm / (norm + 1e-6)), the norm over all of them: LibTorch's
/// clip_grad_norm_ op for op, so the same values bit for bit.
void clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm);

}  // namespace fulgur::detail
