// File: fulgur/distributed/launchers/fork.h
//
// The `ddp_fork` / `ddp_spawn` launcher: at fit() the calling process forks
// one child per local rank and supervises them; global rank 0 saves its
// results (metrics, checkpoint paths, trained weights) and the calling
// process loads them, so after fit() its module holds the trained weights.
//
// LibTorch's OpenMP pool (libgomp) cannot be used again in a forked child
// once the parent has used it, so each child runs with one intra-op thread.
// Use `ddp` for ranks that need several threads each.
#pragma once

#include "fulgur/distributed/launchers/subprocess_script.h"

namespace fulgur {

class ForkLauncher : public Launcher {
 public:
  /// `layout` is asked at each launch().
  ForkLauncher(std::function<RankLayout()> layout, Supervision supervision);
  std::string_view name() const override { return "fork"; }
  bool is_interactive_compatible() const override { return true; }
  bool returns_to_caller() const override { return true; }
  /// Returns in the calling process once every rank exited 0, with what
  /// global rank 0's fn returned (through a temporary file without a name,
  /// so nothing is left in TMPDIR whatever ends the launcher); throws
  /// DistributedError when one failed. With Supervision::max_restarts, forks
  /// every rank again after one failed.
  std::optional<std::string> launch(const std::function<std::string()>& fn) override;

 private:
  std::function<RankLayout()> layout_;
};

}  // namespace fulgur
