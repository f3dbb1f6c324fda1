// The two launchers that create processes: re-executing the program
// (subprocess_script) and forking at fit() (fork). Both make the calling
// process the supervising parent of every local rank (supervisor.h).
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/torch.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <thread>

#include "fulgur/core/errors.h"
#include "fulgur/distributed/launchers/fork.h"
#include "fulgur/distributed/launchers/subprocess_script.h"
#include "fulgur/distributed/process_group.h"
#include "distributed/launchers/node_watch.h"
#include "distributed/launchers/supervisor.h"

namespace fulgur {

namespace {

// Rank 0's results, from its process to the calling one: a temporary file
// that has no name (O_TMPFILE, or unlinked at once), opened before the ranks
// are forked, so nothing is left behind whatever kills the launcher. Rank 0
// writes its length and its bytes with pwrite; the caller reads them back
// after every rank exited 0.
class ResultsFile {
 public:
  ResultsFile() {
    const char* tmpdir = std::getenv("TMPDIR");
    dir_ = tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp";
    fd_ = ::open(dir_.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd_ < 0) {
      // A file system without O_TMPFILE: a fresh name, unlinked at once.
      std::string name = dir_ + "/fulgur-fork-results-XXXXXX";
      fd_ = ::mkostemp(name.data(), O_CLOEXEC);
      if (fd_ >= 0) ::unlink(name.c_str());
    }
    if (fd_ < 0) {
      throw DistributedError(
          str("launcher: cannot create a temporary file for rank 0's results "
              "in ",
              dir_, " (TMPDIR): ", std::strerror(errno), ". Set TMPDIR to a writable directory."));
    }
  }
  ~ResultsFile() { ::close(fd_); }
  ResultsFile(const ResultsFile&) = delete;
  ResultsFile& operator=(const ResultsFile&) = delete;

  /// Before each attempt: nothing written yet.
  void clear() {
    if (::ftruncate(fd_, 0) != 0) {
      throw DistributedError(str("launcher: cannot empty rank 0's results file in ", dir_, ": ",
                                 std::strerror(errno), "."));
    }
  }

  /// In rank 0's process.
  void write(const std::string& bytes) const {
    const uint64_t length = bytes.size();
    if (!write_at(reinterpret_cast<const char*>(&length), sizeof length, 0) ||
        !write_at(bytes.data(), bytes.size(), sizeof length)) {
      throw DistributedError(
          str("rank 0: cannot write its results for the calling process to a "
              "temporary file in ",
              dir_, " (", bytes.size(), " bytes): ", std::strerror(errno),
              ". Free space in TMPDIR, or set TMPDIR to another directory."));
    }
  }

  std::string read() const {
    uint64_t length = 0;
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || static_cast<uint64_t>(st.st_size) < sizeof length ||
        !read_at(reinterpret_cast<char*>(&length), sizeof length, 0) ||
        static_cast<uint64_t>(st.st_size) != sizeof length + length) {
      throw DistributedError(
          str("launcher: every rank exited 0 but rank 0's results (a temporary "
              "file in ",
              dir_, ") are missing or incomplete."));
    }
    std::string bytes(length, '\0');
    if (!read_at(bytes.data(), length, sizeof length)) {
      throw DistributedError(
          str("launcher: cannot read rank 0's results back: ", std::strerror(errno), "."));
    }
    return bytes;
  }

 private:
  bool write_at(const char* data, size_t n, off_t offset) const {
    while (n > 0) {
      ssize_t w = ::pwrite(fd_, data, n, offset);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return false;
      data += w;
      n -= static_cast<size_t>(w);
      offset += w;
    }
    return true;
  }
  bool read_at(char* data, size_t n, off_t offset) const {
    while (n > 0) {
      ssize_t r = ::pread(fd_, data, n, offset);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      data += r;
      n -= static_cast<size_t>(r);
      offset += r;
    }
    return true;
  }

