#include "fulgur/accelerators/cpu.h"

#include <sys/resource.h>

#include <cstdint>
#include <fstream>
#include <initializer_list>
#include <sstream>
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

// "Name:   value kB" lines of a /proc file: the values of `names`, in bytes
// (those not there are left out).
std::map<std::string, double> proc_kilobytes(const char* path,
                                             std::initializer_list<const char*> names) {
  std::map<std::string, double> found;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string name = line.substr(0, colon);
    for (const char* wanted : names) {
      if (name != wanted) continue;
      std::istringstream value(line.substr(colon + 1));
      double kb = 0;
      if (value >> kb) found[name] = kb * 1024.0;
    }
  }
  return found;
}

// The machine's busy and total CPU time, from /proc/stat's first line (user
// nice system idle iowait irq softirq steal ...; idle and iowait are not
// busy; guest time is already in user).
bool machine_cpu_ticks(double& busy, double& total) {
  std::ifstream in("/proc/stat");
  std::string cpu;
  if (!(in >> cpu) || cpu != "cpu") return false;
  double fields[8] = {};
  for (double& f : fields) {
    if (!(in >> f)) return false;
  }
  total = 0;
  for (double f : fields) total += f;
  busy = total - fields[3] - fields[4];
  return true;
}

}  // namespace

std::map<std::string, double> HostStats::read() {
  std::map<std::string, double> stats;
  // VmHWM is never below the VmRSS of the same read (getrusage's peak can
  // lag behind it).
  const auto status = proc_kilobytes("/proc/self/status", {"VmRSS", "VmHWM"});
  if (auto it = status.find("VmRSS"); it != status.end()) stats["cpu_rss_bytes"] = it->second;
  if (auto it = status.find("VmHWM"); it != status.end()) stats["cpu_rss_peak_bytes"] = it->second;
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const auto memory =
      proc_kilobytes("/proc/meminfo", {"MemTotal", "MemAvailable", "SwapTotal", "SwapFree"});
  auto value = [&](const char* name) {
    auto it = memory.find(name);
    return it != memory.end() ? std::optional<double>(it->second) : std::nullopt;
  };
  if (auto total = value("MemTotal"), available = value("MemAvailable");
      total && available && *total > 0) {
    stats["cpu_vm_percent"] = 100.0 * (*total - *available) / *total;
  }
  if (auto total = value("SwapTotal"), free = value("SwapFree"); total && free) {
    stats["cpu_swap_percent"] = *total > 0 ? 100.0 * (*total - *free) / *total : 0.0;
  }

  Times now;
  now.wall = std::chrono::steady_clock::now();
  now.process_cpu_s = static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
                      static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) * 1e-6;
  const bool machine = machine_cpu_ticks(now.machine_busy, now.machine_total);
  std::lock_guard<std::mutex> lock(mutex_);
  if (last_) {
    const double wall = std::chrono::duration<double>(now.wall - last_->wall).count();
    if (wall > 0) {
      stats["cpu_process_percent"] = 100.0 * (now.process_cpu_s - last_->process_cpu_s) / wall;
    }
    // /proc/stat counts in ticks (10 ms): a read within the same tick as
    // the last has no share to give, and the next is measured from the
    // older read.
    const double total = now.machine_total - last_->machine_total;
    if (machine && total > 0) {
      stats["cpu_percent"] = 100.0 * (now.machine_busy - last_->machine_busy) / total;
    } else {
      now.machine_busy = last_->machine_busy;
      now.machine_total = last_->machine_total;
    }
  }
  last_ = now;
  return stats;
}

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

std::map<std::string, double> CPUAccelerator::device_stats(c10::Device) const {
  return host_stats_.read();
}

}  // namespace fulgur
