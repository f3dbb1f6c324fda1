// File: fulgur/trainer/connectors/accelerator_connector.h
//
// Turns the Trainer's flags into one ready Strategy, as one Connection that
// each phase completes:
//   resolve(options, context) -> Connection  (pure: reads only `context`)
//     1. check: every problem with the flags (unknown names with a
//        suggestion, malformed devices, conflicting plugins and instances,
//        flags a strategy cannot honour);
//     2. choose: accelerator (auto: CUDA if available, else CPU), devices,
//        cluster environment (detected from the environment by the
//        registry's priorities), strategy (auto: single_device for one
//        device on one node, else ddp), precision; every default chosen is
//        recorded as a note. Checks of this phase whose inputs are valid run
//        even when phase 1 found problems elsewhere, and ONE FlagError lists
//        them all;
//   build(connection) -> Connection
//     3. construct the strategy and hand it its components; the components
//        themselves reject what they cannot run (16-mixed on the CPU, the
//        fork launcher on CUDA).
//
// Precedence: an instance beats a name; plugins carried by a strategy
// instance beat flags, and a flag that names something different is an error.
//
// The context carries everything the connector reads: the environment, the
// registries, and through the accelerators the device probe. Tests pass their
// own (a registry copy with a fake CUDA accelerator is "a CUDA machine").
//
//   auto [strategy, resolution] = fulgur::connect({.devices = 2});
//   std::cout << resolution.to_json();   // what `fulgur resolve --devices 2` prints
#pragma once

#include <c10/core/Device.h>

#include <memory>
#include <string>
#include <vector>

#include "fulgur/accelerators/accelerator.h"
#include "fulgur/core/env.h"
#include "fulgur/plugins/environments/cluster_environment.h"
#include "fulgur/plugins/io/checkpoint_io.h"
#include "fulgur/plugins/precision/precision.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/connectors/resolution.h"
#include "fulgur/trainer/flags.h"
#include "fulgur/trainer/trainer_options.h"

namespace fulgur {

/// What the connector reads, and nothing else.
struct ConnectorContext {
  /// The process's environment and the global registries.
  ConnectorContext();
  /// `env` and the global registries.
  explicit ConnectorContext(EnvView env);

  EnvView env;
  const AcceleratorRegistry* accelerators;
  const StrategyRegistry* strategies;
  const PrecisionRegistry* precisions;
  const CheckpointIORegistry* checkpoint_ios;
  const ClusterEnvironmentRegistry* cluster_environments;
};

/// What the connector makes of the flags. After resolve(): every component
/// chosen, not yet assembled, and `resolution` holding the flags it keeps
/// (num_nodes, sync_batchnorm, deterministic, benchmark) and the notes so
/// far. After build(): `strategy` is the assembled, configured strategy
/// and `resolution` says all it resolved to, and why.
struct Connection {
  /// The strategy instance passed, or the one created from its name.
  std::shared_ptr<Strategy> strategy;
  std::shared_ptr<Accelerator> accelerator;
  std::vector<c10::Device> devices;
  /// Null when the strategy instance carries its own.
  std::shared_ptr<Precision> precision;
  /// Null: the strategy's (its own, or the default).
  std::shared_ptr<CheckpointIO> checkpoint_io;
  std::shared_ptr<ClusterEnvironment> cluster_environment;
  Resolution resolution;
  /// Whether build() has assembled it.
  bool built = false;
};

/// Phases 1 and 2. Throws FlagError listing every problem found;
/// `other_problems` (the Trainer's loop flags, unparsable flags) come first
/// in the same error.
Connection resolve(const TrainerOptions& options, const ConnectorContext& context,
                   const std::vector<std::string>& other_problems = {});

/// Phase 3: assembles the strategy and lets its components check it.
/// Throws FlagError ("unavailable", "invalid_flags") for what they reject.
Connection build(Connection connection);

/// build(resolve(options, context, other_problems)).
Connection connect(const TrainerOptions& options, const ConnectorContext& context,
                   const std::vector<std::string>& other_problems = {});
/// connect() against `env` and the global registries.
Connection connect(const TrainerOptions& options, const EnvView& env = EnvView(),
                   const std::vector<std::string>& other_problems = {});

/// Applies the process-wide LibTorch flags of a resolution: deterministic
/// algorithms (and what `accelerator` needs for them, e.g. cuBLAS's
/// workspace setting on CUDA), cuDNN benchmark. The Trainer calls it;
/// `fulgur resolve` does not.
void apply_torch_flags(const Resolution& resolution, Accelerator& accelerator);

}  // namespace fulgur
