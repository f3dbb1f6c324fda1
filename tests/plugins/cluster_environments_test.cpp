// The built-in cluster environments, their detection and the connector's
// use of them. Every environment is a fixed EnvView map: the process
// environment is never read.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <functional>

#include "fulgur/core/errors.h"
#include "fulgur/plugins/environments/kubeflow.h"
#include "fulgur/plugins/environments/lightning.h"
#include "fulgur/plugins/environments/lsf.h"
#include "fulgur/plugins/environments/mpi.h"
#include "fulgur/plugins/environments/slurm.h"
#include "fulgur/plugins/environments/torchelastic.h"
#include "fulgur/trainer/connectors/accelerator_connector.h"
#include "support/test_support.h"

namespace fulgur_plugins_cluster_environments_test {
namespace {

using fulgur::ConfigError;
using fulgur::EnvView;
using Vars = std::map<std::string, std::string>;

Vars merged(Vars base, const Vars& extra) {
  for (const auto& [k, v] : extra) base[k] = v;
  return base;
}

// torchrun --nnodes 2 --nproc-per-node 2: the worker with rank 3.
const Vars kTorchrun{{"RANK", "3"},
                     {"GROUP_RANK", "1"},
                     {"LOCAL_RANK", "1"},
                     {"LOCAL_WORLD_SIZE", "2"},
                     {"WORLD_SIZE", "4"},
                     {"MASTER_ADDR", "10.0.0.1"},
                     {"MASTER_PORT", "29400"},
                     {"TORCHELASTIC_RUN_ID", "job7"}};
// srun --nodes 2 --ntasks-per-node 2 inside sbatch job 4123456: task 2.
const Vars kSrun{{"SLURM_NTASKS", "4"},
                 {"SLURM_PROCID", "2"},
                 {"SLURM_LOCALID", "0"},
                 {"SLURM_NODEID", "1"},
                 {"SLURM_NODELIST", "gpu[017-018]"},
                 {"SLURM_JOB_ID", "4123456"},
                 {"SLURM_JOB_NAME", "train"},
                 {"SLURM_NTASKS_PER_NODE", "2"},
                 {"SLURM_NNODES", "2"}};
// mpirun -np 4 on one node (Open MPI): rank 2.
const Vars kMpirun{{"OMPI_COMM_WORLD_SIZE", "4"},
                   {"OMPI_COMM_WORLD_RANK", "2"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};
// jsrun on 2 compute hosts x 3 ranks, job 98765: rank 4.
const Vars kLsf{{"LSB_JOBID", "98765"},
                {"LSB_DJOB_RANKFILE", "/tmp/rankfile"},
                {"LSB_MCPU_HOSTS", "batch1 1 h1 42 h2 42"},
                {"JSM_NAMESPACE_SIZE", "6"},
                {"JSM_NAMESPACE_RANK", "4"},
                {"JSM_NAMESPACE_LOCAL_RANK", "1"}};
// A PyTorchJob with 3 pods: the pod of rank 2.
const Vars kKubeflow{{"KUBERNETES_PORT", "tcp://10.96.0.1:443"},
                     {"MASTER_ADDR", "job-master-0"},
                     {"MASTER_PORT", "23456"},
                     {"WORLD_SIZE", "3"},
                     {"RANK", "2"}};

// ---- Getters for a realistic environment of each kind.

struct Expected {
  const char* label;
  Vars vars;
  std::string name;
  std::string address;
  int port, world, global, local, node;
};

void PrintTo(const Expected& c, std::ostream* os) { *os << c.label; }

class EnvironmentGetters : public ::testing::TestWithParam<Expected> {};

TEST_P(EnvironmentGetters, ReadTheirVariables) {
  const auto& e = GetParam();
  auto env = fulgur::cluster_environment_registry().create(e.name, EnvView(e.vars));
  EXPECT_EQ(env->name(), e.name);
  EXPECT_TRUE(env->creates_processes_externally());
  EXPECT_EQ(env->main_address(), e.address);
  EXPECT_EQ(env->main_port(), e.port);
  EXPECT_EQ(env->world_size(), e.world);
  EXPECT_EQ(env->global_rank(), e.global);
  EXPECT_EQ(env->local_rank(), e.local);
  EXPECT_EQ(env->node_rank(), e.node);
  // The same environment is what detection picks.
  auto detected = fulgur::detect_cluster_environment(EnvView(e.vars), nullptr);
  EXPECT_EQ(detected->name(), e.name);
}

INSTANTIATE_TEST_SUITE_P(
    Realistic, EnvironmentGetters,
    ::testing::Values(
        Expected{"torchrun_2x2", kTorchrun, "torchelastic", "10.0.0.1", 29400, 4, 3, 1, 1},
        // Port: 15000 + the last 4 digits of the job id, as Lightning.
        Expected{"srun_2x2", kSrun, "slurm", "gpu017", 15000 + 3456, 4, 2, 0, 1},
        Expected{"srun_master_vars",
                 merged(kSrun, {{"MASTER_ADDR", "n0"}, {"MASTER_PORT", "1234"}}), "slurm", "n0",
                 1234, 4, 2, 0, 1},
        Expected{"srun_no_job_id", merged(kSrun, {{"SLURM_JOB_ID", ""}}), "slurm", "gpu017", 15000,
                 4, 2, 0, 1},
        Expected{"mpirun_np4_one_node", kMpirun, "mpi", "127.0.0.1", 29500, 4, 2, 2, 0},
        Expected{"mpich_pmi_2x2",
                 Vars{{"PMI_SIZE", "4"},
                      {"PMI_RANK", "3"},
                      {"MPI_LOCALRANKID", "1"},
                      {"MPI_LOCALNRANKS", "2"},
                      {"MASTER_ADDR", "h0"},
                      {"MASTER_PORT", "4000"}},
                 "mpi", "h0", 4000, 4, 3, 1, 1},
        // LSF port: 10000 + LSB_JOBID % 1000, as Lightning.
        Expected{"jsrun_2x3", kLsf, "lsf", "h1", 10765, 6, 4, 1, 1},
        Expected{"kubeflow_3_pods", kKubeflow, "kubeflow", "job-master-0", 23456, 3, 2, 0, 2}),
    [](const auto& info) { return std::string(info.param.label); });

TEST(SLURMEnvironment, EmptyJobIdPortIsTheLightningDefault) {
  auto vars = kSrun;
  vars.erase("SLURM_JOB_ID");
  EXPECT_EQ(fulgur::SLURMEnvironment(EnvView(vars)).main_port(), 12910);
}

TEST(MPIEnvironment, KnowsItsFamily) {
  EXPECT_EQ(fulgur::MPIEnvironment(EnvView(kMpirun)).family(), "Open MPI");
  EXPECT_EQ(fulgur::MPIEnvironment(EnvView(Vars{{"PMI_SIZE", "1"}, {"PMI_RANK", "0"}})).family(),
            "PMI");
}

TEST(LSFEnvironment, LocalSizeFromJsmWhenSet) {
  fulgur::LSFEnvironment env(EnvView(merged(kLsf, {{"JSM_NAMESPACE_LOCAL_SIZE", "2"}})));
  EXPECT_EQ(env.local_size(), 2);
  EXPECT_EQ(env.node_rank(), 2);
  EXPECT_EQ(fulgur::LSFEnvironment::first_compute_host("solo 4"), "solo");
  EXPECT_EQ(fulgur::LSFEnvironment::first_compute_host(""), "");
}

TEST(LSFEnvironment, MainAddressFromTheRankFileWithoutMcpuHosts) {
  fulgur::test::TempDir dir;
  const std::string rankfile = dir.file("rankfile");
  // The second compute host is this machine (a rank reads the file of its own job).
  char name[256] = {};
  ASSERT_EQ(::gethostname(name, sizeof name - 1), 0);
  std::ofstream(rankfile) << "batch1\nh1\nh1\nh1\n" << name << "\n" << name << "\n" << name << "\n";
  Vars vars = merged(kLsf, {{"LSB_DJOB_RANKFILE", rankfile}});
  vars.erase("LSB_MCPU_HOSTS");
  // The launch host (first line) runs no ranks: the first compute host.
  EXPECT_EQ(fulgur::LSFEnvironment(EnvView(vars)).main_address(), "h1");
  vars["LSB_DJOB_RANKFILE"] = dir.file("missing");
  EXPECT_THROWS_WITH(
      ConfigError, fulgur::LSFEnvironment{EnvView(vars)},
      {"LSB_DJOB_RANKFILE=" + dir.file("missing") + " cannot be read", "Set MASTER_ADDR"});
}

// A rank file of a hundred thousand hosts that do not include this one:
// the error lists the first ten and counts the rest (each line was once
// compared with every host before it, minutes for a million, and the
// message listed them all).
TEST(LSFEnvironment, ARankFileOfManyHostsWithoutThisOneIsNamedShort) {
  fulgur::test::TempDir dir;
  const std::string rankfile = dir.file("rankfile");
  {
    std::ofstream out(rankfile);
    out << "launch\n";
    for (int i = 0; i < 100000; ++i) out << "compute-" << i << "\ncompute-" << i << "\n";
  }
  Vars vars = merged(kLsf, {{"LSB_DJOB_RANKFILE", rankfile}});
  try {
    fulgur::LSFEnvironment env{EnvView(vars)};
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    const std::string message = e.what();
    EXPECT_TRUE(fulgur::test::message_contains(
        message, {"is not among the compute hosts", "compute-0, compute-1", "compute-9, ...",
                  "(100000 in all)"}))
        << message.substr(0, 1000);
    EXPECT_LT(message.size(), 1000u);
  }
}

// A rank file that is not a regular file is refused by its type without
// being opened (a FIFO would block, /dev/zero would fill the memory).
TEST(LSFEnvironment, ARankFileThatIsNotARegularFileIsRefusedUnopened) {
  fulgur::test::TempDir dir;
  const std::string fifo = dir.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const auto& [path, kind] : std::vector<std::pair<std::string, std::string>>{
           {"/dev/zero", "a character device"}, {fifo, "a FIFO"}, {dir.path(), "a directory"}}) {
    Vars vars = merged(kLsf, {{"LSB_DJOB_RANKFILE", path}});
    EXPECT_THROWS_WITH(ConfigError, fulgur::LSFEnvironment{EnvView(vars)},
                       {"LSB_DJOB_RANKFILE=" + path + " is " + kind, "one host name per line",
                        "set MASTER_ADDR"});
  }
}

// A count of processes or nodes below 1 is refused naming the variable (an
// MPI world size of 0 divided by zero before), in every environment.
TEST(ClusterEnvironments, ACountBelowOneIsRefusedNamingTheVariable) {
  auto expect_refused = [](const std::function<void()>& make, const std::string& var,
                           const std::string& value) {
    SCOPED_TRACE(var);
    EXPECT_THROWS_WITH(ConfigError, make(),
                       {var + value, "counts processes or nodes, so it must be >= 1"});
  };
  for (const char* value : {"0", "-1"}) {
    for (const char* var : {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"}) {
      const Vars vars = merged(kMpirun, {{var, value}});
      expect_refused([&] { fulgur::MPIEnvironment{EnvView(vars)}; }, var, std::string("=") + value);
    }
    const Vars pmi{{"PMI_SIZE", value}, {"PMI_RANK", "0"}};
    expect_refused([&] { fulgur::MPIEnvironment{EnvView(pmi)}; }, "PMI_SIZE",
                   std::string("=") + value);
    for (const char* var : {"WORLD_SIZE", "LOCAL_WORLD_SIZE"}) {
      const Vars vars = merged(kTorchrun, {{var, value}});
      expect_refused([&] { fulgur::TorchElasticEnvironment{EnvView(vars)}; }, var,
                     std::string("=") + value);
    }
    for (const char* var : {"SLURM_NTASKS", "SLURM_NNODES"}) {
      const Vars vars = merged(kSrun, {{var, value}});
      expect_refused([&] { fulgur::SLURMEnvironment{EnvView(vars)}; }, var,
                     std::string("=") + value);
    }
    for (const char* var : {"JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_SIZE"}) {
      const Vars vars = merged(kLsf, {{var, value}});
      expect_refused([&] { fulgur::LSFEnvironment{EnvView(vars)}; }, var,
                     std::string("=") + value);
    }
    const Vars kubeflow = merged(kKubeflow, {{"WORLD_SIZE", value}});
    expect_refused([&] { fulgur::KubeflowEnvironment{EnvView(kubeflow)}; }, "WORLD_SIZE",
                   std::string("=") + value);
  }
  const Vars zero_per_node = merged(kSrun, {{"SLURM_NTASKS_PER_NODE", "0"}});
  EXPECT_THROWS_WITH(ConfigError, fulgur::SLURMEnvironment{EnvView(zero_per_node)},
                     {"SLURM_NTASKS_PER_NODE=\"0\" is not a task count >= 1"});
}

// Lightning's node rank under LSF: this host's place among the distinct
// compute hosts of the rank file, whatever order jsrun gave the ranks.
TEST(LSFEnvironment, NodeRankIsThisHostsPlaceAmongTheRankFilesComputeHosts) {
  using fulgur::LSFEnvironment;
  const std::vector<std::string> lines = {"launch", "h7", "h7", "c3.site", "c3.site", "h2"};
  EXPECT_EQ(LSFEnvironment::node_rank_among(lines, "h7"), 0);
  EXPECT_EQ(LSFEnvironment::node_rank_among(lines, "c3"), 1);
  EXPECT_EQ(LSFEnvironment::node_rank_among(lines, "c3.site"), 1);
  EXPECT_EQ(LSFEnvironment::node_rank_among(lines, "h2.other"), 2);
  EXPECT_EQ(LSFEnvironment::node_rank_among(lines, "launch"), -1);
  EXPECT_EQ(LSFEnvironment::node_rank_among({"solo", "solo"}, "solo"), 0);
  EXPECT_EQ(LSFEnvironment::node_rank_among({"solo"}, "solo"), 0);

  // This machine, third of the job's compute hosts, runs global rank 1
  // (jsrun numbered its ranks first): node rank 2, from the file, not
  // rank / local size (0).
  char name[256] = {};
  ASSERT_EQ(::gethostname(name, sizeof name - 1), 0);
  fulgur::test::TempDir dir;
  const std::string rankfile = dir.file("rankfile");
  std::ofstream(rankfile) << "batch1\nh1\nh1\nh2\nh2\n" << name << "\n" << name << "\n";
  Vars vars = merged(kLsf, {{"LSB_DJOB_RANKFILE", rankfile},
                            {"LSB_MCPU_HOSTS", "batch1 1 h1 2 h2 2 " + std::string(name) + " 2"},
                            {"JSM_NAMESPACE_RANK", "1"},
                            {"JSM_NAMESPACE_LOCAL_RANK", "1"}});
  LSFEnvironment env{EnvView(vars)};
  EXPECT_EQ(env.node_rank(), 2);
  EXPECT_EQ(env.global_rank(), 1);

  // A rank file without this host: its node rank cannot be known.
  std::ofstream(rankfile) << "batch1\nh1\nh2\n";
  EXPECT_THROWS_WITH(ConfigError, LSFEnvironment{EnvView(vars)},
                     {"this host, \"" + std::string(name) + "\"",
                      "LSB_DJOB_RANKFILE=" + rankfile + " (h1, h2)", "node rank is unknown"});
  // No readable rank file: rank / local size, as before.
  vars["LSB_DJOB_RANKFILE"] = dir.file("missing");
  EXPECT_EQ(LSFEnvironment{EnvView(vars)}.node_rank(), 0);
}

// ---- Detection.

struct DetectCase {
  const char* label;
  Vars vars;
  std::string expected;
};

void PrintTo(const DetectCase& c, std::ostream* os) { *os << c.label; }

class Detection : public ::testing::TestWithParam<DetectCase> {};

TEST_P(Detection, PicksTheEnvironment) {
  const auto& c = GetParam();
  EnvView env(c.vars);
  EXPECT_EQ(fulgur::detect_cluster_environment(env, nullptr)->name(), c.expected);
}

Vars without(Vars vars, const std::string& key) {
  vars.erase(key);
  return vars;
}

TEST(DetectClusterEnvironment, TorchrunWithoutMasterPortIsRecognisedAndNamesIt) {
  // torchrun's own variables decide; the missing one is named instead of
  // another environment being chosen silently.
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::detect_cluster_environment(EnvView(without(kTorchrun, "MASTER_PORT")), nullptr),
      {"\"torchelastic\" needs the environment variable MASTER_PORT"});
  Vars run_id_only = {{"TORCHELASTIC_RUN_ID", "job7"}};
  EXPECT_THROWS_WITH(ConfigError, fulgur::detect_cluster_environment(EnvView(run_id_only), nullptr),
                     {"\"torchelastic\" needs the environment variable WORLD_SIZE"});
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Detection,
    ::testing::Values(
        DetectCase{"empty", Vars{}, "lightning"},
        DetectCase{"lightning_launcher_child",
                   Vars{{"LOCAL_RANK", "1"},
                        {"RANK", "1"},
                        {"WORLD_SIZE", "2"},
                        {"MASTER_ADDR", "127.0.0.1"},
                        {"MASTER_PORT", "5000"},
                        {"NODE_RANK", "0"}},
                   "lightning"},
        DetectCase{"torchrun", kTorchrun, "torchelastic"},
        DetectCase{"torchrun_inside_slurm", merged(kSrun, kTorchrun), "torchelastic"},
        DetectCase{"torchrun_inside_kubeflow", merged(kKubeflow, kTorchrun), "torchelastic"},
        DetectCase{"srun", kSrun, "slurm"},
        DetectCase{"slurm_interactive_bash", merged(kSrun, {{"SLURM_JOB_NAME", "bash"}}),
                   "lightning"},
        DetectCase{"slurm_interactive", merged(kSrun, {{"SLURM_JOB_NAME", "interactive"}}),
                   "lightning"},
        DetectCase{"srun_with_pmi", merged(kSrun, {{"PMI_SIZE", "4"}, {"PMI_RANK", "2"}}), "slurm"},
        DetectCase{"mpirun", kMpirun, "mpi"},
        DetectCase{"ompi_size_without_rank", without(kMpirun, "OMPI_COMM_WORLD_RANK"), "lightning"},
        DetectCase{"lsf", kLsf, "lsf"},
        DetectCase{"lsf_with_lsb_hosts",
                   merged(without(kLsf, "LSB_DJOB_RANKFILE"), {{"LSB_HOSTS", "h1 h1 h2 h2"}}),
                   "lsf"},
        DetectCase{"lsf_without_jsm_rank", without(kLsf, "JSM_NAMESPACE_RANK"), "lightning"},
        DetectCase{"kubeflow", kKubeflow, "kubeflow"},
        DetectCase{"kubernetes_without_rank", without(kKubeflow, "RANK"), "lightning"}),
    [](const auto& info) { return std::string(info.param.label); });

TEST(DetectClusterEnvironment, NotesSayWhy) {
  std::vector<std::string> notes;
  fulgur::detect_cluster_environment(EnvView(kSrun), &notes);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0], "cluster_environment=slurm because SLURM_NTASKS is set (job name \"train\")");
  notes.clear();
  fulgur::detect_cluster_environment(EnvView(merged(kSrun, {{"SLURM_JOB_NAME", "bash"}})), &notes);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("SLURM_JOB_NAME=\"bash\" is an interactive allocation"),
            std::string::npos);
  notes.clear();
  fulgur::detect_cluster_environment(EnvView(Vars{}), &notes);
  EXPECT_TRUE(notes.empty());
}

