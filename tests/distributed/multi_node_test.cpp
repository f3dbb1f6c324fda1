// Nodes with network stacks of their own: scripts/netns-cluster.sh makes two
// "machines" on this host (network and UTS namespaces, each with its own
// address on a bridge that reaches nothing else), and the launch paths run
// across them as on a cluster: rank 0's store and Gloo listen on node 0's
// interface, node 1 reaches it over the bridge. Each run ends with the weights
// of one process with the combined batch.
#include <gtest/gtest.h>
#include <unistd.h>

#include <signal.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <thread>

#include "distributed/worker.h"
#include "support/process.h"
#include "support/test_support.h"

namespace {

using fulgur::test::launch_worker;
using fulgur::test::on_path;
using fulgur::test::ProcessResult;
using fulgur::test::result_value;
using fulgur::test::run_process;
using fulgur::test::same_params;
using fulgur::test::TempDir;
using fulgur::test::torch_python;
using namespace std::chrono_literals;

class AcrossNamespaces : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (::geteuid() != 0) return;
    // A cluster of this process's own: tests of other processes may run
    // clusters of their own at the same time.
    env_ = {{"FULGUR_NETNS_NAME", "fulgur-t" + std::to_string(::getpid())}};
    up_ = run_process({"bash", FULGUR_NETNS_CLUSTER, "up", "2"}, env_, 60s);
  }
  static void TearDownTestSuite() {
    if (::geteuid() != 0) return;
    auto r = run_process({"bash", FULGUR_NETNS_CLUSTER, "down"}, env_, 60s);
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }
  void SetUp() override {
    if (::geteuid() != 0) {
      GTEST_SKIP() << "network namespaces need root; run the suite as root (CI does)";
    }
    ASSERT_EQ(up_.exit_code, 0) << "scripts/netns-cluster.sh up 2 failed:\n" << up_.output;
  }

  /// `argv` run on node `node` of the cluster.
  static std::vector<std::string> on_node(int node, const std::vector<std::string>& argv) {
    std::vector<std::string> out = {"bash", FULGUR_NETNS_CLUSTER, "exec", std::to_string(node)};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }
  static std::string address(int node) {
    auto r = run_process({"bash", FULGUR_NETNS_CLUSTER, "addr", std::to_string(node)}, env_, 10s);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.output.substr(0, r.output.find('\n'));
  }
  static std::map<std::string, std::string> with_cluster(std::map<std::string, std::string> env) {
    env.insert(env_.begin(), env_.end());
    return env;
  }

  /// One process on this host with the batch of `ranks` ranks together.
  std::string baseline(int ranks) {
    std::string out = dir_.path() + "/single-" + std::to_string(ranks) + ".pt";
    auto r = run_process(
        launch_worker({"--devices", "1", "--batch", std::to_string(8 * ranks)}, out, dir_.path()),
        {}, 120s);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return out;
  }

  /// Both nodes at once, each its own command, with `meanwhile` run by this
  /// process while they do; their results in node order.
  std::vector<ProcessResult> run_nodes(
      const std::function<std::vector<std::string>(int node)>& argv,
      const std::function<std::map<std::string, std::string>(int node)>& env,
      std::chrono::seconds timeout, const std::function<void()>& meanwhile = {}) {
    std::vector<std::future<ProcessResult>> nodes;
    for (int node = 0; node < 2; ++node) {
      nodes.push_back(std::async(std::launch::async, [&, node] {
        return run_process(on_node(node, argv(node)), with_cluster(env(node)), timeout);
      }));
    }
    if (meanwhile) meanwhile();
    std::vector<ProcessResult> out;
    for (auto& n : nodes) out.push_back(n.get());
    return out;
  }

  /// `launch` (a launcher started on node 0, given the program's argv) runs
  /// a command printing its host on 4 ranks: two on each node; then the
  /// worker on 2 nodes x 2 ranks: detected as `environment`, with the weights
  /// of one process with the 4x batch.
  void expect_two_per_node_matching_one_process(
      const std::function<ProcessResult(std::vector<std::string>)>& launch,
      const std::string& environment) {
    auto hosts = launch({"sh", "-c", "echo rank-host=$(hostname)"});
    expect_clean(hosts, 0);
    EXPECT_EQ(fulgur::test::count_occurrences(hosts.output, "rank-host=n0"), 2) << hosts.output;
    EXPECT_EQ(fulgur::test::count_occurrences(hosts.output, "rank-host=n1"), 2) << hosts.output;
    const std::string out = dir_.path() + "/" + environment + ".pt";
    auto r = launch(
        launch_worker({"--strategy", "ddp", "--devices", "2", "--num-nodes", "2", "--batch", "8"},
                      out, dir_.path()));
    expect_clean(r, 0);
    EXPECT_EQ(result_value(r.output, "cluster_environment"), environment) << r.output;
    EXPECT_EQ(result_value(r.output, "world_size"), "4") << r.output;
    EXPECT_TRUE(same_params(baseline(4), out));
  }

  static void expect_clean(const ProcessResult& r, int node) {
    EXPECT_FALSE(r.timed_out) << "node " << node << ":\n" << r.output;
    EXPECT_EQ(r.leftover_processes, 0) << "node " << node << ":\n" << r.output;
    EXPECT_EQ(r.exit_code, 0) << "node " << node << ":\n" << r.output;
  }

  TempDir dir_;
  static inline std::map<std::string, std::string> env_;
  static inline ProcessResult up_;
};

