#include "distributed/launchers/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>

#include "fulgur/core/errors.h"
#include "fulgur/utilities/seed.h"
#include "core/signals.h"
#include "distributed/launchers/heartbeat.h"

namespace fulgur::detail {

namespace {

using Clock = std::chrono::steady_clock;

// SIGINT / SIGTERM while supervising: remembered, then the ranks are
// stopped and the supervisor ends the same way.
std::atomic<int> g_signal{0};
extern "C" void on_stop_signal(int sig) { g_signal.store(sig); }

}  // namespace

Supervisor::Supervisor(const Supervision& supervision, std::chrono::milliseconds heartbeat_timeout)
    : supervision_(supervision),
      heartbeat_timeout_(heartbeat_timeout),
      started_(Clock::now()),
      last_look_(started_) {
  // With SIGCHLD ignored (or SA_NOCLDWAIT) the kernel reaps the ranks
  // itself and their exit status is lost: supervise with the default.
  struct sigaction current {};
  ::sigaction(SIGCHLD, nullptr, &current);
  if (current.sa_handler == SIG_IGN || (current.sa_flags & SA_NOCLDWAIT) != 0) {
    struct sigaction fallback {};
    fallback.sa_handler = SIG_DFL;
    sigemptyset(&fallback.sa_mask);
    ::sigaction(SIGCHLD, &fallback, &saved_sigchld_);
    restore_sigchld_ = true;
  }
}

Supervisor::~Supervisor() {
  try {
    stop_all();
  } catch (...) {
  }
  if (restore_sigchld_) ::sigaction(SIGCHLD, &saved_sigchld_, nullptr);
}

bool Supervisor::succeeded(const Child& c) {
  return !c.running && !c.lost && WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0;
}

void Supervisor::spawn(int local_rank, int global_rank, const std::function<void()>& body) {
  int out[2], err[2], beat[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0 ||
      ::pipe2(beat, O_CLOEXEC) != 0) {
    throw DistributedError(
        str("launcher: cannot create pipes for rank ", global_rank, ": ", std::strerror(errno)));
  }
  std::fflush(nullptr);
  std::cout.flush();
  std::cerr.flush();
  pid_t supervisor = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) {
    throw DistributedError(str("launcher: fork() for rank ", global_rank, " failed: ",
                               std::strerror(errno), ". Too many processes, or out of memory?"));
  }
  if (pid == 0) {
    // Die with the supervisor, whatever kills it.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != supervisor) ::_exit(128 + SIGKILL);
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    // The heartbeat end stays open across exec (dup drops O_CLOEXEC).
    int beat_fd = ::dup(beat[1]);
    char value[16];
    std::snprintf(value, sizeof value, "%d", beat_fd);
    ::setenv("FULGUR_HEARTBEAT_FD", value, 1);
    // Pulses a few times per timeout (once a second without one).
    const auto interval = heartbeat_timeout_.count() > 0
                              ? std::clamp<int64_t>(heartbeat_timeout_.count() / 5, 50, 1000)
                              : 1000;
    std::snprintf(value, sizeof value, "%lld", static_cast<long long>(interval));
    ::setenv("FULGUR_HEARTBEAT_INTERVAL_MS", value, 1);
    detail::mark_forked_child();  // no CUDA here: the parent may have initialised it
    body();
    ::_exit(127);
  }
  ::close(out[1]);
  ::close(err[1]);
  ::close(beat[1]);
  for (int fd : {out[0], err[0], beat[0]}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  Child c;
  c.local_rank = local_rank;
  c.global_rank = global_rank;
  c.pid = pid;
  c.out_fd = out[0];
  c.err_fd = err[0];
  c.beat_fd = beat[0];
  c.last_beat_time = c.last_pulse_time = c.cpu_changed = Clock::now();
  children_.push_back(std::move(c));
}

void Supervisor::read_fd(Child& c, int& fd, int which) {
  char buf[8192];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0 || errno != EAGAIN) {
        ::close(fd);
        fd = -1;
      }
      return;
    }
    if (which == 2) {
      // Heartbeats are counted, not shown.
      c.beat_partial.append(buf, static_cast<size_t>(n));
      size_t pos;
      while ((pos = c.beat_partial.find('\n')) != std::string::npos) {
        take_beat(c, c.beat_partial.substr(0, pos));
        c.beat_partial.erase(0, pos + 1);
      }
      continue;
    }
    // Rank 0's output passes through unchanged (progress bars included);
    // other ranks' complete lines are prefixed with their rank.
    int target = which == 0 ? STDOUT_FILENO : STDERR_FILENO;
    std::string& part = c.partial[which];
    part.append(buf, static_cast<size_t>(n));
    size_t pos;
    while ((pos = part.find('\n')) != std::string::npos) {
      std::string line = part.substr(0, pos);
      part.erase(0, pos + 1);
      if (c.global_rank == 0) {
        write_all(target, line.data(), line.size());
        write_all(target, "\n", 1);
      } else {
        std::string prefixed = str("[rank ", c.global_rank, "] ", line, "\n");
        write_all(target, prefixed.data(), prefixed.size());
      }
      auto cr = line.find_last_of('\r');
      c.tail.push_back(cr == std::string::npos ? line : line.substr(cr + 1));
      if (c.tail.size() > kTailLines) c.tail.pop_front();
    }
    if (c.global_rank == 0 && !part.empty() && part.find('\r') != std::string::npos) {
      // A progress bar redraw: show it now, keep only its last state.
      write_all(target, part.data(), part.size());
      part.clear();
    }
  }
}

