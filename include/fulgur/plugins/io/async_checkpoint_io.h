// File: fulgur/plugins/io/async_checkpoint_io.h
//
// AsyncCheckpointIO writes checkpoints on a background thread while
// training goes on. At the save point every tensor of the checkpoint is
// copied into buffers kept between saves (a snapshot: the step after may
// change every tensor; a copy costs about a quarter of serializing); one
// writer thread then serializes and writes it through the wrapped IO, with
// that IO's guarantees (the `torch` IO: checksum footer, temporary file,
// fsync, rename, directory fsync). The snapshot is as large as the
// checkpoint's tensors, on their devices (a GPU's tensors are copied on
// that GPU); nothing else is held.
//
//   fulgur::Trainer trainer({.plugins = {"async"}});          // wraps "torch"
//   auto io = std::make_shared<fulgur::AsyncCheckpointIO>(my_io);
//
// - At most one save is in flight: a save that comes while one is being
//   written waits for it (the buffers are reused, so memory stays at one
//   checkpoint's size).
// - Removals (ModelCheckpoint's top-k eviction) run on the writer thread
//   after the saves handed over before them, so a checkpoint is never
//   removed before the one replacing it is durable.
// - A failed write is never lost: its error is thrown by the next save,
//   by raise_pending_error() (the fit loop calls it at every step boundary)
//   or by wait_until_durable() (fit calls it before returning, so fit never
//   returns before its last checkpoint is durable).
// - Loads and verification wait for the save in flight first.
#pragma once

#include <memory>
#include <string>

#include "fulgur/plugins/io/checkpoint_io.h"

namespace fulgur {

class AsyncCheckpointIO : public CheckpointIO {
 public:
  /// Wraps `io` (default: TorchCheckpointIO); its save_checkpoint runs on
  /// the writer thread, one save at a time.
  explicit AsyncCheckpointIO(std::shared_ptr<CheckpointIO> io = nullptr);
  /// Waits for the save in flight; an error nobody raised is printed.
  ~AsyncCheckpointIO() override;
  AsyncCheckpointIO(const AsyncCheckpointIO&) = delete;
  AsyncCheckpointIO& operator=(const AsyncCheckpointIO&) = delete;

  std::string_view name() const override { return "async"; }
  /// Snapshots `checkpoint`'s tensors (waiting first for a save still in
  /// flight), takes the state and returns; the write goes on in the
  /// background.
  void save_checkpoint(StateDict& checkpoint, const std::string& path) override;
  StateDict load_checkpoint(const std::string& path) override;
  /// Queued behind the saves handed over before it.
  void remove_checkpoint(const std::string& path) override;
  std::string verify(const std::string& path) override;
  /// The wrapped IO's, once the saves handed over are written.
  FileFingerprint fingerprint(const std::string& path) override;
  void remove_stale_files(const std::string& dir) override;
  void raise_pending_error() override;
  void wait_until_durable() override;

  /// The IO that writes.
  CheckpointIO& wrapped() { return *io_; }
  /// Bytes of the snapshot's buffers (kept between saves).
  size_t snapshot_bytes() const;

 private:
  struct Writer;
  /// The writer of this process (a forked child starts its own: threads do
  /// not survive fork).
  Writer& writer();
  /// Returns once the saves handed over are written (a read of a path
  /// sees the file its last save wrote).
  void drain_writer();
  std::shared_ptr<CheckpointIO> io_;
  std::unique_ptr<Writer> writer_;
};

}  // namespace fulgur
