// File: fulgur/core/choice.h
//
// A closed set of named values: an enum inside the code, its spellings where
// users write it (option structs, flags, listings). Each set lists its
// spellings once, in a ChoiceNames specialisation; parsing, printing and the
// "pass X or Y" of an error message all come from that list.
//
//   enum class CheckpointMode { kMin, kMax };
//   template <>
//   struct ChoiceNames<CheckpointMode> {
//     static constexpr std::pair<CheckpointMode, const char*> kNames[] = {
//         {CheckpointMode::kMin, "min"}, {CheckpointMode::kMax, "max"}};
//   };
//
//   Choice<CheckpointMode> mode = "max";          // as users spell it
//   Choice<CheckpointMode> same = CheckpointMode::kMax;
//   if (!mode.is_valid()) error("mode=\"" + mode.text() + "\": pass " + mode.spellings());
//   if (mode == CheckpointMode::kMax) ...
//
// An unknown spelling is kept (text() returns it) so that the component
// that validates can name it in its error; value() on it is a logic error.
#pragma once

#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

namespace fulgur {

/// Specialise with `static constexpr std::pair<E, const char*> kNames[]`.
template <typename E>
struct ChoiceNames;

template <typename E>
class Choice {
 public:
  Choice(E value) : text_(name_of(value)), value_(value) {}                   // NOLINT
  Choice(const char* text) : Choice(std::string(text)) {}                     // NOLINT
  Choice(std::string text) : text_(std::move(text)), value_(parse(text_)) {}  // NOLINT

  /// The spelling: the enum's name, or what was passed when it is none.
  const std::string& text() const { return text_; }
  bool is_valid() const { return value_.has_value(); }
  /// The value; std::logic_error when the spelling was unknown.
  E value() const {
    if (!value_) throw std::logic_error("Choice::value() of an unknown spelling: " + text_);
    return *value_;
  }
  bool operator==(E other) const { return value_ == other; }

  /// The spelling of `value`.
  static const char* name_of(E value) {
    for (const auto& [v, name] : ChoiceNames<E>::kNames) {
      if (v == value) return name;
    }
    return "?";
  }
  /// Every spelling, quoted, as a message offers them: "a", "b" or "c".
  static std::string spellings() {
    std::string out;
    const size_t n = std::size(ChoiceNames<E>::kNames);
    for (size_t i = 0; i < n; ++i) {
      if (i > 0) out += i + 1 == n ? " or " : ", ";
      out += std::string("\"") + ChoiceNames<E>::kNames[i].second + "\"";
    }
    return out;
  }

 private:
  static std::optional<E> parse(const std::string& text) {
    for (const auto& [v, name] : ChoiceNames<E>::kNames) {
      if (text == name) return v;
    }
    return std::nullopt;
  }
  std::string text_;
  std::optional<E> value_;
};

}  // namespace fulgur
