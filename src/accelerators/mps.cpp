#include "fulgur/accelerators/mps.h"

#include <ATen/Context.h>

#include "fulgur/core/errors.h"

namespace fulgur {

bool MPSAccelerator::is_available() const { return at::hasMPS(); }

std::string MPSAccelerator::unavailable_reason() const {
  return "this LibTorch has no MPS backend (it exists only in macOS builds for Apple silicon)";
}

std::vector<c10::Device> MPSAccelerator::parse_devices(const DevicesSpec& spec) const {
  if (auto problem = spec.problem(); !problem.empty()) throw ConfigError(problem);
  const bool one = spec.is_auto() ||
                   (spec.count() && (*spec.count() == 1 || *spec.count() == -1)) ||
                   (spec.is_index_list() && spec.indices() == std::vector<int>{0});
  if (!one) {
    throw ConfigError(str("accelerator=\"mps\", devices=", spec.text(),
                          ": a Mac has one MPS "
                          "device. Pass devices=1 (or \"auto\")."));
  }
  return {c10::Device(c10::kMPS, 0)};
}

}  // namespace fulgur
