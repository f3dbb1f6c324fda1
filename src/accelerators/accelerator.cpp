#include "fulgur/accelerators/accelerator.h"

#include <algorithm>
#include <cctype>
#include <cstddef>

#include "fulgur/accelerators/cpu.h"
#include "fulgur/accelerators/cuda.h"
#include "fulgur/accelerators/mps.h"

namespace fulgur {

namespace {
std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

// Whether `text` is a whole number, however large.
bool is_integer(const std::string& text) {
  const size_t digits = !text.empty() && (text[0] == '-' || text[0] == '+') ? 1 : 0;
  return text.size() > digits &&
         std::all_of(text.begin() + static_cast<std::ptrdiff_t>(digits), text.end(),
                     [](unsigned char c) { return std::isdigit(c) != 0; });
}

std::string bad_devices(const std::string& text, const std::string& number = {}) {
  if (!number.empty() && is_integer(number)) {
    return str("devices=\"", text, "\": ", number,
               " is too large a number for a device count or index. Pass \"auto\", the count "
               "of devices to use (\"2\"), -1 for all devices, or their indices (\"0,2\").");
  }
  return str("devices=\"", text,
             "\": not a device spec. Pass \"auto\", a count (\"2\"), -1 "
             "for all devices, or a list of indices (\"0,2\" or \"0,\").");
}

std::optional<int> parse_device_number(const std::string& text) {
  try {
    size_t used = 0;
    int v = std::stoi(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}
}  // namespace

DevicesSpec::DevicesSpec(const char* raw) {
  std::string text = trim(raw == nullptr ? std::string() : std::string(raw));
  text_ = text;
  if (text == "auto") return;
  is_auto_ = false;
  if (text.empty()) {
    error_ = bad_devices(text);
    return;
  }
  if (text.find(',') == std::string::npos) {
    count_ = parse_device_number(text);
    if (!count_) error_ = bad_devices(text, text);
    return;
  }
  index_list_ = true;
  size_t start = 0;
  while (start < text.size()) {
    size_t comma = text.find(',', start);
    std::string part =
        trim(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (!part.empty()) {
      auto index = parse_device_number(part);
      if (!index) {
        error_ = bad_devices(text, part);
        return;
      }
      indices_.push_back(*index);
    } else if (comma != std::string::npos && comma + 1 < text.size()) {
      error_ = bad_devices(text);  // an empty entry in the middle: "0,,2"
      return;
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (indices_.empty()) error_ = bad_devices(text);
}

DevicesSpec::DevicesSpec(std::vector<int> indices)
    : is_auto_(false), index_list_(true), indices_(std::move(indices)) {
  std::vector<std::string> parts;
  for (int i : indices_) parts.push_back(std::to_string(i));
  text_ = "[" + join(parts) + "]";
  if (indices_.empty()) {
    error_ =
        "devices=[]: an empty device list selects nothing. Pass at least one index, a "
        "count, or \"auto\".";
  }
}

std::string DevicesSpec::problem() const {
  if (!error_.empty()) return error_;
  if (count_ && *count_ == 0) {
    return "devices=0: selects no device. Pass a count >= 1, -1 for all devices, or \"auto\".";
  }
  if (count_ && *count_ < -1) {
    return str("devices=", *count_, ": a count must be >= 1, or -1 for all devices.");
  }
  for (int i : indices_) {
    if (i < 0) {
      return str("devices=", text_, ": device index ", i, " is negative. Indices start at 0.");
    }
  }
  return {};
}

AcceleratorRegistry& accelerator_registry() {
  static AcceleratorRegistry registry = [] {
    AcceleratorRegistry r("accelerator");
    r.add("cpu", "The CPU; devices is a number of processes",
          [] { return std::make_unique<CPUAccelerator>(); });
    r.add("cuda", "NVIDIA GPUs through LibTorch's CUDA build",
          [] { return std::make_unique<CUDAAccelerator>(); });
    r.add("mps", "Apple's Metal GPUs (macOS LibTorch builds); one device",
          [] { return std::make_unique<MPSAccelerator>(); });
    return r;
  }();
  return registry;
}

}  // namespace fulgur