void Supervisor::take_beat(Child& c, const std::string& line) {
  const auto now = Clock::now();
  if (line.rfind("pulse ", 0) != 0) {
    c.last_beat = line;
    ++c.beats;
    c.last_beat_time = now;
    if (line == "train batch") c.in_loop = true;
    return;
  }
  // "pulse cpu=<ms> main=<state> coll=<kind>#<seq>:<bytes>:<waited ms>|-"
  ++c.pulses;
  c.last_pulse_time = now;
  long long cpu = -1, seq = 0, bytes = 0, waited = 0;
  char state = '?';
  char coll[128] = "-";
  if (std::sscanf(line.c_str(), "pulse cpu=%lld main=%c coll=%127s", &cpu, &state, coll) != 3) {
    return;
  }
  // Working: more than 2% of one core (and 5 ms) since the last time it
  // was seen working. Idle threads of LibTorch and Gloo use a little.
  const auto since = std::chrono::duration_cast<std::chrono::milliseconds>(now - c.cpu_changed);
  if (c.cpu_ms < 0 || cpu - c.cpu_ms > std::max<int64_t>(5, since.count() / 50)) {
    c.cpu_ms = cpu;
    c.cpu_changed = now;
  }
  c.main_state = state;
  std::string text = coll;
  const auto hash = text.find('#');
  if (text == "-" || hash == std::string::npos ||
      std::sscanf(text.c_str() + hash + 1, "%lld:%lld:%lld", &seq, &bytes, &waited) != 3) {
    c.coll_kind.clear();
    return;
  }
  c.coll_kind = text.substr(0, hash);
  c.coll_seq = seq;
  c.coll_bytes = bytes;
  c.coll_since = now - std::chrono::milliseconds(waited);
}

void Supervisor::pump(int timeout_ms) {
  std::vector<pollfd> fds;
  std::vector<std::pair<size_t, int>> owners;
  for (size_t i = 0; i < children_.size(); ++i) {
    auto& c = children_[i];
    int* slots[3] = {&c.out_fd, &c.err_fd, &c.beat_fd};
    for (int w = 0; w < 3; ++w) {
      if (*slots[w] >= 0) {
        fds.push_back({*slots[w], POLLIN, 0});
        owners.emplace_back(i, w);
      }
    }
  }
  if (fds.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
    return;
  }
  int n = ::poll(fds.data(), fds.size(), timeout_ms);
  if (n <= 0) return;
  for (size_t k = 0; k < fds.size(); ++k) {
    if (fds[k].revents == 0) continue;
    auto& c = children_[owners[k].first];
    int which = owners[k].second;
    int& fd = which == 0 ? c.out_fd : which == 1 ? c.err_fd : c.beat_fd;
    read_fd(c, fd, which);
  }
}

