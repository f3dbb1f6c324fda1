// Recovery with real processes over 127.0.0.1 (README "When things fail"):
// fulgur's launchers restart every rank after one is killed, frozen or hung,
// and the run ends bit-identical (parameters and optimizer state) to one
// that was never interrupted; frozen, hung and desynchronised ranks are
// named; a signalled launcher ends with 128 + the signal and leaves nothing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <filesystem>
#include <algorithm>
#include <cstdlib>
#include <random>

#include "distributed/worker.h"
#include "support/process.h"
#include "support/test_support.h"

namespace {

using fulgur::test::count_occurrences;
using fulgur::test::expect_identical_runs;
using fulgur::test::ProcessResult;
using fulgur::test::recovery_training;
using fulgur::test::result_value;
using fulgur::test::run_worker;
using fulgur::test::TempDir;
using namespace std::chrono_literals;

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

void expect_success(const ProcessResult& r, const std::string& what) {
  EXPECT_EQ(r.exit_code, 0) << what << ":\n" << r.output;
  EXPECT_EQ(result_value(r.output, "global_step"), "30") << what << ":\n" << r.output;
}

// One rank SIGKILLed at a step drawn from the seed (several seeds, both
// launchers), then two ranks killed in turn, each restart resuming from
// the newest checkpoint: every run ends bit-identical to the uninterrupted one.
TEST(Recovery, RanksKilledAtRandomStepsAreRestartedAndTheRunEndsBitIdentical) {
  for (const std::string strategy : {"ddp", "ddp_fork"}) {
    for (int seed : {3, 11}) {
      SCOPED_TRACE(strategy + " seed " + std::to_string(seed));
      TempDir dir;
      const std::string d = dir.path();
      expect_success(run_worker(recovery_training(strategy, seed, d, "reference")), "reference");
      // The draw is the seed's: a failure names steps that reproduce it.
      std::mt19937 draw(static_cast<unsigned>(seed));
      std::uniform_int_distribution<int> step(1, 29);
      const int rank = seed % 2;
      const std::string kill = std::to_string(rank) + ":" + std::to_string(step(draw));
      auto once = run_worker(with(recovery_training(strategy, seed, d, "once"),
                                  {"--max-restarts", "1", "--kill", kill}));
      expect_success(once, "killed once at " + kill);
      EXPECT_EQ(
          count_occurrences(once.output, "fulgur: restart 1 of 1: rank " + std::to_string(rank)), 1)
          << once.output;
      EXPECT_NE(once.output.find("SIGKILL"), std::string::npos) << once.output;
      expect_identical_runs(d, "reference", "once");

      const std::string first = "0:" + std::to_string(step(draw)) + ":0";
      const std::string second = "1:" + std::to_string(step(draw)) + ":1";
      auto twice = run_worker(with(recovery_training(strategy, seed, d, "twice"),
                                   {"--max-restarts", "2", "--kill", first, "--kill", second}));
      expect_success(twice, "killed at " + first + " and " + second);
      EXPECT_EQ(count_occurrences(twice.output, "fulgur: restart "), 2) << twice.output;
      expect_identical_runs(d, "reference", "twice");
    }
  }
}

TEST(Recovery, ARankKilledBeforeTheFirstCheckpointStartsAgainFromTheBeginning) {
  TempDir dir;
  const std::string d = dir.path();
  expect_success(run_worker(recovery_training("ddp", 5, d, "reference")), "reference");
  auto r = run_worker(
      with(recovery_training("ddp", 5, d, "early"), {"--max-restarts", "1", "--kill", "1:2"}));
  expect_success(r, "killed before step 2");
  EXPECT_NE(r.output.find("starting again from the beginning"), std::string::npos) << r.output;
  expect_identical_runs(d, "reference", "early");
}

TEST(Recovery, WhenTheRestartsAreUsedUpTheLastFailureIsReported) {
  TempDir dir;
  auto r = run_worker(with(recovery_training("ddp", 5, dir.path(), "run"),
                           {"--max-restarts", "1", "--kill", "1:6:0", "--kill", "0:9:1"}));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "fulgur: restart "), 1) << r.output;
  EXPECT_NE(r.output.find("launcher: rank 0 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("No restart left: the ranks were started 2 times (max_restarts=1)"),
            std::string::npos)
      << r.output;
}

// A single process has no launcher to restart it: killed, then run again
// with ckpt_path="auto", it ends as if never stopped.
TEST(Recovery, ASingleProcessKilledAndRunAgainWithAutoEndsBitIdentical) {
  TempDir dir;
  const std::string d = dir.path();
  expect_success(run_worker(recovery_training("auto", 7, d, "reference")), "reference");
  auto killed = run_worker(with(recovery_training("auto", 7, d, "run"), {"--kill", "0:13"}));
  EXPECT_EQ(killed.signal, SIGKILL) << killed.output;
  auto again = run_worker(with(recovery_training("auto", 7, d, "run"), {"--ckpt-path", "auto"}));
  expect_success(again, "run again");
  expect_identical_runs(d, "reference", "run");
}

