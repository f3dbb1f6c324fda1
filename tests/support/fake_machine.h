// A connector context on a pretend machine, so that resolution tests run the
// same everywhere (a machine with GPUs included) and can describe one with
// GPUs on a machine without: copies of the global registries in which
// "cuda" reports a chosen number of GPUs without touching CUDA.
#pragma once

#include <map>
#include <string>

#include "fulgur/trainer/connectors/accelerator_connector.h"

namespace fulgur::test {

class FakeMachine {
 public:
  /// `gpus` visible GPUs (0: CUDA unavailable), and exactly `env` as the
  /// environment.
  explicit FakeMachine(int gpus, std::map<std::string, std::string> env = {});
  FakeMachine(const FakeMachine&) = delete;
  FakeMachine& operator=(const FakeMachine&) = delete;

  /// Points at this machine's registries; valid while it lives.
  const ConnectorContext& context() const { return context_; }
  /// The same machine with another environment.
  ConnectorContext context(std::map<std::string, std::string> env) const;

  // This machine's own registries: tests add to them, never to the globals.
  AcceleratorRegistry accelerators;
  StrategyRegistry strategies;
  PrecisionRegistry precisions;
  CheckpointIORegistry checkpoint_ios;
  ClusterEnvironmentRegistry cluster_environments;

 private:
  ConnectorContext context_;
};

}  // namespace fulgur::test