bool Supervisor::reap() {
  bool any = false;
  for (auto& c : children_) {
    if (!c.running) continue;
    int status = 0;
    pid_t r = ::waitpid(c.pid, &status, WNOHANG);
    if (r == c.pid) {
      c.running = false;
      c.status = status;
      any = true;
    } else if (r < 0 && errno == ECHILD) {
      c.running = false;
      c.lost = true;
      any = true;
    }
  }
  return any;
}

void Supervisor::close_fds(Child& c) {
  for (int* fd : {&c.out_fd, &c.err_fd, &c.beat_fd}) {
    if (*fd >= 0) {
      // Whatever is still buffered goes out first.
      read_fd(c, *fd, fd == &c.out_fd ? 0 : fd == &c.err_fd ? 1 : 2);
      if (*fd >= 0) ::close(*fd);
      *fd = -1;
    }
  }
  for (int w = 0; w < 2; ++w) {
    if (!c.partial[w].empty()) {
      c.tail.push_back(c.partial[w]);
      std::string line =
          (c.global_rank == 0 ? "" : str("[rank ", c.global_rank, "] ")) + c.partial[w] + "\n";
      write_all(w == 0 ? STDOUT_FILENO : STDERR_FILENO, line.data(), line.size());
      c.partial[w].clear();
    }
  }
}

std::string Supervisor::describe_death(const Child& c) const {
  if (c.lost) {
    return "ended, but another part of the program reaped it (a waitpid(-1), or SIGCHLD set to "
           "SIG_IGN after the launch), so how is unknown";
  }
  if (WIFSIGNALED(c.status)) {
    int sig = WTERMSIG(c.status);
    return str("was killed by signal ", sig, " (", signal_name(sig), ")");
  }
  if (WIFEXITED(c.status)) return str("exited with code ", WEXITSTATUS(c.status));
  return "stopped";
}

std::string Supervisor::tail_text(const Child& c) const {
  if (c.tail.empty()) return "  (it printed nothing)";
  std::string out;
  for (const auto& line : c.tail) out += "  | " + line + "\n";
  if (!out.empty()) out.pop_back();
  return out;
}

void Supervisor::stop_all() {
  bool any_running = false;
  for (auto& c : children_) {
    if (c.running) {
      ::kill(c.pid, SIGTERM);
      // A stopped rank (SIGSTOP) acts on SIGTERM only once continued.
      ::kill(c.pid, SIGCONT);
      any_running = true;
    }
  }
  auto deadline = Clock::now() + supervision_.stop_grace;
  while (any_running && Clock::now() < deadline) {
    pump(50);
    reap();
    any_running = false;
    for (auto& c : children_) any_running = any_running || c.running;
  }
  for (auto& c : children_) {
    if (c.running) {
      ::kill(c.pid, SIGKILL);
      int status = 0;
      pid_t r;
      while ((r = ::waitpid(c.pid, &status, 0)) < 0 && errno == EINTR) {
      }
      if (r < 0) c.lost = true;
      c.running = false;
      c.status = status;
    }
    close_fds(c);
  }
}

