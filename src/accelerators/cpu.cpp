#include "fulgur/accelerators/cpu.h"

#include <thread>

#include "fulgur/core/errors.h"

namespace fulgur {

std::vector<c10::Device> CPUAccelerator::parse_devices(const DevicesSpec& spec) const {
  if (auto problem = spec.problem(); !problem.empty()) throw ConfigError(problem);
  int count = 1;
  if (spec.is_index_list()) {
    throw ConfigError(str("accelerator=\"cpu\", devices=", spec.text(),
                          ": the CPU takes a number of processes, not device indices. "
                          "Pass devices=",
                          spec.indices().size(), " for ", spec.indices().size(), " process(es)."));
  }
  if (spec.count()) {
    count = *spec.count();
    if (count == -1) count = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (count < 1) {
      throw ConfigError(str("accelerator=\"cpu\", devices=", spec.text(),
                            ": the number of processes must be >= 1 (or -1 for one per core)."));
    }
  }
  return std::vector<c10::Device>(static_cast<size_t>(count), c10::Device(c10::kCPU));
}

std::map<std::string, double> CPUAccelerator::device_stats(c10::Device) const { return {}; }

}  // namespace fulgur
