// File: fulgur/trainer/determinism.h
//
// The Trainer's `deterministic` flag: off, on (a nondeterministic operation
// throws) or warn (it warns instead), spelled "false", "true" and "warn" on
// command lines and in fulgur resolve's JSON, and passed as a bool or any of
// those spellings in TrainerOptions.
#pragma once

#include <string>
#include <utility>

#include "fulgur/core/choice.h"

namespace fulgur {

enum class Determinism { kOff, kOn, kWarn };
template <>
struct ChoiceNames<Determinism> {
  static constexpr std::pair<Determinism, const char*> kNames[] = {
      {Determinism::kOff, "false"}, {Determinism::kOn, "true"}, {Determinism::kWarn, "warn"}};
};

/// TrainerOptions::deterministic: true, false, "true", "false", "warn" or
/// Determinism; anything else is kept for the connector to name.
class DeterministicFlag : public Choice<Determinism> {
 public:
  /// Unset: LibTorch's flag is left as it is (Lightning's
  /// deterministic=None).
  DeterministicFlag() : Choice(Determinism::kOff), given_(false) {}
  DeterministicFlag(bool on)  // NOLINT
      : Choice(on ? Determinism::kOn : Determinism::kOff) {}
  DeterministicFlag(Determinism value) : Choice(value) {}           // NOLINT
  DeterministicFlag(const char* text) : Choice(text) {}             // NOLINT
  DeterministicFlag(std::string text) : Choice(std::move(text)) {}  // NOLINT
  /// Deterministic algorithms on (true or "warn").
  bool enabled() const { return *this == Determinism::kOn || *this == Determinism::kWarn; }
  bool warn_only() const { return *this == Determinism::kWarn; }
  /// Whether a value was given (false: the default).
  bool given() const { return given_; }

 private:
  bool given_ = true;
};

}  // namespace fulgur
