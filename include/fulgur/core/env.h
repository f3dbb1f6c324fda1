// File: fulgur/core/env.h
//
// EnvView reads environment variables, from the process environment or from
// a fixed map (tests, `fulgur resolve` on a recorded environment). Cluster
// environments and the connector read through it, never through getenv.
#pragma once

#include <map>
#include <optional>
#include <string>

namespace fulgur {

class EnvView {
 public:
  /// The real process environment.
  EnvView() = default;
  /// A fixed set of variables; nothing else is visible.
  explicit EnvView(std::map<std::string, std::string> vars) : vars_(std::move(vars)) {}

  std::optional<std::string> get(const std::string& name) const;
  bool has(const std::string& name) const { return get(name).has_value(); }
  /// The variable parsed as an integer; nullopt when unset. Throws
  /// ConfigError naming the variable when it is set but not an integer.
  std::optional<int64_t> get_int(const std::string& name) const;

 private:
  std::optional<std::map<std::string, std::string>> vars_;
};

}  // namespace fulgur
