#include "fulgur/accelerators/cpu.h"

#include <cstdint>
#include <fstream>
#include <thread>

#include "fulgur/core/errors.h"

namespace fulgur {

namespace {

// The most processes this machine runs at once: its kernel's pid_max (4M,
// the 64-bit limit, where it cannot be read).
int64_t processes_this_machine_runs() {
  std::ifstream in("/proc/sys/kernel/pid_max");
  int64_t most = 0;
  return in >> most && most > 0 ? most : int64_t{4194304};
}

}  // namespace

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
    if (const int64_t most = processes_this_machine_runs(); count > most) {
      throw ConfigError(str("accelerator=\"cpu\", devices=", spec.text(),
                            ": each device is a process on this machine, which runs at most ", most,
                            " processes (kernel.pid_max). Pass fewer devices, and num_nodes for "
                            "more machines."));
    }
  }
  return std::vector<c10::Device>(static_cast<size_t>(count), c10::Device(c10::kCPU));
}

std::map<std::string, double> CPUAccelerator::device_stats(c10::Device) const { return {}; }

}  // namespace fulgur
