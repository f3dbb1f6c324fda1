// File: fulgur/trainer/connectors/resolution.h
//
// What the connector resolved the Trainer's flags to, as `fulgur resolve` and
// Trainer::describe() print it: registered names, counts, ranks, and every
// default chosen with its reason. JSON only; nothing here builds anything.
#pragma once

#include <string>
#include <vector>

#include "fulgur/trainer/determinism.h"

namespace fulgur {

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
  /// JSON true, false or "warn".
  Determinism deterministic = Determinism::kOff;
  /// Whether `deterministic` was given (unset leaves the program's own
  /// setting).
  bool deterministic_given = false;
  bool sync_batchnorm = false;
  bool benchmark = false;
  std::vector<std::string> notes;

  /// One JSON object with exactly the keys accelerator, strategy, launcher,
  /// precision, cluster_environment, num_nodes, num_devices, world_size,
  /// global_rank, local_rank, node_rank, parallel_devices, deterministic,
  /// sync_batchnorm, notes; two-space indented, ending in a newline.
  std::string to_json() const;
  /// The same for a person: one line of what was chosen, then one line per
  /// note (why), ending in a newline:
  ///   fulgur: strategy ddp, 2 cpu devices on 1 node (world size 2), precision 32-true,
  ///           cluster environment lightning, launcher subprocess_script
  ///     accelerator=cpu because accelerator=auto and CUDA is not available
  std::string to_text() const;
};

/// {"error": kind, "problems": [...], "message": what()}, ending in a newline.
std::string to_json(const FlagError& error);

}  // namespace fulgur
