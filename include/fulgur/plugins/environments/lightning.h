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
  int world_size() const override { return world_size_; }
  void set_world_size(int size) override { world_size_ = size; }
  int global_rank() const override { return global_rank_; }
  void set_global_rank(int rank) override { global_rank_ = rank; }
  int local_rank() const override { return local_rank_; }
  int node_rank() const override { return node_rank_; }

 private:
  bool local_rank_set_ = false;
  std::string main_address_ = "127.0.0.1";
  int main_port_ = 0;  // 0: pick a free port at launch
  int world_size_ = 1;
  int global_rank_ = 0;
  int local_rank_ = 0;
  int node_rank_ = 0;
};

}  // namespace fulgur
