#include "fulgur/trainer/connectors/accelerator_connector.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/fulgur.h"
#include "support/fake_machine.h"
#include "support/test_support.h"

namespace {

using fulgur::ConfigError;
using fulgur::TrainerOptions;

fulgur::EnvView empty_env() { return fulgur::EnvView(std::map<std::string, std::string>{}); }

TEST(AcceleratorConnector, DefaultsResolveToSingleDeviceOnTheCpuWithNotes) {
  const fulgur::test::FakeMachine no_gpu(0);
  auto result = fulgur::connect(TrainerOptions{}, no_gpu.context());
  EXPECT_EQ(result.strategy->name(), "single_device");
  EXPECT_EQ(result.strategy->accelerator().name(), "cpu");
  EXPECT_EQ(result.strategy->precision().name(), "32-true");
  EXPECT_EQ(result.strategy->cluster_environment().name(), "lightning");
  EXPECT_EQ(result.strategy->root_device(), c10::Device(c10::kCPU));
  ASSERT_EQ(result.resolution.notes.size(), 3u);
  EXPECT_NE(result.resolution.notes[0].find("accelerator=cpu because accelerator=auto"),
            std::string::npos);
  EXPECT_NE(result.resolution.notes[2].find("strategy=single_device"), std::string::npos);
}

TEST(AcceleratorConnector, LegacyPrecisionSpellingIsNoted) {
  auto result =
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .precision = "32"}, empty_env());
  EXPECT_EQ(result.strategy->precision().name(), "32-true");
  EXPECT_NE(fulgur::join(result.resolution.notes)
                .find("precision=\"32-true\" because precision=\"32\" is its legacy spelling"),
            std::string::npos);
}

TEST(AcceleratorConnector, EveryProblemIsReportedInOneError) {
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(TrainerOptions{.accelerator = "cpuu",
                                     .strategy = std::string("singel_device"),
                                     .precision = "17-true"},
                      empty_env()),
      {"3 problems", "accelerator=\"cpuu\"", "did you mean \"cpu\"", "strategy=\"singel_device\"",
       "did you mean \"single_device\"", "precision=\"17-true\"",
       "Registered: 16-mixed, 16-true, 32-true, 64-true, bf16-mixed, bf16-true"});
}

TEST(AcceleratorConnector, TwoPluginsOfOneTypeConflict) {
  TrainerOptions options{.accelerator = "cpu",
                         .plugins = {std::string("lightning"),
                                     std::make_shared<fulgur::LightningEnvironment>(empty_env())}};
  EXPECT_THROWS_WITH(ConfigError, fulgur::connect(options, empty_env()),
                     {"plugins[1]", "a second cluster environment", "after lightning", "Pass one"});
  TrainerOptions io{
      .accelerator = "cpu",
      .plugins = {std::make_shared<fulgur::TorchCheckpointIO>(), std::string("torch")}};
  EXPECT_THROWS_WITH(ConfigError, fulgur::connect(io, empty_env()),
                     {"plugins[1]", "a second checkpoint IO"});
}

TEST(AcceleratorConnector, NullAndUnknownPluginsAreNamed) {
  TrainerOptions options{
      .accelerator = "cpu",
      .plugins = {std::shared_ptr<fulgur::CheckpointIO>(), std::string("slrum")}};
  EXPECT_THROWS_WITH(
      ConfigError, fulgur::connect(options, empty_env()),
      {"2 problems", "plugins[0] is a null checkpoint IO", "plugins[1]=\"slrum\"", "unknown plugin",
       "did you mean \"slurm\"?",
       "Registered plugin names: 16-mixed, 16-true, 32-true, 64-true, async, bf16-mixed, "
       "bf16-true, kubeflow, lightning, lsf, mpi, slurm, torch, torchelastic"});
}

TEST(AcceleratorConnector, PrecisionPluginAndPrecisionFlagConflict) {
  TrainerOptions options{.accelerator = "cpu",
                         .precision = "64-true",
                         .plugins = {std::make_shared<fulgur::Precision>()}};
  EXPECT_THROWS_WITH(ConfigError, fulgur::connect(options, empty_env()),
                     {"precision=\"64-true\"", "precision plugin (32-true)", "choose one"});
}

TEST(AcceleratorConnector, PluginInstancesAreHandedToTheStrategy) {
  auto io = std::make_shared<fulgur::TorchCheckpointIO>();
  auto precision = std::make_shared<fulgur::Precision>();
  TrainerOptions options{.accelerator = "cpu", .plugins = {io, precision}};
  auto result = fulgur::connect(options, empty_env());
  EXPECT_EQ(&result.strategy->checkpoint_io(), io.get());
  EXPECT_EQ(&result.strategy->precision(), precision.get());
}

