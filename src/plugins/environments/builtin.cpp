// The built-in cluster environments: their registry entries and automatic
// detection.
#include "fulgur/plugins/environments/kubeflow.h"
#include "fulgur/plugins/environments/lightning.h"
#include "fulgur/plugins/environments/lsf.h"
#include "fulgur/plugins/environments/mpi.h"
#include "fulgur/plugins/environments/slurm.h"
#include "fulgur/plugins/environments/torchelastic.h"

#include <algorithm>

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

void ClusterEnvironmentRegistry::set_detector(const std::string& name, int priority,
                                              Detector detector) {
  const Entry& e = entry(name);  // throws when unknown
  std::erase_if(detectors_, [&](const DetectorEntry& d) { return d.name == e.name; });
  for (const auto& d : detectors_) {
    if (d.priority == priority) {
      throw ConfigError(str("cluster environment \"", name, "\": detector priority ", priority,
                            " is taken by \"", d.name,
                            "\". Pick another priority (higher is "
                            "asked first; detection order: ",
                            join(detection_order()), ")."));
    }
  }
  detectors_.push_back({e.name, priority, std::move(detector)});
  std::sort(detectors_.begin(), detectors_.end(),
            [](const DetectorEntry& a, const DetectorEntry& b) { return a.priority > b.priority; });
}

std::vector<std::string> ClusterEnvironmentRegistry::detection_order() const {
  std::vector<std::string> names;
  for (const auto& d : detectors_) names.push_back(d.name);
  return names;
}

std::unique_ptr<ClusterEnvironment> ClusterEnvironmentRegistry::detect(
    const EnvView& env, std::vector<std::string>* notes) const {
  std::vector<std::string> declined;
  for (const auto& d : detectors_) {
    if (!contains(d.name)) continue;  // replaced away since
    Detection verdict = d.detect(env);
    if (verdict.matched) {
      if (notes) notes->push_back(str("cluster_environment=", d.name, " because ", verdict.reason));
      try {
        return create(d.name, env);
      } catch (const ConfigError& e) {
        // No plugin was passed: the message says why this one was chosen,
        // not to drop it.
        std::string what = e.what();
        const std::string plugin_hint =
            str(", or drop the \"", d.name, "\" plugin to let fulgur detect the environment.");
        if (const size_t at = what.find(plugin_hint); at != std::string::npos) {
          what.replace(at, plugin_hint.size(),
                       str(". fulgur chose \"", d.name, "\" because ", verdict.reason,
                           ": unset those variables to let fulgur start the processes itself, "
                           "or pass the cluster environment plugin of your launcher."));
        }
        throw ConfigError(what);
      }
    }
    if (!verdict.reason.empty()) declined.push_back(std::move(verdict.reason));
  }
  if (notes) {
    for (auto& reason : declined) notes->push_back(str("cluster_environment=lightning: ", reason));
  }
  return create("lightning", env);
}

ClusterEnvironmentRegistry& cluster_environment_registry() {
  static ClusterEnvironmentRegistry registry = [] {
    using Detection = ClusterEnvironmentRegistry::Detection;
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

    // Where launchers nest, the most specific is asked first (see set_detector).
    r.set_detector("torchelastic", 500, [](const EnvView& env) {
      if (!TorchElasticEnvironment::detect(env)) return Detection::no();
      return Detection::match(str("torchrun's ",
                                  env.has("GROUP_RANK")
                                      ? "RANK, GROUP_RANK, LOCAL_RANK and LOCAL_WORLD_SIZE are set"
                                      : "TORCHELASTIC_RUN_ID is set",
                                  env.has("TORCHELASTIC_RUN_ID")
                                      ? str(" (run id \"", *env.get("TORCHELASTIC_RUN_ID"), "\")")
                                      : std::string()));
    });
    r.set_detector("slurm", 400, [](const EnvView& env) {
      if (SLURMEnvironment::detect(env)) {
        auto job_name = env.get("SLURM_JOB_NAME");
        return Detection::match(
            str("SLURM_NTASKS is set",
                job_name ? str(" (job name \"", *job_name, "\")") : std::string()));
      }
      if (env.has("SLURM_NTASKS") && SLURMEnvironment::is_interactive(env)) {
        return Detection::no(str("SLURM_NTASKS is set but SLURM_JOB_NAME=\"",
                                 *env.get("SLURM_JOB_NAME"),
                                 "\" is an interactive allocation, "
                                 "so fulgur creates the processes"));
      }
      return Detection::no();
    });
    r.set_detector("mpi", 300, [](const EnvView& env) {
      if (!MPIEnvironment::detect(env)) return Detection::no();
      return Detection::match(env.has("OMPI_COMM_WORLD_SIZE") && env.has("OMPI_COMM_WORLD_RANK")
                                  ? "OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_RANK are set "
                                    "(Open MPI)"
                                  : "PMI_SIZE and PMI_RANK are set (MPICH / Intel MPI)");
    });
    r.set_detector("lsf", 200, [](const EnvView& env) {
      if (!LSFEnvironment::detect(env)) return Detection::no();
      return Detection::match(
          "LSB_JOBID and JSM_NAMESPACE_SIZE / _RANK / _LOCAL_RANK are set "
          "(jsrun)");
    });
    r.set_detector("kubeflow", 100, [](const EnvView& env) {
      if (!KubeflowEnvironment::detect(env)) return Detection::no();
      return Detection::match(
          "KUBERNETES_PORT, MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK "
          "are set (one process per pod)");
    });
    return r;
  }();
  return registry;
}

std::unique_ptr<ClusterEnvironment> detect_cluster_environment(const EnvView& env,
                                                               std::vector<std::string>* notes) {
  return cluster_environment_registry().detect(env, notes);
}

}  // namespace fulgur
