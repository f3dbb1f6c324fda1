// Runs a step on every rank and agrees on how it went (checkpoint_layout,
// PredictionFileWriter): no rank goes on alone into a collective after a
// peer failed.
#pragma once

#include <torch/torch.h>

#include <exception>
#include <string>

#include "fulgur/core/errors.h"
#include "fulgur/core/reduce_op.h"
#include "fulgur/strategies/strategy.h"

namespace fulgur::detail {

// Runs `step` on this rank and agrees with every rank on how it went: one
// all-reduce of which ranks failed, then the first failing rank's reason
// broadcast. When any rank failed every rank throws (a failing rank its own
// error, the others "rank <k> of <n> <what>: <its reason>"), so that no rank
// goes on alone into a collective its peers never reach. The all-reduce is
// also a barrier.
template <class Step>
void on_every_rank(Strategy& strategy, const char* what, Step step) {
  std::exception_ptr error;
  std::string reason;
  try {
    step();
  } catch (const std::exception& e) {
    error = std::current_exception();
    reason = error_message(e);
  } catch (...) {
    error = std::current_exception();
    reason = "an exception that is not a std::exception";
  }
  if (strategy.world_size() > 1) {
    at::Tensor failed = torch::zeros({strategy.world_size()}, torch::kInt);
    failed[strategy.global_rank()] = error ? 1 : 0;
    const at::Tensor failing = strategy.all_reduce(failed, ReduceOp::kSum).cpu().nonzero();
    if (failing.numel() > 0) {
      const int first = static_cast<int>(failing[0][0].item<int64_t>());
      reason = strategy.broadcast_bytes(reason, first);
      if (!error) {
        throw CheckpointError(
            str("rank ", first, " of ", strategy.world_size(), " ", what, ": ", reason));
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace fulgur::detail
