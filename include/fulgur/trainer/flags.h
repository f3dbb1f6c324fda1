// File: fulgur/trainer/flags.h
//
// The connector's flags from command-line text, in one place: `fulgur
// resolve`, the examples and tests parse them here.
//
//   auto parsed = fulgur::parse_flags({{"devices", "2"}, {"num-nodes", "2"}});
//   fulgur::connect(parsed.options, fulgur::EnvView(), parsed.problems);
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "fulgur/trainer/trainer_options.h"

namespace fulgur {

/// The options the flags set, and one problem per flag that could not be
/// used (unknown, given twice, a value that does not parse or does not fit).
/// A flag with a problem leaves its option at the default, so the connector
/// can still check the others and report everything at once.
struct ParsedFlags {
  TrainerOptions options;
  std::vector<std::string> problems;
};

/// Parses {"devices", "0,1"}, {"num-nodes", "2"}, {"plugins", "slurm,torch"},
/// ... (snake_case or kebab-case, leading dashes optional) for accelerator,
/// strategy, devices, num_nodes, precision, plugins, sync_batchnorm,
/// deterministic, benchmark. Never throws for a bad flag: see problems.
ParsedFlags parse_flags(const std::vector<std::pair<std::string, std::string>>& flags);

/// parse_flags(), throwing FlagError("invalid_flags") listing every problem.
TrainerOptions options_from_flags(const std::vector<std::pair<std::string, std::string>>& flags);

/// `text` as an integer in [min, max]: ok when it is one; out_of_range when
/// it is an integer outside [min, max] (never clamped), so that a message can
/// say which. An optional sign, then digits only.
struct ParsedInt {
  bool ok = false;
  bool out_of_range = false;
  long long value = 0;
};
ParsedInt parse_int(const std::string& text, long long min, long long max);

}  // namespace fulgur
