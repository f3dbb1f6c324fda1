// A real SLURM: Debian's slurmctld, two slurmd (nodes n1, n2 on this host)
// and munged, started for each test by scripts/slurm-cluster.sh and stopped
// after it (nothing left running). srun starts the ranks (detected as the
// slurm cluster environment), on one node and on two; a batch job sent its
// requeue signal (scancel --signal=USR1 --batch) writes one checkpoint,
// requeues itself once, and the requeued run resumes and ends bit-identical
// to an uninterrupted run.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "fulgur/distributed/process_group.h"
#include "support/process.h"
#include "support/test_support.h"

namespace {

using fulgur::test::count_occurrences;
using fulgur::test::ProcessResult;
using fulgur::test::result_value;
using fulgur::test::run_process;
using fulgur::test::same_params;
using fulgur::test::TempDir;
using namespace std::chrono_literals;

std::vector<std::string> with_srun(std::vector<std::string> srun,
                                   const std::vector<std::string>& program) {
  srun.insert(srun.end(), program.begin(), program.end());
  return srun;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream out;
  out << in.rdbuf();
  return out.str();
}

class Slurm : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) {
      GTEST_SKIP() << "a real SLURM runs its daemons as root; run the suite as root (CI does)";
    }
    // Short: SLURM's unix sockets live under it (107 bytes at most). The
    // munge user must pass through the test's directory (mkdtemp: 0700).
    std::filesystem::permissions(
        dir_.path(), std::filesystem::perms::group_exec | std::filesystem::perms::others_exec,
        std::filesystem::perm_options::add);
    state_ = dir_.path() + "/s";
    auto r = run_process({"bash", FULGUR_SLURM_CLUSTER, "start", "--nodes", "2"},
                         {{"FULGUR_SLURM_DIR", state_}}, 90s);
    ASSERT_EQ(r.exit_code, 0) << "scripts/slurm-cluster.sh start failed:\n" << r.output;
    started_ = true;
    env_ = {{"SLURM_CONF", state_ + "/slurm.conf"},
            // The node names n1, n2 do not resolve; every node is this host.
            {"MASTER_ADDR", "127.0.0.1"},
            {"MASTER_PORT", std::to_string(fulgur::find_free_port())},
            {"OMP_NUM_THREADS", "1"}};
  }
  void TearDown() override {
    if (!started_) return;
    auto r =
        run_process({"bash", FULGUR_SLURM_CLUSTER, "stop"}, {{"FULGUR_SLURM_DIR", state_}}, 90s);
    EXPECT_EQ(r.exit_code, 0) << "scripts/slurm-cluster.sh stop failed:\n" << r.output;
  }

  // The worker's training; `sleep_ms` per step makes it long enough to be
  // signalled.
  std::vector<std::string> worker(const std::string& name, std::vector<std::string> extra,
                                  int sleep_ms = 20) const {
    std::vector<std::string> args = {FULGUR_DDP_WORKER,
                                     "--strategy",
                                     "ddp",
                                     "--devices",
                                     "2",
                                     "--batch",
                                     "8",
                                     "--steps",
                                     "150",
                                     "--samples",
                                     "640",
                                     "--shuffle",
                                     "--optimizer",
                                     "adam",
                                     "--deterministic",
                                     "--every-n-train-steps",
                                     "4",
                                     "--step-sleep-ms",
                                     std::to_string(sleep_ms),
                                     "--timeout",
                                     "60",
                                     "--root",
                                     dir_.path() + "/" + name,
                                     "--out",
                                     dir_.path() + "/" + name + ".pt",
                                     "--out-optimizer",
                                     dir_.path() + "/" + name + "-optimizer.pt"};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }

  ProcessResult slurm(std::vector<std::string> args, std::chrono::seconds timeout = 120s) const {
    return run_process(args, env_, timeout);
  }

  // `scontrol show job -o ID`, one line of Key=Value.
  std::string job_state(const std::string& id) const {
    return slurm({"scontrol", "show", "job", "-o", id}, 20s).output;
  }

  void expect_identical(const std::string& a, const std::string& b) const {
    for (const std::string suffix : {".pt", "-optimizer.pt"}) {
      EXPECT_TRUE(same_params(dir_.path() + "/" + a + suffix, dir_.path() + "/" + b + suffix,
                              {.exact = true}))
          << a << " vs " << b << suffix;
    }
  }

  TempDir dir_;
  std::string state_;
  bool started_ = false;
  std::map<std::string, std::string> env_;
};

