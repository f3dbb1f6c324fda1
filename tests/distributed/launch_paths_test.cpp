// The same training run on every launch path gives the same weights: one
// process, fulgur's own launchers, torchrun, mpirun, srun's environment,
// and two nodes on one machine. Real processes over 127.0.0.1. Every
// two-rank path is bit-identical to fulgur's own launcher; all are close to
// one process with the double batch.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <torch/torch.h>
#include <unistd.h>

#include <fstream>
#include <future>
#include <regex>
#include <algorithm>
#include <sstream>

#include "distributed/worker.h"
#include "fulgur/distributed/process_group.h"
#include "support/process.h"
#include "support/test_support.h"

namespace {

using fulgur::test::on_path;
using fulgur::test::ProcessResult;
using fulgur::test::result_value;
using fulgur::test::run_process;
using fulgur::test::same_params;
using fulgur::test::torch_python;
using fulgur::test::TempDir;
using namespace std::chrono_literals;

std::vector<std::string> worker(const std::vector<std::string>& extra, const std::string& out,
                                const std::string& root) {
  return fulgur::test::launch_worker(extra, out, root);
}

void expect_clean(const ProcessResult& r) {
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.leftover_processes, 0) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// torchrun through tools/fulgur-torchrun, run by the Python that has torch:
// plain torchrun where PyTorch has libuv, and the classic TCPStore transport
// where it has not (Debian 13's PyTorch 2.6, whose own torchrun cannot start).
std::vector<std::string> torchrun(std::vector<std::string> rendezvous, const std::string& logs) {
  static const std::string python = torch_python();
  std::vector<std::string> args = {python, FULGUR_TORCHRUN};
  args.insert(args.end(), rendezvous.begin(), rendezvous.end());
  // --redirects/--tee: Debian's torchrun 1.13 under Python >= 3.11 cannot
  // parse their default "0" (Std.from_str returns None); "1" works there
  // and everywhere else.
  for (std::string s : {"--nproc_per_node", "2", "--redirects", "1", "--tee", "1", "--log_dir",
                        logs.c_str(), "--no_python"}) {
    args.push_back(s);
  }
  return args;
}

class LaunchPaths : public ::testing::Test {
 protected:
  // One process with the batch of all ranks together (per-rank batch 8).
  std::string baseline(int ranks) {
    std::string out = dir.path() + "/single-" + std::to_string(ranks) + ".pt";
    auto r = run_process(
        worker({"--devices", "1", "--batch", std::to_string(8 * ranks)}, out, dir.path()), {},
        120s);
    expect_clean(r);
    return out;
  }
  // Two ranks under fulgur's own launcher: every other two-rank path must
  // give exactly these weights (same seed, same data split, same sums).
  std::string own_launcher(ProcessResult* result = nullptr) {
    std::string out = dir.path() + "/ddp.pt";
    auto r = run_process(
        worker({"--strategy", "ddp", "--devices", "2", "--batch", "8"}, out, dir.path()), {}, 120s);
    expect_clean(r);
    if (result != nullptr) *result = r;
    return out;
  }
  // Close to one process with the double batch, identical to the own launcher.
  void expect_same_weights(const std::string& out) {
    EXPECT_TRUE(same_params(baseline(2), out));
    EXPECT_TRUE(same_params(own_launcher(), out, {.exact = true}));
  }
  // Two ranks under torchrun (through tools/fulgur-torchrun) with these
  // rendezvous arguments: detected as torchelastic, the own launcher's weights.
  void expect_torchrun_matches(std::vector<std::string> rendezvous, const std::string& name) {
    ASSERT_TRUE(on_path("torchrun")) << "torchrun is missing: scripts/install-deps.sh installs "
                                        "python3-torch, which provides it.";
    std::string out = dir.path() + "/" + name + ".pt";
    auto args = torchrun(std::move(rendezvous), dir.path() + "/" + name + "-logs");
    auto w = worker({"--strategy", "ddp", "--devices", "2", "--batch", "8"}, out, dir.path());
    args.insert(args.end(), w.begin(), w.end());
    auto r = run_process(args, {{"OMP_NUM_THREADS", "1"}}, 180s);
    expect_clean(r);
    EXPECT_EQ(result_value(r.output, "cluster_environment"), "torchelastic") << r.output;
    expect_same_weights(out);
  }
  TempDir dir;
};

TEST_F(LaunchPaths, OwnSubprocessLauncher) {
  ProcessResult r;
  std::string out = own_launcher(&r);
  EXPECT_EQ(result_value(r.output, "cluster_environment"), "lightning");
  EXPECT_TRUE(same_params(baseline(2), out));
}

TEST_F(LaunchPaths, ForkLauncher) {
  std::string out = dir.path() + "/fork.pt";
  // The caller ran LibTorch on two intra-op threads before fit() forks,
  // and writes the weights afterwards: they came back from rank 0.
  auto r = run_process(
      worker({"--strategy", "ddp_fork", "--devices", "2", "--batch", "8", "--warm-parent"}, out,
             dir.path()),
      {}, 120s);
  expect_clean(r);
  EXPECT_EQ(result_value(r.output, "world_size"), "2") << r.output;
  expect_same_weights(out);
}

// The c10d rendezvous. From 2.x torchrun's agent hosts the store at
// MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True) and the ranks join it; in
// 1.x rank 0 hosts fulgur's own store there.
TEST_F(LaunchPaths, Torchrun) { expect_torchrun_matches({"--standalone"}, "torchrun"); }

// The static rendezvous (--master_addr/--master_port, no --standalone): the
// agent hosts the store at MASTER_PORT in every version, so rank 0 must join
// it rather than listen there (it failed with "port in use" before).
TEST_F(LaunchPaths, TorchrunStaticRendezvousJoinsTheAgentsStore) {
  const std::string port = std::to_string(fulgur::find_free_port());
  expect_torchrun_matches(
      {"--nnodes", "1", "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", port},
      "torchrun-static");
}

// torchrun --max_restarts: a worker killed at step 7 makes torchrun start
// both again (TORCHELASTIC_RESTART_COUNT=1); they resume from the newest
// checkpoint by themselves and end with the uninterrupted run's parameters
// and optimizer state, bit for bit.
TEST_F(LaunchPaths, TorchrunRestartedWorkersResumeAndEndBitIdentical) {
  ASSERT_TRUE(on_path("torchrun")) << "torchrun is missing: scripts/install-deps.sh installs "
                                      "python3-torch, which provides it.";
  auto run = [&](const std::string& name, std::vector<std::string> extra) {
    std::vector<std::string> flags = {"--strategy",
                                      "ddp",
                                      "--devices",
                                      "2",
                                      "--batch",
                                      "8",
                                      "--every-n-train-steps",
                                      "4",
                                      "--out-optimizer",
                                      dir.path() + "/" + name + "-optimizer.pt"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    return worker(flags, dir.path() + "/" + name + ".pt", dir.path() + "/" + name);
  };
  expect_clean(run_process(run("uninterrupted", {}), {}, 120s));
  // The c10d rendezvous --standalone makes, on a free port: Debian's
  // torchrun puts --standalone's on 29400, where another test's torchrun
  // (LaunchPaths.Torchrun, running beside this one) would take it over.
  const std::string endpoint = "127.0.0.1:" + std::to_string(fulgur::find_free_port());
  auto args = torchrun({"--nnodes", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
                        "--rdzv_id", "restarted", "--max_restarts", "1", "--monitor_interval", "1"},
                       dir.path() + "/restarted-logs");
  auto w = run("restarted", {"--kill", "1:7"});
  args.insert(args.end(), w.begin(), w.end());
  auto r = run_process(args, {{"OMP_NUM_THREADS", "1"}}, 180s);
  expect_clean(r);
  EXPECT_NE(r.output.find("rank 1 is killed before step 7"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("fulgur: restart 1 (cluster environment \"torchelastic\"): resuming "
                          "from"),
            std::string::npos)
      << r.output;
  for (const std::string suffix : {".pt", "-optimizer.pt"}) {
    EXPECT_TRUE(same_params(dir.path() + "/uninterrupted" + suffix,
                            dir.path() + "/restarted" + suffix, {.exact = true}))
        << suffix;
  }
}

TEST_F(LaunchPaths, Mpirun) {
  ASSERT_TRUE(on_path("mpirun")) << "mpirun is missing: scripts/install-deps.sh installs "
                                    "openmpi-bin, which provides it.";
  std::string out = dir.path() + "/mpirun.pt";
  const std::string port = std::to_string(fulgur::find_free_port());
  std::vector<std::string> args = {"mpirun",
                                   "--allow-run-as-root",
                                   "--oversubscribe",
                                   "-np",
                                   "2",
                                   "-x",
                                   "MASTER_ADDR=127.0.0.1",
                                   "-x",
                                   "MASTER_PORT=" + port,
                                   "-x",
                                   "OMP_NUM_THREADS=1"};
  auto w = worker({"--strategy", "ddp", "--devices", "2", "--batch", "8"}, out, dir.path());
  args.insert(args.end(), w.begin(), w.end());
  auto r = run_process(args, {}, 180s);
  expect_clean(r);
  EXPECT_EQ(result_value(r.output, "cluster_environment"), "mpi") << r.output;
  expect_same_weights(out);
}

// ProcessGroupMPI (LibTorch builds with MPI: Debian 13's) under mpirun
// trains to Gloo's weights. Where the build has no MPI, the backend is a
// clear error instead (ProcessGroup and connector tests).
TEST_F(LaunchPaths, MpirunWithTheMpiBackendMatchesGloo) {
  const auto available = fulgur::available_process_group_backends();
  if (std::find(available.begin(), available.end(), "mpi") == available.end()) {
    GTEST_SKIP() << "this LibTorch was built without MPI (Debian 12's 1.13); Debian 13's has it";
  }
  ASSERT_TRUE(on_path("mpirun")) << "mpirun is missing: scripts/install-deps.sh installs "
                                    "openmpi-bin, which provides it.";
  std::string out = dir.path() + "/mpi-backend.pt";
  std::vector<std::string> args = {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
                                   "-x",     "OMP_NUM_THREADS=1"};
  auto w = worker(
      {"--strategy", "ddp", "--devices", "2", "--batch", "8", "--process-group-backend", "mpi"},
      out, dir.path());
  args.insert(args.end(), w.begin(), w.end());
  auto r = run_process(args, {}, 180s);
  expect_clean(r);
  EXPECT_EQ(result_value(r.output, "cluster_environment"), "mpi") << r.output;
  EXPECT_EQ(result_value(r.output, "process_group_backend"), "mpi") << r.output;
  expect_same_weights(out);
}

// Two ranks started as srun starts its tasks (one process each, with these
// variables, no launcher of fulgur's), rank r with its own extra arguments.
std::vector<ProcessResult> as_srun_tasks(const std::vector<std::vector<std::string>>& args,
                                         const std::string& out, const std::string& root) {
  const std::string port = std::to_string(fulgur::find_free_port());
  std::vector<std::future<ProcessResult>> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    std::map<std::string, std::string> env = {{"SLURM_NTASKS", "2"},
                                              {"SLURM_PROCID", std::to_string(rank)},
                                              {"SLURM_LOCALID", std::to_string(rank)},
                                              {"SLURM_NODEID", "0"},
                                              {"SLURM_JOB_ID", "4242"},
                                              {"SLURM_JOB_NAME", "train"},
                                              {"SLURM_NODELIST", "localhost"},
                                              {"SLURM_NTASKS_PER_NODE", "2"},
                                              {"MASTER_PORT", port},
                                              {"OMP_NUM_THREADS", "1"}};
    std::vector<std::string> extra = {"--strategy", "ddp", "--devices", "2", "--batch", "8"};
    extra.insert(extra.end(), args[static_cast<size_t>(rank)].begin(),
                 args[static_cast<size_t>(rank)].end());
    ranks.push_back(std::async(std::launch::async, [&, env, extra] {
      return run_process(worker(extra, out, root), env, 120s);
    }));
  }
  std::vector<ProcessResult> results;
  for (auto& r : ranks) results.push_back(r.get());
  return results;
}

TEST_F(LaunchPaths, SlurmEnvironmentAsSrunSetsIt) {
  std::string out = dir.path() + "/slurm.pt";
  auto r = as_srun_tasks({{}, {}}, out, dir.path());
  expect_clean(r[0]);
  expect_clean(r[1]);
  EXPECT_EQ(result_value(r[0].output, "cluster_environment"), "slurm") << r[0].output;
  expect_same_weights(out);
}

// Ranks that a launcher outside fulgur started keep one process group for
// the life of the process, as torch.distributed does: a later Trainer takes
// the group an earlier one made instead of a second rendezvous on the same
// port. Here the Tuner's sweep (a Trainer of its own) before the fit, whose
// weights are those of the fit without the sweep, and a second Trainer for
// the test made while the fit's lives (rank 0's second rendezvous found the
// port taken by its own first store; a rank done early could join the
// sweep's store as rank 0 closed it). The test's Trainer asks for another
// timeout, and global rank 0 notes the one the kept group has.
// A rank whose training_step returns no loss at a step of the sweep: every
// rank records the mean of the losses there are (the rank without one took
// part in none of the reduction, and its peers waited for it).
TEST_F(LaunchPaths, TheLrSweepGoesOnWhenARankHasNoLossAtAStep) {
  std::string out = dir.path() + "/skipped.pt";
  const std::vector<std::string> args = {"--lr-find-first", "5", "--skip-ranks", "1",
                                         "--skip-at",       "2", "--timeout",    "60"};
  auto r = as_srun_tasks({args, args}, out, dir.path());
  for (const auto& rank : r) {
    expect_clean(rank);
    EXPECT_EQ(result_value(rank.output, "lr_find_steps"), "5") << rank.output;
  }
  const std::string losses = result_value(r[0].output, "lr_find_losses");
  EXPECT_EQ(std::count(losses.begin(), losses.end(), ';'), 4) << losses;
  EXPECT_EQ(losses.find("nan"), std::string::npos) << losses;
  EXPECT_EQ(result_value(r[1].output, "lr_find_losses"), losses);
}

TEST_F(LaunchPaths, ALaterTrainerOfTheRanksTakesTheFirstOnesProcessGroup) {
  std::string out = dir.path() + "/swept.pt";
  const std::vector<std::string> args = {
      "--lr-find-first", "5",  "--test-samples",   "64", "--test-by-another-trainer",
      "--timeout",       "60", "--tester-timeout", "45"};
  auto r = as_srun_tasks({args, args}, out, dir.path());
  for (const auto& rank : r) {
    expect_clean(rank);
    EXPECT_EQ(result_value(rank.output, "lr_find_steps"), "5") << rank.output;
  }
  EXPECT_FALSE(result_value(r[0].output, "test_acc").empty()) << r[0].output;
  EXPECT_TRUE(same_params(own_launcher(), out, {.exact = true}));
  // The test's Trainer asked for another timeout than the kept group's:
  // global rank 0 says which one its collectives have.
  EXPECT_NE(r[0].output.find("process_group_timeout=45 s, but this process keeps the group an "
                             "earlier Trainer made, whose collectives time out after 60 s."),
            std::string::npos)
      << r[0].output;
  EXPECT_EQ(r[1].output.find("process_group_timeout=45 s"), std::string::npos) << r[1].output;
}

// Without a launcher of fulgur's the ranks watch each other through the
// store (peer_watch.h): what its supervisor names is named by the ranks.
TEST_F(LaunchPaths, UnsupervisedRanksNameAPeersFailureWhereverTheyWaitForIt) {
  const std::string out = dir.path() + "/unsupervised.pt";
  const std::vector<std::string> fails = {"--fail-rank", "1",         "--fault-step",
                                          "2",           "--timeout", "60"};
  // Rank 1 fails and exits: rank 0's collective loses it and names its error.
  {
    auto r = as_srun_tasks({fails, fails}, out, dir.path());
    EXPECT_EQ(r[1].exit_code, 1) << r[1].output;
    EXPECT_EQ(r[0].exit_code, 1) << r[0].output;
    EXPECT_NE(r[0].output.find("rank 1 failed first: rank 1 fails on its own now"),
              std::string::npos)
        << r[0].output;
  }
  // Rank 1 fails and stays 8 s (its connections open, as a rank whose
  // failure path hangs): rank 0, waiting for it in the gradients'
  // all-reduce, ends after the stop grace (1 s) naming it, where it waited
  // until rank 1 left.
  {
    std::vector<std::string> lingers = fails;
    lingers.insert(lingers.end(), {"--linger-after-failure", "8"});
    std::vector<std::string> waits = fails;
    waits.insert(waits.end(), {"--stop-grace", "1"});
    auto r = as_srun_tasks({waits, lingers}, out, dir.path());
    EXPECT_EQ(r[1].exit_code, 1) << r[1].output;
    EXPECT_EQ(r[0].exit_code, 1) << r[0].output;
    EXPECT_FALSE(r[0].timed_out) << r[0].output;
    EXPECT_NE(r[0].output.find("fulgur: rank 0 of 2 ends: rank 1 failed (rank 1 fails on its "
                               "own now), and this rank has waited for it in all_reduce #"),
              std::string::npos)
        << r[0].output;
    EXPECT_EQ(r[0].output.find("Connection closed"), std::string::npos) << r[0].output;
  }
}

TEST_F(LaunchPaths, UnsupervisedRanksInDifferentCollectivesEndNamingTheDesync) {
  // Rank 1 calls a barrier rank 0 does not: each waits in another
  // collective. With a 20 s timeout both end after 10 s, naming both.
  const std::vector<std::string> args = {
      "--extra-barrier-rank", "1", "--fault-step", "2", "--timeout", "20"};
  auto r = as_srun_tasks({args, args}, dir.path() + "/desync.pt", dir.path());
  for (int rank = 0; rank < 2; ++rank) {
    const auto& output = r[static_cast<size_t>(rank)].output;
    EXPECT_EQ(r[static_cast<size_t>(rank)].exit_code, 1) << output;
    EXPECT_TRUE(std::regex_search(
        output, std::regex(fulgur::str("fulgur: rank ", rank,
                                       " of 2 ends: the ranks have waited 1[0-9][.][0-9] s in "
                                       "different collectives of one call number"))))
        << output;
    EXPECT_NE(output.find("rank 1: in barrier #"), std::string::npos) << output;
    EXPECT_NE(output.find("a desync"), std::string::npos) << output;
    EXPECT_EQ(output.find("Timed out"), std::string::npos) << output;
  }
}

// Rank 1's Trainer fails before it joins (a flag wrong on its machine
// only): rank 0, waiting for it at the rendezvous, fails at once naming
// it, not after the 60 s timeout.
TEST_F(LaunchPaths, UnsupervisedRanksWaitingForARankThatFailedBeforeJoiningNameIt) {
  const std::vector<std::string> args = {"--timeout", "60"};
  std::vector<std::string> bad = args;
  bad.insert(bad.end(), {"--precision", "17-true"});
  auto r = as_srun_tasks({args, bad}, dir.path() + "/early.pt", dir.path());
  EXPECT_EQ(r[1].exit_code, 1) << r[1].output;
  EXPECT_NE(r[1].output.find("17-true"), std::string::npos) << r[1].output;
  EXPECT_EQ(r[0].exit_code, 1) << r[0].output;
  EXPECT_TRUE(fulgur::test::message_contains(
      r[0].output, {"rank 0 of 2: rank 1 failed before it joined the rendezvous at ", "17-true",
                    "this rank stops waiting"}))
      << r[0].output;
  EXPECT_EQ(r[0].output.find("Timed out"), std::string::npos) << r[0].output;
}

// A MASTER_PORT whose next port (the launchers' store's) was free too: the
// kernel hands the ports after a free one to other tests' connections.
int free_port_and_the_next() {
  for (int attempt = 0;; ++attempt) {
    const int port = fulgur::find_free_port();
    int sock = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port + 1));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool free = ::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(sock);
    if (free || attempt == 50) return port;
  }
}

TEST_F(LaunchPaths, TwoNodesOnOneMachine) {
  std::string out = dir.path() + "/nodes.pt";
  const std::string port = std::to_string(free_port_and_the_next());
  std::vector<std::future<ProcessResult>> nodes;
  for (int node = 0; node < 2; ++node) {
    std::map<std::string, std::string> env = {{"MASTER_ADDR", "127.0.0.1"},
                                              {"MASTER_PORT", port},
                                              {"NODE_RANK", std::to_string(node)},
                                              {"OMP_NUM_THREADS", "1"}};
    nodes.push_back(std::async(std::launch::async, [&, env] {
      return run_process(
          worker({"--strategy", "ddp", "--devices", "2", "--num-nodes", "2", "--batch", "8"}, out,
                 dir.path()),
          env, 180s);
    }));
  }
  auto n0 = nodes[0].get();
  auto n1 = nodes[1].get();
  expect_clean(n0);
  expect_clean(n1);
  EXPECT_EQ(result_value(n0.output, "world_size"), "4") << n0.output;
  EXPECT_TRUE(same_params(baseline(4), out));
}

}  // namespace
