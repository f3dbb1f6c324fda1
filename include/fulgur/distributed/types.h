// File: fulgur/distributed/types.h
//
// The vocabulary of the distributed runtime shared by the layers above it
// (as c10d's Types.hpp): how a collective reduces (ReduceOp, defined in core
// because a logged value reduces the same ways).
//
//   group->all_reduce_(grad, fulgur::ReduceOp::kSum);
//   strategy.all_reduce(loss, fulgur::ReduceOp::kMean);
#pragma once

#include "fulgur/core/reduce_op.h"