namespace {

double seconds_of(Clock::duration d) {
  return static_cast<double>(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()) /
         1000.0;
}

std::string one_decimal(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

// What /proc says a process is doing, for a frozen rank's message.
std::string process_state(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  const char state = proc_stat_state(path);
  switch (state) {
    case '?': return "";
    case 'T': return "it is stopped (SIGSTOP, SIGTSTP or SIGTTIN; SIGCONT would continue it)";
    case 't': return "it is stopped by a debugger or tracer";
    case 'D': return "it is in uninterruptible I/O (a hung disk or network file system?)";
    case 'Z': return "it has exited and waits to be reaped";
    case 'R': return "it is running, but its heartbeat thread is not (starved, or blocked writing)";
    default: return str("its process is in state '", state, "'");
  }
}

const char* thread_state(char state) {
  switch (state) {
    case 'R': return "running";
    case 'S': return "sleeping";
    case 'D': return "in uninterruptible I/O";
    case 'T': return "stopped";
    case 't': return "stopped by a tracer";
    default: return "in an unknown state";
  }
}

}  // namespace

void Supervisor::forgive_own_pause() {
  const auto now = Clock::now();
  const auto gap = now - last_look_;
  last_look_ = now;
  const auto limit =
      heartbeat_timeout_.count() > 0 ? heartbeat_timeout_ / 2 : std::chrono::milliseconds(5000);
  if (gap < limit) return;
  // This process did not run for a while (the whole job was stopped): the
  // ranks' silence during it says nothing about them.
  for (auto& c : children_) {
    c.last_beat_time = std::max(c.last_beat_time, now);
    c.last_pulse_time = std::max(c.last_pulse_time, now);
    c.cpu_changed = std::max(c.cpu_changed, now);
    if (!c.coll_kind.empty()) c.coll_since = now;
  }
}

std::string Supervisor::check_liveness(const Child*& failed) {
  const auto timeout = heartbeat_timeout_;
  if (timeout.count() <= 0) return "";
  const auto now = Clock::now();
  const std::string limit = str("heartbeat_timeout is ", one_decimal(seconds_of(timeout)), " s");
  for (const auto& c : children_) {
    if (!c.running || c.pulses == 0) continue;
    const auto silent = now - c.last_pulse_time;
    if (silent <= timeout) continue;
    failed = &c;
    std::string state = process_state(c.pid);
    return str("rank ", c.global_rank, " (pid ", c.pid, ") froze: no heartbeat for ",
               one_decimal(seconds_of(silent)), " s (", limit, ")",
               state.empty() ? "" : "; " + state, "; it last reported \"",
               c.last_beat.empty() ? "nothing" : c.last_beat, "\". Its last lines:\n",
               tail_text(c));
  }
  // Hung outside any collective: asleep, no CPU, no progress, while a peer
  // has waited for it in a collective for the whole timeout.
  const Child* waiting = nullptr;
  for (const auto& c : children_) {
    if (c.running && !c.coll_kind.empty() && now - c.coll_since > timeout) waiting = &c;
  }
  if (waiting == nullptr) return "";
  for (const auto& c : children_) {
    if (!c.running || &c == waiting || !c.in_loop || !c.coll_kind.empty() || c.main_state != 'S' ||
        now - c.cpu_changed <= timeout || now - c.last_beat_time <= timeout) {
      continue;
    }
    failed = &c;
    return str(
        "rank ", c.global_rank, " (pid ", c.pid, ") hung outside any collective: for ",
        one_decimal(seconds_of(now - std::max(c.cpu_changed, c.last_beat_time))),
        " s it made no progress and used no CPU, its main thread asleep (a deadlock, "
        "or a wait for something that never comes), while rank ",
        waiting->global_rank, " waited for it in ",
        describe({waiting->coll_kind.c_str(), waiting->coll_seq, waiting->coll_bytes}), " (", limit,
        "; raise it if a step may wait this long on purpose). It last "
        "reported \"",
        c.last_beat.empty() ? "nothing" : c.last_beat, "\". Its last lines:\n", tail_text(c));
  }
  return "";
}

std::string Supervisor::ranks_state() const {
  bool any = false;
  for (const auto& c : children_) any = any || c.pulses > 0;
  if (!any) return "";
  const auto now = Clock::now();
  std::string out = "\nWhat each rank was doing when last heard from:";
  // (kind, seq) of the ranks that have waited in a collective for a while.
  std::vector<const Child*> in_collective;
  for (const auto& c : children_) {
    out += str("\n  rank ", c.global_rank, ": ");
    if (c.pulses == 0) {
      out += "no heartbeat yet";
    } else if (!c.coll_kind.empty()) {
      out += str("in ", describe({c.coll_kind.c_str(), c.coll_seq, c.coll_bytes}), " for ",
                 one_decimal(seconds_of(c.last_pulse_time - c.coll_since)), " s");
      if (c.last_pulse_time - c.coll_since > std::chrono::seconds(1)) in_collective.push_back(&c);
    } else {
      out += str("not in a collective, main thread ", thread_state(c.main_state));
    }
    if (c.pulses > 0 && now - c.last_pulse_time > std::chrono::seconds(2)) {
      out += str(" (", one_decimal(seconds_of(now - c.last_pulse_time)), " s ago)");
    }
  }
  for (const auto* a : in_collective) {
    for (const auto* b : in_collective) {
      if (a->coll_seq != b->coll_seq || a->coll_kind != b->coll_kind) {
        return out + str("\nThe ranks wait in different collectives (rank ", a->global_rank, " in ",
                         a->coll_kind, " #", a->coll_seq, ", rank ", b->global_rank, " in ",
                         b->coll_kind, " #", b->coll_seq,
                         "): a desync. The program calls collectives in a different order or "
                         "number on different ranks (a metric logged with sync_dist on some "
                         "ranks only, a branch on the rank around a collective?).");
      }
    }
  }
  return out;
}

void Supervisor::stop_all_and_end_by(int sig) {
  std::vector<std::string> stopped;
  for (const auto& c : children_) {
    if (c.running) stopped.push_back(str(c.global_rank, " (pid ", c.pid, ")"));
  }
  stop_all();
  const std::string message =
      str("launcher: interrupted by signal ", sig, " (", signal_name(sig), "); stopped every rank",
          stopped.empty() ? std::string(" (none was still running)") : ": " + join(stopped),
          ". Exiting with status ", 128 + sig, ".\n");
  std::cout.flush();
  std::fflush(nullptr);
  write_all(STDERR_FILENO, message.data(), message.size());
  if (restore_sigchld_) ::sigaction(SIGCHLD, &saved_sigchld_, nullptr);
  // End as the signal would have ended this process: status 128 + sig.
  end_by_signal(sig);
}

void Supervisor::wait_all() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  struct sigaction old_int {
  }, old_term{};
  g_signal.store(0);
  ::sigaction(SIGINT, &action, &old_int);
  ::sigaction(SIGTERM, &action, &old_term);
  struct Restore {
    struct sigaction i, t;
    ~Restore() {
      ::sigaction(SIGINT, &i, nullptr);
      ::sigaction(SIGTERM, &t, nullptr);
    }
  } restore{old_int, old_term};

