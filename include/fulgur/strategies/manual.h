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
// Checkpoints are written by every rank: `<path>/rank-<k>-of-<n>.ckpt`, then
// `<path>/manifest.txt` by rank 0 once every shard is complete. Loading needs
// the same world size, and names the saved and current sizes otherwise.
// Several nodes need a filesystem all ranks share for `<path>`.
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
  void configure_launcher() override;
  std::string sync_batchnorm_unsupported_reason() const override {
    return "under manual the Module connects its fulgur::nn::SyncBatchNorm layers itself, with "
           "set_all_reduce";
  }

  /// Every rank writes its own shard.
  bool is_checkpoint_writer() const override { return true; }
  void save_checkpoint(torch::serialize::OutputArchive& checkpoint,
                       const std::string& path) override;
  /// Throws CheckpointError naming the saved and current world sizes, or the
  /// missing shards, or an unfinished save (no manifest).
  void load_checkpoint(const std::string& path,
                       torch::serialize::InputArchive& checkpoint) override;
  void remove_checkpoint(const std::string& path) override;
  /// The manifest and every shard it lists (any world size).
  std::string verify_checkpoint(const std::string& path) override;
  /// In each checkpoint directory under `dir`: the local rank 0 of every
  /// node removes its host's dead writers' temporary files.
  void remove_stale_checkpoint_files(const std::string& dir) override;

  /// What a checkpoint directory's manifest lists: its world size and the
  /// shards' file names. CheckpointError when the manifest is missing,
  /// damaged or fails its CRC32C.
  struct Manifest {
    int world_size = 0;
    std::vector<std::string> shards;
  };
  static Manifest read_manifest(const std::string& path);

  /// `<path>/rank-<k>-of-<n>.ckpt`.
  static std::string shard_path(const std::string& path, int rank, int world_size);
  static constexpr const char* kManifest = "manifest.txt";

  static void register_strategies(StrategyRegistry& registry);

 protected:
  /// Nothing: the Module placed itself.
  void do_setup(Module& /*module*/) override {}

 private:
  std::string name_;
};

}  // namespace fulgur