TEST(AcceleratorConnector, StrategyInstanceWithAnotherAcceleratorConflictsWithTheFlag) {
  auto strategy = std::make_shared<fulgur::SingleDeviceStrategy>();
  strategy->set_accelerator(std::make_shared<fulgur::CPUAccelerator>());
  TrainerOptions options{.accelerator = "cuda", .strategy = strategy};
  EXPECT_THROWS_WITH(
      ConfigError, fulgur::connect(options, empty_env()),
      {"accelerator=\"cuda\"", "the strategy instance (single_device) carries accelerator \"cpu\"",
       "set it in one place"});
}

TEST(AcceleratorConnector, CudaWithoutCudaNamesWhatWasFound) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "this machine has CUDA";
  EXPECT_THROWS_WITH(
      ConfigError, fulgur::connect(TrainerOptions{.accelerator = "gpu"}, empty_env()),
      {"accelerator=\"gpu\"", "not available", "found 0 CUDA devices", "accelerator=\"cpu\""});
}

TEST(AcceleratorConnector, SeveralDevicesChooseDdpWithItsLauncher) {
  auto result = fulgur::connect(TrainerOptions{.accelerator = "cpu", .devices = 2}, empty_env());
  auto& strategy = *result.strategy;
  EXPECT_EQ(strategy.name(), "ddp");
  ASSERT_NE(strategy.launcher(), nullptr);
  EXPECT_EQ(strategy.launcher()->name(), "subprocess_script");
  EXPECT_EQ(strategy.world_size(), 2);
  EXPECT_EQ(strategy.global_rank(), 0);
  EXPECT_TRUE(fulgur::test::message_contains(
      fulgur::join(result.resolution.notes, "\n"),
      {"strategy=ddp because devices=2 and num_nodes=1",
       "process_group_backend=gloo because process_group_backend=auto "
       "and the devices are cpu"}));
}

TEST(AcceleratorConnector, AProcessGroupBackendThatCannotRunHereIsAFlagError) {
  auto ddp = [](const std::string& backend) {
    fulgur::DDPOptions options;
    options.parallel.process_group_backend = backend;
    return std::make_shared<fulgur::DDPStrategy>(options);
  };
  // nccl on CPU devices: not in this build (Debian's LibTorch), or not on CPU.
  const auto available = fulgur::available_process_group_backends();
  const bool has_nccl = std::find(available.begin(), available.end(), "nccl") != available.end();
  EXPECT_THROWS_WITH(
      fulgur::FlagError,
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .strategy = ddp("nccl"), .devices = 2},
                      empty_env()),
      {"strategy \"ddp\" with process_group_backend=\"nccl\"",
       has_nccl ? "runs on CUDA devices, but this rank's device is cpu" : "is not in this build",
       has_nccl ? "Use \"gloo\" on CPU" : "Available: gloo"});
  // Set explicitly and valid: no note about a default.
  auto result = fulgur::connect(
      TrainerOptions{.accelerator = "cpu", .strategy = ddp("gloo"), .devices = 2}, empty_env());
  EXPECT_EQ(fulgur::join(result.resolution.notes, "\n").find("process_group_backend="),
            std::string::npos);
  // A name that is no backend at all is refused when the strategy is built.
  EXPECT_THROWS_WITH(fulgur::ConfigError, ddp("glo"),
                     {"process_group_backend=\"glo\" is not one of gloo, nccl, mpi"});
}

// Lightning's "fsdp" is FULL_SHARD here too; both sharding strategies take
// sync_batchnorm, as ddp does.
TEST(AcceleratorConnector, FsdpIsFullShardAndTakesSyncBatchnorm) {
  for (const char* name : {"fsdp", "fsdp_shard_grad_op"}) {
    auto result = fulgur::connect(
        TrainerOptions{.accelerator = "cpu", .strategy = name, .devices = 2}, empty_env());
    EXPECT_EQ(result.resolution.strategy, name);
    EXPECT_EQ(result.resolution.world_size, 2);
    EXPECT_NO_THROW(fulgur::connect(
        TrainerOptions{
            .accelerator = "cpu", .strategy = name, .devices = 2, .sync_batchnorm = true},
        empty_env()))
        << name;
  }
}

