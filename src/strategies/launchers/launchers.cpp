// The two launchers that create processes: re-executing the program
// (subprocess_script) and forking at fit() (fork). Both make the calling
// process the supervising parent of every local rank (supervisor.h).
#include <dlfcn.h>
#include <unistd.h>

#include <torch/torch.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <thread>

#include "fulgur/core/errors.h"
#include "fulgur/plugins/environments/cluster_environment.h"
#include "fulgur/strategies/launchers/fork.h"
#include "fulgur/strategies/launchers/subprocess_script.h"
#include "fulgur/strategies/parallel.h"
#include "fulgur/strategies/process_group.h"
#include "strategies/launchers/supervisor.h"

namespace fulgur {

namespace {

// Rank 0's results, from its process to the calling one: written whole to a
// file of the launcher's private directory, read back after every rank
// exited 0.
void write_results(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) {
    throw DistributedError(str("rank 0: cannot write its results for the calling process to \"",
                               path, "\" (", bytes.size(), " bytes): ", std::strerror(errno),
                               ". Free space in TMPDIR, or set TMPDIR to another directory."));
  }
}

std::string read_results(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw DistributedError(str("launcher: every rank exited 0 but rank 0's results \"", path,
                               "\" are missing: ", std::strerror(errno), "."));
  }
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Where and how many: one node's share of the run.
struct Plan {
  int local_world_size = 1;
  int num_nodes = 1;
  int node_rank = 0;
  int world_size = 1;
  std::string main_address;
  int main_port = 0;
};

Plan plan_for(ParallelStrategy& strategy) {
  Plan p;
  p.local_world_size = static_cast<int>(std::max<size_t>(strategy.parallel_devices().size(), 1));
  p.num_nodes = strategy.num_nodes();
  p.node_rank = strategy.node_rank();
  p.world_size = p.local_world_size * p.num_nodes;
  p.main_address = strategy.cluster_environment().main_address();
  p.main_port = strategy.main_port();
  // The connector checked the rest (one place): several nodes have
  // MASTER_ADDR, MASTER_PORT and NODE_RANK, and NODE_RANK is in range.
  if (p.main_port == 0) p.main_port = find_free_port(p.main_address);
  return p;
}

// The torchrun-style variables of one rank.
std::vector<std::pair<std::string, std::string>> rank_env(const Plan& p, int local_rank) {
  return {{"MASTER_ADDR", p.main_address},
          {"MASTER_PORT", std::to_string(p.main_port)},
          {"WORLD_SIZE", std::to_string(p.world_size)},
          {"RANK", std::to_string(p.node_rank * p.local_world_size + local_rank)},
          {"LOCAL_RANK", std::to_string(local_rank)},
          {"LOCAL_WORLD_SIZE", std::to_string(p.local_world_size)},
          {"NODE_RANK", std::to_string(p.node_rank)}};
}

std::vector<std::string> own_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> args;
  std::string arg;
  while (std::getline(in, arg, '\0')) args.push_back(arg);
  if (args.empty()) {
    throw DistributedError(
        "subprocess_script launcher: cannot read /proc/self/cmdline to "
        "re-execute the program. Use strategy=\"ddp_fork\", or start the ranks "
        "with torchrun.");
  }
  return args;
}

detail::Supervisor::Options supervisor_options(const Supervision& s) {
  detail::Supervisor::Options o;
  o.grace = s.stop_grace;
  o.hang_timeout = s.hang_timeout;
  return o;
}

}  // namespace

SubprocessScriptLauncher::SubprocessScriptLauncher(ParallelStrategy& strategy,
                                                   Supervision supervision)
    : strategy_(strategy), supervision_(supervision) {}

std::optional<std::string> SubprocessScriptLauncher::launch(const std::function<std::string()>&) {
  Plan plan = plan_for(strategy_);
  const std::vector<std::string> args = own_command_line();
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // Ranks share the cores unless the user said otherwise.
  std::string threads;
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    threads = std::to_string(std::max(1u, cores / static_cast<unsigned>(plan.local_world_size)));
  }
  detail::Supervisor supervisor(supervisor_options(supervision_));
  for (int local = 0; local < plan.local_world_size; ++local) {
    auto vars = rank_env(plan, local);
    if (!threads.empty()) vars.emplace_back("OMP_NUM_THREADS", threads);
    supervisor.spawn(local, plan.node_rank * plan.local_world_size + local, [&] {
      for (const auto& [k, v] : vars) ::setenv(k.c_str(), v.c_str(), 1);
      ::execv("/proc/self/exe", argv.data());
      std::fprintf(stderr, "fulgur: cannot re-execute %s: %s\n", args[0].c_str(),
                   std::strerror(errno));
      ::_exit(127);
    });
  }
  supervisor.wait_all();
  // Every rank ran the whole program and succeeded; this process only
  // launched them, so it must not run the rest of the program again.
  std::cout.flush();
  std::cerr.flush();
  std::exit(0);
}

ForkLauncher::ForkLauncher(ParallelStrategy& strategy, Supervision supervision)
    : strategy_(strategy), supervision_(supervision) {}

std::optional<std::string> ForkLauncher::launch(const std::function<std::string()>& fn) {
  Plan plan = plan_for(strategy_);
  strategy_.set_main_port(plan.main_port);
  // Rank 0's results travel through a file in a directory of our own
  // (mkdtemp: mode 0700, a fresh name), not a predictable name in /tmp that
  // another user could have planted a link at.
  const char* tmpdir = std::getenv("TMPDIR");
  const std::string parent = tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp";
  std::string dir_template = parent + "/fulgur-fork-XXXXXX";
  if (::mkdtemp(dir_template.data()) == nullptr) {
    throw DistributedError(str("launcher: cannot create a directory for rank 0's results in ",
                               parent, " (TMPDIR): ", std::strerror(errno),
                               ". Set TMPDIR to a writable directory."));
  }
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{dir_template};
  const std::string results_path = dir_template + "/rank0-results.bin";
  detail::Supervisor supervisor(supervisor_options(supervision_));
  for (int local = 0; local < plan.local_world_size; ++local) {
    const int global = plan.node_rank * plan.local_world_size + local;
    supervisor.spawn(local, global, [&, local, global] {
      // libgomp's thread pool does not survive fork: one intra-op thread;
      // and OpenBLAS's own pool to match, as OMP_NUM_THREADS=1 would.
      at::set_num_threads(1);
      using SetThreads = void (*)(int);
      if (auto* set_blas_threads =
              reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
        set_blas_threads(1);
      }
      for (const auto& [k, v] : rank_env(plan, local)) ::setenv(k.c_str(), v.c_str(), 1);
      strategy_.assign_rank(local, global, plan.world_size);
      int code = 0;
      try {
        std::string bytes = fn();
        if (global == 0) write_results(results_path, bytes);
      } catch (const std::exception& e) {
        std::cerr << "fulgur: rank " << global << " failed: " << e.what() << std::endl;
        code = 1;
      } catch (...) {
        std::cerr << "fulgur: rank " << global << " failed with an unknown exception" << std::endl;
        code = 1;
      }
      std::cout.flush();
      std::cerr.flush();
      std::fflush(nullptr);
      ::_exit(code);
    });
  }
  supervisor.wait_all();
  if (plan.node_rank != 0) return std::nullopt;
  return read_results(results_path);
}

}  // namespace fulgur