  std::string dir_;
  int fd_ = -1;
};

// Where and how many: one node's share of the run.
struct Plan {
  int local_world_size = 1;
  int num_nodes = 1;
  int node_rank = 0;
  int world_size = 1;
  std::string main_address;
  int main_port = 0;
  /// MASTER_PORT was not given: each attempt gets a free port of its own.
  bool port_chosen = false;
};

Plan plan_for(const RankLayout& layout) {
  Plan p;
  p.local_world_size = layout.local_world_size;
  p.num_nodes = layout.num_nodes;
  p.node_rank = layout.node_rank;
  p.world_size = p.local_world_size * p.num_nodes;
  p.main_address = layout.main_address;
  p.main_port = layout.main_port;
  // The connector checked the rest (one place): several nodes have
  // MASTER_ADDR, MASTER_PORT and NODE_RANK, and NODE_RANK is in range.
  if (p.main_port == 0) {
    p.main_port = find_free_port(p.main_address);
    p.port_chosen = true;
  }
  return p;
}

// The torchrun-style variables of one rank, and how many times the ranks
// were started before this attempt (FULGUR_RESTART_COUNT).
std::vector<std::pair<std::string, std::string>> rank_env(const Plan& p, int local_rank,
                                                          int attempt) {
  return {{"MASTER_ADDR", p.main_address},
          {"MASTER_PORT", std::to_string(p.main_port)},
          {"WORLD_SIZE", std::to_string(p.world_size)},
          {"RANK", std::to_string(p.node_rank * p.local_world_size + local_rank)},
          {"LOCAL_RANK", std::to_string(local_rank)},
          {"LOCAL_WORLD_SIZE", std::to_string(p.local_world_size)},
          {"NODE_RANK", std::to_string(p.node_rank)},
          {"FULGUR_RESTART_COUNT", std::to_string(attempt)}};
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

// Starts every local rank (`spawn_all`, told the attempt number) and
// supervises them; when one fails and restarts are left, starts them all
// again, with one line naming the cause and what the ranks resume from. On
// several nodes the launchers also watch each other (node_watch.h): a lost
// node fails every node's ranks, which restart together.
void supervise(Plan& plan, const Supervision& supervision,
               const std::function<void(detail::Supervisor&, int)>& spawn_all) {
  std::unique_ptr<detail::NodeWatch> nodes;
  if (plan.num_nodes > 1 && supervision.heartbeat_timeout.count() > 0) {
    nodes = std::make_unique<detail::NodeWatch>(
        detail::NodeWatchOptions{.node_rank = plan.node_rank,
                                 .num_nodes = plan.num_nodes,
                                 .main_address = plan.main_address,
                                 .port = detail::launcher_store_port(plan.main_port),
                                 .heartbeat_timeout = supervision.heartbeat_timeout,
                                 .rejoin_timeout = supervision.hang_timeout});
  }
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0 && plan.port_chosen) plan.main_port = find_free_port(plan.main_address);
    detail::Supervisor supervisor(supervision);
    if (nodes) {
      nodes->begin_attempt(attempt);
      supervisor.watch_nodes(nodes.get());
      // No request of the watch's thread while the ranks are forked.
      auto quiet = nodes->quiet();
      spawn_all(supervisor, attempt);
    } else {
      spawn_all(supervisor, attempt);
    }
    try {
      supervisor.wait_all();
      if (nodes) nodes->finish();
      return;
    } catch (const detail::RankFailure& failure) {
      if (failure.final()) throw DistributedError(failure.what());
      if (attempt >= supervision.max_restarts) {
        if (supervision.max_restarts == 0) throw;
        throw DistributedError(str(failure.what(), "\nNo restart left: the ranks were started ",
                                   attempt + 1, " times (max_restarts=", supervision.max_restarts,
                                   ")."));
      }
      const std::string from = supervision.resume_point ? supervision.resume_point() : std::string();
      std::cout.flush();
      detail::print_note(
          str("restart ", attempt + 1, " of ", supervision.max_restarts, ": ", failure.cause(), "; ",
              (from.empty() ? std::string("starting again from the beginning (no checkpoint "
                                          "that verifies yet)")
                            : "resuming from " + from),
              "."));
    }
  }
}

}  // namespace

SubprocessScriptLauncher::SubprocessScriptLauncher(std::function<RankLayout()> layout,
                                                   Supervision supervision)
    : Launcher(std::move(supervision)), layout_(std::move(layout)) {}

std::optional<std::string> SubprocessScriptLauncher::launch(const std::function<std::string()>&) {
  Plan plan = plan_for(layout_());
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
  supervise(plan, supervision_, [&](detail::Supervisor& supervisor, int attempt) {
    for (int local = 0; local < plan.local_world_size; ++local) {
      auto vars = rank_env(plan, local, attempt);
      if (!threads.empty()) vars.emplace_back("OMP_NUM_THREADS", threads);
      supervisor.spawn(local, plan.node_rank * plan.local_world_size + local, [&] {
        for (const auto& [k, v] : vars) ::setenv(k.c_str(), v.c_str(), 1);
        ::execv("/proc/self/exe", argv.data());
        std::fprintf(stderr, "fulgur: cannot re-execute %s: %s\n", args[0].c_str(),
                     std::strerror(errno));
        ::_exit(127);
      });
    }
  });
  // Every rank ran the whole program and succeeded; this process only
  // launched them, so it must not run the rest of the program again.
  std::cout.flush();
  std::cerr.flush();
  std::exit(0);
}

ForkLauncher::ForkLauncher(std::function<RankLayout()> layout, Supervision supervision)
    : Launcher(std::move(supervision)), layout_(std::move(layout)) {}

std::optional<std::string> ForkLauncher::launch(const std::function<std::string()>& fn) {
  Plan plan = plan_for(layout_());
  ResultsFile results;
  supervise(plan, supervision_, [&](detail::Supervisor& supervisor, int attempt) {
    // The forks inherit it; the owner's layout reads it back (a later
    // launch() starts on the same port).
    main_port_ = plan.main_port;
    results.clear();
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
        for (const auto& [k, v] : rank_env(plan, local, attempt)) {
          ::setenv(k.c_str(), v.c_str(), 1);
        }
        // The owning strategy reads it (launched_rank()).
        launched_rank_ = LaunchedRank{.local_rank = local,
                                      .global_rank = global,
                                      .world_size = plan.world_size,
                                      .restart_count = attempt};
        int code = 0;
        try {
          std::string bytes = fn();
          if (global == 0) results.write(bytes);
        } catch (const std::exception& e) {
          std::string why = error_message(e);
          if (why.find("autograd's threading in combination with fork") != std::string::npos) {
            // A backward ran in the launching process before it forked
            // (outside a fit: fulgur refuses the launch after one of its own).
            why +=
                str(" [fulgur: the process that forked the ranks (strategy \"ddp_fork\") had "
                    "run a backward pass before fit(), which LibTorch ",
                    TORCH_VERSION,
                    " cannot continue in a forked process. Fork before any backward, or use "
                    "strategy \"ddp\" (the program is re-executed once per rank).]");
          }
          detail::print_note(str("rank ", global, " failed: ", why));
          code = 1;
        } catch (...) {
          detail::print_note(str("rank ", global, " failed with an unknown exception"));
          code = 1;
        }
        std::cout.flush();
        std::cerr.flush();
        std::fflush(nullptr);
        ::_exit(code);
      });
    }
  });
  if (plan.node_rank != 0) return std::nullopt;
  return results.read();
}

}  // namespace fulgur