// The steps a kill is most likely to get wrong under a schedule (every
// recovery run has 20 steps per epoch and a checkpoint every 4 steps):
// just before the epoch boundary (19: the epoch's last batch, whose
// checkpoint at 20 is written before the epoch's scheduler step), just
// after it (20, 21), and just after a mid-epoch checkpoint (9, 13). Their
// order is drawn from `seed`. A second kill comes at a step drawn from 25
// to 29: resumed from a checkpoint written after the epoch's scheduler
// step (24 or 28), where a per-epoch schedule shows a lost learning rate.
std::vector<int> critical_kill_steps(unsigned seed) {
  std::vector<int> steps = {19, 20, 21, 9, 13};
  std::mt19937 draw(seed);
  std::shuffle(steps.begin(), steps.end(), draw);
  return steps;
}

// `args` under a schedule. LibTorch's StepLR leaves the rate alone at its
// first step (PyTorch's constructor step), so "epoch" runs 10 steps per
// epoch: its rate halves at the boundary of step 20, after the second.
std::vector<std::string> scheduled(std::vector<std::string> args, const std::string& schedule) {
  if (schedule == "epoch") {
    auto samples = std::find(args.begin(), args.end(), "--samples");
    EXPECT_NE(samples, args.end());
    if (samples != args.end()) *std::next(samples) = "160";
  }
  return with(std::move(args), {"--schedule", schedule});
}

// Under a learning-rate schedule stepped every epoch (StepLR) and one
// stepped every optimizer step (a warm-up, then a cosine decay), for each
// strategy with a launcher: two ranks killed in turn, the first at a
// critical step, the second at a step drawn from 25 to 29. The learning
// rate and the schedule's position come back exactly: parameters,
// optimizer state and learning rates end bit-identical.
TEST(Recovery, UnderALearningRateScheduleKilledRanksEndBitIdentical) {
  const unsigned seed = 29;
  const std::vector<int> critical = critical_kill_steps(seed);
  std::mt19937 draw(seed);
  size_t next_critical = 0;
  for (const std::string schedule : {"epoch", "step"}) {
    for (const std::string strategy : {"ddp", "ddp_fork", "fsdp"}) {
      const int first = critical[next_critical++ % critical.size()];
      const int second = std::uniform_int_distribution<int>(25, 29)(draw);
      const std::string kill_first =
          std::to_string(draw() % 2) + ":" + std::to_string(first) + ":0";
      const std::string kill_second =
          std::to_string(draw() % 2) + ":" + std::to_string(second) + ":1";
      SCOPED_TRACE(strategy + ", schedule " + schedule + ", killed at " + kill_first + " and " +
                   kill_second);
      TempDir dir;
      const std::string d = dir.path();
      expect_success(
          run_worker(scheduled(recovery_training(strategy, 5, d, "reference"), schedule)),
          "reference");
      auto killed =
          run_worker(with(scheduled(recovery_training(strategy, 5, d, "killed"), schedule),
                          {"--max-restarts", "2", "--kill", kill_first, "--kill", kill_second}));
      expect_success(killed, "killed twice");
      EXPECT_EQ(count_occurrences(killed.output, "fulgur: restart "), 2) << killed.output;
      // The ranks were started by fulgur's launcher, which restarts them.
      EXPECT_EQ(killed.output.find("has no effect"), std::string::npos) << killed.output;
      expect_identical_runs(d, "reference", "killed");
    }
  }
}

// The checkpoint of `dir` (at any depth) with the highest "step=N".
std::string newest_step_checkpoint(const std::string& dir) {
  std::string best;
  long best_step = -1;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const auto at = name.find("step=");
    if (at == std::string::npos || entry.path().extension() != ".ckpt") continue;
    const long step = std::strtol(name.c_str() + at + 5, nullptr, 10);
    if (step > best_step) {
      best_step = step;
      best = entry.path().string();
    }
  }
  return best;
}

// A single process under each schedule: killed at a critical step, run
// again from the newest checkpoint's path and killed again later, then run
// again with ckpt_path="auto": it ends as if never stopped.
TEST(Recovery, ASingleProcessUnderAScheduleResumedByPathThenByAutoEndsBitIdentical) {
  const unsigned seed = 31;
  const std::vector<int> critical = critical_kill_steps(seed);
  std::mt19937 draw(seed);
  size_t next_critical = 0;
  for (const std::string schedule : {"epoch", "step"}) {
    const int first = critical[next_critical++];
    const int second = std::uniform_int_distribution<int>(25, 29)(draw);
    SCOPED_TRACE("schedule " + schedule + ", killed at " + std::to_string(first) + " and " +
                 std::to_string(second));
    TempDir dir;
    const std::string d = dir.path();
    expect_success(run_worker(scheduled(recovery_training("auto", 7, d, "reference"), schedule)),
                   "reference");
    auto killed = run_worker(with(scheduled(recovery_training("auto", 7, d, "run"), schedule),
                                  {"--kill", "0:" + std::to_string(first)}));
    EXPECT_EQ(killed.signal, SIGKILL) << killed.output;
    const std::string path = newest_step_checkpoint(d + "/run");
    ASSERT_FALSE(path.empty()) << "no checkpoint before step " << first;
    auto by_path = run_worker(with(scheduled(recovery_training("auto", 7, d, "run"), schedule),
                                   {"--ckpt-path", path, "--kill", "0:" + std::to_string(second)}));
    EXPECT_EQ(by_path.signal, SIGKILL) << path << ":\n" << by_path.output;
    auto by_auto = run_worker(
        with(scheduled(recovery_training("auto", 7, d, "run"), schedule), {"--ckpt-path", "auto"}));
    expect_success(by_auto, "run again with auto");
    expect_identical_runs(d, "reference", "run");
  }
}

