#include "fulgur/plugins/environments/lsf.h"

#include <unistd.h>

#include <algorithm>
#include <optional>
#include <sstream>
#include <unordered_set>

#include "env_support.h"
#include "utilities/small_file.h"

namespace fulgur {

namespace {

constexpr const char* kLsfSetBy = "LSF's jsrun";

// LSB_MCPU_HOSTS: "host slots host slots ..." → the host names.
std::vector<std::string> mcpu_hosts(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> hosts;
  std::string host, slots;
  while (in >> host) {
    hosts.push_back(host);
    if (!(in >> slots)) break;
  }
  return hosts;
}

// As Lightning: the first host is the batch (launch) host, which runs no
// ranks when there are compute hosts after it. "" for no host.
std::string first_compute(const std::vector<std::string>& hosts) {
  if (hosts.empty()) return "";
  return hosts.size() > 1 ? hosts[1] : hosts[0];
}

// LSB_DJOB_RANKFILE: one host name per line (one line per slot), the launch
// host first. nullopt when it does not exist or cannot be opened;
// ConfigError when it is not a regular file (a FIFO would block) or larger
// than a rank file of a million slots.
constexpr uint64_t kMaxRankFileBytes = uint64_t{64} << 20;

std::optional<std::vector<std::string>> read_rankfile(const std::string& path,
                                                      std::string* unreadable = nullptr) {
  using Problem = detail::SmallFileRead::Problem;
  const detail::SmallFileRead read = detail::read_small_file(path, kMaxRankFileBytes);
  if (read.problem == Problem::kMissing || read.problem == Problem::kCannotOpen) {
    if (unreadable != nullptr) *unreadable = read.describe(kMaxRankFileBytes);
    return std::nullopt;
  }
  if (!read.ok()) {
    throw ConfigError(str("cluster environment \"lsf\": LSB_DJOB_RANKFILE=", path, " ",
                          read.describe(kMaxRankFileBytes),
                          ": it should be the job's rank file, one host name per line, which "
                          "LSF writes. Run under jsrun inside the job, or unset it and set "
                          "MASTER_ADDR to the first compute host."));
  }
  std::vector<std::string> hosts;
  std::istringstream in(read.text);
  for (std::string line; std::getline(in, line);) {
    const auto begin = line.find_first_not_of(" \t\r");
    if (begin == std::string::npos) continue;
    hosts.push_back(line.substr(begin, line.find_last_not_of(" \t\r") - begin + 1));
  }
  return hosts;
}

// read_rankfile, where the file is the only list of the job's hosts left.
std::vector<std::string> rankfile_hosts(const std::string& path) {
  std::string unreadable;
  if (auto hosts = read_rankfile(path, &unreadable)) return *hosts;
  throw ConfigError(str("cluster environment \"lsf\": LSB_DJOB_RANKFILE=", path,
                        " cannot be read (it ", unreadable,
                        "), and LSB_MCPU_HOSTS is "
                        "not set: one of them names the job's hosts. Set MASTER_ADDR to the "
                        "first compute host instead."));
}

// The distinct compute hosts of a rank file's lines, in order of first
// appearance: the launch host (first line) is left out when there are others.
std::vector<std::string> compute_hosts(const std::vector<std::string>& lines) {
  std::vector<std::string> hosts;
  std::unordered_set<std::string> seen;  // a rank file may list a million hosts
  for (size_t i = lines.size() > 1 ? 1 : 0; i < lines.size(); ++i) {
    if (seen.insert(lines[i]).second) hosts.push_back(lines[i]);
  }
  return hosts;
}

}  // namespace

bool LSFEnvironment::detect(const EnvView& env) {
  return env.has("LSB_JOBID") && (env.has("LSB_DJOB_RANKFILE") || env.has("LSB_HOSTS")) &&
         env.has("JSM_NAMESPACE_SIZE") && env.has("JSM_NAMESPACE_RANK") &&
         env.has("JSM_NAMESPACE_LOCAL_RANK");
}

std::string LSFEnvironment::first_compute_host(const std::string& mcpu_hosts_text) {
  return first_compute(mcpu_hosts(mcpu_hosts_text));
}

LSFEnvironment::LSFEnvironment(const EnvView& env) {
  using namespace env_support;
  world_size_ = require_count(env, "JSM_NAMESPACE_SIZE", name(), kLsfSetBy);
  global_rank_ = require_int(env, "JSM_NAMESPACE_RANK", name(), kLsfSetBy);
  local_rank_ = require_int(env, "JSM_NAMESPACE_LOCAL_RANK", name(), kLsfSetBy);
  rank_sources_ = {"JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK", ""};
  auto hosts_text = env.get("LSB_MCPU_HOSTS");
  if (auto local_size = get_count(env, "JSM_NAMESPACE_LOCAL_SIZE", kLsfSetBy)) {
    local_size_ = *local_size;
  } else if (hosts_text) {
    auto hosts = mcpu_hosts(*hosts_text);
    size_t compute = hosts.size() > 1 ? hosts.size() - 1 : hosts.size();
    if (compute > 0 && world_size_ % static_cast<int>(compute) == 0) {
      local_size_ = world_size_ / static_cast<int>(compute);
    }
  }
  node_rank_ = local_size_ > 0 ? global_rank_ / local_size_ : 0;
  std::optional<std::vector<std::string>> rankfile_lines;
  if (auto rankfile = env.get("LSB_DJOB_RANKFILE")) rankfile_lines = read_rankfile(*rankfile);
  if (rankfile_lines) {
    // Which host this is, from the job's own list of hosts: right however
    // jsrun numbered the ranks across them.
    const std::string rankfile = *env.get("LSB_DJOB_RANKFILE");
    const std::vector<std::string>& lines = *rankfile_lines;
    char name[256] = {};
    ::gethostname(name, sizeof name - 1);
    const int place = node_rank_among(lines, name);
    if (place < 0) {
      const std::vector<std::string> distinct = compute_hosts(lines);
      throw ConfigError(
          str("cluster environment \"lsf\": this host, \"", name,
              "\", is not among the compute hosts of LSB_DJOB_RANKFILE=", rankfile, " (",
              distinct.empty() ? std::string("none") : shortened(join_some(distinct), 400),
              "), so its node rank is unknown. Run the ranks with jsrun inside "
              "the job that wrote that file."));
    }
    node_rank_ = place;
    rank_sources_.node_rank = "LSB_DJOB_RANKFILE";
  }
  if (auto addr = env.get("MASTER_ADDR")) {
    main_address_ = *addr;
  } else {
    // The job's hosts: LSB_MCPU_HOSTS, else the rank file.
    if (hosts_text) main_address_ = first_compute_host(*hosts_text);
    if (main_address_.empty()) {
      if (auto rankfile = env.get("LSB_DJOB_RANKFILE")) {
        main_address_ = first_compute(rankfile_hosts(*rankfile));
      }
    }
    if (main_address_.empty()) {
      missing("LSB_MCPU_HOSTS or LSB_DJOB_RANKFILE (or MASTER_ADDR)", name(), "LSF's bsub");
    }
  }
  if (auto port = master_port(env)) {
    main_port_ = *port;
  } else {
    // Lightning: LSB_JOBID % 1000 + 10000, the same in every process of the job.
    main_port_ = 10000 + require_int(env, "LSB_JOBID", name(), "LSF's bsub") % 1000;
  }
}

int LSFEnvironment::node_rank_among(const std::vector<std::string>& rankfile_lines,
                                    const std::string& host) {
  auto short_name = [](const std::string& h) { return h.substr(0, h.find('.')); };
  const std::vector<std::string> hosts = compute_hosts(rankfile_lines);
  for (size_t i = 0; i < hosts.size(); ++i) {
    if (hosts[i] == host || short_name(hosts[i]) == short_name(host)) return static_cast<int>(i);
  }
  return -1;
}

std::string LSFEnvironment::main_address() const { return main_address_; }
int LSFEnvironment::main_port() const { return main_port_; }

void LSFEnvironment::validate_settings(int num_devices, int num_nodes) const {
  std::vector<std::string> problems;
  if (int64_t{num_devices} * num_nodes != world_size_) {
    problems.push_back(str("devices=", num_devices, " x num_nodes=", num_nodes, " = ",
                           int64_t{num_devices} * num_nodes, " processes, but jsrun started ",
                           "JSM_NAMESPACE_SIZE=", world_size_, " ranks"));
  }
  if (local_size_ > 0 && num_devices != local_size_) {
    problems.push_back(str("devices=", num_devices, " per node, but jsrun started ", local_size_,
                           " ranks per node"));
  }
  if (problems.empty()) return;
  throw ConfigError(str(join(problems, "; and "),
                        ". Pass devices=<ranks per node> and num_nodes=<nodes>, or run jsrun "
                        "with --nrs ",
                        int64_t{num_devices} * num_nodes, " and ", num_devices,
                        " resource sets per host (--rs_per_host ", num_devices, ")."));
}

}  // namespace fulgur
