// File: fulgur/strategies/launchers/launcher.h
//
// A Launcher creates (or adopts) the worker processes and runs a function on
// every rank. It is owned by its Strategy; the Trainer asks the strategy for
// it and, when there is one, calls launch(fn) instead of fn().
//
//   if (auto* launcher = strategy.launcher()) launcher->launch(run);
//   else run();
#pragma once

#include <functional>
#include <string_view>

namespace fulgur {

class Launcher {
 public:
  virtual ~Launcher() = default;
  /// "subprocess_script", "fork".
  virtual std::string_view name() const = 0;
  /// Whether it can run from an interactive session (no re-executed script).
  virtual bool is_interactive_compatible() const = 0;
  /// Runs `fn` on every local rank; returns in the calling process once rank
  /// 0 is done, with rank 0's results available there. Throws
  /// DistributedError when a rank fails, naming it and how it died.
  virtual void launch(const std::function<void()>& fn) = 0;
};

}  // namespace fulgur
