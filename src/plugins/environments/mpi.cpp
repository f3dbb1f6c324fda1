#include "fulgur/plugins/environments/mpi.h"

#include "env_support.h"

namespace fulgur {

namespace {

bool is_open_mpi(const EnvView& env) {
  return env.has("OMPI_COMM_WORLD_SIZE") && env.has("OMPI_COMM_WORLD_RANK");
}
bool is_pmi(const EnvView& env) { return env.has("PMI_SIZE") && env.has("PMI_RANK"); }

}  // namespace

bool MPIEnvironment::detect(const EnvView& env) { return is_open_mpi(env) || is_pmi(env); }

MPIEnvironment::MPIEnvironment(const EnvView& env) {
  using namespace env_support;
  const char* set_by = "mpirun (Open MPI: OMPI_COMM_WORLD_*; MPICH / Intel MPI: PMI_*)";
  std::optional<int> local_rank, local_size;
  if (is_open_mpi(env) || !is_pmi(env)) {
    family_ = "Open MPI";
    world_size_ = require_count(env, "OMPI_COMM_WORLD_SIZE", name(), set_by);
    global_rank_ = require_int(env, "OMPI_COMM_WORLD_RANK", name(), set_by);
    local_rank = get_int(env, "OMPI_COMM_WORLD_LOCAL_RANK");
    local_size = get_count(env, "OMPI_COMM_WORLD_LOCAL_SIZE", set_by);
    rank_sources_ = {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                     local_rank ? "OMPI_COMM_WORLD_LOCAL_RANK" : "", ""};
  } else {
    family_ = "PMI";
    world_size_ = require_count(env, "PMI_SIZE", name(), set_by);
    global_rank_ = require_int(env, "PMI_RANK", name(), set_by);
    local_rank = get_int(env, "MPI_LOCALRANKID");
    local_size = get_count(env, "MPI_LOCALNRANKS", set_by);
    rank_sources_ = {"PMI_SIZE", "PMI_RANK", local_rank ? "MPI_LOCALRANKID" : "", ""};
  }
  // Without the local variables, assume every rank is on this node.
  local_size_ = local_size ? *local_size : world_size_;
  local_rank_ = local_rank ? *local_rank : global_rank_ % local_size_;
  node_rank_ = global_rank_ / local_size_;
  if (auto addr = env.get("MASTER_ADDR")) {
    main_address_ = *addr;
  } else if (world_size_ == local_size_) {
    main_address_ = "127.0.0.1";
  }
  if (auto port = master_port(env)) main_port_ = *port;
}

std::string MPIEnvironment::main_address() const {
  if (main_address_) return *main_address_;
  throw ConfigError(str("cluster environment \"mpi\": ", world_size_, " ranks on ",
                        (int64_t{world_size_} + local_size_ - 1) / local_size_,
                        " nodes and MASTER_ADDR is not set, so the ranks cannot find rank 0. "
                        "Export it to all ranks: mpirun -x MASTER_ADDR=<host of rank 0> "
                        "-x MASTER_PORT=<port> (MPICH / Intel MPI: -genv MASTER_ADDR <host>)."));
}

int MPIEnvironment::main_port() const { return main_port_; }

void MPIEnvironment::validate_settings(int num_devices, int num_nodes) const {
  std::vector<std::string> problems;
  const std::string size_var = family_ == "PMI" ? "PMI_SIZE" : "OMPI_COMM_WORLD_SIZE";
  const std::string local_var = family_ == "PMI" ? "MPI_LOCALNRANKS" : "OMPI_COMM_WORLD_LOCAL_SIZE";
  if (int64_t{num_devices} * num_nodes != world_size_) {
    problems.push_back(str("devices=", num_devices, " x num_nodes=", num_nodes, " = ",
                           int64_t{num_devices} * num_nodes, " processes, but mpirun started ",
                           size_var, "=", world_size_, " ranks"));
  }
  if (num_devices != local_size_) {
    problems.push_back(str("devices=", num_devices, " per node, but mpirun started ", local_var,
                           "=", local_size_, " ranks on this node"));
  }
  if (!problems.empty()) {
    throw ConfigError(str(join(problems, "; and "), ". Pass devices=", local_size_,
                          " and num_nodes=", (int64_t{world_size_} + local_size_ - 1) / local_size_,
                          ", or run mpirun -np ", int64_t{num_devices} * num_nodes, " with ",
                          num_devices, " ranks per node (--npernode ", num_devices, ")."));
  }
  if (!main_address_) (void)main_address();  // throws: how to export MASTER_ADDR
}

}  // namespace fulgur
