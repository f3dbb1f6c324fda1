#include "fulgur/plugins/environments/kubeflow.h"

#include "env_support.h"

namespace fulgur {

namespace {
constexpr const char* kKubeflowSetBy = "the Kubeflow training operator (PyTorchJob)";
}

bool KubeflowEnvironment::detect(const EnvView& env) {
  for (const char* var : {"KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"}) {
    if (!env.has(var)) return false;
  }
  // torchrun inside a pod is torchelastic, not one process per pod.
  return !env.has("GROUP_RANK") && !env.has("LOCAL_RANK");
}

KubeflowEnvironment::KubeflowEnvironment(const EnvView& env) {
  using namespace env_support;
  world_size_ = require_count(env, "WORLD_SIZE", name(), kKubeflowSetBy);
  global_rank_ = require_int(env, "RANK", name(), kKubeflowSetBy);
  local_rank_ = 0;
  node_rank_ = global_rank_;
  rank_sources_ = {"WORLD_SIZE", "RANK", "", "RANK"};  // one process per pod
  main_port_ = checked_port(require_int(env, "MASTER_PORT", name(), kKubeflowSetBy), "MASTER_PORT");
  main_address_ = require_string(env, "MASTER_ADDR", name(), kKubeflowSetBy);
}

std::string KubeflowEnvironment::main_address() const { return main_address_; }
int KubeflowEnvironment::main_port() const { return main_port_; }

void KubeflowEnvironment::validate_settings(int num_devices, int num_nodes) const {
  if (num_devices == 1 && num_nodes == world_size_) return;
  throw ConfigError(str("devices=", num_devices, " x num_nodes=", num_nodes, " = ",
                        int64_t{num_devices} * num_nodes,
                        " processes, but Kubeflow runs one process per "
                        "pod and its WORLD_SIZE=",
                        world_size_,
                        " pods. Pass devices=1 and "
                        "num_nodes=",
                        world_size_, ", or change the PyTorchJob's replicas."));
}

}  // namespace fulgur