TEST_F(Slurm, SrunStartsTheRanksAndFulgurDetectsSlurm) {
  auto r = slurm(
      with_srun({"srun", "-N1", "-n2", "--overcommit", "-J", "train"}, worker("srun", {}, 0)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(result_value(r.output, "cluster_environment"), "slurm") << r.output;
  EXPECT_EQ(result_value(r.output, "world_size"), "2") << r.output;
  EXPECT_EQ(result_value(r.output, "global_step"), "150") << r.output;
}

#ifdef FULGUR_FASHION_EXAMPLE
// The main example, unchanged, as two SLURM tasks: detected as slurm (the
// description it prints), trained for 60 steps, tested on every image.
TEST_F(Slurm, SrunRunsTheExampleAsTwoRanks) {
  auto r = slurm({"srun", "-N1", "-n2", "--overcommit", "-J", "fashion", FULGUR_FASHION_EXAMPLE,
                  "--strategy", "ddp", "--devices", "2", "--max_steps", "60", "--limit_val_batches",
                  "0", "--enable_progress_bar", "false", "--default_root_dir", dir_.path() + "/ex"},
                 240s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("cluster environment slurm"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("test_acc="), std::string::npos) << r.output;
}
#endif

#ifdef FULGUR_FASHION_EXAMPLE
// The example's configuration fails on task 1 only (its file is missing
// there, as on a machine without the shared directory): task 0, waiting for
// it at the rendezvous, fails at once naming it, not after the 30-minute
// timeout.
TEST_F(Slurm, ATaskWhoseConfigurationFailsIsNamedByTheTaskWaitingForIt) {
  const std::string run = fulgur::str(
      FULGUR_FASHION_EXAMPLE, " --strategy ddp --devices 2 --max_steps 5 --limit_val_batches 0 ",
      "--enable_progress_bar false --default_root_dir ", dir_.path(), "/early");
  const std::string missing = dir_.path() + "/missing.yaml";
  auto r = slurm({"srun", "-N1", "-n2", "--overcommit", "-J", "early", "bash", "-c",
                  fulgur::str("if [ \"$SLURM_PROCID\" = 1 ]; then exec ", run, " --config ",
                              missing, "; else exec ", run, "; fi")},
                 120s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      r.output, {"rank 0 of 2: rank 1 failed before it joined the rendezvous at ", missing,
                 "this rank stops waiting"}))
      << r.output;
}
#endif

TEST_F(Slurm, TwoNodesFourRanks) {
  auto r = slurm(with_srun({"srun", "-N2", "-n4", "--overcommit", "-J", "train"},
                           worker("nodes", {"--num-nodes", "2"}, 0)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(result_value(r.output, "cluster_environment"), "slurm") << r.output;
  EXPECT_EQ(result_value(r.output, "world_size"), "4") << r.output;
  EXPECT_EQ(result_value(r.output, "global_step"), "150") << r.output;
}

TEST_F(Slurm, RequeueSignalSavesOnceRequeuesOnceAndTheRequeuedJobEndsBitIdentical) {
  // The run never interrupted.
  auto reference = slurm(with_srun({"srun", "-N1", "-n2", "--overcommit", "-J", "reference"},
                                   worker("reference", {})));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;

  // The batch script: srun in the background, the requeue signal forwarded
  // to it (srun passes SIGUSR1 to every task).
  const std::string script = dir_.path() + "/job.sh";
  {
    std::ofstream out(script);
    out << "#!/bin/bash\nsrun --overcommit -n2 -J train";
    for (const auto& a : worker("requeued", {})) out << " '" << a << "'";
    out << " &\npid=$!\ntrap 'kill -USR1 $pid' USR1\n"
        << "while :; do wait $pid; status=$?; kill -0 $pid 2>/dev/null || break; done\n"
        << "exit $status\n";
  }
  const std::string log = dir_.path() + "/job.log";
  auto submitted = slurm({"sbatch", "--parsable", "--requeue", "--open-mode=append", "-N1", "-n2",
                          "--overcommit", "-J", "train", "-o", log, script},
                         30s);
  ASSERT_EQ(submitted.exit_code, 0) << submitted.output;
  const std::string id = submitted.output.substr(0, submitted.output.find_first_of(";\n"));

  // Once the run has saved a checkpoint, the scheduler's requeue signal.
  const auto checkpoint = dir_.path() + "/requeued/checkpoints/last.ckpt";
  auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!std::filesystem::exists(checkpoint) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_TRUE(std::filesystem::exists(checkpoint)) << job_state(id) << read_file(log);
  auto signalled = slurm({"scancel", "--signal=USR1", "--batch", id}, 20s);
  ASSERT_EQ(signalled.exit_code, 0) << signalled.output;

  // Requeued (about 6 s: cred_expire), run again, completed.
  std::string state;
  deadline = std::chrono::steady_clock::now() + 150s;
  while (std::chrono::steady_clock::now() < deadline) {
    state = job_state(id);
    if (state.find("JobState=COMPLETED") != std::string::npos ||
        state.find("JobState=FAILED") != std::string::npos ||
        state.find("JobState=CANCELLED") != std::string::npos) {
      break;
    }
    std::this_thread::sleep_for(200ms);
  }
  const std::string output = read_file(log);
  ASSERT_NE(state.find("JobState=COMPLETED"), std::string::npos) << state << "\n" << output;
  EXPECT_NE(state.find("Restarts=1"), std::string::npos) << state;
  EXPECT_EQ(count_occurrences(output, "fulgur: SIGUSR1 (cluster environment \"slurm\"): saved"), 1)
      << output;
  EXPECT_EQ(count_occurrences(output, "requeued SLURM job " + id), 1) << output;
  EXPECT_EQ(
      count_occurrences(output, "fulgur: restart 1 (cluster environment \"slurm\"): resuming from"),
      1)
      << output;
  EXPECT_EQ(result_value(output, "global_step"), "150") << output;
  expect_identical("reference", "requeued");
}

// SIGTERM (the time limit, a preemption) reaching one rank only: every
// rank agrees at the next step, one checkpoint is saved, and the job step
// ends by the signal; a new job with ckpt_path="auto" resumes from it and
// ends bit-identical to an uninterrupted run.
TEST_F(Slurm, SigtermOnOneRankSavesACheckpointAndANewJobResumesBitIdentical) {
  auto reference = slurm(with_srun({"srun", "-N1", "-n2", "--overcommit", "-J", "reference"},
                                   worker("reference", {}, 0)));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  auto stopped = slurm(with_srun({"srun", "-N1", "-n2", "--overcommit", "-J", "train"},
                                 worker("stopped", {"--raise", "1:13:15"}, 0)));
  EXPECT_NE(stopped.exit_code, 0) << stopped.output;
  EXPECT_NE(stopped.output.find("rank 1 receives signal 15 before step 13"), std::string::npos)
      << stopped.output;
  EXPECT_EQ(
      count_occurrences(stopped.output, "fulgur: SIGTERM (cluster environment \"slurm\"): saved"),
      1)
      << stopped.output;
  EXPECT_EQ(stopped.output.find("requeued SLURM job"), std::string::npos) << stopped.output;
  EXPECT_EQ(result_value(stopped.output, "global_step"), "") << "fit went on:\n" << stopped.output;
  auto resumed = slurm(with_srun({"srun", "-N1", "-n2", "--overcommit", "-J", "train"},
                                 worker("stopped", {"--ckpt-path", "auto"}, 0)));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(result_value(resumed.output, "global_step"), "150") << resumed.output;
  expect_identical("reference", "stopped");
}

// Under `manual` every rank writes its own shard: SIGTERM on one rank makes
// every rank save its part of last.ckpt (a manifest and a shard per rank,
// verified), and a new job with ckpt_path="auto" resumes each rank's shard
// and ends with every rank's parameters bit-identical to an uninterrupted run.
TEST_F(Slurm, SigtermUnderManualSavesEveryRanksShardAndANewJobResumesThem) {
  auto manual = [&](const std::string& name, std::vector<std::string> extra) {
    std::filesystem::create_directories(dir_.path() + "/" + name + "-out");
    std::vector<std::string> args = {"srun",
                                     "-N1",
                                     "-n2",
                                     "--overcommit",
                                     "-J",
                                     "train",
                                     FULGUR_MANUAL_WORKER,
                                     "--devices",
                                     "2",
                                     "--steps",
                                     "12",
                                     "--ckpt-root",
                                     dir_.path() + "/" + name,
                                     "--out",
                                     dir_.path() + "/" + name + "-out"};
    args.insert(args.end(), extra.begin(), extra.end());
    return slurm(args);
  };
  auto reference = manual("reference", {});
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  auto stopped = manual("stopped", {"--raise", "1:5:15"});
  EXPECT_NE(stopped.exit_code, 0) << stopped.output;
  EXPECT_EQ(
      count_occurrences(stopped.output, "fulgur: SIGTERM (cluster environment \"slurm\"): saved"),
      1)
      << stopped.output;
  const std::string last = dir_.path() + "/stopped/checkpoints/last.ckpt";
  auto inspect = run_process({FULGUR_CLI, "checkpoint", "inspect", last}, {}, 60s);
  EXPECT_EQ(inspect.exit_code, 0) << inspect.output;
  auto resumed = manual("stopped", {"--resume", "auto"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  for (const std::string rank : {"0", "1"}) {
    EXPECT_EQ(result_value(resumed.output, "rank" + rank + "_global_step"), "12") << resumed.output;
    EXPECT_TRUE(same_params(dir_.path() + "/reference-out/rank-" + rank + ".pt",
                            dir_.path() + "/stopped-out/rank-" + rank + ".pt", {.exact = true}))
        << "rank " << rank;
  }
}

}  // namespace
