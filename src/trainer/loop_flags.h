// Private: the Trainer's own checks of its loop flags (max_epochs, limits,
// val_check_interval, loggers: what the connector does not check). The
// Trainer reports them with the connector's in one error; fulgur::CLI runs
// them at parse time too, to name the file and line of a value. Not installed.
#pragma once

#include <string>
#include <vector>

#include "fulgur/trainer/trainer_options.h"

namespace fulgur::detail {

/// Every problem with the loop flags of `options`; empty when none.
std::vector<std::string> check_loop_flags(const TrainerOptions& options);

/// Every check a Trainer of `options` runs when it is made, reported as it
/// reports them (FlagError, ConfigError), starting nothing: fulgur::CLI's
/// parse and the Tuner check options before anything runs.
void check_trainer_options(const TrainerOptions& options);

}  // namespace fulgur::detail