// mpi: a resolved choice where LibTorch has ProcessGroupMPI (Debian 13's), a
// flag error naming the build where it has not (Debian 12's).
TEST(AcceleratorConnector, TheMpiBackendResolvesExactlyWhereTheBuildHasIt) {
  fulgur::DDPOptions options;
  options.parallel.process_group_backend = "mpi";
  auto flags = [&] {
    return TrainerOptions{.accelerator = "cpu",
                          .strategy = std::make_shared<fulgur::DDPStrategy>(options),
                          .devices = 2};
  };
  const auto available = fulgur::available_process_group_backends();
  if (std::find(available.begin(), available.end(), "mpi") != available.end()) {
    EXPECT_NO_THROW(fulgur::connect(flags(), empty_env()));
  } else {
    EXPECT_THROWS_WITH(
        fulgur::FlagError, fulgur::connect(flags(), empty_env()),
        {"process_group_backend=\"mpi\"", "is not in this build", "Available: gloo"});
  }
}

TEST(AcceleratorConnector, DdpVariantsPickTheirLauncher) {
  for (auto [name, launcher] : std::vector<std::pair<std::string, std::string>>{
           {"ddp", "subprocess_script"},
           {"ddp_find_unused_parameters_true", "subprocess_script"},
           {"ddp_fork", "fork"},
           {"ddp_spawn", "fork"},
           {"ddp_fork_find_unused_parameters_false", "fork"},
           {"ddp_spawn_find_unused_parameters_true", "fork"},
           {"ddp_spawn_find_unused_parameters_false", "fork"}}) {
    auto result = fulgur::connect(
        TrainerOptions{.accelerator = "cpu", .strategy = name, .devices = 2}, empty_env());
    EXPECT_EQ(result.strategy->name(), name);
    ASSERT_NE(result.strategy->launcher(), nullptr) << name;
    EXPECT_EQ(result.strategy->launcher()->name(), launcher) << name;
  }
}

TEST(AcceleratorConnector, NamesMatchInAnyCase) {
  auto result = fulgur::connect(
      TrainerOptions{.accelerator = "CPU", .strategy = "Ddp_Spawn", .devices = 2}, empty_env());
  EXPECT_EQ(result.strategy->name(), "ddp_spawn");
  EXPECT_EQ(result.strategy->accelerator().name(), "cpu");
  auto capitals =
      fulgur::connect(TrainerOptions{.accelerator = "Auto", .strategy = "AUTO"}, empty_env());
  EXPECT_EQ(capitals.resolution.strategy, "single_device");
}