TEST_F(AcrossNamespaces, EachNodeHasItsOwnAddressAndHostNameAndNoRouteOut) {
  EXPECT_EQ(address(0), "10.213.0.10");
  EXPECT_EQ(address(1), "10.213.0.11");
  auto r = run_process(on_node(1, {"sh", "-c",
                                   "hostname; ip -4 -o addr show eth0; ip route; "
                                   "ping -c 1 -W 2 n0 >/dev/null && echo reached-n0; "
                                   "ping -c 1 -W 1 192.0.2.1 2>&1 | tail -n 1"}),
                       env_, 30s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("n1\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("inet 10.213.0.11/24"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("reached-n0"), std::string::npos) << r.output;
  // No default route: an address off the bridge is unreachable.
  EXPECT_EQ(r.output.find("default"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Network is unreachable"), std::string::npos) << r.output;
}

TEST_F(AcrossNamespaces, FulgursLauncherTwoNodesOfTwoRanksMatchOneProcess) {
  const std::string out = dir_.path() + "/nodes.pt";
  const std::string main_address = address(0);
  const std::string port = "29611";
  auto results = run_nodes(
      [&](int) {
        return launch_worker(
            {"--strategy", "ddp", "--devices", "2", "--num-nodes", "2", "--batch", "8"}, out,
            dir_.path());
      },
      [&](int node) {
        return std::map<std::string, std::string>{{"MASTER_ADDR", main_address},
                                                  {"MASTER_PORT", port},
                                                  {"NODE_RANK", std::to_string(node)},
                                                  {"OMP_NUM_THREADS", "1"}};
      },
      180s);
  expect_clean(results[0], 0);
  expect_clean(results[1], 1);
  EXPECT_EQ(result_value(results[0].output, "world_size"), "4") << results[0].output;
  EXPECT_TRUE(same_params(baseline(4), out));
}

// torchrun's c10d rendezvous across the nodes: node 0's agent hosts the
// rendezvous at its own address (it knows the endpoint is itself by host name
// and address), node 1's agent joins it over the bridge; four ranks.
TEST_F(AcrossNamespaces, TorchrunC10dRendezvousTwoNodesOfTwoRanksMatchOneProcess) {
  ASSERT_TRUE(on_path("torchrun")) << "torchrun is missing: scripts/install-deps.sh installs "
                                      "python3-torch, which provides it.";
  static const std::string python = torch_python();
  const std::string out = dir_.path() + "/torchrun.pt";
  const std::string endpoint = address(0) + ":29613";
  auto results = run_nodes(
      [&](int node) {
        std::vector<std::string> args = {python,
                                         FULGUR_TORCHRUN,
                                         "--nnodes",
                                         "2",
                                         "--nproc_per_node",
                                         "2",
                                         "--rdzv_backend",
                                         "c10d",
                                         "--rdzv_endpoint",
                                         endpoint,
                                         "--rdzv_id",
                                         "multi-node-test",
                                         "--redirects",
                                         "1",
                                         "--tee",
                                         "1",
                                         "--log_dir",
                                         dir_.path() + "/logs-" + std::to_string(node),
                                         "--no_python"};
        auto w = launch_worker(
            {"--strategy", "ddp", "--devices", "2", "--num-nodes", "2", "--batch", "8"}, out,
            dir_.path());
        args.insert(args.end(), w.begin(), w.end());
        return args;
      },
      [](int) {
        return std::map<std::string, std::string>{{"OMP_NUM_THREADS", "1"}};
      },
      240s);
  expect_clean(results[0], 0);
  expect_clean(results[1], 1);
  const std::string both = results[0].output + results[1].output;
  EXPECT_EQ(result_value(both, "cluster_environment"), "torchelastic") << both;
  EXPECT_EQ(result_value(both, "world_size"), "4") << both;
  EXPECT_TRUE(same_params(baseline(4), out));
}

// mpirun on node 0 starts its daemon on node 1 through the cluster's remote
// shell (Open MPI's plm_rsh_agent, as ssh on a cluster), two ranks per node:
// placed by --map-by ppr:2:node, which Open MPI 4 (Debian 12) and 5 (Debian
// 13, PRRTE) both honour (with --oversubscribe, 5 put all four on node 0).
TEST_F(AcrossNamespaces, MpirunTwoNodesOfTwoRanksMatchOneProcess) {
  ASSERT_TRUE(on_path("mpirun")) << "mpirun is missing: scripts/install-deps.sh installs "
                                    "openmpi-bin, which provides it.";
  auto mpirun = [&](std::vector<std::string> program) {
    std::vector<std::string> args = {"mpirun",
                                     "--allow-run-as-root",
                                     "--map-by",
                                     "ppr:2:node",
                                     "--bind-to",
                                     "none",
                                     "--mca",
                                     "plm_rsh_agent",
                                     std::string(FULGUR_NETNS_CLUSTER) + " rsh",
                                     "--host",
                                     "n0:2,n1:2",
                                     "-np",
                                     "4",
                                     "-x",
                                     "MASTER_ADDR=" + address(0),
                                     "-x",
                                     "MASTER_PORT=29614",
                                     "-x",
                                     "OMP_NUM_THREADS=1"};
    args.insert(args.end(), program.begin(), program.end());
    return run_process(on_node(0, args), env_, 180s);
  };
  expect_two_per_node_matching_one_process(mpirun, "mpi");
}

TEST_F(AcrossNamespaces, SlurmOneSlurmdPerNodeTwoNodesOfTwoRanksMatchOneProcess) {
  // Short (SLURM's unix sockets), and passable by the munge user.
  std::filesystem::permissions(
      dir_.path(), std::filesystem::perms::group_exec | std::filesystem::perms::others_exec,
      std::filesystem::perm_options::add);
  auto env = with_cluster({{"FULGUR_SLURM_DIR", dir_.path() + "/s"}});
  auto start =
      run_process({"bash", FULGUR_SLURM_CLUSTER, "start", "--nodes", "2", "--netns"}, env, 90s);
  ASSERT_EQ(start.exit_code, 0) << "scripts/slurm-cluster.sh start --netns failed:\n"
                                << start.output;
  struct Stop {
    std::map<std::string, std::string> env;
    ~Stop() {
      auto r = run_process({"bash", FULGUR_SLURM_CLUSTER, "stop"}, env, 60s);
      EXPECT_EQ(r.exit_code, 0) << r.output;
    }
  } stop{env};
  env["SLURM_CONF"] = dir_.path() + "/s/slurm.conf";
  env["OMP_NUM_THREADS"] = "1";
  auto srun = [&](std::vector<std::string> program) {
    std::vector<std::string> args = {"srun", "-N2", "-n4", "--overcommit", "-J", "train"};
    args.insert(args.end(), program.begin(), program.end());
    return run_process(on_node(0, args), env, 180s);
  };
  expect_two_per_node_matching_one_process(srun, "slurm");
}

// Faults across nodes while fulgur's own launcher trains on 2 nodes x 2 ranks
// (the recovery run of worker.h: 30 Adam steps, a checkpoint every 4): every
// rank pauses after step 10 (attempt 0), and the test then cuts node 1's link,
// stops (SIGSTOP) or kills (SIGKILL) every process of node 1. Each node's
// launcher names the lost node within heartbeat_timeout (2 s) plus a round,
// not after the process_group_timeout; with a restart left, the nodes restart
// together from the step-8 checkpoint and end bit-identical to a run that was
// never interrupted; a node that never comes back is a bounded error.
class NodeFaults : public AcrossNamespaces {
 protected:
  /// The recovery run named `name` under `dir_`, on 2 nodes, its collectives
  /// and a lost node's return bounded by `timeout_s`.
  std::vector<std::string> training(const std::string& name, int timeout_s,
                                    const std::vector<std::string>& extra = {}) {
    auto args = fulgur::test::recovery_training("ddp", 7, dir_.path(), name);
    args.insert(args.begin(), FULGUR_DDP_WORKER);
    for (size_t i = 0; i + 1 < args.size(); ++i) {
      if (args[i] == "--timeout") args[i + 1] = std::to_string(timeout_s);
    }
    args.insert(args.end(), {"--num-nodes", "2", "--heartbeat-timeout", "2"});
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }
  /// With a pause after step 10 of attempt 0 that `meanwhile` uses.
  std::vector<std::string> paused(const std::string& name, int timeout_s,
                                  const std::vector<std::string>& extra = {}) {
    auto args = training(name, timeout_s, extra);
    args.insert(args.end(), {"--pause-step", "10", "--pause-seconds", "3", "--pause-file",
                             dir_.path() + "/" + name + ".paused"});
    return args;
  }

  /// `argv` on both nodes (MASTER_ADDR node 0, MASTER_PORT `port`), with
  /// `meanwhile` run by this process while they train.
  std::vector<ProcessResult> on_both(const std::vector<std::string>& argv, const std::string& port,
                                     const std::function<void()>& meanwhile = {}) {
    const std::string main_address = address(0);
    return run_nodes(
        [&](int) { return argv; },
        [&](int node) -> std::map<std::string, std::string> {
          return {{"MASTER_ADDR", main_address},
                  {"MASTER_PORT", port},
                  {"NODE_RANK", std::to_string(node)},
                  {"OMP_NUM_THREADS", "1"}};
        },
        240s, meanwhile);
  }

  /// Waits for the pause of run `name` (rank 0 writes the file).
  void wait_for_pause(const std::string& name) {
    const std::string file = dir_.path() + "/" + name + ".paused";
    for (int i = 0; i < 1200 && !std::filesystem::exists(file); ++i) {
      std::this_thread::sleep_for(100ms);
    }
    ASSERT_TRUE(std::filesystem::exists(file)) << "the run never reached its pause";
  }

  static void cluster(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {"bash", FULGUR_NETNS_CLUSTER};
    argv.insert(argv.end(), args.begin(), args.end());
    auto r = run_process(argv, env_, 30s);
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }

  static void expect_finished(const std::vector<ProcessResult>& runs, const std::string& what) {
    for (int node = 0; node < 2; ++node) expect_clean(runs[node], node);
    EXPECT_EQ(result_value(runs[0].output, "global_step"), "30") << what << ":\n" << runs[0].output;
  }
};

TEST_F(NodeFaults, ALinkDownOrAFrozenNodeIsNamedOnEveryNodeAndTheNodesRestartTogetherBitIdentical) {
  expect_finished(on_both(training("reference", 20), "29621"), "reference");

  // A partition: node 1's link down for 6 s. Node 0 hears nothing from node
  // 1's launcher, node 1 nothing from node 0's store; both stop their ranks,
  // restart, and meet again once the link is back.
  auto cut = on_both(paused("partition", 20, {"--max-restarts", "1"}), "29623", [&] {
    wait_for_pause("partition");
    cluster({"link", "1", "down"});
    std::this_thread::sleep_for(6s);
    cluster({"link", "1", "up"});
  });
  expect_finished(cut, "partition");
  EXPECT_NE(cut[0].output.find("fulgur: restart 1 of 1: node 1 is lost: no heartbeat from its "
                               "launcher for"),
            std::string::npos)
      << cut[0].output;
  EXPECT_NE(cut[1].output.find("fulgur: restart 1 of 1: node 0 is lost: the launchers' store it "
                               "keeps at 10.213.0.10:29624 has not answered for"),
            std::string::npos)
      << cut[1].output;
  EXPECT_NE(cut[0].output.find("heartbeat_timeout is 2.0 s"), std::string::npos) << cut[0].output;
  fulgur::test::expect_identical_runs(dir_.path(), "reference", "partition");

  // A frozen machine: every process of node 1 stopped for 5 s. Node 0 names
  // it and restarts; node 1, continued, finds its peers gone and restarts.
  auto frozen = on_both(paused("frozen", 20, {"--max-restarts", "1"}), "29625", [&] {
    wait_for_pause("frozen");
    cluster({"signal", "1", "STOP"});
    std::this_thread::sleep_for(5s);
    cluster({"signal", "1", "CONT"});
  });
  expect_finished(frozen, "frozen");
  EXPECT_NE(frozen[0].output.find("fulgur: restart 1 of 1: node 1 is lost: no heartbeat from its "
                                  "launcher for"),
            std::string::npos)
      << frozen[0].output;
  fulgur::test::expect_identical_runs(dir_.path(), "reference", "frozen");
}

TEST_F(NodeFaults, AKilledNodeIsNamedAndWhenItNeverComesBackTheErrorSaysSoInBoundedTime) {
  // Every process of node 1 killed: node 0 names node 1 (what its ranks were
  // doing included), restarts, waits the rejoin timeout (the 10 s
  // process_group_timeout) for it, then fails saying it did not come back.
  auto runs = on_both(paused("killed", 10, {"--max-restarts", "1"}), "29627", [&] {
    wait_for_pause("killed");
    cluster({"signal", "1", "KILL"});
  });
  const auto& zero = runs[0];
  EXPECT_FALSE(zero.timed_out) << zero.output;
  EXPECT_EQ(zero.leftover_processes, 0) << zero.output;
  EXPECT_NE(zero.exit_code, 0) << zero.output;
  EXPECT_NE(zero.output.find("fulgur: restart 1 of 1: node 1 is lost: no heartbeat from its "
                             "launcher for"),
            std::string::npos)
      << zero.output;
  EXPECT_NE(zero.output.find("node 1 did not come back: no heartbeat from its launcher in the"),
            std::string::npos)
      << zero.output;
  EXPECT_NE(zero.output.find("restarting again cannot help"), std::string::npos) << zero.output;
  EXPECT_NE(zero.output.find("What node 1's ranks were doing when last heard from"),
            std::string::npos)
      << zero.output;
  // Start-up, steps 1-10, the 3 s pause, the 2 s timeout and the 10 s wait:
  // well under the minutes a collective would wait.
  EXPECT_LT(zero.seconds, 90) << zero.output;
  EXPECT_NE(runs[1].exit_code, 0) << "node 1 was killed:\n" << runs[1].output;
}

TEST_F(AcrossNamespaces, RankZeroRefusesAMainAddressThatIsNotItsNodes) {
  // MASTER_ADDR names node 1 while node rank 0 (which hosts the store) runs
  // on node 0: rank 0 cannot listen there, and says so.
  auto r = run_process(on_node(0, launch_worker({"--strategy", "ddp", "--devices", "2",
                                                 "--num-nodes", "2", "--batch", "8"},
                                                dir_.path() + "/wrong.pt", dir_.path())),
                       with_cluster({{"MASTER_ADDR", address(1)},
                                     {"MASTER_PORT", "29612"},
                                     {"NODE_RANK", "0"},
                                     {"OMP_NUM_THREADS", "1"}}),
                       120s);
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.leftover_processes, 0) << r.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      r.output, {"10.213.0.11 (MASTER_ADDR) is not an address of this machine"}))
      << r.output;
}

}  // namespace

