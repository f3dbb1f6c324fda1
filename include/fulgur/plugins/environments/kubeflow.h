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
  void validate_settings(int num_devices, int num_nodes) const override;

 private:
  std::string main_address_;
  int main_port_ = 0;
};

}  // namespace fulgur
