// File: fulgur/callbacks/on_exception_checkpoint.h
//
// When fit fails with an exception (a NaN check, a bug in a step, a peer
// that died), saves a checkpoint of the state the run had reached, named in
// a message, before the error reaches the caller. An error before fit
// started (a bad flag, a missing file) saves nothing.
#pragma once

#include <chrono>

#include <string>

#include "fulgur/callbacks/callback.h"

namespace fulgur {

struct OnExceptionCheckpointOptions {
  /// Default: the run's checkpoint directory (<default_root_dir>/checkpoints,
  /// or the ModelCheckpoint's dirpath).
  std::string dirpath = "";
  std::string filename = "on_exception";
  /// Where saving runs collectives (sharded checkpoints, fsdp), the save
  /// happens only when every rank reaches it within this time (all failed
  /// together); after an error on some ranks only, the others are in
  /// another collective and the save would wait for them until the process
  /// group's timeout: it is skipped, with a note.
  std::chrono::milliseconds peer_timeout = std::chrono::seconds(30);
};

class OnExceptionCheckpoint : public Callback {
 public:
  explicit OnExceptionCheckpoint(OnExceptionCheckpointOptions options = {});
  std::string state_key() const override { return "OnExceptionCheckpoint"; }
  void on_fit_start(Trainer& trainer, Module& module) override;
  void on_fit_end(Trainer& trainer, Module& module) override;
  void on_exception(Trainer& trainer, Module& module, const std::exception& error) override;
  /// Where it saved ("" while it has not).
  const std::string& saved_path() const { return saved_path_; }

 private:
  OnExceptionCheckpointOptions options_;
  bool in_fit_ = false;
  std::string saved_path_;
};

}  // namespace fulgur