namespace {

// The cluster script itself: bad input is refused by name, and down leaves
// nothing behind, whatever runs in the nodes.
TEST(NetnsCluster, DownLeavesNothingAndBadInputIsNamed) {
  if (::geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
  const std::string name = "fulgur-d" + std::to_string(::getpid());
  const std::map<std::string, std::string> env = {{"FULGUR_NETNS_NAME", name}};
  auto script = [&](std::vector<std::string> args, std::chrono::seconds timeout = 60s) {
    args.insert(args.begin(), {"bash", FULGUR_NETNS_CLUSTER});
    return run_process(args, env, timeout);
  };
  auto up = script({"up", "0"});
  EXPECT_EQ(up.exit_code, 2);
  EXPECT_NE(up.output.find("up 0: give a node count from 1 to 16"), std::string::npos) << up.output;
  up = script({"up", "2", "--rate", "fast"});
  EXPECT_EQ(up.exit_code, 2);
  EXPECT_NE(up.output.find("rate \"fast\": give a tc rate such as 1gbit"), std::string::npos)
      << up.output;
  // SLURM on the nodes of a cluster that is not up: named, nothing started.
  TempDir slurm_dir;
  auto slurm = run_process(
      {"bash", FULGUR_SLURM_CLUSTER, "start", "--nodes", "2", "--netns"},
      {{"FULGUR_NETNS_NAME", name}, {"FULGUR_SLURM_DIR", slurm_dir.path() + "/s"}}, 60s);
  EXPECT_EQ(slurm.exit_code, 2) << slurm.output;
  EXPECT_NE(slurm.output.find("--netns: no netns cluster \"" + name + "\" with 2 node(s) is up"),
            std::string::npos)
      << slurm.output;
  auto no_cluster = script({"exec", "0", "true"});
  EXPECT_EQ(no_cluster.exit_code, 2);
  EXPECT_NE(no_cluster.output.find("no cluster \"" + name + "\" is up"), std::string::npos)
      << no_cluster.output;

  up = script({"up", "2", "--rate", "100mbit"});
  ASSERT_EQ(up.exit_code, 0) << up.output;
  EXPECT_NE(up.output.find("node 1: host n1, 10.213.0.11"), std::string::npos) << up.output;
  EXPECT_NE(up.output.find("rate 100mbit"), std::string::npos) << up.output;
  auto again = script({"up", "3"});
  EXPECT_EQ(again.exit_code, 2);
  EXPECT_NE(again.output.find("is up with 2 node(s), not 3"), std::string::npos) << again.output;
  auto out_of_range = script({"exec", "2", "true"});
  EXPECT_EQ(out_of_range.exit_code, 2);
  EXPECT_NE(out_of_range.output.find("node \"2\": the cluster \"" + name + "\" has nodes 0 to 1"),
            std::string::npos)
      << out_of_range.output;
  // A partition: node 1's link down, node 0 unreachable from it; up again.
  ASSERT_EQ(script({"link", "1", "down"}).exit_code, 0);
  EXPECT_NE(script({"exec", "1", "ping", "-c", "1", "-W", "1", "n0"}).exit_code, 0);
  ASSERT_EQ(script({"link", "1", "up"}).exit_code, 0);
  EXPECT_EQ(script({"exec", "1", "ping", "-c", "1", "-W", "2", "n0"}).exit_code, 0);

  // A process that would outlive its caller: down ends it.
  auto started = script({"exec", "1", "sh", "-c", "setsid sleep 600 >/dev/null 2>&1 & echo $!"});
  ASSERT_EQ(started.exit_code, 0) << started.output;
  const pid_t sleeper = std::stoi(started.output);
  // Running: not gone and not a zombie (this process may be its reaper).
  auto running = [&] {
    if (::kill(sleeper, 0) != 0) return false;
    std::ifstream status("/proc/" + std::to_string(sleeper) + "/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("State:", 0) == 0) return line.find('Z') == std::string::npos;
    }
    return false;
  };
  EXPECT_TRUE(running()) << "the sleeper should run until down";
  // signal: every process of the node, and only those (a frozen machine).
  auto state_of = [&] {
    std::ifstream status("/proc/" + std::to_string(sleeper) + "/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("State:", 0) == 0) return line;
    }
    return std::string();
  };
  auto stop = script({"signal", "1", "STOP"});
  EXPECT_EQ(stop.exit_code, 0) << stop.output;
  EXPECT_NE(state_of().find("T (stopped)"), std::string::npos) << state_of();
  EXPECT_EQ(script({"signal", "0", "STOP"}).exit_code, 0);
  EXPECT_NE(state_of().find("T (stopped)"), std::string::npos) << "node 0's signal reached node 1";
  EXPECT_EQ(script({"signal", "1", "CONT"}).exit_code, 0);
  EXPECT_EQ(state_of().find("T (stopped)"), std::string::npos) << state_of();
  auto bad_signal = script({"signal", "1", "FREEZE"});
  EXPECT_EQ(bad_signal.exit_code, 2);
  EXPECT_NE(bad_signal.output.find("signal 1 FREEZE: not a signal"), std::string::npos)
      << bad_signal.output;
  auto down = script({"down"});
  EXPECT_EQ(down.exit_code, 0) << down.output;
  for (int i = 0; i < 50 && running(); ++i) std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(running()) << "pid " << sleeper << " survived down";
  ::waitpid(sleeper, nullptr, WNOHANG);
  auto namespaces = run_process({"ip", "netns", "list"}, {}, 10s);
  EXPECT_EQ(namespaces.output.find(name), std::string::npos) << namespaces.output;
  EXPECT_FALSE(std::filesystem::exists("/run/fulgur-netns/" + name));
  EXPECT_EQ(script({"down"}).exit_code, 0) << "down twice is a no-op";
  EXPECT_EQ(script({"status"}).exit_code, 3);
}

}  // namespace