TEST(AcceleratorConnector, ProcessesCreatedByTorchrunNeedNoLauncher) {
  auto result = fulgur::connect(
      TrainerOptions{.accelerator = "cpu", .strategy = "ddp", .devices = 2},
      fulgur::EnvView(std::map<std::string, std::string>{{"RANK", "1"},
                                                         {"GROUP_RANK", "0"},
                                                         {"LOCAL_RANK", "1"},
                                                         {"LOCAL_WORLD_SIZE", "2"},
                                                         {"WORLD_SIZE", "2"},
                                                         {"MASTER_ADDR", "127.0.0.1"},
                                                         {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(result.strategy->launcher(), nullptr);
  EXPECT_EQ(result.strategy->global_rank(), 1);
  EXPECT_EQ(result.strategy->local_rank(), 1);
  EXPECT_EQ(result.strategy->world_size(), 2);
  EXPECT_EQ(result.strategy->cluster_environment().name(), "torchelastic");
}

fulgur::EnvView env_of(std::map<std::string, std::string> vars) {
  return fulgur::EnvView(std::move(vars));
}

TEST(AcceleratorConnector, RanksOutOfRangeNameTheVariableTheyCameFrom) {
  const TrainerOptions ddp2{.accelerator = "cpu", .strategy = "ddp", .devices = 2};
  const std::map<std::string, std::string> torchrun = {
      {"RANK", "1"},           {"GROUP_RANK", "0"},
      {"LOCAL_RANK", "1"},     {"LOCAL_WORLD_SIZE", "2"},
      {"WORLD_SIZE", "2"},     {"MASTER_ADDR", "127.0.0.1"},
      {"MASTER_PORT", "29500"}};
  auto with = [&](std::map<std::string, std::string> changes) {
    auto vars = torchrun;
    for (auto& [k, v] : changes) vars[k] = v;
    return env_of(vars);
  };
  EXPECT_THROWS_WITH(
      ConfigError, fulgur::connect(ddp2, with({{"RANK", "5"}})),
      {"RANK=5 (cluster environment \"torchelastic\") is outside 0..1", "WORLD_SIZE=2"});
  EXPECT_THROWS_WITH(ConfigError, fulgur::connect(ddp2, with({{"RANK", "-1"}})),
                     {"RANK=-1", "outside 0..1"});
  EXPECT_THROWS_WITH(ConfigError, fulgur::connect(ddp2, with({{"LOCAL_RANK", "5"}})),
                     {"LOCAL_RANK=5", "outside 0..1 for devices=2"});
  EXPECT_THROWS_WITH(ConfigError, fulgur::connect(ddp2, with({{"LOCAL_RANK", "-2"}})),
                     {"LOCAL_RANK=-2"});
  EXPECT_THROWS_WITH(ConfigError, fulgur::connect(ddp2, with({{"GROUP_RANK", "1"}})),
                     {"GROUP_RANK=1", "outside 0..0 for num_nodes=1"});
  // Every problem at once.
  EXPECT_THROWS_WITH(ConfigError, fulgur::connect(ddp2, with({{"RANK", "9"}, {"LOCAL_RANK", "7"}})),
                     {"RANK=9", "LOCAL_RANK=7"});
  // Open MPI and SLURM name their own variables.
  EXPECT_THROWS_WITH(ConfigError,
                     fulgur::connect(ddp2, env_of({{"OMPI_COMM_WORLD_SIZE", "2"},
                                                   {"OMPI_COMM_WORLD_RANK", "9"},
                                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                                   {"MASTER_ADDR", "127.0.0.1"},
                                                   {"MASTER_PORT", "29500"}})),
                     {"OMPI_COMM_WORLD_RANK=9", "OMPI_COMM_WORLD_SIZE=2"});
  EXPECT_THROWS_WITH(ConfigError,
                     fulgur::connect(ddp2, env_of({{"SLURM_NTASKS", "2"},
                                                   {"SLURM_PROCID", "5"},
                                                   {"SLURM_LOCALID", "1"},
                                                   {"SLURM_NODEID", "0"},
                                                   {"SLURM_NODELIST", "node1"},
                                                   {"SLURM_JOB_NAME", "train"}})),
                     {"SLURM_PROCID=5", "SLURM_NTASKS=2"});
}

// Ranks are 32-bit numbers: devices x num_nodes past 2^31 - 1 is named (it
// wrapped to a world of 0, or a negative one), and the environments' counts
// and advice are computed without wrapping.
TEST(AcceleratorConnector, MoreProcessesThanRanksCanNumberAreNamed) {
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .devices = 4, .num_nodes = 1073741824},
                      env_of({{"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}, {"NODE_RANK", "0"}})),
      {"devices=4 x num_nodes=1073741824 = 4294967296 processes", "at most 2147483647"});
  EXPECT_THROWS_WITH(ConfigError,
                     fulgur::connect(TrainerOptions{.accelerator = "cpu", .devices = 1},
                                     env_of({{"OMPI_COMM_WORLD_SIZE", "2147483647"},
                                             {"OMPI_COMM_WORLD_RANK", "0"},
                                             {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                             {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                             {"MASTER_ADDR", "127.0.0.1"},
                                             {"MASTER_PORT", "29500"}})),
                     {"Pass devices=2 and num_nodes=1073741824"});
}

TEST(AcceleratorConnector, TorchrunWithoutMasterAddrNamesTheMissingVariable) {
  // torchrun's own variables are there, MASTER_ADDR is not: torchelastic is
  // still recognised, and the error names what is missing.
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .strategy = "ddp", .devices = 2},
                      env_of({{"RANK", "0"},
                              {"GROUP_RANK", "0"},
                              {"LOCAL_RANK", "0"},
                              {"LOCAL_WORLD_SIZE", "2"},
                              {"WORLD_SIZE", "2"},
                              {"MASTER_PORT", "29500"}})),
      {"\"torchelastic\" needs the environment variable MASTER_ADDR, which is not set"});
}

TEST(AcceleratorConnector, AnEmptyMasterAddrWithSeveralRanksIsNamed) {
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .devices = 1, .num_nodes = 2},
                      env_of({{"MASTER_ADDR", ""}, {"MASTER_PORT", "29500"}, {"NODE_RANK", "1"}})),
      {"MASTER_ADDR is set but empty, with num_nodes=2"});
  // On one machine too: under torchrun, and for the ranks fulgur starts.
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .strategy = "ddp", .devices = 2},
                      env_of({{"RANK", "1"},
                              {"GROUP_RANK", "0"},
                              {"LOCAL_RANK", "1"},
                              {"LOCAL_WORLD_SIZE", "2"},
                              {"WORLD_SIZE", "2"},
                              {"MASTER_ADDR", ""},
                              {"MASTER_PORT", "29500"}})),
      {"MASTER_ADDR is set but empty, with 2 ranks", "127.0.0.1"});
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .strategy = "ddp", .devices = 2},
                      env_of({{"MASTER_ADDR", ""}})),
      {"MASTER_ADDR is set but empty, with 2 ranks"});
  // One rank reaches no one: no problem.
  EXPECT_NO_THROW(fulgur::connect(TrainerOptions{.accelerator = "cpu", .devices = 1},
                                  env_of({{"MASTER_ADDR", ""}})));
}

