// File: fulgur/plugins/io/torch_checkpoint_io.h
#pragma once

#include <cstdint>
#include <functional>
#include <utility>

#include "fulgur/plugins/io/checkpoint_io.h"

namespace fulgur {

/// LibTorch's archive format (the zip container torch::save writes)
/// followed by a 32-byte footer with its length and CRC32C. Written to
/// `<path>.tmp.<pid>.<host>`, flushed to disk, renamed over `path`, and the
/// directory flushed: after a crash `path` holds the old checkpoint or the
/// complete new one. A write error (a full disk, no permission) is a
/// CheckpointError naming the file, the operation and the OS reason; the
/// partial file is removed.
///
/// Loading computes the checksum on a second thread while LibTorch parses
/// the file (reading it with pread), and hands nothing parsed back before it
/// matches; a parse that fails on a damaged file reports the checksum
/// mismatch, not LibTorch's error. A mismatch is a CheckpointError naming the damaged part (a
/// tensor's record, the archive's structure, its directory) and the newest
/// other checkpoint of the same directory that verifies. A file without the
/// footer, written before fulgur 0.2, loads unverified (with a warning on
/// stderr); one that had a footer and lost it is corrupt.
class TorchCheckpointIO : public CheckpointIO {
 public:
  /// A key this IO adds to every archive it saves (a reserved name; loads
  /// leave it out of the state): an archive that has it but no valid footer
  /// lost its footer, rather than predating checksums.
  static constexpr const char* kIntegrityKey = "fulgur_integrity";

  std::string_view name() const override { return "torch"; }
  /// Writes the state as a LibTorch archive (write_archive), with the
  /// footer.
  void save_checkpoint(StateDict& checkpoint, const std::string& path) override;
  /// The archive's state (read_archive), once its checksum matched; the
  /// integrity marker is not part of it.
  StateDict load_checkpoint(const std::string& path) override;
  void remove_checkpoint(const std::string& path) override;
  /// Checks the file against its checksum footer (reads it; parses
  /// nothing). A file without a footer verifies when it is one from before
  /// checksums that LibTorch reads (it loads, unverified: has_checksum()
  /// tells them apart).
  std::string verify(const std::string& path) override;
  /// From the footer when it is intact (the data's CRC32C joined with the
  /// footer's own bytes); a file without one is read whole.
  FileFingerprint fingerprint(const std::string& path) override;
  /// Whether `path` ends with a checksum footer (intact or not is verify's).
  static bool has_checksum(const std::string& path);

  /// The steps of a save, in order; a save observer runs after each (for
  /// fault-injection tests: a process killed at any of them).
  enum class SaveStep {
    kCreated,           // the temporary file exists, empty
    kWrote,             // one more chunk of the archive written (`chunk`: 0, 1, ...)
    kFlushed,           // footer written and the file fsynced and closed
    kRenamed,           // renamed over the checkpoint's path
    kDirectoryFlushed,  // the directory fsynced: the save is durable
  };
  /// Must not throw: it runs inside LibTorch's archive writer.
  using SaveObserver = std::function<void(SaveStep step, int64_t chunk)>;
  void set_save_observer(SaveObserver observer) { save_observer_ = std::move(observer); }

 private:
  using ByteSink = std::function<size_t(const void*, size_t)>;
  /// `produce` writes the archive's bytes into the sink; they go to a
  /// temporary file with the footer, fsynced, renamed over `path`, and the
  /// directory fsynced. CheckpointError on any failure (the partial file
  /// removed, a previous checkpoint at `path` untouched).
  void write_atomically(const std::string& path,
                        const std::function<void(const ByteSink&)>& produce);
  void observe(SaveStep step, int64_t chunk = 0) const {
    if (save_observer_) save_observer_(step, chunk);
  }
  SaveObserver save_observer_;
  /// Removes `<name>.tmp.<pid>.<host>` files in `dir` whose writer `pid`
  /// on this host is no longer alive (a save killed mid-write); a live
  /// writer's, and another host's (a shared file system), stay. Every save
  /// also does it in its own directory.
  void remove_stale_files(const std::string& dir) override;
};

}  // namespace fulgur
