// File: fulgur/distributed/types.h
//
// The vocabulary of the distributed runtime shared by the layers above it
// (as c10d's Types.hpp): how a collective reduces.
//
//   group->all_reduce_(grad, fulgur::ReduceOp::Sum);
//   strategy.all_reduce(loss, fulgur::ReduceOp::Mean);
#pragma once

namespace fulgur {

/// Reduction of a collective.
enum class ReduceOp { Sum, Mean, Max, Min };
/// "sum", "mean", "max", "min".
const char* to_string(ReduceOp op);

}  // namespace fulgur