// Ranks started by hand (LOCAL_RANK, RANK, WORLD_SIZE) without MASTER_PORT
// cannot meet: the connector says so (as `fulgur resolve` shows), where only
// fit's process group named it.
TEST(AcceleratorConnector, RanksStartedByHandWithoutMasterPortAreNamed) {
  const auto ranks = [](std::map<std::string, std::string> vars) {
    vars.insert({{"LOCAL_RANK", "0"}, {"RANK", "0"}, {"WORLD_SIZE", "2"}});
    return vars;
  };
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .strategy = "ddp", .devices = 2},
                      env_of(ranks({}))),
      {"LOCAL_RANK=0 says another program started this process, one of 2 ranks, but MASTER_PORT "
       "is not set",
       "Set MASTER_PORT (one free port, the same on every rank)"});
  EXPECT_NO_THROW(
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .strategy = "ddp", .devices = 2},
                      env_of(ranks({{"MASTER_PORT", "29500"}}))));
  // The MPI backend meets without a store (where the build lacks it, that
  // is the only problem named).
  fulgur::DDPOptions mpi;
  mpi.parallel.process_group_backend = "mpi";
  try {
    fulgur::connect(TrainerOptions{.accelerator = "cpu",
                                   .strategy = std::make_shared<fulgur::DDPStrategy>(mpi),
                                   .devices = 2},
                    env_of(ranks({})));
  } catch (const std::exception& e) {
    EXPECT_EQ(std::string(e.what()).find("MASTER_PORT"), std::string::npos) << e.what();
  }
  // One rank needs no store.
  EXPECT_NO_THROW(
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .devices = 1},
                      env_of({{"LOCAL_RANK", "0"}, {"RANK", "0"}, {"WORLD_SIZE", "1"}})));
}

