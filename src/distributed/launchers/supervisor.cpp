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
#include "distributed/launchers/node_watch.h"

namespace fulgur::detail {

namespace {

using Clock = std::chrono::steady_clock;

// SIGINT / SIGTERM while supervising: remembered, then the ranks are
// stopped and the supervisor ends the same way.
std::atomic<int> g_signal{0};
extern "C" void on_stop_signal(int sig) { g_signal.store(sig); }

}  // namespace

Supervisor::Supervisor(const Supervision& supervision)
    : supervision_(supervision),
      heartbeat_timeout_(supervision.heartbeat_timeout),
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
    // For this process only (heartbeat.cpp): not for what it starts.
    std::snprintf(value, sizeof value, "%lld", static_cast<long long>(::getpid()));
    ::setenv("FULGUR_HEARTBEAT_PID", value, 1);
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
  c.fds[0] = out[0];
  c.fds[1] = err[0];
  c.fds[2] = beat[0];
  c.progress.at = c.pulse.at = c.pulse.cpu_changed = Clock::now();
  children_.push_back(std::move(c));
}

void Supervisor::read_fd(Child& c, int which) {
  int& fd = c.fds[which];
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
    std::string& part = c.output.partial[which];
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
      c.output.tail.push_back(cr == std::string::npos ? line : line.substr(cr + 1));
      if (c.output.tail.size() > kTailLines) c.output.tail.pop_front();
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
  if (auto record = decode_failure(line)) {
    if (!c.failure) c.failure = std::move(record);
    return;
  }
  if (line.rfind("pulse ", 0) != 0) {
    c.progress.last = line;
    ++c.progress.count;
    c.progress.at = now;
    if (line == "train batch") c.progress.in_loop = true;
    return;
  }
  // "pulse cpu=<ms> main=<state> coll=<kind>#<seq>:<bytes>:<waited ms>|-"
  auto& p = c.pulse;
  ++p.count;
  p.at = now;
  long long cpu = -1, seq = 0, bytes = 0, waited = 0;
  char state = '?';
  char coll[128] = "-";
  if (std::sscanf(line.c_str(), "pulse cpu=%lld main=%c coll=%127s", &cpu, &state, coll) != 3) {
    return;
  }
  // Working: more than 2% of one core (and 5 ms) since the last time it
  // was seen working. Idle threads of LibTorch and Gloo use a little.
  const auto since = std::chrono::duration_cast<std::chrono::milliseconds>(now - p.cpu_changed);
  if (p.cpu_ms < 0 || cpu - p.cpu_ms > std::max<int64_t>(5, since.count() / 50)) {
    p.cpu_ms = cpu;
    p.cpu_changed = now;
  }
  p.main_state = state;
  std::string text = coll;
  const auto hash = text.find('#');
  if (text == "-" || hash == std::string::npos ||
      std::sscanf(text.c_str() + hash + 1, "%lld:%lld:%lld", &seq, &bytes, &waited) != 3) {
    p.kind.clear();
    return;
  }
  p.kind = text.substr(0, hash);
  p.seq = seq;
  p.bytes = bytes;
  p.since = now - std::chrono::milliseconds(waited);
}

