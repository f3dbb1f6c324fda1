// The connector as a table: command-line style flags x environment
// variables -> the full resolution, or the exact list of problems.
//
// Each case parses its flags with parse_flags (what `fulgur resolve` does)
// and resolves them on a pretend machine without GPUs with its own
// environment (support/fake_machine.h), so no case sees another's variables
// or the test process's, and the table runs the same on a machine with CUDA. A resolution is
// asserted field by field:
//   "accelerator strategy launcher precision cluster_environment
//    num_nodes num_devices world_size global_rank local_rank node_rank"
// with "-" for no launcher. A failure is asserted as the error's kind and one
// fragment per problem, in order, and no other problem.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>

#include "fulgur/core/errors.h"
#include "fulgur/trainer/connectors/accelerator_connector.h"
#include "support/fake_machine.h"
#include "support/test_support.h"

namespace fulgur_trainer_connectors_resolution_table_test {
namespace {

using Vars = std::map<std::string, std::string>;
using Flags = std::vector<std::pair<std::string, std::string>>;

Vars merged(Vars base, const Vars& extra) {
  for (const auto& [k, v] : extra) base[k] = v;
  return base;
}

// ---- Environments, as their launchers set them.
const Vars kClean{};
// fulgur's own subprocess-script launcher: the child of local rank 1 of 2.
const Vars kOwnChild{{"RANK", "1"},           {"LOCAL_RANK", "1"},
                     {"WORLD_SIZE", "2"},     {"LOCAL_WORLD_SIZE", "2"},
                     {"NODE_RANK", "0"},      {"MASTER_ADDR", "127.0.0.1"},
                     {"MASTER_PORT", "29511"}};
// One node of two, started by hand for fulgur's own launcher.
const Vars kSecondNode{{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29400"}, {"NODE_RANK", "1"}};
// torchrun --nproc-per-node 2: worker 1.
const Vars kTorchrun1x2{{"RANK", "1"},
                        {"GROUP_RANK", "0"},
                        {"LOCAL_RANK", "1"},
                        {"LOCAL_WORLD_SIZE", "2"},
                        {"WORLD_SIZE", "2"},
                        {"MASTER_ADDR", "127.0.0.1"},
                        {"MASTER_PORT", "29500"},
                        {"TORCHELASTIC_RUN_ID", "none"}};
// torchrun --nnodes 2 --nproc-per-node 2: worker 3.
const Vars kTorchrun2x2{{"RANK", "3"},
                        {"GROUP_RANK", "1"},
                        {"LOCAL_RANK", "1"},
                        {"LOCAL_WORLD_SIZE", "2"},
                        {"WORLD_SIZE", "4"},
                        {"MASTER_ADDR", "10.0.0.1"},
                        {"MASTER_PORT", "29400"},
                        {"TORCHELASTIC_RUN_ID", "job7"}};
// srun --nodes 2 --ntasks-per-node 2: task 2.
const Vars kSrun2x2{{"SLURM_NTASKS", "4"},
                    {"SLURM_PROCID", "2"},
                    {"SLURM_LOCALID", "0"},
                    {"SLURM_NODEID", "1"},
                    {"SLURM_NODELIST", "gpu[017-018]"},
                    {"SLURM_JOB_ID", "4123456"},
                    {"SLURM_JOB_NAME", "train"},
                    {"SLURM_NTASKS_PER_NODE", "2"},
                    {"SLURM_NNODES", "2"}};
// srun --ntasks 2 on one node: task 1.
const Vars kSrun1x2{
    {"SLURM_NTASKS", "2"},       {"SLURM_PROCID", "1"},          {"SLURM_LOCALID", "1"},
    {"SLURM_NODEID", "0"},       {"SLURM_NODELIST", "node01"},   {"SLURM_JOB_ID", "77"},
    {"SLURM_JOB_NAME", "train"}, {"SLURM_NTASKS_PER_NODE", "2"}, {"SLURM_NNODES", "1"}};
// salloc + a shell: an interactive allocation, not an srun task.
const Vars kSallocBash =
    merged(kSrun1x2, {{"SLURM_JOB_NAME", "bash"}, {"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}});
const Vars kSallocInteractive = merged(kSallocBash, {{"SLURM_JOB_NAME", "interactive"}});
// mpirun -np 2 (Open MPI): rank 1.
const Vars kMpirun1x2{{"OMPI_COMM_WORLD_SIZE", "2"},
                      {"OMPI_COMM_WORLD_RANK", "1"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
// mpirun -np 4 on one node: rank 2.
const Vars kMpirun1x4{{"OMPI_COMM_WORLD_SIZE", "4"},
                      {"OMPI_COMM_WORLD_RANK", "2"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};
// MPICH / Intel MPI (PMI): rank 1 of 2.
const Vars kPmi1x2{
    {"PMI_SIZE", "2"}, {"PMI_RANK", "1"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}};
// jsrun on 2 compute hosts x 3 ranks: rank 4.
const Vars kLsf{{"LSB_JOBID", "98765"},
                {"LSB_DJOB_RANKFILE", "/tmp/rankfile"},
                {"LSB_MCPU_HOSTS", "batch1 1 h1 42 h2 42"},
                {"JSM_NAMESPACE_SIZE", "6"},
                {"JSM_NAMESPACE_RANK", "4"},
                {"JSM_NAMESPACE_LOCAL_RANK", "1"}};
// A PyTorchJob with 3 pods: rank 2.
const Vars kKubeflow{{"KUBERNETES_PORT", "tcp://10.96.0.1:443"},
                     {"MASTER_ADDR", "job-master-0"},
                     {"MASTER_PORT", "23456"},
                     {"WORLD_SIZE", "3"},
                     {"RANK", "2"}};

struct Case {
  std::string name;
  Flags flags;
  Vars env;
  // Either the resolution ("cpu ddp ...") or, for a failure, the error's kind.
  std::string expected;
  // One fragment per problem, in order; empty when the flags resolve.
  std::vector<std::string> problems = {};
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::string summary(const fulgur::Resolution& r) {
  return fulgur::str(r.accelerator, " ", r.strategy, " ", r.launcher.empty() ? "-" : r.launcher,
                     " ", r.precision, " ", r.cluster_environment, " ", r.num_nodes, " ",
                     r.num_devices, " ", r.world_size, " ", r.global_rank, " ", r.local_rank, " ",
                     r.node_rank);
}

Flags cpu(Flags more = {}) {
  more.insert(more.begin(), {"accelerator", "cpu"});
  return more;
}

// clang-format off
std::vector<Case> cases() {
  const std::string own = "subprocess_script";
  std::vector<Case> c = {
    // ---- Plain runs on a clean environment.
    {"defaults", {}, kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    {"cpu", cpu(), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    {"cpu_devices_auto", cpu({{"devices", "auto"}}), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    {"cpu_devices_1", cpu({{"devices", "1"}}), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    {"cpu_devices_2", cpu({{"devices", "2"}}), kClean, "cpu ddp subprocess_script 32-true lightning 1 2 2 0 0 0"},
    {"cpu_devices_3", cpu({{"devices", "3"}}), kClean, "cpu ddp subprocess_script 32-true lightning 1 3 3 0 0 0"},
    {"cpu_devices_4", cpu({{"devices", "4"}}), kClean, "cpu ddp subprocess_script 32-true lightning 1 4 4 0 0 0"},
    {"auto_devices_2", {{"devices", "2"}}, kClean, "cpu ddp subprocess_script 32-true lightning 1 2 2 0 0 0"},
    {"single_device_by_name", cpu({{"strategy", "single_device"}}), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    {"single_device_devices_1", cpu({{"strategy", "single_device"}, {"devices", "1"}}), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    {"ddp_one_device_runs_in_place", cpu({{"strategy", "ddp"}}), kClean, "cpu ddp - 32-true lightning 1 1 1 0 0 0"},
    {"ddp_fork_one_device_runs_in_place", cpu({{"strategy", "ddp_fork"}, {"devices", "1"}}), kClean, "cpu ddp_fork - 32-true lightning 1 1 1 0 0 0"},
    {"ddp_2", cpu({{"strategy", "ddp"}, {"devices", "2"}}), kClean, "cpu ddp subprocess_script 32-true lightning 1 2 2 0 0 0"},
    {"ddp_fork_2", cpu({{"strategy", "ddp_fork"}, {"devices", "2"}}), kClean, "cpu ddp_fork fork 32-true lightning 1 2 2 0 0 0"},
    {"ddp_spawn_2", cpu({{"strategy", "ddp_spawn"}, {"devices", "2"}}), kClean, "cpu ddp_spawn fork 32-true lightning 1 2 2 0 0 0"},
    {"ddp_spawn_3", cpu({{"strategy", "ddp_spawn"}, {"devices", "3"}}), kClean, "cpu ddp_spawn fork 32-true lightning 1 3 3 0 0 0"},
    {"ddp_unused_true", cpu({{"strategy", "ddp_find_unused_parameters_true"}, {"devices", "2"}}), kClean, "cpu ddp_find_unused_parameters_true subprocess_script 32-true lightning 1 2 2 0 0 0"},
    {"ddp_unused_false", cpu({{"strategy", "ddp_find_unused_parameters_false"}, {"devices", "2"}}), kClean, "cpu ddp_find_unused_parameters_false subprocess_script 32-true lightning 1 2 2 0 0 0"},
    {"ddp_fork_unused_true", cpu({{"strategy", "ddp_fork_find_unused_parameters_true"}, {"devices", "2"}}), kClean, "cpu ddp_fork_find_unused_parameters_true fork 32-true lightning 1 2 2 0 0 0"},
    {"manual_one", cpu({{"strategy", "manual"}}), kClean, "cpu manual - 32-true lightning 1 1 1 0 0 0"},
    {"manual_2", cpu({{"strategy", "manual"}, {"devices", "2"}}), kClean, "cpu manual subprocess_script 32-true lightning 1 2 2 0 0 0"},
    {"manual_4_bf16", cpu({{"strategy", "manual"}, {"devices", "4"}, {"precision", "bf16-mixed"}}), kClean, "cpu manual subprocess_script bf16-mixed lightning 1 4 4 0 0 0"},
    {"manual_torchrun", cpu({{"strategy", "manual"}, {"devices", "2"}}), kTorchrun1x2, "cpu manual - 32-true torchelastic 1 2 2 1 1 0"},
    {"manual_srun_2x2", cpu({{"strategy", "manual"}, {"devices", "2"}, {"num_nodes", "2"}}), kSrun2x2, "cpu manual - 32-true slurm 2 2 4 2 0 1"},
    {"manual_own_child", cpu({{"strategy", "manual"}, {"devices", "2"}}), kOwnChild, "cpu manual - 32-true lightning 1 2 2 1 1 0"},
    {"kebab_case_flags", {{"--accelerator", "cpu"}, {"--num-nodes", "1"}, {"--devices", "2"}}, kClean, "cpu ddp subprocess_script 32-true lightning 1 2 2 0 0 0"},
    {"snake_case_dashes", {{"--accelerator", "cpu"}, {"--num_nodes", "1"}}, kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    // ---- Precision, legacy spellings included.
    {"precision_32_true", cpu({{"precision", "32-true"}}), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    {"precision_32", cpu({{"precision", "32"}}), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    {"precision_64", cpu({{"precision", "64"}}), kClean, "cpu single_device - 64-true lightning 1 1 1 0 0 0"},
    {"precision_64_true", cpu({{"precision", "64-true"}}), kClean, "cpu single_device - 64-true lightning 1 1 1 0 0 0"},
    {"precision_bf16", cpu({{"precision", "bf16"}}), kClean, "cpu single_device - bf16-mixed lightning 1 1 1 0 0 0"},
    {"precision_bf16_mixed", cpu({{"precision", "bf16-mixed"}}), kClean, "cpu single_device - bf16-mixed lightning 1 1 1 0 0 0"},
    {"precision_bf16_true", cpu({{"precision", "bf16-true"}}), kClean, "cpu single_device - bf16-true lightning 1 1 1 0 0 0"},
    {"precision_bf16_mixed_ddp", cpu({{"precision", "bf16-mixed"}, {"devices", "2"}}), kClean, "cpu ddp subprocess_script bf16-mixed lightning 1 2 2 0 0 0"},
    {"precision_64_ddp_fork", cpu({{"precision", "64-true"}, {"strategy", "ddp_fork"}, {"devices", "2"}}), kClean, "cpu ddp_fork fork 64-true lightning 1 2 2 0 0 0"},
    {"precision_plugin_by_name", cpu({{"plugins", "bf16-mixed"}}), kClean, "cpu single_device - bf16-mixed lightning 1 1 1 0 0 0"},
    {"precision_plugin_same_as_flag", cpu({{"plugins", "64-true"}, {"precision", "64"}}), kClean, "cpu single_device - 64-true lightning 1 1 1 0 0 0"},
    // ---- Reproducibility and BatchNorm flags that resolve.
    {"deterministic_true", cpu({{"deterministic", "true"}}), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    {"deterministic_warn", cpu({{"deterministic", "warn"}}), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    {"deterministic_false", cpu({{"deterministic", "false"}}), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    {"benchmark_false", cpu({{"benchmark", "false"}}), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    {"sync_batchnorm_ddp", cpu({{"sync_batchnorm", "true"}, {"devices", "2"}}), kClean, "cpu ddp subprocess_script 32-true lightning 1 2 2 0 0 0"},
    {"sync_batchnorm_ddp_fork", cpu({{"sync-batchnorm", "true"}, {"strategy", "ddp_fork"}, {"devices", "2"}}), kClean, "cpu ddp_fork fork 32-true lightning 1 2 2 0 0 0"},
    {"sync_batchnorm_false_single", cpu({{"sync_batchnorm", "false"}}), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    // ---- Plugins by name.
    {"plugin_lightning", cpu({{"plugins", "lightning"}}), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    {"plugin_torch_io", cpu({{"plugins", "torch"}}), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    {"plugins_env_and_io", cpu({{"plugins", "lightning,torch"}, {"devices", "2"}}), kClean, "cpu ddp subprocess_script 32-true lightning 1 2 2 0 0 0"},
    {"plugins_trailing_comma", cpu({{"plugins", "torch,"}}), kClean, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    // ---- Several nodes with fulgur's own launcher.
    {"two_nodes_second_node", cpu({{"num_nodes", "2"}, {"devices", "2"}}), kSecondNode, "cpu ddp subprocess_script 32-true lightning 2 2 4 2 0 1"},
    {"two_nodes_one_device_each", cpu({{"num_nodes", "2"}}), kSecondNode, "cpu ddp - 32-true lightning 2 1 2 1 0 1"},
    {"two_nodes_fork", cpu({{"num_nodes", "2"}, {"devices", "2"}, {"strategy", "ddp_fork"}}), kSecondNode, "cpu ddp_fork fork 32-true lightning 2 2 4 2 0 1"},
    {"two_nodes_first_node", cpu({{"num_nodes", "2"}, {"devices", "2"}}), merged(kSecondNode, {{"NODE_RANK", "0"}}), "cpu ddp subprocess_script 32-true lightning 2 2 4 0 0 0"},
    // ---- A rank that fulgur's own launcher started.
    {"own_child_rank_1", cpu({{"devices", "2"}}), kOwnChild, "cpu ddp - 32-true lightning 1 2 2 1 1 0"},
    {"own_child_fork_variant", cpu({{"devices", "2"}, {"strategy", "ddp_spawn"}}), kOwnChild, "cpu ddp_spawn - 32-true lightning 1 2 2 1 1 0"},
    {"own_child_bf16", cpu({{"devices", "2"}, {"precision", "bf16-mixed"}}), kOwnChild, "cpu ddp - bf16-mixed lightning 1 2 2 1 1 0"},
    // ---- torchrun.
    {"torchrun_1x2", cpu({{"devices", "2"}}), kTorchrun1x2, "cpu ddp - 32-true torchelastic 1 2 2 1 1 0"},
    {"torchrun_1x2_auto_accelerator", {{"devices", "2"}}, kTorchrun1x2, "cpu ddp - 32-true torchelastic 1 2 2 1 1 0"},
    {"torchrun_1x2_ddp", cpu({{"devices", "2"}, {"strategy", "ddp"}}), kTorchrun1x2, "cpu ddp - 32-true torchelastic 1 2 2 1 1 0"},
    {"torchrun_1x2_ddp_fork_runs_in_place", cpu({{"devices", "2"}, {"strategy", "ddp_fork"}}), kTorchrun1x2, "cpu ddp_fork - 32-true torchelastic 1 2 2 1 1 0"},
    {"torchrun_1x2_plugin", cpu({{"devices", "2"}, {"plugins", "torchelastic"}}), kTorchrun1x2, "cpu ddp - 32-true torchelastic 1 2 2 1 1 0"},
    {"torchrun_2x2", cpu({{"devices", "2"}, {"num_nodes", "2"}}), kTorchrun2x2, "cpu ddp - 32-true torchelastic 2 2 4 3 1 1"},
    {"torchrun_2x2_bf16", cpu({{"devices", "2"}, {"num_nodes", "2"}, {"precision", "bf16"}}), kTorchrun2x2, "cpu ddp - bf16-mixed torchelastic 2 2 4 3 1 1"},
    {"torchrun_inside_slurm", cpu({{"devices", "2"}, {"num_nodes", "2"}}), merged(kSrun2x2, kTorchrun2x2), "cpu ddp - 32-true torchelastic 2 2 4 3 1 1"},
    // ---- SLURM.
    {"srun_2x2", cpu({{"devices", "2"}, {"num_nodes", "2"}}), kSrun2x2, "cpu ddp - 32-true slurm 2 2 4 2 0 1"},
    {"srun_2x2_ddp", cpu({{"devices", "2"}, {"num_nodes", "2"}, {"strategy", "ddp"}}), kSrun2x2, "cpu ddp - 32-true slurm 2 2 4 2 0 1"},
    {"srun_2x2_plugin", cpu({{"devices", "2"}, {"num_nodes", "2"}, {"plugins", "slurm"}}), kSrun2x2, "cpu ddp - 32-true slurm 2 2 4 2 0 1"},
    {"srun_1x2", cpu({{"devices", "2"}}), kSrun1x2, "cpu ddp - 32-true slurm 1 2 2 1 1 0"},
    {"srun_1x2_64", cpu({{"devices", "2"}, {"precision", "64"}}), kSrun1x2, "cpu ddp - 64-true slurm 1 2 2 1 1 0"},
    {"salloc_bash_is_not_srun", cpu({{"devices", "2"}}), kSallocBash, "cpu ddp subprocess_script 32-true lightning 1 2 2 0 0 0"},
    {"salloc_interactive_is_not_srun", cpu({{"devices", "2"}}), kSallocInteractive, "cpu ddp subprocess_script 32-true lightning 1 2 2 0 0 0"},
    {"salloc_bash_single", cpu(), kSallocBash, "cpu single_device - 32-true lightning 1 1 1 0 0 0"},
    // ---- MPI.
    {"mpirun_1x2", cpu({{"devices", "2"}}), kMpirun1x2, "cpu ddp - 32-true mpi 1 2 2 1 1 0"},
    {"mpirun_1x2_plugin", cpu({{"devices", "2"}, {"plugins", "mpi"}}), kMpirun1x2, "cpu ddp - 32-true mpi 1 2 2 1 1 0"},
    {"mpirun_1x4", cpu({{"devices", "4"}}), kMpirun1x4, "cpu ddp - 32-true mpi 1 4 4 2 2 0"},
    {"mpirun_1x4_fork", cpu({{"devices", "4"}, {"strategy", "ddp_fork"}}), kMpirun1x4, "cpu ddp_fork - 32-true mpi 1 4 4 2 2 0"},
    {"pmi_1x2", cpu({{"devices", "2"}}), kPmi1x2, "cpu ddp - 32-true mpi 1 2 2 1 1 0"},
    // ---- LSF and Kubeflow.
    {"jsrun_2x3", cpu({{"devices", "3"}, {"num_nodes", "2"}}), kLsf, "cpu ddp - 32-true lsf 2 3 6 4 1 1"},
    {"jsrun_2x3_plugin", cpu({{"devices", "3"}, {"num_nodes", "2"}, {"plugins", "lsf"}}), kLsf, "cpu ddp - 32-true lsf 2 3 6 4 1 1"},
    {"kubeflow_3_pods", cpu({{"num_nodes", "3"}}), kKubeflow, "cpu ddp - 32-true kubeflow 3 1 3 2 0 2"},
    {"kubeflow_3_pods_bf16", cpu({{"num_nodes", "3"}, {"precision", "bf16-mixed"}}), kKubeflow, "cpu ddp - bf16-mixed kubeflow 3 1 3 2 0 2"},
    {"kubeflow_plugin", cpu({{"num_nodes", "3"}, {"plugins", "kubeflow"}}), kKubeflow, "cpu ddp - 32-true kubeflow 3 1 3 2 0 2"},
  };
  // ---- Failures: the kind, then one fragment per problem, in order.
  std::vector<Case> failures = {
    {"unknown_accelerator", {{"accelerator", "cpuu"}}, kClean, "invalid_flags", {"accelerator=\"cpuu\": unknown accelerator \"cpuu\"; did you mean \"cpu\"?"}},
    {"unknown_accelerator_far", {{"accelerator", "neuron"}}, kClean, "invalid_flags", {"accelerator=\"neuron\": unknown accelerator \"neuron\". Registered: cpu, cuda, mps."}},
    {"unknown_accelerator_close", {{"accelerator", "tpu"}}, kClean, "invalid_flags", {"accelerator=\"tpu\": unknown accelerator \"tpu\"; did you mean \"cpu\"?"}},
    {"mps_unavailable", {{"accelerator", "mps"}}, kClean, "unavailable", {"accelerator=\"mps\" is not available on this machine: this LibTorch has no MPS backend"}},
    {"unknown_strategy", cpu({{"strategy", "dpp"}}), kClean, "invalid_flags", {"strategy=\"dpp\": unknown strategy \"dpp\"; did you mean \"ddp\"?"}},
    {"unknown_strategy_dp", cpu({{"strategy", "dp"}}), kClean, "invalid_flags", {"strategy=\"dp\": unknown strategy \"dp\""}},
    {"unknown_strategy_ddp2", cpu({{"strategy", "ddp2"}}), kClean, "invalid_flags", {"strategy=\"ddp2\": unknown strategy \"ddp2\""}},
    {"unknown_precision", cpu({{"precision", "17-true"}}), kClean, "invalid_flags", {"precision=\"17-true\": unknown precision"}},
    {"precision_typo", cpu({{"precision", "bf16-mixd"}}), kClean, "invalid_flags", {"precision=\"bf16-mixd\": unknown precision \"bf16-mixd\"; did you mean \"bf16-mixed\"?"}},
    {"precision_8", cpu({{"precision", "8"}}), kClean, "invalid_flags", {"precision=\"8\": unknown precision \"8\""}},
    {"unknown_plugin", cpu({{"plugins", "slrum"}}), kClean, "invalid_flags", {"plugins[0]=\"slrum\": unknown plugin; did you mean \"slurm\"?"}},
    {"unknown_second_plugin", cpu({{"plugins", "torch,kubeflw"}}), kClean, "invalid_flags", {"plugins[1]=\"kubeflw\": unknown plugin; did you mean \"kubeflow\"?"}},
    {"two_cluster_environments", cpu({{"plugins", "lightning,lightning"}}), kClean, "invalid_flags", {"plugins[1]: a second cluster environment (lightning, after lightning)"}},
    {"two_checkpoint_ios", cpu({{"plugins", "torch,torch"}}), kClean, "invalid_flags", {"plugins[1]: a second checkpoint IO"}},
    {"two_precision_plugins", cpu({{"plugins", "bf16-mixed,64-true"}}), kClean, "invalid_flags", {"plugins[1]: a second precision plugin (64-true, after bf16-mixed)"}},
    {"precision_plugin_and_other_flag", cpu({{"plugins", "bf16-mixed"}, {"precision", "64-true"}}), kClean, "invalid_flags", {"precision=\"64-true\" and a precision plugin (bf16-mixed) in plugins: choose one"}},
    {"slurm_plugin_outside_slurm", cpu({{"plugins", "slurm"}}), kClean, "invalid_flags", {"plugins[0]=\"slurm\": "}},
    {"devices_0", cpu({{"devices", "0"}}), kClean, "invalid_flags", {"devices=0: selects no device"}},
    {"devices_minus_3", cpu({{"devices", "-3"}}), kClean, "invalid_flags", {"devices=-3: a count must be >= 1, or -1"}},
    {"devices_word", cpu({{"devices", "two"}}), kClean, "invalid_flags", {"devices=\"two\": not a device spec"}},
    {"devices_empty_entry", cpu({{"devices", "0,,2"}}), kClean, "invalid_flags", {"devices=\"0,,2\": not a device spec"}},
    {"devices_fraction", cpu({{"devices", "1.5"}}), kClean, "invalid_flags", {"devices=\"1.5\": not a device spec"}},
    {"devices_too_large", cpu({{"devices", "99999999999"}}), kClean, "invalid_flags", {"devices=\"99999999999\": 99999999999 is too large a number"}},
    {"devices_index_too_large", cpu({{"devices", "0,99999999999"}}), kClean, "invalid_flags", {"devices=\"0,99999999999\": 99999999999 is too large a number"}},
    {"devices_empty", cpu({{"devices", ""}}), kClean, "invalid_flags", {"devices=\"\": not a device spec"}},
    {"devices_negative_index", cpu({{"devices", "0,-1"}}), kClean, "invalid_flags", {"device index -1 is negative"}},
    {"cpu_device_indices", cpu({{"devices", "0,2"}}), kClean, "invalid_flags", {"the CPU takes a number of processes, not device indices. Pass devices=2"}},
    {"cpu_device_index_trailing_comma", cpu({{"devices", "1,"}}), kClean, "invalid_flags", {"not device indices. Pass devices=1"}},
    {"num_nodes_0", cpu({{"num_nodes", "0"}}), kClean, "invalid_flags", {"num_nodes=0: must be >= 1"}},
    {"num_nodes_negative", cpu({{"num_nodes", "-2"}}), kClean, "invalid_flags", {"num_nodes=-2: must be >= 1"}},
    {"num_nodes_not_a_number", cpu({{"num_nodes", "two"}}), kClean, "invalid_flags", {"--num_nodes two: not an integer"}},
    {"unknown_flag", cpu({{"device", "2"}}), kClean, "invalid_flags", {"--device: unknown flag; did you mean --devices?"}},
    {"flag_twice", cpu({{"devices", "2"}, {"devices", "3"}}), kClean, "invalid_flags", {"--devices is given twice"}},
    {"bad_bool", cpu({{"sync_batchnorm", "yes"}}), kClean, "invalid_flags", {"--sync_batchnorm yes: pass true or false"}},
    {"bad_benchmark_bool", cpu({{"benchmark", "maybe"}}), kClean, "invalid_flags", {"--benchmark maybe: pass true or false"}},
    {"deterministic_typo", cpu({{"deterministic", "warning"}}), kClean, "invalid_flags", {"deterministic=\"warning\": pass true, false or \"warn\""}},
    {"deterministic_and_benchmark", {{"deterministic", "true"}, {"benchmark", "true"}, {"accelerator", "cuda"}}, kClean, "invalid_flags", {"deterministic=true and benchmark=true", "accelerator=\"cuda\" is not available on this machine"}},
    {"benchmark_on_cpu", cpu({{"benchmark", "true"}}), kClean, "invalid_flags", {"benchmark=true with accelerator=\"cpu\""}},
    {"benchmark_auto_without_cuda", {{"benchmark", "true"}}, kClean, "invalid_flags", {"benchmark=true, but accelerator=auto chose \"cpu\""}},
    {"sync_batchnorm_manual", cpu({{"sync_batchnorm", "true"}, {"strategy", "manual"}, {"devices", "2"}}), kClean, "invalid_flags", {"sync_batchnorm=true with strategy=\"manual\", which cannot synchronise BatchNorm statistics (under manual the Module connects its fulgur::nn::SyncBatchNorm layers itself"}},
    {"manual_typo", cpu({{"strategy", "manuel"}}), kClean, "invalid_flags", {"strategy=\"manuel\": unknown strategy \"manuel\"; did you mean \"manual\"?"}},
    {"sync_batchnorm_single_device", cpu({{"sync_batchnorm", "true"}, {"strategy", "single_device"}}), kClean, "invalid_flags", {"sync_batchnorm=true with strategy=\"single_device\", which cannot synchronise BatchNorm statistics (one process has no peers)"}},
    {"sync_batchnorm_auto_one_device", cpu({{"sync_batchnorm", "true"}}), kClean, "invalid_flags", {"sync_batchnorm=true, but strategy=auto chose \"single_device\""}},
    {"single_device_with_two_devices", cpu({{"strategy", "single_device"}, {"devices", "2"}}), kClean, "invalid_flags", {"strategy=\"single_device\" runs one process on one device, but devices=2"}},
    {"single_device_with_two_nodes", cpu({{"strategy", "single_device"}, {"num_nodes", "2"}}), kSecondNode, "invalid_flags", {"strategy=\"single_device\" runs one process on one device, but devices=auto and num_nodes=2"}},
    {"cuda_unavailable", {{"accelerator", "cuda"}}, kClean, "unavailable", {"accelerator=\"cuda\" is not available on this machine"}},
    {"gpu_alias_unavailable", {{"accelerator", "gpu"}, {"devices", "2"}}, kClean, "unavailable", {"accelerator=\"gpu\" is not available on this machine"}},
    {"fp16_mixed_on_cpu", cpu({{"precision", "16-mixed"}}), kClean, "unavailable", {"precision=\"16-mixed\" with accelerator=\"cpu\"", }},
    {"legacy_16_on_cpu", cpu({{"precision", "16"}}), kClean, "unavailable", {"precision=\"16-mixed\" with accelerator=\"cpu\": LibTorch's CPU autocast runs in bfloat16 only. Pass precision=\"bf16-mixed\""}},
    {"fp16_true_on_cpu", cpu({{"precision", "16-true"}}), kClean, "unavailable", {"precision=\"16-true\" with accelerator=\"cpu\"", }},
    {"two_nodes_without_main_address", cpu({{"num_nodes", "2"}}), kClean, "invalid_environment", {"missing: MASTER_ADDR, MASTER_PORT, NODE_RANK"}},
    {"two_nodes_without_node_rank", cpu({{"num_nodes", "2"}}), {{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29400"}}, "invalid_environment", {"missing: NODE_RANK"}},
    {"bad_master_port", cpu(), {{"MASTER_PORT", "99999"}}, "invalid_environment", {"MASTER_PORT=99999 is not a TCP port"}},
    // Processes created by someone else must match devices x num_nodes.
    {"torchrun_1x2_but_devices_1", cpu(), kTorchrun1x2, "environment_mismatch", {"devices=auto, num_nodes=1 under cluster environment \"torchelastic\""}},
    {"torchrun_2x2_but_one_node", cpu({{"devices", "2"}}), kTorchrun2x2, "environment_mismatch", {"devices=2, num_nodes=1 under cluster environment \"torchelastic\""}},
    {"torchrun_1x2_but_devices_3", cpu({{"devices", "3"}}), kTorchrun1x2, "environment_mismatch", {"devices=3, num_nodes=1 under cluster environment \"torchelastic\""}},
    {"srun_2x2_but_devices_1", cpu({{"num_nodes", "2"}}), kSrun2x2, "environment_mismatch", {"devices=auto, num_nodes=2 under cluster environment \"slurm\""}},
    {"srun_2x2_but_one_node", cpu({{"devices", "2"}}), kSrun2x2, "environment_mismatch", {"devices=2, num_nodes=1 under cluster environment \"slurm\""}},
    {"srun_1x2_single_device", cpu(), kSrun1x2, "environment_mismatch", {"under cluster environment \"slurm\""}},
    {"mpirun_1x4_but_devices_2", cpu({{"devices", "2"}}), kMpirun1x4, "environment_mismatch", {"mpirun started OMPI_COMM_WORLD_SIZE=4 ranks"}},
    {"pmi_1x2_but_devices_3", cpu({{"devices", "3"}}), kPmi1x2, "environment_mismatch", {"mpirun started PMI_SIZE=2 ranks"}},
    {"jsrun_2x3_but_devices_2", cpu({{"devices", "2"}, {"num_nodes", "2"}}), kLsf, "environment_mismatch", {"jsrun started JSM_NAMESPACE_SIZE=6 ranks"}},
    {"kubeflow_but_devices_2", cpu({{"devices", "2"}, {"num_nodes", "3"}}), kKubeflow, "environment_mismatch", {"Kubeflow runs one process per pod"}},
    {"own_child_but_devices_3", cpu({{"devices", "3"}}), kOwnChild, "environment_mismatch", {"under cluster environment \"lightning\""}},
    // Several problems, every one reported, in order.
    {"three_unknown_names", {{"accelerator", "cpuu"}, {"strategy", "singel_device"}, {"precision", "17-true"}}, kClean, "invalid_flags",
     {"accelerator=\"cpuu\"", "precision=\"17-true\"", "strategy=\"singel_device\""}},
    {"devices_and_nodes", cpu({{"devices", "0"}, {"num_nodes", "0"}}), kClean, "invalid_flags", {"devices=0", "num_nodes=0"}},
    {"plugin_and_devices_and_deterministic", cpu({{"plugins", "slrum"}, {"devices", "x"}, {"deterministic", "no"}}), kClean, "invalid_flags",
     {"plugins[0]=\"slrum\"", "devices=\"x\"", "deterministic=\"no\""}},
    {"strategy_and_sync_batchnorm", cpu({{"strategy", "single_device"}, {"sync_batchnorm", "true"}, {"devices", "2"}}), kClean, "invalid_flags",
     {"strategy=\"single_device\" runs one process", "sync_batchnorm=true with strategy=\"single_device\""}},
    {"everything_wrong", {{"accelerator", "tpu"}, {"strategy", "dpp"}, {"precision", "12"}, {"plugins", "x"}, {"devices", "0"}, {"num_nodes", "0"}, {"deterministic", "maybe"}}, kClean, "invalid_flags",
     {"accelerator=\"tpu\"", "plugins[0]=\"x\"", "precision=\"12\"", "strategy=\"dpp\"", "devices=0", "num_nodes=0", "deterministic=\"maybe\""}},
    {"parse_problems_together", cpu({{"num_nodes", "x"}, {"benchmark", "y"}, {"colour", "z"}}), kClean, "invalid_flags",
     {"--num_nodes x", "--benchmark y", "--colour: unknown flag"}},
    {"cpu_indices_and_precision", cpu({{"devices", "0,1"}, {"precision", "99"}}), kClean, "invalid_flags",
     {"precision=\"99\"", "not device indices"}},
    {"benchmark_and_deterministic_on_cpu", cpu({{"benchmark", "true"}, {"deterministic", "true"}}), kClean, "invalid_flags",
     {"deterministic=true and benchmark=true", "benchmark=true with accelerator=\"cpu\""}},
    // Across phases: a flag that does not parse, phase 1's problems and the
    // checks of phase 2 whose own inputs are valid, in one error.
    {"unknown_strategy_and_bad_sync_batchnorm_value", {{"strategy", "xyz"}, {"sync_batchnorm", "-1"}}, kClean, "invalid_flags",
     {"--sync_batchnorm -1: pass true or false", "strategy=\"xyz\": unknown strategy"}},
    {"unknown_strategy_and_rank_out_of_range", cpu({{"strategy", "dpp"}, {"devices", "2"}}), merged(kTorchrun1x2, {{"RANK", "5"}}), "invalid_flags",
     {"strategy=\"dpp\"", "RANK=5 (cluster environment \"torchelastic\") is outside 0..1"}},
    {"unknown_plugin_and_cuda_unavailable", {{"accelerator", "cuda"}, {"plugins", "slrum"}}, kClean, "invalid_flags",
     {"plugins[0]=\"slrum\"", "accelerator=\"cuda\" is not available on this machine"}},
    {"cuda_unavailable_and_two_nodes_without_rendezvous", {{"accelerator", "cuda"}, {"num_nodes", "2"}}, kClean, "unavailable",
     {"accelerator=\"cuda\" is not available", "missing: MASTER_ADDR, MASTER_PORT, NODE_RANK"}},
    {"bad_environment_and_unknown_precision", cpu({{"precision", "17"}}), {{"MASTER_PORT", "99999"}}, "invalid_flags",
     {"precision=\"17\"", "MASTER_PORT=99999 is not a TCP port"}},
    // Integers that do not fit are errors, never clamped.
    {"num_nodes_beyond_int", cpu({{"num_nodes", "99999999999999999999"}}), kClean, "invalid_flags",
     {"--num_nodes 99999999999999999999: out of range"}},
    {"num_nodes_beyond_int_negative", cpu({{"num_nodes", "-99999999999999999999"}}), kClean, "invalid_flags",
     {"--num_nodes -99999999999999999999: out of range"}},
    {"num_nodes_just_beyond_int", cpu({{"num_nodes", "2147483648"}}), kClean, "invalid_flags",
     {"--num_nodes 2147483648: out of range"}},
  };
  c.insert(c.end(), failures.begin(), failures.end());
  return c;
}
// clang-format on

class ResolutionTable : public ::testing::TestWithParam<Case> {};

TEST_P(ResolutionTable, ResolvesOrReportsEveryProblem) {
  const Case& c = GetParam();
  const fulgur::test::FakeMachine no_gpu(0, c.env);
  try {
    auto parsed = fulgur::parse_flags(c.flags);
    auto result = fulgur::connect(parsed.options, no_gpu.context(), parsed.problems);
    ASSERT_TRUE(c.problems.empty()) << "resolved, but expected " << c.expected << " with "
                                    << fulgur::join(c.problems, " | ") << "\n"
                                    << result.resolution.to_json();
    const auto& r = result.resolution;
    EXPECT_EQ(summary(r), c.expected) << r.to_json();
    // The parts of the resolution the summary does not spell out.
    ASSERT_EQ(r.parallel_devices.size(), static_cast<size_t>(r.num_devices));
    for (const auto& d : r.parallel_devices) EXPECT_EQ(d, r.accelerator);
    EXPECT_EQ(r.world_size, r.num_devices * r.num_nodes);
    std::string deterministic = "false";
    bool sync_batchnorm = false;
    for (const auto& [flag, value] : c.flags) {
      if (flag == "deterministic") deterministic = value;
      if (flag == "sync_batchnorm" || flag == "sync-batchnorm") sync_batchnorm = value == "true";
    }
    EXPECT_EQ(fulgur::Choice<fulgur::Determinism>::name_of(r.deterministic), deterministic);
    EXPECT_EQ(r.sync_batchnorm, sync_batchnorm);
    EXPECT_EQ(result.strategy->name(), r.strategy);
    EXPECT_EQ(result.strategy->global_rank(), r.global_rank);
  } catch (const fulgur::FlagError& e) {
    ASSERT_FALSE(c.problems.empty()) << "expected " << c.expected << " but got: " << e.what();
    EXPECT_EQ(e.kind(), c.expected) << e.what();
    ASSERT_EQ(e.problems().size(), c.problems.size()) << e.what();
    for (size_t i = 0; i < c.problems.size(); ++i) {
      EXPECT_NE(e.problems()[i].find(c.problems[i]), std::string::npos)
          << "problem " << i << " is\n  " << e.problems()[i] << "\nexpected it to contain\n  "
          << c.problems[i];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Flags, ResolutionTable, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

TEST(ResolutionTable, HasAtLeast120Cases) { EXPECT_GE(cases().size(), 120u); }

// ---- Notes: every default chosen, with its reason.

TEST(ResolutionNotes, StateEachDefaultAndWhy) {
  const fulgur::test::FakeMachine no_gpu(0);
  auto notes = [&](const Flags& flags, const Vars& env) {
    return fulgur::join(
        fulgur::connect(fulgur::options_from_flags(flags), no_gpu.context(env)).resolution.notes,
        "\n");
  };
  EXPECT_TRUE(fulgur::test::message_contains(
      notes({{"devices", "2"}}, kClean),
      {"accelerator=cpu because accelerator=auto and CUDA is not available",
       "strategy=ddp because devices=2 and num_nodes=1",
       "launcher=subprocess_script because strategy=ddp"}));
  EXPECT_TRUE(fulgur::test::message_contains(
      notes({{"precision", "bf16"}}, kClean),
      {"devices=1 because devices=auto on cpu",
       "precision=\"bf16-mixed\" because precision=\"bf16\" is its legacy spelling",
       "strategy=single_device because one device on one node"}));
  EXPECT_TRUE(fulgur::test::message_contains(notes({{"devices", "2"}}, kTorchrun1x2),
                                             {"cluster_environment=torchelastic because"}));
  EXPECT_TRUE(
      fulgur::test::message_contains(notes({{"devices", "2"}}, kSallocBash),
                                     {"SLURM_JOB_NAME=\"bash\" is an interactive allocation"}));
  EXPECT_EQ(notes({{"devices", "2"}}, kTorchrun1x2).find("launcher="), std::string::npos);
}

// ---- The same connector on a machine with two GPUs.

TEST(ResolutionOnAGpuMachine, AutoPicksCudaAndEveryGpu) {
  const fulgur::test::FakeMachine two_gpus(2);
  auto result = fulgur::connect(fulgur::TrainerOptions{}, two_gpus.context());
  const auto& r = result.resolution;
  EXPECT_EQ(summary(r), "cuda ddp subprocess_script 32-true lightning 1 2 2 0 0 0");
  EXPECT_EQ(r.parallel_devices, (std::vector<std::string>{"cuda:0", "cuda:1"}));
  EXPECT_TRUE(fulgur::test::message_contains(
      fulgur::join(r.notes, "\n"),
      {"accelerator=cuda because accelerator=auto and CUDA is available",
       "devices=2 because devices=auto on cuda", "strategy=ddp because devices=2"}));
}

TEST(ResolutionOnAGpuMachine, ChoosesDevicesAndChecksWhatCudaCannotDo) {
  const fulgur::test::FakeMachine two_gpus(2);
  auto resolve = [&](const Flags& flags) {
    return fulgur::connect(fulgur::options_from_flags(flags), two_gpus.context()).resolution;
  };
  EXPECT_EQ(summary(resolve({{"devices", "1"}})),
            "cuda single_device - 32-true lightning 1 1 1 0 0 0");
  EXPECT_EQ(resolve({{"accelerator", "gpu"}, {"devices", "1,"}}).parallel_devices,
            (std::vector<std::string>{"cuda:1"}));
  EXPECT_EQ(resolve({{"devices", "1"}, {"precision", "16-mixed"}}).precision, "16-mixed");
  EXPECT_TRUE(resolve({{"devices", "1"}, {"benchmark", "true"}}).benchmark);
  EXPECT_EQ(summary(resolve({{"accelerator", "cpu"}})),
            "cpu single_device - 32-true lightning 1 1 1 0 0 0");
  auto problems = [&](const Flags& flags) {
    try {
      resolve(flags);
    } catch (const fulgur::FlagError& e) {
      return fulgur::join(e.problems(), " | ");
    }
    return std::string("resolved");
  };
  EXPECT_TRUE(fulgur::test::message_contains(problems({{"devices", "3"}}),
                                             {"asked for 3 GPUs but 2 are visible"}));
  EXPECT_TRUE(fulgur::test::message_contains(problems({{"devices", "0,2"}}),
                                             {"GPU index 2 does not exist"}));
  EXPECT_TRUE(fulgur::test::message_contains(
      problems({{"strategy", "ddp_fork"}, {"devices", "2"}}),
      {"strategy \"ddp_fork\" forks its ranks, which cannot use CUDA"}));
  EXPECT_TRUE(fulgur::test::message_contains(
      problems({{"devices", "2"}, {"deterministic", "true"}, {"benchmark", "true"}}),
      {"deterministic=true and benchmark=true"}));
}

}  // namespace
}  // namespace fulgur_trainer_connectors_resolution_table_test