// Ranks started by hand with RANK and WORLD_SIZE but no LOCAL_RANK: fulgur
// starts the processes itself there, and each took rank 0 (one waited 30
// minutes for peers, the other was told its port was in use); LOCAL_RANK
// without RANK was taken as rank 0 too.
TEST(AcceleratorConnector, RankVariablesThatDisagreeWithTheLaunchAreNamed) {
  const TrainerOptions ddp1{.accelerator = "cpu", .strategy = "ddp", .devices = 1};
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(ddp1, env_of({{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"MASTER_PORT", "29500"}})),
      {"WORLD_SIZE=2 is set, but devices=1 x num_nodes=1 = 1 process(es)",
       "fulgur starts the processes itself here (LOCAL_RANK is not set", "RANK=1 is set, but",
       "this one is rank node_rank x devices = 0", "Set LOCAL_RANK too"});
  EXPECT_THROWS_WITH(ConfigError,
                     fulgur::connect(ddp1, env_of({{"WORLD_SIZE", "2"}, {"RANK", "0"}})),
                     {"WORLD_SIZE=2 is set"});
  EXPECT_THROWS_WITH(ConfigError, fulgur::connect(ddp1, env_of({{"RANK", "1"}})),
                     {"RANK=1 is set, but"});
  const TrainerOptions ddp2{.accelerator = "cpu", .strategy = "ddp", .devices = 2};
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(ddp2,
                      env_of({{"LOCAL_RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}})),
      {"LOCAL_RANK=1 and WORLD_SIZE=2 are set, RANK is not", "Set RANK too"});
  EXPECT_THROWS_WITH(ConfigError,
                     fulgur::connect(ddp2, env_of({{"LOCAL_RANK", "1"},
                                                   {"RANK", "0"},
                                                   {"WORLD_SIZE", "2"},
                                                   {"MASTER_PORT", "29500"}})),
                     {"RANK=0 and LOCAL_RANK=1 on one node (num_nodes=1)"});
  // What agrees: a node's processes placed by NODE_RANK, with or without
  // a RANK that says the same; a torchrun-style rank.
  const TrainerOptions two_nodes{
      .accelerator = "cpu", .strategy = "ddp", .devices = 2, .num_nodes = 2};
  // (A WORLD_SIZE below the processes, as Lightning's older cluster recipe
  // sets it to the node count, and a RANK on several nodes, as that recipe's
  // node index, are left as they were.)
  for (const char* rank : {"", "2", "1"}) {
    std::map<std::string, std::string> vars = {{"NODE_RANK", "1"},
                                               {"WORLD_SIZE", *rank == '1' ? "2" : "4"},
                                               {"MASTER_ADDR", "127.0.0.1"},
                                               {"MASTER_PORT", "29500"}};
    if (*rank != '\0') vars["RANK"] = rank;
    EXPECT_NO_THROW(fulgur::connect(two_nodes, env_of(vars))) << rank;
  }
  EXPECT_NO_THROW(fulgur::connect(
      ddp2,
      env_of({{"LOCAL_RANK", "1"}, {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}})));
}

// The devices a strategy instance carries are checked against the flag
// (they won silently: 3 ranks for devices=2; a reused instance trained on
// the devices its first Trainer gave it), and a SingleDeviceStrategy's
// device against the accelerator (a CUDA device on a CPU run failed inside
// LibTorch's dispatcher).
TEST(AcceleratorConnector, TheDevicesAStrategyInstanceCarriesAreChecked) {
  const c10::Device cpu(c10::kCPU);
  auto three = std::make_shared<fulgur::DDPStrategy>();
  three->set_parallel_devices({cpu, cpu, cpu});
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .strategy = three, .devices = 2},
                      empty_env()),
      {"devices=2 but the strategy instance (ddp) carries parallel_devices [cpu, cpu, cpu]",
       "set_parallel_devices"});
  // With devices=auto the instance's are the only ones given.
  auto auto_three = std::make_shared<fulgur::DDPStrategy>();
  auto_three->set_parallel_devices({cpu, cpu, cpu});
  EXPECT_EQ(
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .strategy = auto_three}, empty_env())
          .resolution.num_devices,
      3);
  // One instance given to a second Trainer: what the first Trainer filled
  // in (its devices, precision, checkpoint IO) is the second one's to
  // decide, where it carried over as the instance's own (the devices were
  // named as a conflict, the precision kept silently).
  auto reused = std::make_shared<fulgur::DDPStrategy>();
  auto io = std::make_shared<fulgur::TorchCheckpointIO>();
  auto first = fulgur::connect(TrainerOptions{.accelerator = "cpu",
                                              .strategy = reused,
                                              .devices = 2,
                                              .precision = "bf16-mixed",
                                              .plugins = {io}},
                               empty_env());
  EXPECT_EQ(first.resolution.precision, "bf16-mixed");
  auto second = fulgur::connect(
      TrainerOptions{.accelerator = "cpu", .strategy = reused, .devices = 1}, empty_env());
  EXPECT_EQ(second.resolution.num_devices, 1);
  EXPECT_NE(first.resolution.launcher, "");
  EXPECT_EQ(second.resolution.launcher, "");  // one process: nothing to launch
  EXPECT_EQ(second.resolution.precision, "32-true");
  EXPECT_NE(&reused->checkpoint_io(), io.get());
  EXPECT_EQ(
      fulgur::connect(
          TrainerOptions{
              .accelerator = "cpu", .strategy = reused, .devices = 2, .precision = "bf16-mixed"},
          empty_env())
          .resolution.precision,
      "bf16-mixed");
  // What the instance was given itself stays, and a flag against it is named.
  reused->set_precision(std::make_shared<fulgur::MixedPrecision>(at::kBFloat16));
  fulgur::connect(TrainerOptions{.accelerator = "cpu", .strategy = reused, .devices = 2},
                  empty_env());
  EXPECT_EQ(fulgur::connect(TrainerOptions{.accelerator = "cpu", .strategy = reused, .devices = 2},
                            empty_env())
                .resolution.precision,
            "bf16-mixed");
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(
          TrainerOptions{
              .accelerator = "cpu", .strategy = reused, .devices = 2, .precision = "bf16-true"},
          empty_env()),
      {"precision=\"bf16-true\" but the strategy instance (ddp) carries precision "
       "\"bf16-mixed\""});
  // A SingleDeviceStrategy of a CUDA device on the CPU accelerator.
  auto on_gpu = std::make_shared<fulgur::SingleDeviceStrategy>(c10::Device(c10::kCUDA, 0));
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .strategy = on_gpu}, empty_env()),
      {"the strategy instance (single_device) carries device cuda:0, but "
       "accelerator=\"cpu\" runs on cpu"});
  auto on_cpu = std::make_shared<fulgur::SingleDeviceStrategy>(cpu);
  EXPECT_NO_THROW(
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .strategy = on_cpu}, empty_env()));
}

TEST(AcceleratorConnector, AWorldSizeTheLauncherDidNotSetIsNotGivenAValue) {
  // LOCAL_RANK alone: a launcher started this process but said nothing of
  // the world size.
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .strategy = "ddp", .devices = 2},
                      env_of({{"LOCAL_RANK", "0"}})),
      {"did not set WORLD_SIZE"});
}

// A user's subclasses under other names: the components' capabilities
// decide, not their names.
struct RenamedCpu : fulgur::CPUAccelerator {
  std::string_view name() const override { return "my_cpu"; }
};
struct RenamedSingleDevice : fulgur::SingleDeviceStrategy {
  std::string_view name() const override { return "my_single"; }
};

