// File: fulgur/strategies/checkpoint_layout.h
//
// Which ranks write which files for one checkpoint, and how the checkpoint
// at a path is read, verified and removed. A Strategy owns one, as it owns
// the CheckpointIO that writes each file; the Trainer and the callbacks reach
// it through the strategy's save_checkpoint / load_checkpoint / ... .
//
//   SingleFileCheckpoint  global rank 0 writes one file (single_device, ddp)
//   ShardedCheckpoint     every rank writes its shard into a directory
//                         `<path>/rank-<k>-of-<n>.ckpt`, then rank 0 a
//                         manifest marking it complete (manual); loading
//                         needs the world size that saved it
//
// A layout's save, load and remove are called by every rank at the same
// point; a layout whose ranks coordinate (sharded) synchronises them itself.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "fulgur/core/state_dict.h"
#include "fulgur/plugins/io/checkpoint_io.h"


namespace fulgur {

class Strategy;

class CheckpointLayout {
 public:
  virtual ~CheckpointLayout();
  /// "single_file", "sharded" (as Trainer::describe() lists it).
  virtual std::string_view name() const = 0;
  /// Whether the rank `strategy` runs writes checkpoint files.
  virtual bool is_writer(const Strategy& strategy) const = 0;
  /// Writes `checkpoint` (this rank's part) at `path` through the
  /// strategy's CheckpointIO.
  virtual void save(Strategy& strategy, StateDict& checkpoint, const std::string& path) = 0;
  /// Reads this rank's part of the checkpoint at `path`; CheckpointError
  /// naming what is wrong with it.
  virtual StateDict load(Strategy& strategy, const std::string& path) = 0;
  virtual void remove(Strategy& strategy, const std::string& path) = 0;
  /// Empty when the checkpoint at `path` is complete and verifies;
  /// otherwise what is wrong with it. Reads only.
  virtual std::string verify(Strategy& strategy, const std::string& path) = 0;
  /// What tells the checkpoint at `path` from another save's, read on this
  /// rank alone: ranks that found checkpoints under different names (mounts
  /// of one share, copies on each node) compare it before they resume.
  /// Default: the CheckpointIO's fingerprint of the file; CheckpointError
  /// when it cannot be read.
  virtual FileFingerprint fingerprint(Strategy& strategy, const std::string& path);
  /// Removes what interrupted saves left in the checkpoint directory `dir`
  /// (never a live writer's file).
  virtual void remove_stale_files(Strategy& strategy, const std::string& dir) = 0;
};

/// Global rank 0 writes one file through the CheckpointIO; every rank reads it.
class SingleFileCheckpoint : public CheckpointLayout {
 public:
  std::string_view name() const override { return "single_file"; }
  bool is_writer(const Strategy& strategy) const override;
  void save(Strategy& strategy, StateDict& checkpoint, const std::string& path) override;
  StateDict load(Strategy& strategy, const std::string& path) override;
  void remove(Strategy& strategy, const std::string& path) override;
  std::string verify(Strategy& strategy, const std::string& path) override;
  void remove_stale_files(Strategy& strategy, const std::string& dir) override;
};

/// Every rank writes its own shard; rank 0 writes `manifest.txt` (with its
/// CRC32C) once every shard is durable, so a directory without a manifest
/// is a save that did not complete. The manifest records each shard's size
/// and CRC32C (CheckpointIO::fingerprint), so a shard of another save (a
/// copy, a restore from a backup of another step) is refused rather than
/// resumed with its peers' state. Several nodes need a filesystem every
/// rank shares for the path.
class ShardedCheckpoint : public CheckpointLayout {
 public:
  std::string_view name() const override { return "sharded"; }
  /// Every rank.
  bool is_writer(const Strategy& strategy) const override;
  void save(Strategy& strategy, StateDict& checkpoint, const std::string& path) override;
  /// Throws CheckpointError naming the saved and current world sizes, or
  /// the missing shards, or an unfinished save (no manifest), or a one-file
  /// checkpoint, or a shard of another save. Whatever one rank finds wrong,
  /// every rank throws (one all-reduce, and the failing rank's reason
  /// broadcast), so none goes on into the fit alone; save agrees the same
  /// way after each of its steps.
  StateDict load(Strategy& strategy, const std::string& path) override;
  void remove(Strategy& strategy, const std::string& path) override;
  /// The manifest and every shard it lists, each against its fingerprint
  /// (any world size).
  std::string verify(Strategy& strategy, const std::string& path) override;
  /// A directory's: the size and CRC32C of its manifest, which records
  /// every shard's (a one-file checkpoint, fsdp's: the default).
  FileFingerprint fingerprint(Strategy& strategy, const std::string& path) override;
  /// In each checkpoint directory under `dir`: the local rank 0 of every
  /// node removes its host's dead writers' temporary files.
  void remove_stale_files(Strategy& strategy, const std::string& dir) override;

  /// What a checkpoint directory's manifest lists: its world size, the
  /// shards' file names and what each held as it was saved. CheckpointError
  /// when the manifest is missing, damaged or fails its CRC32C.
  struct Manifest {
    int world_size = 0;
    std::vector<std::string> shards;
    /// In the order of `shards`; empty in a manifest from before fulgur
    /// recorded them (such a checkpoint cannot tell a foreign shard).
    std::vector<FileFingerprint> fingerprints;
  };
  static Manifest read_manifest(const std::string& path);
  /// Empty when every shard the manifest lists exists; otherwise the
  /// CheckpointError's message naming the missing ones.
  static std::string missing_shards(const std::string& path, const Manifest& manifest);
  /// Empty when shard `index` of the manifest is the file its save wrote
  /// (`io`'s fingerprint of it is the one recorded); otherwise the
  /// CheckpointError's message: the directory mixes saves.
  static std::string foreign_shard(CheckpointIO& io, const std::string& path,
                                   const Manifest& manifest, size_t index);
  /// `<path>/rank-<k>-of-<n>.ckpt`.
  static std::string shard_path(const std::string& path, int rank, int world_size);
  static constexpr const char* kManifest = "manifest.txt";
};

}  // namespace fulgur
