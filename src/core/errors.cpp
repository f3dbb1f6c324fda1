#include "fulgur/core/errors.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <utility>
#include <vector>

namespace fulgur {

std::vector<std::string> split_list(std::string_view text, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(sep, start);
    std::string_view item =
        text.substr(start, comma == std::string_view::npos ? text.npos : comma - start);
    const size_t first = item.find_first_not_of(" \t");
    const size_t last = item.find_last_not_of(" \t");
    out.emplace_back(first == item.npos ? std::string_view()
                                        : item.substr(first, last - first + 1));
    if (comma == std::string_view::npos) return out;
    start = comma + 1;
  }
}

std::string join(const std::vector<std::string>& items, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += sep;
    out += items[i];
  }
  return out;
}

std::string join_some(const std::vector<std::string>& items, size_t at_most) {
  if (items.size() <= at_most) return join(items);
  return str(join(std::vector<std::string>(items.begin(), items.begin() + at_most)), ", ... (",
             items.size(), " in all)");
}

std::string shortened(std::string_view text, size_t max) {
  if (text.size() <= max) return std::string(text);
  return str(text.substr(0, max), "... (", text.size(), " bytes)");
}

std::string by_rank(const std::vector<std::string>& value_of_rank, std::string_view between) {
  std::vector<std::pair<std::string, std::vector<std::string>>> ranks_of;  // in first-seen order
  for (size_t r = 0; r < value_of_rank.size(); ++r) {
    auto it = std::find_if(ranks_of.begin(), ranks_of.end(),
                           [&](const auto& entry) { return entry.first == value_of_rank[r]; });
    if (it == ranks_of.end()) it = ranks_of.insert(ranks_of.end(), {value_of_rank[r], {}});
    it->second.push_back(std::to_string(r));
  }
  std::string out;
  for (const auto& [value, ranks] : ranks_of) {
    out += str(out.empty() ? "" : "; ", ranks.size() == 1 ? "rank " : "ranks ", join(ranks),
               between, value);
  }
  return out;
}

void detail::print_note(const std::string& text) {
  // One insertion: unbuffered std::cerr hands it to the stream in one write.
  std::cerr << ("fulgur: " + text + "\n") << std::flush;
}

namespace {
// Optimal string alignment distance: insertions, deletions, substitutions
// and transpositions of adjacent characters ("slrum" -> "slurm") cost 1.
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}
}  // namespace

std::string to_lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

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

std::string did_you_mean(std::string_view name, const std::vector<std::string>& candidates,
                         std::string_view before, std::string_view after) {
  const std::string guess = closest_match(name, candidates);
  return guess.empty() ? std::string(". ") : str("; did you mean ", before, guess, after, "? ");
}

std::string error_message(const std::exception& error) {
  if (const auto* torch_error = dynamic_cast<const c10::Error*>(&error)) {
    const char* frames = std::getenv("TORCH_SHOW_CPP_STACKTRACES");
    if (frames == nullptr || std::strcmp(frames, "1") != 0) {
      return torch_error->what_without_backtrace();
    }
  }
  return error.what();
}

namespace detail {
void assert_failed(const char* cond, const char* file, int line, const std::string& message) {
  throw InternalError(str("bug in fulgur: ", cond, " failed at ", file, ":", line,
                          message.empty() ? "" : ": ", message,
                          ". Please report it with the command that triggered it."));
}
}  // namespace detail

}  // namespace fulgur

namespace fulgur {

namespace {
std::string flag_error_message(const std::vector<std::string>& problems) {
  if (problems.size() == 1) return "Trainer: " + problems.front();
  return str("Trainer: ", problems.size(), " problems with the flags:\n  - ",
             join(problems, "\n  - "));
}
}  // namespace

FlagError::FlagError(std::string kind, std::vector<std::string> problems)
    : ConfigError(flag_error_message(problems)),
      kind_(std::move(kind)),
      problems_(std::move(problems)) {}

}  // namespace fulgur