TEST(ClusterEnvironmentRegistry, HasEveryBuiltInWithADescription) {
  const auto& r = fulgur::cluster_environment_registry();
  for (const char* name : {"lightning", "torchelastic", "slurm", "mpi", "lsf", "kubeflow"}) {
    ASSERT_TRUE(r.contains(name)) << name;
    EXPECT_FALSE(r.entry(name).description.empty()) << name;
  }
}

TEST(ClusterEnvironmentRegistry, DetectsInItsDeclaredPriorityOrder) {
  EXPECT_EQ(fulgur::cluster_environment_registry().detection_order(),
            (std::vector<std::string>{"torchelastic", "slurm", "mpi", "lsf", "kubeflow"}));
}

// An environment a user registers is detected like a built-in, at the
// priority it declares: above torchelastic it wins even inside torchrun.
TEST(ClusterEnvironmentRegistry, DetectsAUserEnvironmentByItsPriority) {
  struct MySchedulerEnvironment : fulgur::LightningEnvironment {
    using fulgur::LightningEnvironment::LightningEnvironment;
    std::string_view name() const override { return "my_scheduler"; }
  };
  using Detection = fulgur::ClusterEnvironmentRegistry::Detection;
  fulgur::ClusterEnvironmentRegistry registry = fulgur::cluster_environment_registry();
  registry.add("my_scheduler", "a user's scheduler",
               [](const EnvView& env) { return std::make_unique<MySchedulerEnvironment>(env); });
  auto detector = [](const EnvView& env) {
    return env.has("MY_SCHED_JOB") ? Detection::match("MY_SCHED_JOB is set") : Detection::no();
  };
  registry.set_detector("my_scheduler", 50, detector);
  const Vars mine{{"MY_SCHED_JOB", "12"}};
  std::vector<std::string> notes;
  EXPECT_EQ(registry.detect(EnvView(mine), &notes)->name(), "my_scheduler");
  EXPECT_EQ(notes, (std::vector<std::string>{"cluster_environment=my_scheduler because "
                                             "MY_SCHED_JOB is set"}));
  // Below torchelastic: torchrun's variables decide first.
  EXPECT_EQ(registry.detect(EnvView(merged(kTorchrun, mine)), nullptr)->name(), "torchelastic");
  // Above it: the user's environment decides.
  registry.set_detector("my_scheduler", 900, detector);
  EXPECT_EQ(registry.detection_order().front(), "my_scheduler");
  EXPECT_EQ(registry.detect(EnvView(merged(kTorchrun, mine)), nullptr)->name(), "my_scheduler");
  // Nothing matches: fulgur creates the processes.
  EXPECT_EQ(registry.detect(EnvView(Vars{}), nullptr)->name(), "lightning");
  // The global registry is untouched.
  EXPECT_FALSE(fulgur::cluster_environment_registry().contains("my_scheduler"));
}

