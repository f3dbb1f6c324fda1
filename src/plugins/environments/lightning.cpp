#include "fulgur/plugins/environments/lightning.h"

#include "fulgur/core/errors.h"
#include "env_support.h"

namespace fulgur {

LightningEnvironment::LightningEnvironment(const EnvView& env) {
  if (auto addr = env.get("MASTER_ADDR")) main_address_ = *addr;
  if (auto port = env.get_int("MASTER_PORT")) {
    if (*port < 1 || *port > 65535) {
      throw ConfigError(str("environment variable MASTER_PORT=", *port,
                            " is not a TCP port. Set it to a port in 1..65535, or unset it to "
                            "let fulgur pick a free one."));
    }
    main_port_ = static_cast<int>(*port);
  }
  if (auto ws = env_support::get_int(env, "WORLD_SIZE")) {
    world_size_ = *ws;
    rank_sources_.world_size = "WORLD_SIZE";
  }
  if (auto r = env_support::get_int(env, "RANK")) {
    global_rank_ = *r;
    rank_sources_.global_rank = "RANK";
  }
  if (auto lr = env_support::get_int(env, "LOCAL_RANK")) {
    local_rank_ = *lr;
    local_rank_set_ = true;
    rank_sources_.local_rank = "LOCAL_RANK";
  }
  if (auto lws = env_support::get_int(env, "LOCAL_WORLD_SIZE")) local_world_size_ = *lws;
  for (const char* var : {"NODE_RANK", "GROUP_RANK"}) {
    if (auto nr = env_support::get_int(env, var)) {
      node_rank_ = *nr;
      rank_sources_.node_rank = var;
      break;
    }
  }
  // Set by fulgur's own launcher in the ranks it starts again.
  restart_count_ = env_support::restart_count(env, "FULGUR_RESTART_COUNT");
  started_by_fulgur_ = env.get("FULGUR_RESTART_COUNT").has_value();
}

bool LightningEnvironment::creates_processes_externally() const {
  // A LOCAL_RANK in the environment means a launcher (ours re-executing the
  // script, or a user's) already created this process.
  return local_rank_set_;
}

void LightningEnvironment::validate_settings(int num_devices, int num_nodes) const {
  std::vector<std::string> problems;
  if (int64_t{num_devices} * num_nodes != world_size_) {
    problems.push_back(str("devices=", num_devices, " x num_nodes=", num_nodes, " = ",
                           int64_t{num_devices} * num_nodes,
                           " processes, but the launcher that started "
                           "this one ",
                           rank_sources_.world_size.empty()
                               ? std::string("did not set WORLD_SIZE (one process)")
                               : str("set WORLD_SIZE=", world_size_)));
  }
  if (world_size_ > 1 && rank_sources_.global_rank.empty()) {
    problems.push_back(str("LOCAL_RANK=", local_rank_, " and WORLD_SIZE=", world_size_,
                           " are set, RANK is not: this process's rank among all is unknown "
                           "(it would be taken as 0). Set RANK too (torchrun sets all three)"));
  } else if (num_nodes == 1 && !rank_sources_.global_rank.empty() && global_rank_ != local_rank_) {
    problems.push_back(str("RANK=", global_rank_, " and LOCAL_RANK=", local_rank_,
                           " on one node (num_nodes=1), where they are the same"));
  }
  if (local_world_size_ > 0 && num_devices != local_world_size_) {
    problems.push_back(
        str("devices=", num_devices, " per node, but LOCAL_WORLD_SIZE=", local_world_size_));
  }
  if (problems.empty()) return;
  throw ConfigError(str(join(problems, "; and "),
                        ". Every rank must get the flags its launcher "
                        "got; unset LOCAL_RANK to let fulgur start the processes itself."));
}

}  // namespace fulgur
