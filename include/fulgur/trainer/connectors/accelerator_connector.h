// File: fulgur/trainer/connectors/accelerator_connector.h
//
// Turns the Trainer's flags into one ready Strategy, in three phases:
//   1. check: every problem with the flags is collected and reported in ONE
//      FlagError (unknown names with a suggestion, malformed devices,
//      conflicting plugins and instances, flags a strategy cannot honour);
//   2. choose: accelerator (auto: CUDA if available, else CPU), devices,
//      cluster environment (detected from the environment), strategy
//      (auto: single_device for one device on one node, else ddp),
//      precision; every default chosen is recorded as a note;
//   3. build: construct the strategy and hand it its components; the
//      components themselves reject what they cannot run (16-mixed on the
//      CPU, CUDA where there is none).
//
// Precedence: an instance beats a name; plugins carried by a strategy
// instance beat flags, and a flag that names something different is an error.
//
//   auto [strategy, resolution] = fulgur::connect({.devices = 2});
//   std::cout << resolution.to_json();   // what `fulgur resolve --devices 2` prints
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "fulgur/core/env.h"
#include "fulgur/trainer/trainer_options.h"

namespace fulgur {

class Strategy;
class FlagError;

/// What the flags resolved to: registered names, counts, ranks, and every
/// default chosen with its reason.
struct Resolution {
  std::string accelerator;
  std::string strategy;
  /// "subprocess_script", "fork", or "" when none (JSON null).
  std::string launcher;
  std::string precision;
  std::string cluster_environment;
  int num_nodes = 1;
  int num_devices = 1;
  int world_size = 1;
  int global_rank = 0;
  int local_rank = 0;
  int node_rank = 0;
  std::vector<std::string> parallel_devices;
  /// "true", "false" or "warn" (JSON true, false, "warn").
  std::string deterministic = "false";
  bool sync_batchnorm = false;
  bool benchmark = false;
  std::vector<std::string> notes;

  /// One JSON object with exactly the keys accelerator, strategy, launcher,
  /// precision, cluster_environment, num_nodes, num_devices, world_size,
  /// global_rank, local_rank, node_rank, parallel_devices, deterministic,
  /// sync_batchnorm, notes; two-space indented, ending in a newline.
  std::string to_json() const;
};

/// {"error": kind, "problems": [...], "message": what()}, ending in a newline.
std::string to_json(const FlagError& error);

/// The result of the connector: the strategy and what was chosen and why.
struct ConnectorResult {
  std::shared_ptr<Strategy> strategy;
  Resolution resolution;
};

/// Runs the three phases against `env`. Throws FlagError listing every
/// problem found; `other_problems` (the Trainer's loop flags) are reported
/// in the same error.
ConnectorResult connect(const TrainerOptions& options, const EnvView& env = EnvView(),
                        const std::vector<std::string>& other_problems = {});

/// Applies the process-wide LibTorch flags of a resolution: deterministic
/// algorithms (and cuBLAS's workspace setting on CUDA), cuDNN benchmark.
/// The Trainer calls it; `fulgur resolve` does not.
void apply_torch_flags(const Resolution& resolution);

/// Trainer options from command-line style flags: {"devices", "0,1"},
/// {"num-nodes", "2"}, {"plugins", "slurm,torch"}, ... (snake_case or
/// kebab-case, leading dashes optional) for accelerator, strategy, devices,
/// num_nodes, precision, plugins, sync_batchnorm, deterministic, benchmark.
/// Throws FlagError listing every unknown flag and unparsable value.
TrainerOptions options_from_flags(const std::vector<std::pair<std::string, std::string>>& flags);

}  // namespace fulgur
