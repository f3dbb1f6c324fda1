// File: fulgur/trainer/connectors/accelerator_connector.h
//
// Turns the Trainer's flags into one ready Strategy, in three phases:
//   1. check: every problem with the flags is collected and reported in ONE
//      ConfigError (unknown names with a suggestion, malformed devices,
//      conflicting plugins, ...);
//   2. choose: accelerator (auto: CUDA if available, else CPU), devices,
//      cluster environment, strategy (auto: single_device for one device on
//      one node), precision; every default chosen is recorded as a note;
//   3. build: construct the strategy and hand it its components; the
//      components themselves reject what they cannot run.
//
// Precedence: an instance beats a name; plugins carried by a strategy
// instance beat flags, and a flag that names something different is an error.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "fulgur/core/env.h"
#include "fulgur/trainer/trainer_options.h"

namespace fulgur {

class Strategy;

/// The result of the connector: the strategy, and what was chosen and why.
struct ConnectorResult {
  std::shared_ptr<Strategy> strategy;
  std::vector<std::string> notes;
};

/// Runs the three phases. Throws ConfigError listing every problem found.
ConnectorResult connect(const TrainerOptions& options, const EnvView& env = EnvView());

}  // namespace fulgur
