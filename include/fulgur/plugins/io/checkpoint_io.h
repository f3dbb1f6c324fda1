// File: fulgur/plugins/io/checkpoint_io.h
//
// CheckpointIO moves checkpoints between memory and disk: save, load,
// remove. It never decides which rank writes; the Strategy does.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "fulgur/core/registry.h"

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace fulgur {

class CheckpointIO {
 public:
  virtual ~CheckpointIO() = default;
  virtual std::string_view name() const = 0;
  /// Writes `checkpoint` to `path` atomically: readers see the old file or the
  /// complete new one, never a partial file. Creates parent directories.
  virtual void save_checkpoint(torch::serialize::OutputArchive& checkpoint,
                               const std::string& path) = 0;
  /// Reads `path` into `checkpoint`. Throws CheckpointError naming the file
  /// when it is missing or unreadable.
  virtual void load_checkpoint(const std::string& path,
                               torch::serialize::InputArchive& checkpoint) = 0;
  /// Removes `path`; a missing file is not an error.
  virtual void remove_checkpoint(const std::string& path) = 0;
  /// Empty when `path` holds a complete, intact checkpoint; otherwise what
  /// is wrong with it, in one sentence. Changes nothing. Default: a load
  /// into a scratch archive (an IO with a cheaper check overrides it).
  virtual std::string verify(const std::string& path);
  /// Removes what interrupted saves left in `dir` (a killed writer's
  /// temporary files), never a live writer's file or a checkpoint.
  /// ModelCheckpoint calls it at the start of fit. Default: nothing.
  virtual void remove_stale_files(const std::string& /*dir*/) {}
};

using CheckpointIORegistry = Registry<CheckpointIO>;
CheckpointIORegistry& checkpoint_io_registry();

}  // namespace fulgur