void Supervisor::pump(int timeout_ms) {
  std::vector<pollfd> fds;
  std::vector<std::pair<size_t, int>> owners;
  for (size_t i = 0; i < children_.size(); ++i) {
    for (int w = 0; w < 3; ++w) {
      if (children_[i].fds[w] >= 0) {
        fds.push_back({children_[i].fds[w], POLLIN, 0});
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
    read_fd(children_[owners[k].first], owners[k].second);
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
  for (int w = 0; w < 3; ++w) {
    if (c.fds[w] >= 0) {
      // Whatever is still buffered goes out first.
      read_fd(c, w);
      if (c.fds[w] >= 0) ::close(c.fds[w]);
      c.fds[w] = -1;
    }
  }
  for (int w = 0; w < 2; ++w) {
    std::string& part = c.output.partial[w];
    if (!part.empty()) {
      c.output.tail.push_back(part);
      std::string line = (c.global_rank == 0 ? "" : str("[rank ", c.global_rank, "] ")) + part + "\n";
      write_all(w == 0 ? STDOUT_FILENO : STDERR_FILENO, line.data(), line.size());
      part.clear();
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
  if (c.output.tail.empty()) return "  (it printed nothing)";
  std::string out;
  for (const auto& line : c.output.tail) out += "  | " + line + "\n";
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
    c.progress.at = std::max(c.progress.at, now);
    c.pulse.at = std::max(c.pulse.at, now);
    c.pulse.cpu_changed = std::max(c.pulse.cpu_changed, now);
    if (c.pulse.in_collective()) c.pulse.since = now;
  }
}

std::string Supervisor::check_liveness(const Child*& failed) {
  const auto timeout = heartbeat_timeout_;
  if (timeout.count() <= 0) return "";
  const auto now = Clock::now();
  const std::string limit = str("heartbeat_timeout is ", seconds_text(timeout), " s");
  for (const auto& c : children_) {
    if (!c.running || c.pulse.count == 0) continue;
    const auto silent = now - c.pulse.at;
    if (silent <= timeout) continue;
    failed = &c;
    std::string state = process_state(c.pid);
    return str("rank ", c.global_rank, " (pid ", c.pid, ") froze: no heartbeat for ",
               seconds_text(silent), " s (", limit, ")",
               state.empty() ? "" : "; " + state, "; it last reported \"",
               c.progress.last.empty() ? "nothing" : c.progress.last, "\". Its last lines:\n",
               tail_text(c));
  }
  // Hung outside any collective: asleep, no CPU, no progress, while a peer
  // has waited for it in a collective for the whole timeout.
  const Child* waiting = nullptr;
  for (const auto& c : children_) {
    if (c.running && c.pulse.in_collective() && now - c.pulse.since > timeout) waiting = &c;
  }
  if (waiting == nullptr) return "";
  for (const auto& c : children_) {
    if (!c.running || &c == waiting || !c.progress.in_loop || c.pulse.in_collective() ||
        c.pulse.main_state != 'S' || now - c.pulse.cpu_changed <= timeout ||
        now - c.progress.at <= timeout) {
      continue;
    }
    failed = &c;
    return str(
        "rank ", c.global_rank, " (pid ", c.pid, ") hung outside any collective: for ",
        seconds_text(now - std::max(c.pulse.cpu_changed, c.progress.at)),
        " s it made no progress and used no CPU, its main thread asleep (a deadlock, "
        "or a wait for something that never comes), while rank ",
        waiting->global_rank, " waited for it in ",
        describe({waiting->pulse.kind.c_str(), waiting->pulse.seq, waiting->pulse.bytes}), " (",
        limit,
        "; raise it if a step may wait this long on purpose). It last "
        "reported \"",
        c.progress.last.empty() ? "nothing" : c.progress.last, "\". Its last lines:\n",
        tail_text(c));
  }
  return "";
}

std::string Supervisor::ranks_state() const {
  bool any = false;
  for (const auto& c : children_) any = any || c.pulse.count > 0;
  if (!any) return "";
  const auto now = Clock::now();
  std::string out = "\nWhat each rank was doing when last heard from:";
  // (kind, seq) of the ranks that have waited in a collective for a while.
  std::vector<const Child*> in_collective;
  for (const auto& c : children_) {
    const auto& p = c.pulse;
    out += str("\n  rank ", c.global_rank, ": ");
    if (p.count == 0) {
      out += "no heartbeat yet";
    } else if (p.in_collective()) {
      out += str("in ", describe({p.kind.c_str(), p.seq, p.bytes}), " for ",
                 seconds_text(p.at - p.since), " s");
      if (p.at - p.since > std::chrono::seconds(1)) in_collective.push_back(&c);
    } else {
      out += str("not in a collective, main thread ", thread_state(p.main_state));
    }
    if (p.count > 0 && now - p.at > std::chrono::seconds(2)) {
      out += str(" (", seconds_text(now - p.at), " s ago)");
    }
  }
  for (const auto* a : in_collective) {
    for (const auto* b : in_collective) {
      if (a->pulse.seq != b->pulse.seq || a->pulse.kind != b->pulse.kind) {
        return out + str("\nThe ranks wait in different collectives (rank ", a->global_rank, " in ",
                         a->pulse.kind, " #", a->pulse.seq, ", rank ", b->global_rank, " in ",
                         b->pulse.kind, " #", b->pulse.seq, "): a desync. ", kDesyncHint);
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

namespace {

// SIGINT / SIGTERM noted (on_stop_signal) while it lives; the program's
// own handlers restored after.
class CatchStopSignals {
 public:
  CatchStopSignals() {
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    sigemptyset(&action.sa_mask);
    g_signal.store(0);
    ::sigaction(SIGINT, &action, &old_int_);
    ::sigaction(SIGTERM, &action, &old_term_);
  }
  ~CatchStopSignals() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }
  CatchStopSignals(const CatchStopSignals&) = delete;
  CatchStopSignals& operator=(const CatchStopSignals&) = delete;

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

int64_t whole_seconds(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::seconds>(d).count();
}

}  // namespace

void Supervisor::wait_all() {
  CatchStopSignals catching;
  Watch w;
  while (!watch_once(w)) {
  }
  if (w.node_loss) fail_for(*w.node_loss);
  if (w.failed == nullptr) return;
  if (w.report.empty()) w.failed = settle_on_cause(w.failed);
  if (w.report.empty()) w.report = blame_early_exit(w.failed);
  if (w.report.empty()) w.report = blame_lagging(w.failed);
  if (nodes_ != nullptr && w.report.empty() && w.failed->victim()) {
    // It lost a peer and nothing on this node caused it: the cause may be
    // another node, which the watch names within the heartbeat timeout.
    if (auto loss = nodes_->wait_for_loss(heartbeat_timeout_ + std::chrono::seconds(2))) {
      fail_for(*loss);
    }
  }
  fail(w.failed, std::move(w.report));
}

bool Supervisor::watch_once(Watch& w) {
  pump(100);
  // A signal first: ranks killed by the same Ctrl-C are not a failure.
  if (int sig = g_signal.load()) stop_all_and_end_by(sig);
  forgive_own_pause();
  reap();
  note_exits(w);
  bool all_done = true;
  for (const auto& c : children_) all_done = all_done && !c.running;
  if (w.failed != nullptr || all_done) return true;
  if (nodes_ != nullptr) {
    nodes_->publish(ranks_line());
    if (auto loss = nodes_->lost()) {
      w.node_loss = std::make_shared<const NodeLoss>(std::move(*loss));
      return true;
    }
  }
  w.report = check_liveness(w.failed);
  if (w.failed == nullptr) check_progress(w);
  return w.failed != nullptr;
}

void Supervisor::note_exits(Watch& w) {
  for (auto& c : children_) {
    if (c.running) continue;
    close_fds(c);
    if (!succeeded(c) && w.failed == nullptr) w.failed = &c;
    if (succeeded(c) && w.finished == nullptr) {
      w.finished = &c;
      w.finished_at = Clock::now();
    }
  }
}

void Supervisor::check_progress(Watch& w) {
  const auto timeout = supervision_.hang_timeout;
  if (timeout.count() <= 0) return;
  const auto now = Clock::now();
  const Child* ahead = nullptr;
  for (const auto& c : children_) {
    if (ahead == nullptr || c.progress.count > ahead->progress.count) ahead = &c;
  }
  for (const auto& c : children_) {
    if (!c.running) continue;
    const std::string last = c.progress.last.empty() ? "nothing" : c.progress.last;
    // A rank that finished is ahead of every rank still running: one stuck
    // on its way out (a teardown that never returns) is hung too.
    if (w.finished != nullptr) {
      const auto silent = now - std::max(c.progress.at, w.finished_at);
      if (silent <= timeout) continue;
      w.report = str("rank ", c.global_rank, " (pid ", c.pid, ") hung: it is still running ",
                     whole_seconds(now - w.finished_at), " s after rank ", w.finished->global_rank,
                     " finished, with no progress for ", whole_seconds(silent),
                     " s (the timeout is ", whole_seconds(timeout), " s); it last reported \"",
                     last, "\". Its last lines:\n", tail_text(c));
      w.failed = &c;
      return;
    }
    // A rank behind another one that sent nothing for the timeout.
    if (c.progress.count >= ahead->progress.count || now - c.progress.at <= timeout) continue;
    w.report = str("rank ", c.global_rank, " (pid ", c.pid, ") hung: no progress for ",
                   whole_seconds(now - c.progress.at), " s (the timeout is ",
                   whole_seconds(timeout), " s); it last reported \"", last, "\" while rank ",
                   ahead->global_rank, " reported \"", ahead->progress.last,
                   "\". Its last lines:\n", tail_text(c));
    w.failed = &c;
    return;
  }
}

const Supervisor::Child* Supervisor::settle_on_cause(const Child* failed) {
  // A killed rank's peers fail in their next collective within
  // milliseconds and may be reaped first: collect the deaths of the next
  // moment (their records with them) before naming the cause.
  const auto settle = Clock::now() + std::chrono::milliseconds(500);
  for (;;) {
    bool any_running = false;
    for (const auto& c : children_) any_running = any_running || c.running;
    if (!any_running || Clock::now() >= settle) break;
    pump(50);
    reap();
  }
  for (auto& c : children_) {
    if (!c.running) close_fds(c);
  }
  // A rank killed by a signal is a cause, never a victim.
  for (const auto& c : children_) {
    if (!c.running && WIFSIGNALED(c.status)) return &c;
  }
  if (!failed->victim()) return failed;
  // Among the ranks that exited with an error, the one that failed first on
  // its own (by its record; one without a record failed on its own too).
  const Child* cause = nullptr;
  auto at = [](const Child& c) { return c.failure ? c.failure->at_ms : INT64_MAX; };
  for (const auto& c : children_) {
    if (c.running || !WIFEXITED(c.status) || WEXITSTATUS(c.status) == 0 || c.victim()) continue;
    if (cause == nullptr || at(c) < at(*cause)) cause = &c;
  }
  return cause != nullptr ? cause : failed;
}

std::string Supervisor::blame_lagging(const Child*& failed) {
  // A rank that failed in a collective (timeout, closed connection) is
  // usually the victim: a running rank that fell behind it is the cause.
  // (A rank that failed on its own is the cause, whoever is behind it.)
  if (WIFSIGNALED(failed->status) || !failed->victim()) return "";
  const Child* lagging = nullptr;
  for (const auto& c : children_) {
    if (c.running && c.progress.count < failed->progress.count &&
        (lagging == nullptr || c.progress.count < lagging->progress.count)) {
      lagging = &c;
    }
  }
  if (lagging == nullptr) return "";
  std::string report =
      str("rank ", lagging->global_rank, " (pid ", lagging->pid, ") hung: it sent no progress for ",
          whole_seconds(Clock::now() - lagging->progress.at), " s and fell behind rank ",
          failed->global_rank, ", which gave up waiting for it (", describe_death(*failed),
          "). Rank ", lagging->global_rank, "'s last lines:\n", tail_text(*lagging), "\nRank ",
          failed->global_rank, "'s last lines:\n", tail_text(*failed));
  failed = lagging;
  return report;
}

std::string Supervisor::blame_early_exit(const Child*& failed) {
  if (WIFSIGNALED(failed->status) || !failed->victim()) return "";
  const Child* left = nullptr;
  for (const auto& c : children_) {
    if (!c.running && WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0) {
      left = &c;
      break;
    }
  }
  if (left == nullptr) return "";
  std::string report =
      str("rank ", left->global_rank, " (pid ", left->pid,
          ") left the fit early: it exited with status 0 while rank ", failed->global_rank,
          " still waited for it in a collective (", describe_death(*failed),
          "). A return or exit() in the program on one rank only? Every rank must run the whole "
          "fit. Rank ",
          left->global_rank, "'s last lines:\n", tail_text(*left), "\nRank ", failed->global_rank,
          "'s last lines:\n", tail_text(*failed));
  failed = left;
  return report;
}

void Supervisor::fail(const Child* failed, std::string report) {
  if (report.empty()) {
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

void Supervisor::fail_for(const NodeLoss& loss) {
  std::vector<std::string> stopped;
  for (const auto& c : children_) {
    if (c.running) stopped.push_back(str(c.global_rank, " (pid ", c.pid, ")"));
  }
  std::string report = loss.report + ranks_state();
  stop_all();
  if (!stopped.empty()) report += str("\nStopped this node's ranks: ", join(stopped), ".");
  throw RankFailure(loss.cause, "launcher: " + report, loss.final);
}

std::string Supervisor::ranks_line() const {
  const auto now = Clock::now();
  std::vector<std::string> parts;
  for (const auto& c : children_) {
    const auto& p = c.pulse;
    std::string what;
    if (!c.running) {
      what = "ended";
    } else if (p.in_collective()) {
      what = str("in ", describe({p.kind.c_str(), p.seq, p.bytes}), " for ",
                 seconds_text(now - p.since), " s");
    } else if (p.count == 0) {
      what = "starting";
    } else {
      what = str("not in a collective, main thread ", thread_state(p.main_state));
      if (!c.progress.last.empty()) what += str(", last reported \"", c.progress.last, "\"");
    }
    parts.push_back(str("rank ", c.global_rank, " ", what));
  }
  return join(parts, "; ");
}

}  // namespace fulgur::detail
