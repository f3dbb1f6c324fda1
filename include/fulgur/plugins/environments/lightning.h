// File: fulgur/plugins/environments/lightning.h
#pragma once

#include "fulgur/plugins/environments/cluster_environment.h"

namespace fulgur {

/// The default: fulgur's own launcher creates the processes. Reads the
/// torchrun-style variables its launcher sets in child processes (RANK,
/// LOCAL_RANK, NODE_RANK / GROUP_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
/// and falls back to a single process on 127.0.0.1.
class LightningEnvironment : public ClusterEnvironment {
 public:
  explicit LightningEnvironment(const EnvView& env = EnvView());

  std::string_view name() const override { return "lightning"; }
  bool creates_processes_externally() const override;
  std::string main_address() const override { return main_address_; }
  int main_port() const override { return main_port_; }
  /// In a rank its launcher started: WORLD_SIZE and LOCAL_WORLD_SIZE must
  /// match devices x num_nodes (the program got other flags than its parent).
  void validate_settings(int num_devices, int num_nodes) const override;
  /// FULGUR_RESTART_COUNT is set (by fulgur's launcher, in every rank it starts).
  bool started_by_fulgur_launcher() const override { return started_by_fulgur_; }

 private:
  bool local_rank_set_ = false;
  bool started_by_fulgur_ = false;
  int local_world_size_ = 0;  // 0: not set
  std::string main_address_ = "127.0.0.1";
  int main_port_ = 0;  // 0: pick a free port at launch
};

}  // namespace fulgur
