// File: fulgur/strategies/launchers/launcher.h
//
// A Launcher creates the worker processes of one node and runs a function on
// every rank. It is owned by its Strategy; the Trainer asks the strategy for
// it and, when there is one, calls launch(fn, results) instead of fn().
//
//   if (auto* launcher = strategy.launcher()) launcher->launch(run, results);
//   else run();
//
// The launching process is the parent of every local rank: it forwards
// their output, reaps them all, and when one dies (exit code, signal, a
// hang) stops the others and throws DistributedError naming the rank, its
// pid, how it died and the last lines it printed.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace fulgur {

/// How rank 0's results reach the calling process (fork launcher): `save`
/// runs on global rank 0 after fn, writing to `path`; `load` runs in the
/// calling process once every rank succeeded.
struct LaunchResults {
  std::function<void(const std::string& path)> save;
  std::function<void(const std::string& path)> load;
};

class Launcher {
 public:
  virtual ~Launcher() = default;
  /// "subprocess_script", "fork".
  virtual std::string_view name() const = 0;
  /// Whether it can run from an interactive session (no re-executed script).
  virtual bool is_interactive_compatible() const = 0;
  /// Runs `fn` on every local rank. Throws DistributedError when a rank
  /// fails. See each launcher for what the calling process does after.
  virtual void launch(const std::function<void()>& fn, const LaunchResults& results) = 0;
};

}  // namespace fulgur
