// File: tests/support/process.h
//
// Runs a program for the multi-process tests, bounded in time: its output
// (stdout and stderr together) is collected, and on timeout its whole
// process group is killed. Afterwards it checks that nothing of that group
// is left running (no orphan ranks).
//
//   auto r = fulgur::test::run_process({worker, "--devices", "2"},
//                                      {{"MASTER_PORT", "29512"}}, 60s);
//   EXPECT_EQ(r.exit_code, 0) << r.output;
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace fulgur::test {

struct ProcessResult {
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;
  bool timed_out = false;
  /// Processes of its group still alive after it ended (orphans), killed.
  int leftover_processes = 0;
  double seconds = 0;
  std::string output;
};

/// `env` is added to this process's environment; names in `unset` are
/// removed (so a test's own variables do not leak into the child).
ProcessResult run_process(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& env,
                          std::chrono::seconds timeout, const std::vector<std::string>& unset = {});

/// Runs one test of this test program (`test`: "Suite.Name") in a process of
/// its own, with `env` added: for a child that trains after this process
/// has (LibTorch 2.x refuses autograd in a child forked from a process that
/// has used it: run_in_child cannot). The child test reads its orders from
/// `env` and skips without them.
ProcessResult run_test_alone(const std::string& test, const std::map<std::string, std::string>& env,
                             std::chrono::seconds timeout);

/// The value of the last "RESULT key=value" in `output` (anywhere in a
/// line), or "" when absent.
std::string result_value(const std::string& output, const std::string& key);

/// Whether `program` is found on PATH.
bool on_path(const std::string& program);

/// The Python whose PyTorch provides torchrun: the interpreter of the
/// `torchrun` on PATH (a pip-installed PyTorch's, where /usr/bin/python3 may
/// have no torch), else `python3` on PATH, when it imports torch's launcher.
std::string torch_python();

}  // namespace fulgur::test
