// File: fulgur/trainer/flags.h
//
// The Trainer's flags as text, in one table: fulgur::cli (command lines and
// YAML files), `fulgur resolve`, the examples and the docs all read it, so a
// new TrainerOptions field with a text form appears everywhere at once.
//
//   auto parsed = fulgur::parse_flags({{"devices", "2"}, {"num-nodes", "2"}});
//   fulgur::connect(parsed.options, fulgur::EnvView(), parsed.problems);
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
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

/// "true"/"True"/"1" or "false"/"False"/"0"; nothing for anything else.
std::optional<bool> parse_bool(const std::string& text);
/// A finite or infinite number written in full (no trailing text, no NaN).
std::optional<double> parse_double(const std::string& text);
/// Why parse_double() refused `text`, as a clause: "not a number", or that
/// the number is beyond a double's range ("1e999", "1e-400").
std::string not_a_double(const std::string& text);
/// The shortest text that parse_double() reads back to `value`.
std::string number_text(double value);
/// A flag's name as the table spells it: leading dashes dropped, '-' → '_'
/// ("--max-epochs" → "max_epochs", "trainer.max-epochs" → "trainer.max_epochs").
std::string flag_key(std::string_view name);

/// One field of TrainerOptions as text.
struct TrainerFlag {
  std::string name;   // snake_case, as the field
  std::string group;  // "hardware", "run length", "validation", ...
  std::string help;   // one line
  /// The field's value as set() reads it back ("none" when unset; an
  /// object passed in code shows as its name).
  std::function<std::string(const TrainerOptions&)> get;
  /// Sets the field from text; "" when it parsed, else what is wrong and
  /// what to pass instead ("not an integer. Pass ..."). Values the
  /// connector judges (devices, precision, ...) are stored as written and
  /// judged there, with every other problem of the configuration.
  std::function<std::string(TrainerOptions&, const std::string&)> set;
  /// Takes free text (default_root_dir): a config file's null or list for
  /// it is refused, not read as "none" or "a,b".
  bool is_text = false;
};

/// Every flag, in TrainerOptions' declaration order.
const std::vector<TrainerFlag>& trainer_flags();

/// The flag named `name` (snake_case or kebab-case, leading dashes
/// optional), or null.
const TrainerFlag* find_trainer_flag(std::string_view name);

/// Parses {"devices", "0,1"}, {"num-nodes", "2"}, {"max_epochs", "5"}, ...
/// (any flag of trainer_flags(); snake_case or kebab-case, leading dashes
/// optional). Never throws for a bad flag: see problems.
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
