// The connector's flags from command-line text: one table of names, every
// problem collected, integers checked for range (never clamped).
#include "fulgur/trainer/flags.h"

#include <algorithm>
#include <climits>
#include <set>

#include "fulgur/core/errors.h"

namespace fulgur {

ParsedInt parse_int(const std::string& text, long long min, long long max) {
  ParsedInt result;
  size_t i = 0;
  const bool negative = !text.empty() && text[0] == '-';
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) i = 1;
  if (i == text.size()) return result;
  // Accumulate the magnitude as unsigned, so that any digit string either
  // fits or is known not to, whatever its length.
  unsigned long long magnitude = 0;
  bool overflow = false;
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (c < '0' || c > '9') return result;
    const unsigned digit = static_cast<unsigned>(c - '0');
    if (magnitude > (ULLONG_MAX - digit) / 10) {
      overflow = true;
    } else {
      magnitude = magnitude * 10 + digit;
    }
  }
  result.ok = true;
  const unsigned long long limit =
      negative ? static_cast<unsigned long long>(LLONG_MAX) + 1 : LLONG_MAX;
  if (overflow || magnitude > limit) {
    result.out_of_range = true;
    return result;
  }
  const long long value = negative ? (magnitude == static_cast<unsigned long long>(LLONG_MAX) + 1
                                          ? LLONG_MIN
                                          : -static_cast<long long>(magnitude))
                                   : static_cast<long long>(magnitude);
  if (value < min || value > max) {
    result.out_of_range = true;
    return result;
  }
  result.value = value;
  return result;
}

ParsedFlags parse_flags(const std::vector<std::pair<std::string, std::string>>& flags) {
  static const std::vector<std::string> known = {"accelerator", "benchmark", "deterministic",
                                                 "devices",     "num_nodes", "plugins",
                                                 "precision",   "strategy",  "sync_batchnorm"};
  ParsedFlags parsed;
  TrainerOptions& options = parsed.options;
  std::vector<std::string>& problems = parsed.problems;
  std::set<std::string> seen;
  auto parse_bool = [&](const std::string& flag, const std::string& value, bool fallback) {
    if (value == "true" || value == "1") return true;
    if (value == "false" || value == "0") return false;
    problems.push_back(str("--", flag, " ", value, ": pass true or false."));
    return fallback;
  };
  for (const auto& [raw, value] : flags) {
    std::string flag = raw;
    while (!flag.empty() && flag.front() == '-') flag.erase(flag.begin());
    std::replace(flag.begin(), flag.end(), '-', '_');
    if (!seen.insert(flag).second) {
      problems.push_back(str("--", flag, " is given twice: pass it once."));
      continue;
    }
    if (flag == "accelerator") {
      options.accelerator = value;
    } else if (flag == "strategy") {
      options.strategy = value;
    } else if (flag == "devices") {
      options.devices = DevicesSpec(value);
    } else if (flag == "num_nodes") {
      const ParsedInt n = parse_int(value, INT_MIN, INT_MAX);
      if (n.ok && !n.out_of_range) {
        options.num_nodes = static_cast<int>(n.value);
      } else {
        problems.push_back(str("--num_nodes ", value,
                               n.ok ? ": out of range (at most 2147483647)." : ": not an integer.",
                               " Pass the number of machines, e.g. --num_nodes 2."));
      }
    } else if (flag == "precision") {
      options.precision = value;
    } else if (flag == "plugins") {
      size_t start = 0;
      while (start <= value.size()) {
        size_t comma = value.find(',', start);
        std::string name =
            value.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        if (!name.empty()) options.plugins.emplace_back(name);
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    } else if (flag == "sync_batchnorm") {
      options.sync_batchnorm = parse_bool(flag, value, options.sync_batchnorm);
    } else if (flag == "deterministic") {
      options.deterministic = value;
    } else if (flag == "benchmark") {
      options.benchmark = parse_bool(flag, value, options.benchmark);
    } else {
      problems.push_back(str("--", flag, ": unknown flag", did_you_mean(flag, known, "--", ""),
                             "Flags: --", join(known, ", --"), "."));
    }
  }
  return parsed;
}

TrainerOptions options_from_flags(const std::vector<std::pair<std::string, std::string>>& flags) {
  ParsedFlags parsed = parse_flags(flags);
  if (!parsed.problems.empty()) throw FlagError("invalid_flags", parsed.problems);
  return std::move(parsed.options);
}

}  // namespace fulgur