TEST(AcceleratorConnector, CapabilitiesDecideNotNames) {
  EXPECT_THROWS_WITH(ConfigError,
                     fulgur::connect(TrainerOptions{.accelerator = std::make_shared<RenamedCpu>(),
                                                    .precision = "16-mixed"},
                                     empty_env()),
                     {"precision=\"16-mixed\" with accelerator=\"my_cpu\"", "bfloat16 only"});
  EXPECT_THROWS_WITH(ConfigError,
                     fulgur::connect(TrainerOptions{.accelerator = std::make_shared<RenamedCpu>(),
                                                    .benchmark = true},
                                     empty_env()),
                     {"benchmark=true with accelerator=\"my_cpu\""});
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(TrainerOptions{.accelerator = "cpu",
                                     .strategy = std::make_shared<RenamedSingleDevice>(),
                                     .devices = 2},
                      empty_env()),
      {"strategy=\"my_single\" runs one process on one device"});
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(TrainerOptions{.accelerator = "cpu",
                                     .strategy = std::make_shared<RenamedSingleDevice>(),
                                     .sync_batchnorm = true},
                      empty_env()),
      {"strategy=\"my_single\", which cannot synchronise BatchNorm statistics (one process has "
       "no peers)"});
}

TEST(AcceleratorConnector, CpuRejectsDeviceIndices) {
  EXPECT_THROWS_WITH(
      ConfigError,
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .devices = "0,2"}, empty_env()),
      {"devices=0,2", "number of processes", "devices=2"});
}

TEST(AcceleratorConnector, UserRegisteredAcceleratorIsSelectedByName) {
  struct MyCpu : fulgur::CPUAccelerator {
    std::string_view name() const override { return "my_cpu"; }
  };
  fulgur::test::FakeMachine machine(0);
  machine.accelerators.add("my_cpu", "a user's accelerator",
                           [] { return std::make_unique<MyCpu>(); });
  auto result = fulgur::connect(TrainerOptions{.accelerator = "my_cpu"}, machine.context());
  EXPECT_EQ(result.strategy->accelerator().name(), "my_cpu");
}

TEST(AcceleratorConnector, AcceleratorInstanceIsUsedAsIs) {
  auto cpu = std::make_shared<fulgur::CPUAccelerator>();
  auto result = fulgur::connect(TrainerOptions{.accelerator = cpu, .devices = 2}, empty_env());
  EXPECT_EQ(&result.strategy->accelerator(), cpu.get());
  EXPECT_EQ(result.resolution.accelerator, "cpu");
  EXPECT_EQ(result.resolution.strategy, "ddp");
}

TEST(AcceleratorConnector, AcceleratorInstanceAndAnotherOnTheStrategyConflict) {
  auto strategy = std::make_shared<fulgur::SingleDeviceStrategy>();
  strategy->set_accelerator(std::make_shared<fulgur::CPUAccelerator>());
  TrainerOptions options{.accelerator = std::make_shared<fulgur::CPUAccelerator>(),
                         .strategy = strategy};
  EXPECT_THROWS_WITH(fulgur::FlagError, fulgur::connect(options, empty_env()),
                     {"accelerator=\"cpu\" but the strategy instance (single_device) carries "
                      "accelerator \"cpu\"",
                      "set it in one place"});
  TrainerOptions null_accelerator{.accelerator = std::shared_ptr<fulgur::Accelerator>()};
  EXPECT_THROWS_WITH(fulgur::FlagError, fulgur::connect(null_accelerator, empty_env()),
                     {"accelerator is a null Accelerator instance"});
}

TEST(AcceleratorConnector, StrategyInstanceCarriesPrecisionAndEnvironment) {
  auto strategy = std::make_shared<fulgur::SingleDeviceStrategy>();
  strategy->set_precision(std::make_shared<fulgur::TruePrecision>(at::kDouble));
  strategy->set_cluster_environment(std::make_shared<fulgur::LightningEnvironment>(empty_env()));
  // What the instance carries is used...
  auto result =
      fulgur::connect(TrainerOptions{.accelerator = "cpu", .strategy = strategy}, empty_env());
  EXPECT_EQ(result.resolution.precision, "64-true");
  // ...and a flag or plugin naming something else is a problem, all at once.
  TrainerOptions conflicting{.accelerator = "cpu",
                             .strategy = strategy,
                             .precision = "bf16-mixed",
                             .plugins = {std::string("lightning")}};
  std::optional<fulgur::FlagError> error;
  try {
    fulgur::connect(conflicting, empty_env());
  } catch (const fulgur::FlagError& e) {
    error.emplace(e);
  }
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->kind(), "invalid_flags");
  ASSERT_EQ(error->problems().size(), 2u) << error->what();
  EXPECT_TRUE(fulgur::test::message_contains(
      error->problems()[0], {"precision=\"bf16-mixed\" but the strategy instance (single_device) "
                             "carries precision \"64-true\""}));
  EXPECT_TRUE(fulgur::test::message_contains(
      error->problems()[1], {"plugins has a cluster environment (lightning) but the strategy "
                             "instance (single_device) carries cluster environment"}));
}

