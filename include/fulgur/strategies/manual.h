// File: fulgur/strategies/manual.h
//
// strategy = "manual": parallelism belongs to the Module.
//
// The strategy still creates the processes (its launcher, or torchrun /
// srun / mpirun), knows the ranks, creates the default process group before
// the Module's configure_model() runs, provides the collectives to the
// Trainer and to callbacks, and tears down. It does not move the Module to a
// device, does not wrap it and does not touch its gradients: the Module
// places its parameters, creates sub-groups, wraps parts of itself (e.g. a
// fulgur::GradientReducer on a replicated sub-module) and normalises its own
// gradients. Batches are moved to root_device(); the Module may move them on.
//
// Checkpoints are sharded (ShardedCheckpoint): every rank writes
// `<path>/rank-<k>-of-<n>.ckpt`, then rank 0 `<path>/manifest.txt` once every
// shard is complete. Loading needs the same world size, and names the saved
// and current sizes otherwise. Several nodes need a filesystem all ranks
// share for `<path>`.
//
//   fulgur::Trainer trainer({.strategy = "manual", .devices = 2});
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "fulgur/strategies/parallel.h"

namespace fulgur {

/// The process group's timeout and backend, and the launcher's stop grace:
/// all `manual` has to choose (it always re-executes the program per rank).
using ManualOptions = ParallelOptions;

class ManualStrategy : public ParallelStrategy {
 public:
  explicit ManualStrategy(ManualOptions options = {}, std::string name = "manual");

  std::string_view name() const override { return name_; }
  const ManualOptions& options() const { return parallel_options(); }

  static void register_strategies(StrategyRegistry& registry);

 protected:
  /// Nothing: the Module placed itself.
  void do_setup(Module& /*module*/) override {}

 private:
  std::string name_;
};

}  // namespace fulgur
