#include "fulgur/plugins/environments/slurm.h"

#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>

#include "core/run_program.h"
#include "env_support.h"

namespace fulgur {

namespace {

constexpr const char* kSlurmSetBy = "srun";

// "2", "2(x3)" or "2,1" (SLURM's per-node task counts): the leading count.
std::optional<int> leading_count(const EnvView& env, const std::string& var) {
  auto text = env.get(var);
  if (!text) return std::nullopt;
  size_t n = 0;
  while (n < text->size() && std::isdigit(static_cast<unsigned char>((*text)[n]))) ++n;
  if (n == 0 || n > 9 || std::stoi(text->substr(0, n)) < 1) {
    throw ConfigError(str("environment variable ", var, "=\"", *text,
                          "\" is not a task count >= 1 (like \"2\" or \"2(x3)\"). Unset it or "
                          "fix the srun / sbatch flags that set it."));
  }
  return std::stoi(text->substr(0, n));
}

}  // namespace

bool SLURMEnvironment::is_interactive(const EnvView& env) {
  auto job_name = env.get("SLURM_JOB_NAME");
  return job_name && (*job_name == "bash" || *job_name == "interactive");
}

bool SLURMEnvironment::detect(const EnvView& env) {
  // As Lightning's SLURMEnvironment.detect: srun set SLURM_NTASKS, and this is
  // not an interactive allocation (salloc / srun --pty bash), where the user
  // runs the program by hand and fulgur creates the processes.
  return env.has("SLURM_NTASKS") && !is_interactive(env);
}

std::string SLURMEnvironment::first_host(const std::string& nodelist) {
  // Same rule as Lightning's resolve_root_node_address: the first host of the
  // first entry; each [..] range contributes its first value as written
  // ("node[001-004,7]" → "node001").
  auto bad = [&](const char* why) {
    return ConfigError(str("SLURM_NODELIST=\"", nodelist, "\": ", why,
                           ". Set MASTER_ADDR to the address of the first node instead."));
  };
  std::string host;
  size_t i = 0;
  while (i < nodelist.size() && nodelist[i] != ',' && nodelist[i] != ' ') {
    char c = nodelist[i];
    if (c == '[') {
      size_t close = nodelist.find(']', i);
      if (close == std::string::npos) throw bad("a '[' has no matching ']'");
      std::string range = nodelist.substr(i + 1, close - i - 1);
      size_t end = range.find_first_of(",-");
      std::string first = range.substr(0, end);
      if (first.empty()) throw bad("an empty range");
      host += first;
      i = close + 1;
    } else if (c == ']') {
      throw bad("a ']' has no matching '['");
    } else {
      host += c;
      ++i;
    }
  }
  if (host.empty()) throw bad("no host");
  return host;
}

SLURMEnvironment::SLURMEnvironment(const EnvView& env, SLURMOptions options)
    : options_(std::move(options)) {
  using namespace env_support;
  if (options_.requeue_signal < 1 || options_.requeue_signal >= NSIG ||
      options_.requeue_signal == SIGKILL || options_.requeue_signal == SIGSTOP) {
    throw ConfigError(str("SLURMOptions::requeue_signal=", options_.requeue_signal,
                          " cannot be caught: pass a signal such as SIGUSR1 (", SIGUSR1,
                          "), the one given to sbatch --signal."));
  }
  job_id_ = env.get("SLURM_JOB_ID").value_or("");
  world_size_ = require_count(env, "SLURM_NTASKS", name(), kSlurmSetBy);
  global_rank_ = require_int(env, "SLURM_PROCID", name(), kSlurmSetBy);
  local_rank_ = require_int(env, "SLURM_LOCALID", name(), kSlurmSetBy);
  node_rank_ = require_int(env, "SLURM_NODEID", name(), kSlurmSetBy);
  rank_sources_ = {"SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"};
  restart_count_ = env_support::restart_count(env, "SLURM_RESTART_COUNT");
  if (auto addr = env.get("MASTER_ADDR")) {
    main_address_ = *addr;
  } else if (auto list = env.get("SLURM_NODELIST")) {
    main_address_ = first_host(*list);
  } else if (auto job_list = env.get("SLURM_JOB_NODELIST")) {
    main_address_ = first_host(*job_list);
  } else {
    missing("SLURM_NODELIST (or MASTER_ADDR)", name(), kSlurmSetBy);
  }
  if (auto port = master_port(env)) {
    main_port_ = *port;
  } else if (auto job_id = env.get("SLURM_JOB_ID")) {
    // Lightning: the last 4 digits of the job id + 15000, so every process of
    // the job computes the same port.
    main_port_ = 15000 + trailing_digits(*job_id, 4);
  } else {
    main_port_ = 12910;
  }
  if ((ntasks_per_node_ = leading_count(env, "SLURM_NTASKS_PER_NODE"))) {
    ntasks_per_node_source_ = "SLURM_NTASKS_PER_NODE";
  }
  if ((nnodes_ = get_count(env, "SLURM_NNODES", kSlurmSetBy))) {
    nnodes_source_ = "SLURM_NNODES";
  } else if ((nnodes_ = get_count(env, "SLURM_JOB_NUM_NODES", kSlurmSetBy))) {
    nnodes_source_ = "SLURM_JOB_NUM_NODES";
  }
}

std::vector<int> SLURMEnvironment::preemption_signals() const {
  if (options_.requeue_signal == SIGTERM) return {SIGTERM};
  return {options_.requeue_signal, SIGTERM};
}

std::string SLURMEnvironment::requeue(int signal) {
  if (signal != options_.requeue_signal) return {};
  if (!options_.auto_requeue) return "not requeued (SLURMOptions::auto_requeue is false)";
  if (job_id_.empty()) return "not requeued: SLURM_JOB_ID is not set";
  const std::string command = str(options_.scontrol, " requeue ", job_id_);
  // Bounded: a controller that does not answer must not keep the job alive.
  // The requeue makes SLURM cancel this step, whose SIGTERM reaches every
  // process of it, scontrol too, maybe before scontrol has exited: blocked
  // there, it cannot turn a requeue that happened into a failed command.
  const auto ran = detail::run_program({options_.scontrol, "requeue", job_id_}, "",
                                       std::chrono::seconds(60), {SIGTERM, signal});
  if (ran.spawn_error != 0) {
    return str("NOT requeued: cannot run `", command, "`: ", std::strerror(ran.spawn_error),
               " (is slurm-client installed and scontrol on PATH?). Resubmit the job: it "
               "resumes from the checkpoint");
  }
  if (ran.timed_out) {
    return str("NOT requeued: `", command,
               "` did not finish in 60 s. Resubmit the job: it resumes from the checkpoint");
  }
  if (ran.succeeded()) return str("requeued SLURM job ", job_id_, " (`", command, "`)");
  return str("NOT requeued: `", command, "` ", ran.how_it_ended(),
             ran.output.empty() ? std::string() : ": " + ran.output,
             " (was the job submitted with --requeue?). Resubmit the job: it resumes from the "
             "checkpoint");
}

std::string SLURMEnvironment::main_address() const { return main_address_; }
int SLURMEnvironment::main_port() const { return main_port_; }

void SLURMEnvironment::validate_settings(int num_devices, int num_nodes) const {
  std::vector<std::string> problems;
  if (ntasks_per_node_ && *ntasks_per_node_ != num_devices) {
    problems.push_back(str("devices=", num_devices, " but SLURM runs ", *ntasks_per_node_,
                           " tasks per node (", ntasks_per_node_source_, "=", *ntasks_per_node_,
                           "): pass devices=", *ntasks_per_node_,
                           " or run srun --ntasks-per-node=", num_devices));
  }
  if (nnodes_ && *nnodes_ != num_nodes) {
    problems.push_back(str("num_nodes=", num_nodes, " but SLURM allocated ", *nnodes_, " nodes (",
                           nnodes_source_, "=", *nnodes_, "): pass num_nodes=", *nnodes_,
                           " or run sbatch / srun --nodes=", num_nodes));
  }
  // Per node and nodes may agree while the total does not (SLURM_NNODES
  // unset, or fewer tasks on the last node): the total decides the world.
  if (problems.empty() && int64_t{num_devices} * num_nodes != world_size_) {
    problems.push_back(str("devices=", num_devices, " x num_nodes=", num_nodes, " = ",
                           int64_t{num_devices} * num_nodes, " processes, but SLURM started ",
                           world_size_, " tasks (SLURM_NTASKS=", world_size_,
                           "): run srun --ntasks-per-node=", num_devices, " --nodes=", num_nodes,
                           ", or pass matching devices and num_nodes"));
  }
  if (problems.empty()) return;
  throw ConfigError(join(problems, "; and ") + ".");
}

}  // namespace fulgur