  const Child* failed = nullptr;
  // The first rank seen to finish successfully, and when.
  const Child* finished = nullptr;
  Clock::time_point finished_at;
  std::string hang_report;
  auto seconds = [](Clock::duration d) {
    return std::chrono::duration_cast<std::chrono::seconds>(d).count();
  };
  for (;;) {
    pump(100);
    // A signal first: ranks killed by the same Ctrl-C are not a failure.
    if (int sig = g_signal.load()) stop_all_and_end_by(sig);
    forgive_own_pause();
    reap();
    bool all_done = true;
    for (auto& c : children_) {
      if (!c.running) {
        if (c.out_fd >= 0 || c.err_fd >= 0 || c.beat_fd >= 0) close_fds(c);
        if (!succeeded(c) && failed == nullptr) failed = &c;
        if (succeeded(c) && finished == nullptr) {
          finished = &c;
          finished_at = Clock::now();
        }
      } else {
        all_done = false;
      }
    }
    if (failed != nullptr || all_done) break;
    hang_report = check_liveness(failed);
    if (failed != nullptr) break;
    if (supervision_.hang_timeout.count() > 0) {
      // A rank is hung when it is behind another rank and has sent nothing
      // for hang_timeout.
      auto now = Clock::now();
      const Child* ahead = nullptr;
      for (const auto& c : children_) {
        if (ahead == nullptr || c.beats > ahead->beats) ahead = &c;
      }
      for (const auto& c : children_) {
        if (!c.running) continue;
        // A rank that finished is ahead of every rank still running: one
        // stuck on its way out (a teardown that never returns) is hung too.
        if (finished != nullptr) {
          const auto silent = now - std::max(c.last_beat_time, finished_at);
          if (silent > supervision_.hang_timeout) {
            hang_report =
                str("rank ", c.global_rank, " (pid ", c.pid, ") hung: it is still running ",
                    seconds(now - finished_at), " s after rank ", finished->global_rank,
                    " finished, with no progress for ", seconds(silent), " s (the timeout is ",
                    seconds(supervision_.hang_timeout), " s); it last reported \"",
                    c.last_beat.empty() ? "nothing" : c.last_beat, "\". Its last lines:\n",
                    tail_text(c));
            failed = &c;
            break;
          }
          continue;
        }
        if (c.beats >= ahead->beats) continue;
        if (now - c.last_beat_time > supervision_.hang_timeout) {
          hang_report = str("rank ", c.global_rank, " (pid ", c.pid, ") hung: no progress for ",
                            seconds(now - c.last_beat_time), " s (the timeout is ",
                            seconds(supervision_.hang_timeout), " s); it last reported \"",
                            c.last_beat.empty() ? "nothing" : c.last_beat, "\" while rank ",
                            ahead->global_rank, " reported \"", ahead->last_beat,
                            "\". Its last lines:\n", tail_text(c));
          failed = &c;
          break;
        }
      }
      if (failed != nullptr) break;
    }
  }
  if (failed == nullptr) return;
  // A rank whose collective failed because a peer left (its message ends
  // with kPeerFailedHint) is a victim of one that failed on its own.
  auto victim = [&](const Child& c) {
    return tail_text(c).find(kPeerFailedHint) != std::string::npos;
  };
  if (hang_report.empty()) {
    // Ranks fail together: a killed rank's peers fail in their next
    // collective within milliseconds and may be reaped first. Collect the
    // deaths of the next moment before naming the cause; a rank killed by
    // a signal is a cause, never a victim.
    const auto settle = Clock::now() + std::chrono::milliseconds(500);
    for (;;) {
      bool any_running = false;
      for (const auto& c : children_) any_running = any_running || c.running;
      if (!any_running || Clock::now() >= settle) break;
      pump(50);
      reap();
    }
    for (const auto& c : children_) {
      if (!c.running && WIFSIGNALED(c.status)) {
        failed = &c;
        break;
      }
    }
    // Among ranks that exited with an error, name one that failed on its own.
    if (!WIFSIGNALED(failed->status) && victim(*failed)) {
      for (const auto& c : children_) {
        if (!c.running && WIFEXITED(c.status) && WEXITSTATUS(c.status) != 0 && !victim(c)) {
          failed = &c;
          break;
        }
      }
    }
  }
  std::string report;
  if (hang_report.empty() && !WIFSIGNALED(failed->status) && victim(*failed)) {
    // A rank that failed in a collective (timeout, closed connection) is
    // usually the victim: a running rank that fell behind it is the cause.
    // (A rank that failed on its own is the cause, whoever is behind it.)
    const Child* lagging = nullptr;
    for (const auto& c : children_) {
      if (c.running && c.beats < failed->beats &&
          (lagging == nullptr || c.beats < lagging->beats)) {
        lagging = &c;
      }
    }
    if (lagging != nullptr) {
      hang_report = str(
          "rank ", lagging->global_rank, " (pid ", lagging->pid, ") hung: it sent no progress for ",
          seconds(Clock::now() - lagging->last_beat_time), " s and fell behind rank ",
          failed->global_rank, ", which gave up waiting for it (", describe_death(*failed),
          "). Rank ", lagging->global_rank, "'s last lines:\n", tail_text(*lagging), "\nRank ",
          failed->global_rank, "'s last lines:\n", tail_text(*failed));
      failed = lagging;
    }
  }
  if (!hang_report.empty()) {
    report = hang_report;
  } else {
    report =
        str("rank ", failed->global_rank, " (pid ", failed->pid, ") ", describe_death(*failed),
            " after ",
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started_).count() /
                1000.0,
            " s. Its last lines:\n", tail_text(*failed));
  }
  report += ranks_state();
  // The cause in one line: the report up to its first line break, without
  // the lead-in to the rank's last lines.
  std::string cause = report.substr(0, report.find('\n'));
  for (const char* lead : {" Its last lines:", ". Rank "}) {
    if (auto at = cause.find(lead); at != std::string::npos) cause.erase(at);
  }
  if (!cause.empty() && cause.back() == '.') cause.pop_back();
  std::vector<std::string> others;
  for (const auto& c : children_) {
    if (&c != failed && c.running) others.push_back(str(c.global_rank, " (pid ", c.pid, ")"));
  }
  stop_all();
  if (!others.empty()) report += str("\nStopped the other ranks: ", join(others), ".");
  throw RankFailure(cause, "launcher: " + report);
}

}  // namespace fulgur::detail
