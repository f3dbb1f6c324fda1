// File: fulgur/plugins/environments/cluster_environment.h
//
// A ClusterEnvironment says who this process is: world size, global, local
// and node rank, and where the main process listens. It reads its own
// environment variables (through an EnvView), says whether processes are
// created externally (torchrun, srun, mpirun) or by fulgur's launcher, and
// checks devices x num_nodes against what the cluster reports.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fulgur/core/env.h"
#include "fulgur/core/registry.h"

namespace fulgur {

class ClusterEnvironment {
 public:
  virtual ~ClusterEnvironment() = default;
  virtual std::string_view name() const = 0;
  /// True when something else (torchrun, srun, mpirun) created this process
  /// and its peers; fulgur then launches nothing.
  virtual bool creates_processes_externally() const = 0;
  virtual std::string main_address() const = 0;
  virtual int main_port() const = 0;
  /// Non-empty when a rendezvous store already listens at main_address():
  /// main_port(), hosted by whoever created the processes (torchrun's agent
  /// with TORCHELASTIC_USE_AGENT_STORE=True): every rank, rank 0 included,
  /// then connects to it as a client, and keeps its keys under this prefix.
  /// Empty (the default): rank 0 hosts the store itself.
  virtual std::string hosted_store_prefix() const { return {}; }
  /// The ranks as read from the environment (the defaults describe one
  /// process); launchers set world size and global rank once known.
  virtual int world_size() const { return world_size_; }
  virtual void set_world_size(int size) { world_size_ = size; }
  virtual int global_rank() const { return global_rank_; }
  virtual void set_global_rank(int rank) { global_rank_ = rank; }
  virtual int local_rank() const { return local_rank_; }
  virtual void set_local_rank(int rank) { local_rank_ = rank; }
  virtual int node_rank() const { return node_rank_; }
  /// Throws ConfigError when `num_devices` x `num_nodes` disagrees with what
  /// the cluster reports, naming both numbers and both sources.
  virtual void validate_settings(int /*num_devices*/, int /*num_nodes*/) const {}
  /// Called in each process once its rank is known.
  virtual void teardown() {}

  /// The ranks read from the environment against the flags, one problem
  /// each, naming the variable it came from: the global rank in
  /// [0, world size), the local rank in [0, num_devices), the node rank in
  /// [0, num_nodes). Empty when all are in range. The connector reports
  /// them for processes created externally (a rank out of range would
  /// otherwise surface as a process group that never forms).
  std::vector<std::string> rank_problems(int num_devices, int num_nodes) const;

 protected:
  // Filled by each environment's constructor from its variables.
  int world_size_ = 1;
  int global_rank_ = 0;
  int local_rank_ = 0;
  int node_rank_ = 0;
  /// The variable each value was read from, for rank_problems(); empty for
  /// a value derived from others (then described as such) or a default.
  struct RankSources {
    std::string world_size, global_rank, local_rank, node_rank;
  };
  RankSources rank_sources_;
};

using ClusterEnvironmentRegistry = Registry<ClusterEnvironment, const EnvView&>;
/// lightning, torchelastic, slurm, mpi, lsf, kubeflow, and what users add.
ClusterEnvironmentRegistry& cluster_environment_registry();

/// The environment this process runs in, checked in order torchelastic,
/// slurm, mpi, lsf, kubeflow, else lightning (fulgur creates the processes).
/// Appends to `notes` (when not null) which one was chosen and which
/// variables decided it; nothing for plain lightning on an empty
/// environment.
std::unique_ptr<ClusterEnvironment> detect_cluster_environment(const EnvView& env,
                                                               std::vector<std::string>* notes);

}  // namespace fulgur
