#include "fulgur/trainer/trainer_options.h"

#include <charconv>
#include <cmath>
#include <sstream>

#include "fulgur/core/errors.h"

namespace fulgur {

std::string BatchLimit::text() const {
  if (!fraction_) return std::to_string(*count_);
  // The shortest text that reads back as the same double (1.0000001 is not
  // shown as 1.0, the limit it was refused for exceeding).
  char digits[32];
  const auto written = std::to_chars(digits, digits + sizeof(digits), *fraction_);
  std::string s(digits, written.ptr);
  if (s.find('.') == std::string::npos && s.find('e') == std::string::npos) s += ".0";
  return s;
}

std::optional<int64_t> BatchLimit::apply(std::optional<int64_t> available, const char* flag) const {
  if (!fraction_) {
    return available ? std::min(*count_, *available) : *count_;
  }
  if (*fraction_ >= 1.0) return available;
  if (!available) {
    throw ConfigError(str(flag, "=", text(),
                          ": a fraction needs a loader of known length, and "
                          "this loader's length is unknown. Pass a number of batches (an int) "
                          "instead."));
  }
  auto n = static_cast<int64_t>(std::floor(static_cast<double>(*available) * *fraction_));
  if (n == 0 && *fraction_ > 0.0) {
    // 0 skips the loop for limit_*_batches; for overfit_batches it is off.
    const bool zero_skips = std::string_view(flag).rfind("limit_", 0) == 0;
    throw ConfigError(str(flag, "=", text(), " of ", *available,
                          " batches rounds down to 0 batches. Pass a larger fraction or an int "
                          "number of batches",
                          zero_skips ? ", or 0 to skip this loop." : "."));
  }
  return n;
}

std::string PrecisionFlag::canonical() const {
  // PyTorch Lightning 2.x's _PRECISION_INPUT_STR_ALIAS_CONVERSION.
  if (text_ == "32") return "32-true";
  if (text_ == "64") return "64-true";
  if (text_ == "16") return "16-mixed";
  if (text_ == "bf16") return "bf16-mixed";
  return text_;
}

LoggerFlag::LoggerFlag(const char* raw) {
  const std::string text = raw == nullptr ? std::string() : std::string(raw);
  if (text == "true" || text == "True") {
    names_ = {"csv"};
    return;
  }
  if (text == "false" || text == "False" || text == "none") return;
  for (auto& name : split_list(text)) {
    if (name.empty()) {
      problem_ = "a logger name is empty. Pass names separated by commas (csv,tensorboard), "
                 "true or false.";
      text_with_problem_ = text;
    } else {
      names_.push_back(std::move(name));
    }
  }
}

LoggerFlag::LoggerFlag(std::vector<std::string> names) : names_(std::move(names)) {
  for (const auto& n : names_) {
    if (n.empty()) problem_ = "a logger name is empty.";
  }
}

std::string LoggerFlag::text() const {
  if (text_with_problem_) return *text_with_problem_;
  if (names_.empty()) return "false";
  std::string out;
  for (const auto& n : names_) out += (out.empty() ? "" : ",") + n;
  return out;
}

}  // namespace fulgur