// A user's DDP subclass registers the same variants under its own prefix,
// without repeating the base's code.
struct MyDDP : fulgur::DDPStrategy {
  using fulgur::DDPStrategy::DDPStrategy;
};

TEST(StrategyRegistry, SubclassRegistersItsVariantsThroughTheBase) {
  fulgur::StrategyRegistry registry("strategy");
  fulgur::DDPStrategy::register_variants<MyDDP>(registry, "my_ddp", "My DDP");
  EXPECT_EQ(registry.names(),
            (std::vector<std::string>{"my_ddp", "my_ddp_find_unused_parameters_false",
                                      "my_ddp_find_unused_parameters_true", "my_ddp_fork",
                                      "my_ddp_fork_find_unused_parameters_false",
                                      "my_ddp_fork_find_unused_parameters_true", "my_ddp_spawn",
                                      "my_ddp_spawn_find_unused_parameters_false",
                                      "my_ddp_spawn_find_unused_parameters_true"}));
  auto fork = registry.create("my_ddp_fork");
  auto* mine = dynamic_cast<MyDDP*>(fork.get());
  ASSERT_NE(mine, nullptr);
  EXPECT_EQ(mine->name(), "my_ddp_fork");
  EXPECT_EQ(mine->options().start_method.text(), "fork");
  const auto& entry = registry.entry("my_ddp_find_unused_parameters_true");
  EXPECT_TRUE(fulgur::test::message_contains(entry.description, {"My DDP: "}));
  EXPECT_TRUE(fulgur::test::message_contains(
      entry.defaults, {"start_method=popen", "find_unused_parameters=true", "bucket_cap_mb=25"}));
}

TEST(StrategyRegistry, UserStrategyIsSelectedByNameThroughItsRegistry) {
  fulgur::test::FakeMachine machine(0);
  fulgur::DDPOptions options;
  options.bucket_cap_mb = 1;
  machine.strategies.add("my_ddp_small_buckets", "DDP with 1 MiB buckets", [options] {
    return std::make_unique<MyDDP>(options, "my_ddp_small_buckets");
  });
  auto result = fulgur::connect(
      TrainerOptions{.accelerator = "cpu", .strategy = "my_ddp_small_buckets", .devices = 2},
      machine.context());
  EXPECT_EQ(result.resolution.strategy, "my_ddp_small_buckets");
  EXPECT_EQ(result.resolution.launcher, "subprocess_script");
  auto* mine = dynamic_cast<MyDDP*>(result.strategy.get());
  ASSERT_NE(mine, nullptr);
  EXPECT_EQ(mine->options().bucket_cap_mb, 1);
}

}  // namespace

namespace {

// The options of a strategy object are checked when it is made, naming
// the option (a timeout of 0 failed inside every launched rank at fit(),
// naming no option; a bucket beyond int64's bytes gave one per parameter).
TEST(StrategyOptions, AreCheckedWhenTheStrategyIsMade) {
  using namespace std::chrono_literals;
  fulgur::DDPOptions ddp;
  ddp.parallel.process_group_timeout = 0ms;
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::DDPStrategy{ddp},
                     {"DDPStrategy", "process_group_timeout=0ms", "> 0"});
  ddp = {};
  ddp.parallel.stop_grace = -1000ms;
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::DDPStrategy{ddp}, {"stop_grace=-1000ms", ">= 0"});
  fulgur::FSDPOptions fsdp;
  fsdp.parallel.process_group_timeout = -5ms;
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::FSDPStrategy{fsdp},
                     {"process_group_timeout=-5ms"});
  for (double cap : {0.0, 1e13, std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    ddp = {};
    ddp.bucket_cap_mb = cap;
    EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::DDPStrategy{ddp},
                       {"bucket_cap_mb=", "at most 1048576"});
  }
  ddp = {};
  ddp.bucket_cap_mb = 1024.0 * 1024.0;
  ddp.parallel.process_group_timeout = 1ms;
  ddp.parallel.stop_grace = 0ms;
  EXPECT_NO_THROW(fulgur::DDPStrategy{ddp});
}

}  // namespace
