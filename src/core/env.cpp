#include "fulgur/core/env.h"

#include <cstdlib>

#include "fulgur/core/errors.h"

namespace fulgur {

std::optional<std::string> EnvView::get(const std::string& name) const {
  if (vars_) {
    auto it = vars_->find(name);
    if (it == vars_->end()) return std::nullopt;
    return it->second;
  }
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

std::optional<int64_t> EnvView::get_int(const std::string& name) const {
  auto value = get(name);
  if (!value) return std::nullopt;
  try {
    size_t used = 0;
    int64_t parsed = std::stoll(*value, &used);
    if (used == value->size()) return parsed;
  } catch (const std::exception&) {
  }
  throw ConfigError(str("environment variable ", name, "=\"", *value,
                        "\" is not an integer. Set it to a whole number or unset it."));
}

}  // namespace fulgur
