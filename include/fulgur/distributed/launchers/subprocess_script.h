// File: fulgur/distributed/launchers/subprocess_script.h
//
// The `ddp` launcher. The launching process re-executes the program (same
// executable, same arguments) once per local rank, with torchrun's
// environment contract (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
// NODE_RANK, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS = cores / ranks when
// unset), and supervises them. Each rank runs the whole program; the
// launching process only waits: when every rank exited 0 it exits 0 itself
// (code after fit() runs in the ranks, not here), and when one fails it
// stops the others and throws DistributedError.
//
// On several nodes, start the program once per node with the same
// MASTER_ADDR / MASTER_PORT and NODE_RANK = 0, 1, ...
#pragma once

#include <chrono>

#include "fulgur/distributed/launchers/launcher.h"

namespace fulgur {

class SubprocessScriptLauncher : public Launcher {
 public:
  /// `layout` is asked at each launch().
  SubprocessScriptLauncher(std::function<RankLayout()> layout, Supervision supervision);
  std::string_view name() const override { return "subprocess_script"; }
  bool is_interactive_compatible() const override { return false; }
  /// Every rank re-runs the whole program; the launching process only waits.
  bool returns_to_caller() const override { return false; }
  /// Does not return on success: the process exits 0 once every rank has
  /// (`fn` is not called here: each rank runs the program itself).
  std::optional<std::string> launch(const std::function<std::string()>& fn) override;

 private:
  std::function<RankLayout()> layout_;
};

}  // namespace fulgur