// SIGSTOP: the process is alive but frozen. Named by its silent heartbeat
// in seconds, not at the 60 s process group timeout; then restarted.
TEST(Recovery, AFrozenRankIsNamedWithinTheHeartbeatTimeoutAndRestarted) {
  TempDir dir;
  const std::string d = dir.path();
  expect_success(run_worker(recovery_training("ddp", 5, d, "reference")), "reference");
  auto r = run_worker(with(recovery_training("ddp", 5, d, "frozen"),
                           {"--sigstop-rank", "1", "--fault-step", "6", "--heartbeat-timeout", "2",
                            "--max-restarts", "1"}),
                      {}, 90s);
  expect_success(r, "rank 1 stopped");
  EXPECT_NE(r.output.find("fulgur: restart 1 of 1: rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("froze: no heartbeat for"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("heartbeat_timeout is 2.0 s"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("it is stopped (SIGSTOP"), std::string::npos) << r.output;
  // Named by the heartbeat, well before the process group's 60 s.
  EXPECT_LT(r.seconds, 50) << r.output;
  expect_identical_runs(d, "reference", "frozen");
}

// Asleep on a condition variable that is never signalled, outside any
// collective, while its peer waits in the gradient all-reduce.
TEST(Recovery, ARankAsleepOutsideAnyCollectiveWhileItsPeerWaitsIsNamedAsHung) {
  TempDir dir;
  auto r =
      run_worker(with(recovery_training("ddp", 5, dir.path(), "run"),
                      {"--deadlock-rank", "1", "--fault-step", "6", "--heartbeat-timeout", "2"}),
                 {}, 90s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1 deadlocks now"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("launcher: rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("hung outside any collective"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("while rank 0 waited for it in all_reduce #"), std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 50) << r.output;
}

// Rank 1 calls a barrier its peer does not: both wait until the process
// group timeout, and the report says they wait in different collectives.
TEST(Recovery, RanksWaitingInDifferentCollectivesAreNamedAsADesync) {
  TempDir dir;
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "20", "--desync-rank", "1",
                       "--fault-step", "3", "--timeout", "4", "--root", dir.path()},
                      {}, 90s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("What each rank was doing when last heard from:"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("rank 1: in barrier #"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 0: in all_reduce #"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("wait in different collectives"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("a desync"), std::string::npos) << r.output;
}

// SIGTERM / SIGINT to the launcher: every rank stopped (named by pid), and
// the launcher ends by the same signal (a shell sees 128 + the signal).
TEST(Recovery, ALauncherStoppedByASignalEndsByItAndNamesTheRanksItStopped) {
  for (const std::string strategy : {"ddp", "ddp_fork"}) {
    for (int sig : {SIGTERM, SIGINT}) {
      SCOPED_TRACE(strategy + " signal " + std::to_string(sig));
      TempDir dir;
      auto r = run_worker(
          {"--strategy", strategy, "--devices", "2", "--steps", "1000", "--samples", "100000",
           "--signal-launcher-rank", "1", "--launcher-signal", std::to_string(sig), "--fault-step",
           "3", "--timeout", "60", "--root", dir.path()},
          {}, 60s);
      EXPECT_EQ(r.signal, sig) << r.output;
      EXPECT_NE(r.output.find("stopped every rank: 0 (pid "), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("Exiting with status " + std::to_string(128 + sig)),
                std::string::npos)
          << r.output;
    }
  }
}

// The fork launcher's results travel through a file without a name: a
// launcher killed by SIGKILL leaves nothing in TMPDIR (its ranks die with it).
TEST(Recovery, AForkLauncherKilledBySigkillLeavesNothingInTmpdir) {
  TempDir dir, tmp;
  auto r = run_worker(
      {"--strategy", "ddp_fork", "--devices", "2", "--steps", "1000", "--samples", "100000",
       "--signal-launcher-rank", "1", "--launcher-signal", std::to_string(SIGKILL), "--fault-step",
       "3", "--timeout", "60", "--root", dir.path()},
      {{"TMPDIR", tmp.path()}}, 60s);
  EXPECT_EQ(r.signal, SIGKILL) << r.output;
  std::vector<std::string> left;
  for (const auto& entry : std::filesystem::directory_iterator(tmp.path())) {
    left.push_back(entry.path().string());
  }
  EXPECT_TRUE(left.empty()) << "left in TMPDIR: " << left.front();
}

}  // namespace