// A detected environment missing a variable says why it was chosen (it
// said to drop a plugin nobody passed); a passed one still says to drop it.
TEST(ClusterEnvironmentRegistry, ADetectedEnvironmentMissingAVariableSaysWhyItWasChosen) {
  try {
    fulgur::cluster_environment_registry().detect(EnvView(without(kTorchrun, "WORLD_SIZE")),
                                                  nullptr);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_TRUE(fulgur::test::message_contains(
        what, {"needs the environment variable WORLD_SIZE", "fulgur chose \"torchelastic\" because",
               "unset those variables"}))
        << what;
    EXPECT_EQ(what.find("drop the"), std::string::npos) << what;
  }
  EXPECT_THROWS_WITH(ConfigError,
                     fulgur::cluster_environment_registry().create(
                         "torchelastic", EnvView(without(kTorchrun, "WORLD_SIZE"))),
                     {"drop the \"torchelastic\" plugin"});
}

TEST(ClusterEnvironmentRegistry, DetectorsNeedARegisteredNameAndTheirOwnPriority) {
  fulgur::ClusterEnvironmentRegistry registry = fulgur::cluster_environment_registry();
  auto never = [](const EnvView&) { return fulgur::ClusterEnvironmentRegistry::Detection::no(); };
  EXPECT_THROWS_WITH(ConfigError, registry.set_detector("my_sched", 50, never),
                     {"unknown cluster environment \"my_sched\""});
  registry.add("my_sched", "a user's scheduler", [](const EnvView& env) {
    return std::make_unique<fulgur::LightningEnvironment>(env);
  });
  EXPECT_THROWS_WITH(ConfigError, registry.set_detector("my_sched", 400, never),
                     {"detector priority 400 is taken by \"slurm\"", "Pick another priority",
                      "torchelastic, slurm, mpi, lsf, kubeflow"});
}

