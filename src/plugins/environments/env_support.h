// Private helpers shared by the cluster environments in this folder.
#pragma once

#include <cstdint>
#include <vector>
#include <optional>
#include <string>
#include <string_view>

#include "fulgur/core/env.h"
#include "fulgur/core/errors.h"

namespace fulgur::env_support {

/// The variable as an int; nullopt when unset. ConfigError (naming the
/// variable) when it is not an integer or does not fit an int.
inline std::optional<int> get_int(const EnvView& env, const std::string& var) {
  auto v = env.get_int(var);
  if (!v) return std::nullopt;
  if (*v < INT32_MIN || *v > INT32_MAX) {
    throw ConfigError(str("environment variable ", var, "=", *v, " is out of range."));
  }
  return static_cast<int>(*v);
}

/// A restart counter (TORCHELASTIC_RESTART_COUNT, SLURM_RESTART_COUNT, ...):
/// 0 when unset; ConfigError when negative or not an integer.
inline int restart_count(const EnvView& env, const std::string& var) {
  const int count = get_int(env, var).value_or(0);
  if (count < 0) {
    throw ConfigError(str("environment variable ", var, "=", count,
                          " is negative; it counts restarts (0 on the first run). Unset it."));
  }
  return count;
}

[[noreturn]] inline void missing(const std::string& var, std::string_view environment,
                                 std::string_view set_by) {
  throw ConfigError(str("cluster environment \"", environment,
                        "\" needs the environment "
                        "variable ",
                        var, ", which is not set. It is set by ", set_by,
                        "; run under it, or drop the \"", environment,
                        "\" plugin to let fulgur detect the environment."));
}

/// The variable's text; ConfigError like require_int when unset.
inline std::string require_string(const EnvView& env, const std::string& var,
                                  std::string_view environment, std::string_view set_by) {
  auto v = env.get(var);
  if (!v) missing(var, environment, set_by);
  return *v;
}

/// The variable as an int; ConfigError naming the variable, the environment
/// and how it is normally set when unset.
inline int require_int(const EnvView& env, const std::string& var, std::string_view environment,
                       std::string_view set_by) {
  auto v = get_int(env, var);
  if (!v) missing(var, environment, set_by);
  return *v;
}

/// A count of processes or nodes (WORLD_SIZE, SLURM_NNODES, ...): as
/// get_int, and ConfigError naming the variable when it is below 1 (a
/// launch of no process is none fulgur can join; a count of 0 would also
/// divide by zero where ranks are laid out on nodes).
inline std::optional<int> get_count(const EnvView& env, const std::string& var,
                                    std::string_view set_by) {
  auto v = get_int(env, var);
  if (v && *v < 1) {
    throw ConfigError(str("environment variable ", var, "=", *v,
                          " counts processes or nodes, so it must be >= 1. It is set by ", set_by,
                          ": run under it as it sets it, or unset ", var, "."));
  }
  return v;
}

/// get_count of a variable the environment needs (ConfigError like
/// require_int when unset).
inline int require_count(const EnvView& env, const std::string& var, std::string_view environment,
                         std::string_view set_by) {
  auto v = get_count(env, var, set_by);
  if (!v) missing(var, environment, set_by);
  return *v;
}

/// A TCP port read from `var`; ConfigError when outside 1..65535.
inline int checked_port(int64_t port, std::string_view var) {
  if (port < 1 || port > 65535) {
    throw ConfigError(str("environment variable ", var, "=", port,
                          " is not a TCP port. Set it to a port in 1..65535."));
  }
  return static_cast<int>(port);
}

/// MASTER_PORT when set (checked), else nullopt.
inline std::optional<int> master_port(const EnvView& env) {
  if (auto p = env.get_int("MASTER_PORT")) return checked_port(*p, "MASTER_PORT");
  return std::nullopt;
}

/// The trailing digits of a job id, at most `n` of them, as a number
/// ("123456" → 3456 for n=4); 0 when it ends in no digit.
inline int trailing_digits(const std::string& id, size_t n) {
  size_t end = id.size(), begin = end;
  while (begin > 0 && end - begin < n && id[begin - 1] >= '0' && id[begin - 1] <= '9') --begin;
  return begin == end ? 0 : std::stoi(id.substr(begin, end - begin));
}

}  // namespace fulgur::env_support
