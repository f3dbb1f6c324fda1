// File: fulgur/plugins/environments/mpi.h
#pragma once

#include <optional>
#include <string>

#include "fulgur/plugins/environments/cluster_environment.h"

namespace fulgur {

/// mpirun created this process. Open MPI: OMPI_COMM_WORLD_SIZE / _RANK /
/// _LOCAL_RANK / _LOCAL_SIZE; MPICH / Intel MPI (PMI): PMI_SIZE, PMI_RANK,
/// MPI_LOCALRANKID, MPI_LOCALNRANKS. Node rank = rank / local size. MPI
/// exports no rendezvous address: MASTER_ADDR / MASTER_PORT when set, else
/// 127.0.0.1:29500 on a single node; on several nodes MASTER_ADDR must be
/// exported (validate_settings and main_address() say how).
class MPIEnvironment : public ClusterEnvironment {
 public:
  /// Reads the variables now; ConfigError naming a required variable that is
  /// unset or one that is not an integer.
  explicit MPIEnvironment(const EnvView& env = EnvView());
  /// True when this environment's variables are set in `env`.
  static bool detect(const EnvView& env);

  std::string_view name() const override { return "mpi"; }
  bool creates_processes_externally() const override { return true; }
  std::string main_address() const override;
  int main_port() const override;
  void validate_settings(int num_devices, int num_nodes) const override;

  /// "Open MPI" or "PMI".
  const std::string& family() const { return family_; }
  int local_size() const { return local_size_; }

 private:
  std::string family_;
  int local_size_ = 1;
  std::optional<std::string> main_address_;
  int main_port_ = 29500;
};

}  // namespace fulgur
