// The built-in cluster environments: their registry entries and automatic
// detection.
#include "fulgur/plugins/environments/kubeflow.h"
#include "fulgur/plugins/environments/lightning.h"
#include "fulgur/plugins/environments/lsf.h"
#include "fulgur/plugins/environments/mpi.h"
#include "fulgur/plugins/environments/slurm.h"
#include "fulgur/plugins/environments/torchelastic.h"

#include "fulgur/core/errors.h"

namespace fulgur {

namespace {

// "RANK=5" when read from a variable, else "the derived global rank 5".
std::string described(const std::string& variable, const char* what, int value) {
  return variable.empty() ? str("the ", what, " ", value, " (derived from the others)")
                          : str(variable, "=", value);
}

}  // namespace

std::vector<std::string> ClusterEnvironment::rank_problems(int num_devices, int num_nodes) const {
  const auto& s = rank_sources_;
  const std::string env = str("cluster environment \"", name(), "\"");
  std::vector<std::string> problems;
  if (world_size_ < 1) {
    problems.push_back(str(described(s.world_size, "world size", world_size_), " (", env,
                           "): the number of processes must be >= 1"));
  } else if (global_rank_ < 0 || global_rank_ >= world_size_) {
    problems.push_back(str(described(s.global_rank, "global rank", global_rank_), " (", env,
                           ") is outside 0..", world_size_ - 1, " (",
                           described(s.world_size, "world size", world_size_),
                           "): each process needs its own rank below the world size"));
  }
  if (local_rank_ < 0 || local_rank_ >= num_devices) {
    problems.push_back(str(described(s.local_rank, "local rank", local_rank_), " (", env,
                           ") is outside 0..", num_devices - 1, " for devices=", num_devices,
                           ": pass devices equal to the processes started per node"));
  }
  if (node_rank_ < 0 || node_rank_ >= num_nodes) {
    problems.push_back(str(described(s.node_rank, "node rank", node_rank_), " (", env,
                           ") is outside 0..", num_nodes - 1, " for num_nodes=", num_nodes,
                           ": pass num_nodes equal to the machines the job runs on"));
  }
  return problems;
}

ClusterEnvironmentRegistry& cluster_environment_registry() {
  static ClusterEnvironmentRegistry registry = [] {
    ClusterEnvironmentRegistry r("cluster environment");
    r.add("lightning", "fulgur creates the processes (default)",
          [](const EnvView& env) { return std::make_unique<LightningEnvironment>(env); });
    r.add("torchelastic", "torchrun created the processes (RANK, LOCAL_RANK, GROUP_RANK, ...)",
          [](const EnvView& env) { return std::make_unique<TorchElasticEnvironment>(env); });
    r.add("slurm", "srun created the processes (SLURM_NTASKS, SLURM_PROCID, ...)",
          [](const EnvView& env) { return std::make_unique<SLURMEnvironment>(env); });
    r.add("mpi", "mpirun created the processes (OMPI_COMM_WORLD_* or PMI_*)",
          [](const EnvView& env) { return std::make_unique<MPIEnvironment>(env); });
    r.add("lsf", "LSF's jsrun created the processes (LSB_JOBID, JSM_NAMESPACE_*)",
          [](const EnvView& env) { return std::make_unique<LSFEnvironment>(env); });
    r.add("kubeflow", "a Kubeflow PyTorchJob, one process per pod (KUBERNETES_PORT, RANK, ...)",
          [](const EnvView& env) { return std::make_unique<KubeflowEnvironment>(env); });
    return r;
  }();
  return registry;
}

std::unique_ptr<ClusterEnvironment> detect_cluster_environment(const EnvView& env,
                                                               std::vector<std::string>* notes) {
  auto note = [&](std::string text) {
    if (notes) notes->push_back(std::move(text));
  };
  // Order matters where launchers nest, most specific first:
  //  - torchelastic first: torchrun is often started inside a SLURM, LSF or
  //    Kubernetes job, and then it, not the outer scheduler, created this
  //    process (SLURM_NTASKS counts srun's tasks, not torchrun's workers);
  //  - slurm before mpi: srun --mpi=pmi2 also sets PMI_SIZE / PMI_RANK, and
  //    the SLURM variables are the more complete description;
  //  - mpi before lsf: LSF sites also run mpirun inside a job; jsrun sets
  //    JSM_NAMESPACE_* which mpirun does not;
  //  - kubeflow last: its variables (MASTER_ADDR, RANK, WORLD_SIZE) are the
  //    most generic, and KUBERNETES_PORT is set in every pod.
  if (TorchElasticEnvironment::detect(env)) {
    note(str("cluster_environment=torchelastic because torchrun's ",
             env.has("GROUP_RANK") ? "RANK, GROUP_RANK, LOCAL_RANK and LOCAL_WORLD_SIZE are set"
                                   : "TORCHELASTIC_RUN_ID is set",
             env.has("TORCHELASTIC_RUN_ID") ? str(" (run id \"", *env.get("TORCHELASTIC_RUN_ID"),
                                                  "\")")
                                            : std::string()));
    return std::make_unique<TorchElasticEnvironment>(env);
  }
  if (SLURMEnvironment::detect(env)) {
    auto job_name = env.get("SLURM_JOB_NAME");
    note(str("cluster_environment=slurm because SLURM_NTASKS is set",
             job_name ? str(" (job name \"", *job_name, "\")") : std::string()));
    return std::make_unique<SLURMEnvironment>(env);
  }
  if (MPIEnvironment::detect(env)) {
    auto mpi = std::make_unique<MPIEnvironment>(env);
    note(str("cluster_environment=mpi because ",
             mpi->family() == "PMI" ? "PMI_SIZE and PMI_RANK are set (MPICH / Intel MPI)"
                                    : "OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_RANK are set "
                                      "(Open MPI)"));
    return mpi;
  }
  if (LSFEnvironment::detect(env)) {
    note("cluster_environment=lsf because LSB_JOBID and JSM_NAMESPACE_SIZE / _RANK / "
         "_LOCAL_RANK are set (jsrun)");
    return std::make_unique<LSFEnvironment>(env);
  }
  if (KubeflowEnvironment::detect(env)) {
    note("cluster_environment=kubeflow because KUBERNETES_PORT, MASTER_ADDR, MASTER_PORT, "
         "WORLD_SIZE and RANK are set (one process per pod)");
    return std::make_unique<KubeflowEnvironment>(env);
  }
  if (env.has("SLURM_NTASKS") && SLURMEnvironment::is_interactive(env)) {
    note(str("cluster_environment=lightning: SLURM_NTASKS is set but SLURM_JOB_NAME=\"",
             *env.get("SLURM_JOB_NAME"), "\" is an interactive allocation, so fulgur creates "
             "the processes"));
  }
  return std::make_unique<LightningEnvironment>(env);
}

}  // namespace fulgur
