// File: fulgur/plugins/io/checkpoint_io.h
//
// CheckpointIO moves checkpoints between memory and disk: save, load,
// remove. It never decides which rank writes; the Strategy does.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fulgur/core/registry.h"
#include "fulgur/core/state_dict.h"

namespace fulgur {

/// The size and CRC32C of a checkpoint file's bytes, all of them: what a
/// sharded checkpoint's manifest records of each shard, so that a shard
/// from another save is told apart from the one its save wrote.
struct FileFingerprint {
  uint64_t size = 0;
  uint32_t crc32c = 0;
  bool operator==(const FileFingerprint&) const = default;
};

class CheckpointIO {
 public:
  virtual ~CheckpointIO() = default;
  virtual std::string_view name() const = 0;
  /// Writes `checkpoint` to `path` atomically: readers see the old file or the
  /// complete new one, never a partial file. Creates parent directories. This
  /// is where the state becomes a file (its format is the IO's). An IO that
  /// writes in the background (AsyncCheckpointIO) takes the state's
  /// contents, leaving `checkpoint` empty.
  virtual void save_checkpoint(StateDict& checkpoint, const std::string& path) = 0;
  /// The state `path` holds. Throws CheckpointError naming the file when it
  /// is missing or unreadable.
  virtual StateDict load_checkpoint(const std::string& path) = 0;
  /// Removes `path`; a missing file is not an error.
  virtual void remove_checkpoint(const std::string& path) = 0;
  /// Empty when `path` holds a complete, intact checkpoint; otherwise what
  /// is wrong with it, in one sentence. Changes nothing. Default: a load
  /// whose state is dropped (an IO with a cheaper check overrides it).
  virtual std::string verify(const std::string& path);
  /// The size and CRC32C of the file at `path` as it is on disk (intact or
  /// not is verify's); CheckpointError naming the file when it cannot be
  /// read. Default: reads the file whole. An IO whose files record their
  /// own checksum computes the same value from it (TorchCheckpointIO: from
  /// its footer, 32 bytes read).
  virtual FileFingerprint fingerprint(const std::string& path);
  /// Removes what interrupted saves left in `dir` (a killed writer's
  /// temporary files), never a live writer's file or a checkpoint.
  /// ModelCheckpoint calls it at the start of fit. Default: nothing.
  virtual void remove_stale_files(const std::string& /*dir*/) {}

  // ---- Saves that finish in the background (AsyncCheckpointIO); a
  // synchronous IO has nothing to do here.

  /// Throws the error of a save that failed in the background, once. Never
  /// blocks. The fit loop calls it at every step boundary.
  virtual void raise_pending_error() {}
  /// Returns once every save handed over is durable; throws the error of
  /// one that failed. Fit calls it before it returns.
  virtual void wait_until_durable() {}
};

/// The checkpoints of directory `dir` (its `*.ckpt` entries: files, or
/// directories of per-rank shards), newest first by modification time,
/// last.ckpt first among equals. Empty when `dir` cannot be read.
std::vector<std::string> checkpoints_newest_first(const std::string& dir);

using CheckpointIORegistry = Registry<CheckpointIO>;
CheckpointIORegistry& checkpoint_io_registry();

}  // namespace fulgur
