#include "fulgur/plugins/environments/torchelastic.h"

#include "env_support.h"

namespace fulgur {

namespace {
constexpr const char* kTorchrunSetBy = "torchrun";
}

bool TorchElasticEnvironment::detect(const EnvView& env) {
  // torchrun's own variables (GROUP_RANK and LOCAL_WORLD_SIZE are set by no
  // other launcher), or its run id: the contract is recognised even when
  // MASTER_ADDR or MASTER_PORT is missing, so that the constructor names the
  // missing one instead of another environment being chosen.
  if (env.has("TORCHELASTIC_RUN_ID")) return true;
  for (const char* var : {"RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}) {
    if (!env.has(var)) return false;
  }
  return true;
}

TorchElasticEnvironment::TorchElasticEnvironment(const EnvView& env) {
  using namespace env_support;
  world_size_ = require_count(env, "WORLD_SIZE", name(), kTorchrunSetBy);
  global_rank_ = require_int(env, "RANK", name(), kTorchrunSetBy);
  local_rank_ = require_int(env, "LOCAL_RANK", name(), kTorchrunSetBy);
  node_rank_ = require_int(env, "GROUP_RANK", name(), kTorchrunSetBy);
  rank_sources_ = {"WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK"};
  restart_count_ = env_support::restart_count(env, "TORCHELASTIC_RESTART_COUNT");
  local_world_size_ = require_count(env, "LOCAL_WORLD_SIZE", name(), kTorchrunSetBy);
  main_port_ = checked_port(require_int(env, "MASTER_PORT", name(), kTorchrunSetBy), "MASTER_PORT");
  main_address_ = require_string(env, "MASTER_ADDR", name(), kTorchrunSetBy);
  if (auto agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE")) {
    // Python writes str(bool).
    if (*agent_store == "True" || *agent_store == "true" || *agent_store == "1") {
      hosted_store_prefix_ = str("fulgur/", env.get("TORCHELASTIC_RUN_ID").value_or("run"), "/",
                                 env.get("TORCHELASTIC_RESTART_COUNT").value_or("0"), "/");
    } else if (*agent_store != "False" && *agent_store != "false" && *agent_store != "0") {
      throw ConfigError(str("environment variable TORCHELASTIC_USE_AGENT_STORE=\"", *agent_store,
                            "\" is neither True nor False (torchrun sets it). Unset it, or set "
                            "True when torchrun's agent hosts the store at MASTER_ADDR:"
                            "MASTER_PORT."));
    }
  }
}

std::string TorchElasticEnvironment::main_address() const { return main_address_; }
int TorchElasticEnvironment::main_port() const { return main_port_; }

void TorchElasticEnvironment::validate_settings(int num_devices, int num_nodes) const {
  std::vector<std::string> problems;
  if (int64_t{num_devices} * num_nodes != world_size_) {
    problems.push_back(str("devices=", num_devices, " x num_nodes=", num_nodes, " = ",
                           int64_t{num_devices} * num_nodes,
                           " processes, but torchrun's WORLD_SIZE=", world_size_,
                           " processes were started"));
  }
  if (num_devices != local_world_size_) {
    problems.push_back(str("devices=", num_devices, " per node, but torchrun's LOCAL_WORLD_SIZE=",
                           local_world_size_, " processes per node"));
  }
  if (problems.empty()) return;
  std::string hint = local_world_size_ > 0 && world_size_ % local_world_size_ == 0
                         ? str(" (here devices=", local_world_size_,
                               ", num_nodes=", world_size_ / local_world_size_, ")")
                         : std::string();
  throw ConfigError(str(join(problems, "; and "),
                        ". Pass devices=LOCAL_WORLD_SIZE and "
                        "num_nodes=WORLD_SIZE/LOCAL_WORLD_SIZE",
                        hint, ", or change torchrun's --nproc-per-node / --nnodes."));
}

}  // namespace fulgur
