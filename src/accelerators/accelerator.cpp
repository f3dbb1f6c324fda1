#include "fulgur/accelerators/accelerator.h"

#include <cctype>

#include "fulgur/accelerators/cpu.h"
#include "fulgur/accelerators/cuda.h"

namespace fulgur {

namespace {
std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

[[noreturn]] void bad_devices(const std::string& text) {
  throw ConfigError(str("devices=\"", text, "\": not a device spec. Pass \"auto\", a count "
                        "(\"2\"), -1 for all devices, or a list of indices (\"0,2\" or "
                        "\"0,\")."));
}

int parse_int(const std::string& text, const std::string& whole) {
  try {
    size_t used = 0;
    int v = std::stoi(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  bad_devices(whole);
}
}  // namespace

DevicesSpec::DevicesSpec(const char* raw) {
  std::string text = trim(raw == nullptr ? std::string() : std::string(raw));
  text_ = text;
  if (text == "auto") return;
  is_auto_ = false;
  if (text.empty()) bad_devices(text);
  if (text.find(',') == std::string::npos) {
    count_ = parse_int(text, text);
    return;
  }
  index_list_ = true;
  size_t start = 0;
  while (start < text.size()) {
    size_t comma = text.find(',', start);
    std::string part = trim(text.substr(start, comma == std::string::npos ? std::string::npos
                                                                        : comma - start));
    if (!part.empty()) {
      indices_.push_back(parse_int(part, text));
    } else if (comma != std::string::npos && comma + 1 < text.size()) {
      bad_devices(text);  // an empty entry in the middle: "0,,2"
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (indices_.empty()) bad_devices(text);
}

DevicesSpec::DevicesSpec(std::vector<int> indices)
    : is_auto_(false), index_list_(true), indices_(std::move(indices)) {
  std::vector<std::string> parts;
  for (int i : indices_) parts.push_back(std::to_string(i));
  text_ = "[" + join(parts) + "]";
  if (indices_.empty()) {
    throw ConfigError("devices=[]: an empty device list selects nothing. Pass at least one "
                      "index, a count, or \"auto\".");
  }
}

AcceleratorRegistry& accelerator_registry() {
  static AcceleratorRegistry registry = [] {
    AcceleratorRegistry r("accelerator");
    r.add("cpu", "The CPU; devices is a number of processes",
          [] { return std::make_unique<CPUAccelerator>(); });
    r.add("cuda", "NVIDIA GPUs through LibTorch's CUDA build",
          [] { return std::make_unique<CUDAAccelerator>(); });
    return r;
  }();
  return registry;
}

}  // namespace fulgur
