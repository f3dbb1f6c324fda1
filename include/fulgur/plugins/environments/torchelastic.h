// File: fulgur/plugins/environments/torchelastic.h
#pragma once

#include <string>

#include "fulgur/plugins/environments/cluster_environment.h"

namespace fulgur {

/// torchrun (torch.distributed.elastic) created this process: RANK,
/// GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE, MASTER_ADDR and
/// MASTER_PORT are set. Where torchrun's agent hosts the rendezvous store at
/// MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True: torchrun 2.x,
/// and 1.x's static rendezvous), the ranks join it instead of rank 0 hosting
/// one; their keys are kept apart per run and restart
/// (TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT).
class TorchElasticEnvironment : public ClusterEnvironment {
 public:
  /// Reads the variables now; ConfigError naming a required variable that is
  /// unset or one that is not an integer.
  explicit TorchElasticEnvironment(const EnvView& env = EnvView());
  /// True when this environment's variables are set in `env`.
  static bool detect(const EnvView& env);

  std::string_view name() const override { return "torchelastic"; }
  bool creates_processes_externally() const override { return true; }
  std::string main_address() const override;
  int main_port() const override;
  std::string hosted_store_prefix() const override { return hosted_store_prefix_; }
  void validate_settings(int num_devices, int num_nodes) const override;

 private:
  int local_world_size_ = 1;
  std::string main_address_;
  int main_port_ = 0;
  std::string hosted_store_prefix_;
};

}  // namespace fulgur
