#include "core/run_program.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <csignal>

namespace {

using fulgur::detail::run_program;
using namespace std::chrono_literals;

TEST(RunProgram, FeedsItsInputAndCollectsItsOutputAndStatus) {
  auto r = run_program({"sh", "-c", "cat; echo to-stderr >&2; exit 3"}, "line one\nline two\n", 30s);
  EXPECT_EQ(r.spawn_error, 0);
  EXPECT_FALSE(r.timed_out);
  EXPECT_FALSE(r.succeeded());
  EXPECT_EQ(r.how_it_ended(), "exited with status 3");
  EXPECT_EQ(r.output, "line one\nline two\nto-stderr");
  EXPECT_TRUE(run_program({"true"}, "", 30s).succeeded());
}

TEST(RunProgram, AMissingProgramIsASpawnError) {
  auto r = run_program({"/no/such/program"}, "", 30s);
  EXPECT_EQ(r.spawn_error, ENOENT);
  EXPECT_FALSE(r.succeeded());
  EXPECT_NE(r.how_it_ended().find("could not start"), std::string::npos);
}

TEST(RunProgram, AProgramPastItsTimeIsKilled) {
  auto r = run_program({"sleep", "30"}, "", 200ms);
  EXPECT_TRUE(r.timed_out);
  EXPECT_FALSE(r.succeeded());
  EXPECT_EQ(r.how_it_ended(), "did not finish in time and was killed");
}

TEST(RunProgram, AProgramKilledByASignalSaysWhich) {
  auto r = run_program({"sh", "-c", "kill -9 $$"}, "", 30s);
  EXPECT_EQ(r.how_it_ended(), "was killed by signal 9 (SIGKILL)");
}

TEST(RunProgram, ABlockedSignalWaitsUntilTheProgramHasExited) {
  // As scontrol requeue gets the SIGTERM of the job step it cancels.
  auto r = run_program({"sh", "-c", "kill -TERM $$; echo still running"}, "", 30s, {SIGTERM});
  EXPECT_TRUE(r.succeeded()) << r.how_it_ended();
  EXPECT_EQ(r.output, "still running");
  auto unblocked = run_program({"sh", "-c", "kill -TERM $$; echo still running"}, "", 30s);
  EXPECT_EQ(unblocked.how_it_ended(), "was killed by signal 15 (SIGTERM)");
}

}  // namespace
