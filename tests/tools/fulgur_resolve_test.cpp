// `fulgur resolve` and `fulgur list`, run as the installed program would be:
// its JSON must be exactly Trainer::describe() for the same flags and the
// same environment (set here per case, and restored), and bad flags give
// the JSON error and exit status 2.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <optional>

#include "fulgur/fulgur.h"
#include "support/process.h"
#include "support/test_support.h"

namespace fulgur_tools_fulgur_resolve_test {
namespace {

using namespace std::chrono_literals;
using Vars = std::map<std::string, std::string>;

// Every variable a cluster environment reads: unset in the child and, while
// a case runs, in this process, so the machine's own never leak in.
const std::vector<std::string> kClusterVars = {"RANK",
                                               "LOCAL_RANK",
                                               "WORLD_SIZE",
                                               "LOCAL_WORLD_SIZE",
                                               "GROUP_RANK",
                                               "NODE_RANK",
                                               "MASTER_ADDR",
                                               "MASTER_PORT",
                                               "TORCHELASTIC_RUN_ID",
                                               "SLURM_NTASKS",
                                               "SLURM_PROCID",
                                               "SLURM_LOCALID",
                                               "SLURM_NODEID",
                                               "SLURM_NODELIST",
                                               "SLURM_JOB_NODELIST",
                                               "SLURM_JOB_ID",
                                               "SLURM_JOB_NAME",
                                               "SLURM_NTASKS_PER_NODE",
                                               "SLURM_NNODES",
                                               "OMPI_COMM_WORLD_SIZE",
                                               "OMPI_COMM_WORLD_RANK",
                                               "OMPI_COMM_WORLD_LOCAL_RANK",
                                               "OMPI_COMM_WORLD_LOCAL_SIZE",
                                               "PMI_SIZE",
                                               "PMI_RANK",
                                               "MPI_LOCALRANKID",
                                               "MPI_LOCALNRANKS",
                                               "LSB_JOBID",
                                               "LSB_DJOB_RANKFILE",
                                               "LSB_MCPU_HOSTS",
                                               "JSM_NAMESPACE_SIZE",
                                               "JSM_NAMESPACE_RANK",
                                               "JSM_NAMESPACE_LOCAL_RANK",
                                               "KUBERNETES_PORT"};

// Sets `vars` (and unsets every other cluster variable) for its lifetime.
class EnvScope {
 public:
  explicit EnvScope(const Vars& vars) {
    for (const auto& name : kClusterVars) {
      if (const char* v = std::getenv(name.c_str())) saved_[name] = v;
      ::unsetenv(name.c_str());
    }
    for (const auto& [k, v] : vars) {
      if (saved_.count(k) == 0) {
        if (const char* old = std::getenv(k.c_str())) saved_[k] = old;
      }
      ::setenv(k.c_str(), v.c_str(), 1);
      set_.push_back(k);
    }
  }
  ~EnvScope() {
    for (const auto& k : set_) ::unsetenv(k.c_str());
    for (const auto& [k, v] : saved_) ::setenv(k.c_str(), v.c_str(), 1);
  }
  EnvScope(const EnvScope&) = delete;
  EnvScope& operator=(const EnvScope&) = delete;

