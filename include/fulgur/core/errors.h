// File: fulgur/core/errors.h
//
// The exception types fulgur throws, and the helpers that build their
// messages. Every user-facing message follows one template:
//
//   <the call as the user wrote it>: <what is wrong and why>. <what to do>.
//
//   throw fulgur::ConfigError(fulgur::str(
//       "Trainer(max_epochs=", n, "): max_epochs must be >= -1. ",
//       "Pass -1 to train until max_steps, or a positive number of epochs."));
#pragma once

#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

/// A user misconfiguration: a flag, option, environment variable or argument
/// that cannot be honoured. The message names the value and the fix.
class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Bad Trainer flags, found by the connector: every problem, one entry each,
/// and a kind ("invalid_flags", "environment_mismatch", "invalid_environment",
/// "unavailable") that
/// tools such as `fulgur resolve` report. what() is the whole text.
class FlagError : public ConfigError {
 public:
  FlagError(std::string kind, std::vector<std::string> problems);
  const std::string& kind() const { return kind_; }
  const std::vector<std::string>& problems() const { return problems_; }

 private:
  std::string kind_;
  std::vector<std::string> problems_;
};

/// A failure of rendezvous, process launch, a collective or a timeout.
class DistributedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A checkpoint that cannot be read: missing, truncated, or not fulgur's.
/// The message names the file and what is wrong with it.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Loading a batch failed: the message names the sample (or the batch's
/// samples), the epoch and what the dataset raised.
class DataLoaderError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A violated invariant inside fulgur: a bug in fulgur, never the user's.
class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

/// Concatenates the streamable arguments into one string.
template <class... Args>
std::string str(const Args&... args) {
  std::ostringstream out;
  ((out << args), ...);
  return out.str();
}

namespace detail {
/// Writes "fulgur: <text>" and a newline to std::cerr as one write, so a
/// line from another process sharing the stream (srun's, another rank's)
/// never lands inside it.
void print_note(const std::string& text);
}  // namespace detail

/// What `error` says, for a person: a LibTorch error (c10::Error) without
/// the C++ stack frames LibTorch appends to its what() (they stay when
/// TORCH_SHOW_CPP_STACKTRACES=1), anything else its what(). fulgur prints
/// errors with it (a rank's failure, the programs' last line); a program's
/// own main can too.
std::string error_message(const std::exception& error);

/// Joins `items` with `sep` ("a, b, c").
std::string join(const std::vector<std::string>& items, std::string_view sep = ", ");
/// As join, for a list a message names that may be as long as its input
/// (the hosts of a rank file): the first `at_most`, then "... (N in all)".
std::string join_some(const std::vector<std::string>& items, size_t at_most = 10);
/// `text` for a message: whole when at most `max` bytes, else its start and
/// its length ("abc... (5000 bytes)"): a key or value from a file may be as
/// long as the file.
std::string shortened(std::string_view text, size_t max = 80);
/// Ranks grouped by what each has, in the order each value first appears:
/// by_rank({"4 batches", "6 batches", "4 batches"}, ": ") is
/// "ranks 0, 2: 4 batches; rank 1: 6 batches" (value_of_rank[r] is rank r's).
std::string by_rank(const std::vector<std::string>& value_of_rank, std::string_view between);

/// "a, b,,c" → {"a", "b", "", "c"}: the comma-separated items of a flag's
/// value (or those separated by `sep`), spaces and tabs around each
/// trimmed, empty ones kept.
std::vector<std::string> split_list(std::string_view text, char sep = ',');

/// `text` in ASCII lower case ("DDP" -> "ddp").
std::string to_lower(std::string_view text);

/// The candidate closest to `name` by edit distance, or "" when none is
/// close enough to be a plausible typo.
std::string closest_match(std::string_view name, const std::vector<std::string>& candidates);

/// The joint between "unknown ... \"dpp\"" and the list of what is known:
/// "; did you mean \"ddp\"? " when a candidate is a plausible typo of `name`
/// (spelled between `before` and `after`), else ". ". The one place that
/// words a suggestion.
std::string did_you_mean(std::string_view name, const std::vector<std::string>& candidates,
                         std::string_view before = "\"", std::string_view after = "\"");

namespace detail {
[[noreturn]] void assert_failed(const char* cond, const char* file, int line,
                                const std::string& message);
}  // namespace detail

}  // namespace fulgur

/// Checks an invariant of fulgur itself; throws fulgur::InternalError
/// ("bug in fulgur") when it does not hold. Not for user input.
#define FULGUR_ASSERT(cond, ...)                                                     \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      ::fulgur::detail::assert_failed(#cond, __FILE__, __LINE__,                     \
                                      ::fulgur::str("" __VA_OPT__(, ) __VA_ARGS__)); \
    }                                                                                \
  } while (false)
