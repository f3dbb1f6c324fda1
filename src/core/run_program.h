// Internal: runs another program (gnuplot, scontrol) to its end, bounded in
// time, feeding it `input` and collecting what it prints.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace fulgur::detail {

struct ProgramResult {
  /// The errno of a program that could not be started (not on PATH); 0 when it ran.
  int spawn_error = 0;
  /// Killed after the time allowed.
  bool timed_out = false;
  /// waitpid's status, when it ran.
  int status = 0;
  /// What it wrote to stdout and stderr, in order.
  std::string output;

  /// It ran and exited with status 0.
  bool succeeded() const;
  /// "exited with status 2" or "was killed by signal 9 (SIGKILL)".
  std::string how_it_ended() const;
};

/// Runs `argv` (argv[0] is looked up on PATH) with `input` on its stdin,
/// its stdout and stderr collected; kills it after `timeout`. SIGPIPE is
/// ignored while writing the input, so a program that exits early does not
/// end the caller. `blocked_signals` are blocked in the program (they stay
/// pending, so a program that does not unblock them is not ended by them).
ProgramResult run_program(const std::vector<std::string>& argv, const std::string& input,
                          std::chrono::milliseconds timeout,
                          const std::vector<int>& blocked_signals = {});

}  // namespace fulgur::detail
