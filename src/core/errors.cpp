#include "fulgur/core/errors.h"

#include <algorithm>

namespace fulgur {

std::string join(const std::vector<std::string>& items, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += sep;
    out += items[i];
  }
  return out;
}

namespace {
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}
}  // namespace

std::string closest_match(std::string_view name, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = std::string::npos;
  for (const auto& c : candidates) {
    size_t d = edit_distance(name, c);
    if (d < best_distance) {
      best_distance = d;
      best = c;
    }
  }
  // A plausible typo: at most a third of the longer word, and at least 1 edit allowed.
  size_t limit = std::max<size_t>(1, std::max(name.size(), best.size()) / 3);
  return best_distance <= limit ? best : std::string();
}

namespace detail {
void assert_failed(const char* cond, const char* file, int line, const std::string& message) {
  throw InternalError(str("bug in fulgur: ", cond, " failed at ", file, ":", line,
                          message.empty() ? "" : ": ", message,
                          ". Please report it with the command that triggered it."));
}
}  // namespace detail

}  // namespace fulgur