// ---- SLURM_NODELIST.

TEST(SLURMEnvironment, FirstHostOfANodeList) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"node1", "node1"},
      {"node[1-4]", "node1"},
      {"node[001-004,7]", "node001"},
      {"a,b", "a"},
      {"host-[3,5]", "host-3"},
      {"node[7]", "node7"},
      {"rack[2-3]-node[09-12]", "rack2-node09"},
      {"gpu[10-11],cpu[1-2]", "gpu10"},
  };
  for (const auto& [list, first] : cases) {
    EXPECT_EQ(fulgur::SLURMEnvironment::first_host(list), first) << list;
  }
  EXPECT_THROWS_WITH(ConfigError, fulgur::SLURMEnvironment::first_host("node[1-4"),
                     {"SLURM_NODELIST=\"node[1-4\"", "MASTER_ADDR"});
  EXPECT_THROWS_WITH(ConfigError, fulgur::SLURMEnvironment::first_host(""), {"no host"});
}

// ---- Mismatched counts.

struct MismatchCase {
  const char* label;
  Vars vars;
  std::string name;
  int devices, num_nodes;
  std::vector<std::string> substrings;
};

void PrintTo(const MismatchCase& c, std::ostream* os) { *os << c.label; }

class Mismatch : public ::testing::TestWithParam<MismatchCase> {};

