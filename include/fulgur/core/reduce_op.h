// File: fulgur/core/reduce_op.h
//
// How values combine: a collective across ranks (fulgur/distributed/types.h)
// and a logged value over an epoch (LogOptions::reduce) use the same four.
//
//   group->all_reduce_(grad, fulgur::ReduceOp::kSum);
//   log("val_loss", loss, {.sync_dist = true, .reduce = fulgur::ReduceOp::kMean});
#pragma once

namespace fulgur {

enum class ReduceOp { kSum, kMean, kMax, kMin };

/// "sum", "mean", "max", "min".
inline const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMean: return "mean";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

}  // namespace fulgur
