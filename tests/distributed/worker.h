// Runs tests/distributed/ddp_worker.cpp (FULGUR_DDP_WORKER) with `args`
// under a time limit, expecting it to finish and leave no process behind.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "support/process.h"

namespace fulgur::test {

inline ProcessResult run_worker(std::vector<std::string> args,
                                std::map<std::string, std::string> env = {},
                                std::chrono::seconds timeout = std::chrono::seconds(120)) {
  args.insert(args.begin(), FULGUR_DDP_WORKER);
  auto r = run_process(args, env, timeout);
  EXPECT_FALSE(r.timed_out) << "the worker did not finish in " << timeout.count() << " s:\n"
                            << r.output;
  EXPECT_EQ(r.leftover_processes, 0) << "processes were left running:\n" << r.output;
  return r;
}

}  // namespace fulgur::test
