// File: fulgur/plugins/environments/kubeflow.h
#pragma once

#include <string>

#include "fulgur/plugins/environments/cluster_environment.h"

namespace fulgur {

/// A Kubeflow PyTorchJob: one process per pod, KUBERNETES_PORT, MASTER_ADDR,
/// MASTER_PORT, WORLD_SIZE and RANK set, and not torchrun (no GROUP_RANK /
/// LOCAL_RANK). Local rank 0, node rank = RANK.
class KubeflowEnvironment : public ClusterEnvironment {
 public:
  /// Reads the variables now; ConfigError naming a required variable that is
  /// unset or one that is not an integer.
  explicit KubeflowEnvironment(const EnvView& env = EnvView());
  /// True when this environment's variables are set in `env`.
  static bool detect(const EnvView& env);

  std::string_view name() const override { return "kubeflow"; }
  bool creates_processes_externally() const override { return true; }
  std::string main_address() const override;
  int main_port() const override;
  int world_size() const override { return world_size_; }
  void set_world_size(int size) override { world_size_ = size; }
  int global_rank() const override { return global_rank_; }
  void set_global_rank(int rank) override { global_rank_ = rank; }
  int local_rank() const override { return local_rank_; }
  int node_rank() const override { return node_rank_; }
  void validate_settings(int num_devices, int num_nodes) const override;

 private:
  int world_size_ = 1;
  int global_rank_ = 0;
  int local_rank_ = 0;
  int node_rank_ = 0;
  std::string main_address_;
  int main_port_ = 0;
};

}  // namespace fulgur