 private:
  std::map<std::string, std::string> saved_;
  std::vector<std::string> set_;
};

fulgur::test::ProcessResult resolve(std::vector<std::string> args, const Vars& env = {}) {
  args.insert(args.begin(), {FULGUR_CLI, "resolve"});
  return fulgur::test::run_process(args, env, 60s, kClusterVars);
}

// What a program would get from Trainer::describe() with these options.
std::string describe(fulgur::TrainerOptions options, const Vars& env) {
  EnvScope scope(env);
  options.enable_checkpointing = false;
  options.logger = false;
  options.enable_progress_bar = false;
  fulgur::Trainer trainer(std::move(options));
  auto text = trainer.describe();
  at::globalContext().setDeterministicAlgorithms(false, false);
  return text;
}

struct Case {
  std::string name;
  std::vector<std::string> args;
  fulgur::TrainerOptions options;
  Vars env = {};
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class ResolveMatchesDescribe : public ::testing::TestWithParam<Case> {};

TEST_P(ResolveMatchesDescribe, ForTheSameFlagsAndEnvironment) {
  const auto& c = GetParam();
  auto r = resolve(c.args, c.env);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.leftover_processes, 0);
  EXPECT_EQ(r.output, describe(c.options, c.env));
}

const Vars kTorchrun{{"RANK", "1"},
                     {"GROUP_RANK", "0"},
                     {"LOCAL_RANK", "1"},
                     {"LOCAL_WORLD_SIZE", "2"},
                     {"WORLD_SIZE", "2"},
                     {"MASTER_ADDR", "127.0.0.1"},
                     {"MASTER_PORT", "29500"},
                     {"TORCHELASTIC_RUN_ID", "none"}};
const Vars kSrun{
    {"SLURM_NTASKS", "2"},       {"SLURM_PROCID", "0"},          {"SLURM_LOCALID", "0"},
    {"SLURM_NODEID", "0"},       {"SLURM_NODELIST", "node01"},   {"SLURM_JOB_ID", "77"},
    {"SLURM_JOB_NAME", "train"}, {"SLURM_NTASKS_PER_NODE", "2"}, {"SLURM_NNODES", "1"}};

INSTANTIATE_TEST_SUITE_P(
    Cli, ResolveMatchesDescribe,
    ::testing::Values(
        Case{"plain", {"--accelerator", "cpu"}, {.accelerator = "cpu"}}, Case{"no_flags", {}, {}},
        Case{"ddp_bf16",
             {"--accelerator", "cpu", "--devices", "2", "--precision", "bf16"},
             {.accelerator = "cpu", .devices = 2, .precision = "bf16"}},
        Case{"kebab_and_equals",
             {"--accelerator=cpu", "--num-nodes", "1", "--sync-batchnorm", "true", "--devices=2",
              "--strategy", "ddp_fork"},
             {.accelerator = "cpu",
              .strategy = std::string("ddp_fork"),
              .devices = 2,
              .num_nodes = 1,
              .sync_batchnorm = true}},
        Case{"deterministic_warn_64",
             {"--accelerator", "cpu", "--deterministic", "warn", "--precision", "64"},
             {.accelerator = "cpu", .precision = 64, .deterministic = "warn"}},
        Case{"plugins",
             {"--accelerator", "cpu", "--plugins", "lightning,torch"},
             {.accelerator = "cpu", .plugins = {std::string("lightning"), std::string("torch")}}},
        Case{"manual",
             {"--strategy", "manual", "--devices", "2", "--accelerator", "cpu"},
             {.accelerator = "cpu", .strategy = std::string("manual"), .devices = 2}},
        Case{"torchrun",
             {"--accelerator", "cpu", "--devices", "2"},
             {.accelerator = "cpu", .devices = 2},
             kTorchrun},
        Case{"srun",
             {"--accelerator", "cpu", "--devices", "2"},
             {.accelerator = "cpu", .devices = 2},
             kSrun}),
    [](const auto& info) { return info.param.name; });

TEST(FulgurResolve, PrintsTheDocumentedKeys) {
  auto r = resolve({"--accelerator", "cpu", "--devices", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      r.output,
      {"\"accelerator\": \"cpu\"", "\"strategy\": \"ddp\"", "\"launcher\": \"subprocess_script\"",
       "\"precision\": \"32-true\"", "\"cluster_environment\": \"lightning\"", "\"num_nodes\": 1",
       "\"num_devices\": 2", "\"world_size\": 2", "\"global_rank\": 0", "\"local_rank\": 0",
       "\"node_rank\": 0", "\"parallel_devices\": [\n    \"cpu\",\n    \"cpu\"\n  ]",
       "\"deterministic\": false", "\"sync_batchnorm\": false",
       "strategy=ddp because devices=2 and num_nodes=1"}));
}

TEST(FulgurResolve, BadFlagsGiveTheJsonErrorAndStatus2) {
  auto r = resolve({"--accelerator", "cpu", "--devices", "0", "--strategy", "dpp"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  std::string expected;
  try {
    EnvScope scope({});
    fulgur::Trainer trainer(fulgur::TrainerOptions{.accelerator = "cpu",
                                                   .strategy = std::string("dpp"),
                                                   .devices = 0,
                                                   .enable_checkpointing = false,
                                                   .enable_progress_bar = false,
                                                   .logger = false});
  } catch (const fulgur::FlagError& e) {
    expected = fulgur::to_json(e);
  }
  ASSERT_FALSE(expected.empty());
  EXPECT_EQ(r.output, expected);
  EXPECT_TRUE(fulgur::test::message_contains(
      r.output, {"\"error\": \"invalid_flags\"", "\"problems\": [", "strategy=\\\"dpp\\\"",
                 "did you mean \\\"ddp\\\"", "devices=0: selects no device",
                 "\"message\": \"Trainer: 2 problems with the flags:"}));
}

TEST(FulgurResolve, CommandLineMistakesAreFlagErrorsToo) {
  auto missing = resolve({"--accelerator", "cpu", "--devices"});
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      missing.output, {"\"error\": \"invalid_flags\"", "--devices has no value"}));
  auto unknown = resolve({"--accelerator", "cpu", "--gpus", "2", "stray"});
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;
  EXPECT_TRUE(fulgur::test::message_contains(unknown.output, {"\\\"stray\\\": expected a flag"}));
  auto unknown_flag = resolve({"--accelerator", "cpu", "--gpus", "2"});
  EXPECT_EQ(unknown_flag.exit_code, 2) << unknown_flag.output;
  EXPECT_TRUE(fulgur::test::message_contains(unknown_flag.output, {"--gpus: unknown flag"}));
}

// A program's config file (its model:, data: and own keys beside trainer:)
// resolves from its trainer: section, the others left out with one note; a
// mistake under trainer: is still named.
TEST(FulgurResolve, AProgramsConfigResolvesFromItsTrainerSection) {
  fulgur::test::TempDir dir;
  fulgur::test::write_text(dir.file("program.yaml"),
                           "trainer:\n  accelerator: cpu\n  devices: 2\nmodel:\n  lr: 0.001\n"
                           "data:\n  batch_size: 128\nthreads: 2\n");
  auto r = resolve({"--config", dir.file("program.yaml")});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(
      fulgur::test::message_contains(r.output, {"\"num_devices\": 2",
                                                "the config sets keys of a program (model.lr, "
                                                "data.batch_size, threads)",
                                                "they are left out"}));
  fulgur::test::write_text(dir.file("typo.yaml"),
                           "trainer:\n  accelerator: cpu\n  max_epoch: 2\nmodel:\n  lr: 0.001\n");
  auto typo = resolve({"--config", dir.file("typo.yaml")});
  EXPECT_EQ(typo.exit_code, 2) << typo.output;
  EXPECT_TRUE(fulgur::test::message_contains(typo.output, {"unknown key trainer.max_epoch"}))
      << typo.output;
}

TEST(FulgurResolve, EnvironmentMismatchIsReportedWithItsKind) {
  auto r = resolve({"--accelerator", "cpu"}, kTorchrun);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      r.output, {"\"error\": \"environment_mismatch\"", "torchelastic"}));
}

TEST(FulgurList, ShowsEveryRegistryWithDescriptions) {
  auto r = fulgur::test::run_process({FULGUR_CLI, "list"}, {}, 60s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      r.output, {"strategies:", "ddp_fork", "single_device", "accelerators:", "cpu", "cuda",
                 "precision:", "bf16-mixed", "cluster environments (plugins):", "slurm",
                 "checkpoint IO (plugins):", "torch"}));
}

TEST(FulgurCli, WithoutACommandPrintsUsageAndFails) {
  auto r = fulgur::test::run_process({FULGUR_CLI}, {}, 60s);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(fulgur::test::message_contains(r.output, {"usage: fulgur resolve"}));
}

}  // namespace
}  // namespace fulgur_tools_fulgur_resolve_test