TEST_P(Mismatch, NamesBothNumbersAndTheVariable) {
  const auto& c = GetParam();
  auto env = fulgur::cluster_environment_registry().create(c.name, EnvView(c.vars));
  EXPECT_THROWS_WITH(ConfigError, env->validate_settings(c.devices, c.num_nodes), {c.substrings});
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Mismatch,
    ::testing::Values(
        MismatchCase{
            "torchrun_world",
            kTorchrun,
            "torchelastic",
            2,
            1,
            {"devices=2 x num_nodes=1 = 2 processes", "WORLD_SIZE=4", "devices=LOCAL_WORLD_SIZE",
             "num_nodes=WORLD_SIZE/LOCAL_WORLD_SIZE", "devices=2, num_nodes=2"}},
        MismatchCase{"torchrun_local",
                     kTorchrun,
                     "torchelastic",
                     4,
                     1,
                     {"devices=4 per node", "LOCAL_WORLD_SIZE=2"}},
        MismatchCase{"slurm_devices",
                     kSrun,
                     "slurm",
                     4,
                     2,
                     {"devices=4", "SLURM_NTASKS_PER_NODE=2", "srun --ntasks-per-node=4"}},
        MismatchCase{
            "slurm_nodes", kSrun, "slurm", 2, 1, {"num_nodes=1", "SLURM_NNODES=2", "--nodes=1"}},
        MismatchCase{
            "slurm_per_node_with_repeat",
            merged(without(kSrun, "SLURM_NNODES"),
                   {{"SLURM_NTASKS_PER_NODE", "2(x3)"}, {"SLURM_JOB_NUM_NODES", "3"}}),
            "slurm",
            1,
            2,
            {"devices=1", "SLURM_NTASKS_PER_NODE=2", "num_nodes=2", "SLURM_JOB_NUM_NODES=3"}},
        // Per node agrees and SLURM_NNODES is unset, but srun started 2
        // tasks, not devices x num_nodes = 4.
        MismatchCase{"slurm_total_without_nnodes",
                     merged(without(kSrun, "SLURM_NNODES"), {{"SLURM_NTASKS", "2"}}),
                     "slurm",
                     2,
                     2,
                     {"devices=2 x num_nodes=2 = 4 processes", "SLURM_NTASKS=2"}},
        MismatchCase{
            "mpi_world",
            kMpirun,
            "mpi",
            2,
            1,
            {"devices=2 x num_nodes=1", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_SIZE=4"}},
        MismatchCase{"mpi_multi_node_without_master_addr",
                     merged(kMpirun, {{"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
                     "mpi",
                     2,
                     2,
                     {"MASTER_ADDR is not set", "mpirun -x MASTER_ADDR=<host of rank 0>",
                      "-x MASTER_PORT=<port>"}},
        MismatchCase{
            "lsf_world", kLsf, "lsf", 2, 2, {"devices=2 x num_nodes=2", "JSM_NAMESPACE_SIZE=6"}},
        MismatchCase{"kubeflow_devices",
                     kKubeflow,
                     "kubeflow",
                     2,
                     3,
                     {"devices=2", "WORLD_SIZE=3", "devices=1 and num_nodes=3"}}),
    [](const auto& info) { return std::string(info.param.label); });

TEST(ClusterEnvironments, MatchingCountsPass) {
  fulgur::TorchElasticEnvironment(EnvView(kTorchrun)).validate_settings(2, 2);
  fulgur::SLURMEnvironment(EnvView(kSrun)).validate_settings(2, 2);
  fulgur::MPIEnvironment(EnvView(kMpirun)).validate_settings(4, 1);
  fulgur::LSFEnvironment(EnvView(kLsf)).validate_settings(3, 2);
  fulgur::KubeflowEnvironment(EnvView(kKubeflow)).validate_settings(1, 3);
}

// torchrun 2.x (and 1.x's static rendezvous) hosts the store in its agent:
// the ranks join it, under a prefix per run and restart.
TEST(TorchElasticEnvironment, AgentHostedStoreIsJoinedUnderAPrefixPerRunAndRestart) {
  EXPECT_EQ(fulgur::TorchElasticEnvironment(EnvView(kTorchrun)).hosted_store_prefix(), "");
  EXPECT_EQ(fulgur::TorchElasticEnvironment(
                EnvView(merged(kTorchrun, {{"TORCHELASTIC_USE_AGENT_STORE", "False"}})))
                .hosted_store_prefix(),
            "");
  EXPECT_EQ(fulgur::TorchElasticEnvironment(
                EnvView(merged(kTorchrun, {{"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                           {"TORCHELASTIC_RESTART_COUNT", "2"}})))
                .hosted_store_prefix(),
            "fulgur/job7/2/");
  EXPECT_THROWS_WITH(ConfigError,
                     fulgur::TorchElasticEnvironment(
                         EnvView(merged(kTorchrun, {{"TORCHELASTIC_USE_AGENT_STORE", "yes"}}))),
                     {"TORCHELASTIC_USE_AGENT_STORE=\"yes\"", "True"});
}

TEST(MPIEnvironment, MultiNodeWithoutMasterAddrHasNoAddress) {
  fulgur::MPIEnvironment env(EnvView(merged(kMpirun, {{"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}})));
  EXPECT_EQ(env.node_rank(), 1);
  EXPECT_THROWS_WITH(ConfigError, env.main_address(), {"MASTER_ADDR", "mpirun -x"});
}

// ---- Bad variables.

TEST(ClusterEnvironments, NonIntegerVariableIsAConfigError) {
  EXPECT_THROWS_WITH(ConfigError,
                     fulgur::SLURMEnvironment(EnvView(merged(kSrun, {{"SLURM_PROCID", "two"}}))),
                     {"SLURM_PROCID", "two"});
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::TorchElasticEnvironment(EnvView(merged(kTorchrun, {{"LOCAL_WORLD_SIZE", "2x"}}))),
      {"LOCAL_WORLD_SIZE", "2x"});
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::SLURMEnvironment(EnvView(merged(kSrun, {{"SLURM_NTASKS_PER_NODE", "many"}}))),
      {"SLURM_NTASKS_PER_NODE=\"many\""});
}

TEST(ClusterEnvironments, MissingVariableNamesIt) {
  EXPECT_THROWS_WITH(ConfigError,
                     fulgur::cluster_environment_registry().create("slurm", EnvView(Vars{})),
                     {"\"slurm\"", "SLURM_NTASKS", "srun"});
  EXPECT_THROWS_WITH(ConfigError,
                     fulgur::TorchElasticEnvironment(EnvView(without(kTorchrun, "MASTER_ADDR"))),
                     {"MASTER_ADDR", "torchrun"});
}

// ---- The connector.

fulgur::TrainerOptions cpu_options(int devices, int num_nodes) {
  fulgur::TrainerOptions options;
  options.accelerator = "cpu";
  options.devices = devices;
  options.num_nodes = num_nodes;
  return options;
}

const Vars kTorchrunSingle{{"RANK", "0"},           {"GROUP_RANK", "0"},
                           {"LOCAL_RANK", "0"},     {"LOCAL_WORLD_SIZE", "1"},
                           {"WORLD_SIZE", "1"},     {"MASTER_ADDR", "127.0.0.1"},
                           {"MASTER_PORT", "29500"}};

TEST(ConnectorClusterEnvironment, UsesTheDetectedEnvironment) {
  auto result = fulgur::connect(cpu_options(1, 1), EnvView(kTorchrunSingle));
  EXPECT_EQ(result.strategy->cluster_environment().name(), "torchelastic");
  EXPECT_NE(fulgur::join(result.resolution.notes).find("cluster_environment=torchelastic because"),
            std::string::npos);
}

TEST(ConnectorClusterEnvironment, EmptyEnvironmentIsLightning) {
  auto result = fulgur::connect(cpu_options(1, 1), EnvView(Vars{}));
  EXPECT_EQ(result.strategy->cluster_environment().name(), "lightning");
}

TEST(ConnectorClusterEnvironment, MismatchWithTheLauncherIsAnError) {
  auto vars = merged(kTorchrunSingle, {{"WORLD_SIZE", "2"}});
  EXPECT_THROWS_WITH(ConfigError, fulgur::connect(cpu_options(1, 1), EnvView(vars)),
                     {"devices=1, num_nodes=1 under cluster environment \"torchelastic\"",
                      "devices=1 x num_nodes=1 = 1 processes", "WORLD_SIZE=2"});
}

TEST(ConnectorClusterEnvironment, APluginInstanceWinsOverDetection) {
  auto options = cpu_options(1, 1);
  options.plugins.push_back(std::shared_ptr<fulgur::ClusterEnvironment>(
      std::make_shared<fulgur::LightningEnvironment>(EnvView(Vars{}))));
  auto result = fulgur::connect(options, EnvView(merged(kTorchrunSingle, {{"WORLD_SIZE", "2"}})));
  EXPECT_EQ(result.strategy->cluster_environment().name(), "lightning");
}

// ---- Restarts and preemption.

TEST(ClusterEnvironmentRestarts, EachEnvironmentReadsItsSchedulersCounter) {
  EXPECT_EQ(fulgur::SLURMEnvironment(EnvView(kSrun)).restart_count(), 0);
  EXPECT_EQ(fulgur::SLURMEnvironment(EnvView(merged(kSrun, {{"SLURM_RESTART_COUNT", "2"}})))
                .restart_count(),
            2);
  EXPECT_EQ(
      fulgur::LightningEnvironment(EnvView(Vars{{"FULGUR_RESTART_COUNT", "1"}})).restart_count(),
      1);
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::SLURMEnvironment(EnvView(merged(kSrun, {{"SLURM_RESTART_COUNT", "-1"}}))),
      {"SLURM_RESTART_COUNT=-1 is negative", "counts restarts"});
  EXPECT_THROWS_WITH(ConfigError,
                     fulgur::LightningEnvironment(EnvView(Vars{{"FULGUR_RESTART_COUNT", "two"}})),
                     {"FULGUR_RESTART_COUNT"});
}

TEST(ClusterEnvironmentRestarts, SlurmAnswersItsRequeueSignalAndSigterm) {
  fulgur::SLURMEnvironment slurm{EnvView(kSrun)};
  EXPECT_EQ(slurm.preemption_signals(), (std::vector<int>{SIGUSR1, SIGTERM}));
  EXPECT_EQ(fulgur::LightningEnvironment(EnvView(Vars{})).preemption_signals(), std::vector<int>{});
  EXPECT_THROWS_WITH(ConfigError,
                     fulgur::SLURMEnvironment(EnvView(kSrun), {.requeue_signal = SIGKILL}),
                     {"SLURMOptions::requeue_signal=9 cannot be caught", "sbatch --signal"});
}

// requeue() says what it did, and never throws: the checkpoint is saved
// whatever scontrol does.
TEST(ClusterEnvironmentRestarts, SlurmRequeueNamesWhatItCouldNotDo) {
  fulgur::SLURMEnvironment unrun(EnvView(kSrun), {.scontrol = "/no/such/scontrol"});
  EXPECT_EQ(unrun.requeue(SIGTERM), "");  // not the requeue signal
  EXPECT_NE(unrun.requeue(SIGUSR1).find("NOT requeued: cannot run `/no/such/scontrol requeue"),
            std::string::npos);
  fulgur::SLURMEnvironment failing(EnvView(kSrun), {.scontrol = "false"});
  EXPECT_NE(failing.requeue(SIGUSR1).find("exited with status 1"), std::string::npos);
  fulgur::SLURMEnvironment off(EnvView(kSrun), {.auto_requeue = false});
  EXPECT_EQ(off.requeue(SIGUSR1), "not requeued (SLURMOptions::auto_requeue is false)");
  fulgur::SLURMEnvironment no_job(EnvView(merged(kSrun, {{"SLURM_JOB_ID", ""}})),
                                  {.scontrol = "true"});
  // An empty SLURM_JOB_ID counts as none.
  EXPECT_EQ(no_job.requeue(SIGUSR1), "not requeued: SLURM_JOB_ID is not set");
}

}  // namespace
}  // namespace fulgur_plugins_cluster_environments_test
