#include "distributed/launchers/heartbeat.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace fulgur::detail {

namespace {

// The heartbeat pipe of this process, read again after a fork (a forked
// rank has its own pipe; its parent had none). Only the process the
// supervisor made it for uses it (FULGUR_HEARTBEAT_PID, its pid, which
// exec keeps): a program that process starts, or a loader worker it forks,
// inherits the variables but is no rank, and writes nothing to the pipe.
int heartbeat_fd() {
  static pid_t cached_pid = -1;
  static int fd = -1;
  const pid_t pid = ::getpid();
  if (pid != cached_pid) {
    cached_pid = pid;
    fd = -1;
    const char* v = std::getenv("FULGUR_HEARTBEAT_FD");
    const char* owner = std::getenv("FULGUR_HEARTBEAT_PID");
    if (v != nullptr && owner != nullptr && std::atoll(owner) == static_cast<long long>(pid)) {
      fd = std::atoi(v);
      if (fd >= 0 && ::fcntl(fd, F_GETFD) == -1) fd = -1;
    }
  }
  return fd;
}

// The collective this process waits in, published to the pulse thread.
// `generation` is odd while the fields change (a reader that sees it odd,
// or changed, reads again). Atomics only: trivially destructible, so the
// pulse thread can still read them while the program exits.
struct Published {
  std::atomic<uint64_t> generation{0};
  std::atomic<const char*> kind{nullptr};
  std::atomic<int64_t> seq{0};
  std::atomic<int64_t> bytes{0};
  std::atomic<int64_t> since_ms{0};
};
Published g_collective;

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void publish(const char* kind, int64_t seq, int64_t bytes) {
  g_collective.generation.fetch_add(1);
  g_collective.kind.store(kind);
  g_collective.seq.store(seq);
  g_collective.bytes.store(bytes);
  g_collective.since_ms.store(now_ms());
  g_collective.generation.fetch_add(1);
}

int64_t cpu_ms_of(int who) {
  rusage usage{};
  ::getrusage(who, &usage);
  return (usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) * 1000 +
         (usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1000;
}

// CPU time of every thread but the pulse thread itself (which calls this):
// what the program used.
int64_t cpu_ms() { return cpu_ms_of(RUSAGE_SELF) - cpu_ms_of(RUSAGE_THREAD); }

void pulse_loop(int fd, pid_t main_tid, std::chrono::milliseconds interval) {
  // The main thread's scheduler state: 'R' running, 'S' sleeping, ...
  char main_stat[64];
  std::snprintf(main_stat, sizeof main_stat, "/proc/self/task/%d/stat", static_cast<int>(main_tid));
  for (;;) {
    char coll[160] = "-";
    for (;;) {
      const uint64_t before = g_collective.generation.load();
      if (before % 2 == 1) {
        std::this_thread::yield();
        continue;
      }
      const char* kind = g_collective.kind.load();
      const int64_t seq = g_collective.seq.load();
      const int64_t bytes = g_collective.bytes.load();
      const int64_t since = g_collective.since_ms.load();
      if (g_collective.generation.load() != before) continue;
      if (kind != nullptr) {
        std::snprintf(coll, sizeof coll, "%s#%lld:%lld:%lld", kind, static_cast<long long>(seq),
                      static_cast<long long>(bytes), static_cast<long long>(now_ms() - since));
      }
      break;
    }
    char line[256];
    int n = std::snprintf(line, sizeof line, "pulse cpu=%lld main=%c coll=%s\n",
                          static_cast<long long>(cpu_ms()), proc_stat_state(main_stat), coll);
    write_all(fd, line, static_cast<size_t>(std::min<int>(n, sizeof line - 1)));
    std::this_thread::sleep_for(interval);
  }
}

}  // namespace

void write_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
}

char proc_stat_state(const char* stat_path) {
  int fd = ::open(stat_path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return '?';
  char buf[512];
  ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return '?';
  buf[n] = '\0';
  // "pid (comm) S ...": the command may hold spaces and parentheses.
  const char* close = std::strrchr(buf, ')');
  return close != nullptr && close[1] == ' ' && close[2] != '\0' ? close[2] : '?';
}

bool has_supervisor() { return heartbeat_fd() >= 0; }

void send_heartbeat(const char* what) {
  int fd = heartbeat_fd();
  if (fd < 0) return;
  char line[256];
  int n = std::snprintf(line, sizeof line, "%s\n", what);
  write_all(fd, line, static_cast<size_t>(std::min<int>(n, sizeof line - 1)));
}

void start_pulse() {
  static pid_t started_in = -1;
  const pid_t pid = ::getpid();
  if (started_in == pid) return;
  const int fd = heartbeat_fd();
  if (fd < 0) return;
  started_in = pid;
  int64_t interval_ms = 1000;
  if (const char* v = std::getenv("FULGUR_HEARTBEAT_INTERVAL_MS")) {
    interval_ms = std::clamp<int64_t>(std::atoll(v), 10, 60000);
  }
  std::thread(pulse_loop, fd, pid, std::chrono::milliseconds(interval_ms)).detach();
}

InCollective::InCollective(const CollectiveCall& call) { publish(call.kind, call.seq, call.bytes); }

InCollective::~InCollective() { publish(nullptr, 0, 0); }

std::string describe(const CollectiveCall& call) {
  char size[32];
  const double b = static_cast<double>(call.bytes);
  if (b >= 1 << 20) {
    std::snprintf(size, sizeof size, "%.1f MiB", b / (1 << 20));
  } else if (b >= 1 << 10) {
    std::snprintf(size, sizeof size, "%.1f KiB", b / (1 << 10));
  } else {
    std::snprintf(size, sizeof size, "%lld B", static_cast<long long>(call.bytes));
  }
  return std::string(call.kind) + " #" + std::to_string(call.seq) + " (" + size + ")";
}

std::string encode(const FailureRecord& record) {
  // One line: the error's line breaks become " / "; the collective (its
  // description has spaces) runs up to " what=".
  std::string what = record.what;
  for (size_t at; (at = what.find('\n')) != std::string::npos;) what.replace(at, 1, " / ");
  return "failure peer=" + std::string(record.peer_lost ? "1" : "0") +
         " at=" + std::to_string(record.at_ms) +
         " coll=" + (record.collective.empty() ? std::string("-") : record.collective) +
         " what=" + what;
}

std::optional<FailureRecord> decode_failure(const std::string& line) {
  static constexpr const char* kLead = "failure peer=";
  if (line.rfind(kLead, 0) != 0) return std::nullopt;
  FailureRecord record;
  long long at = 0;
  int peer = 0, used = 0;
  if (std::sscanf(line.c_str(), "failure peer=%d at=%lld coll=%n", &peer, &at, &used) != 2 ||
      used == 0) {
    return std::nullopt;
  }
  const auto what = line.find(" what=", static_cast<size_t>(used));
  if (what == std::string::npos) return std::nullopt;
  record.peer_lost = peer != 0;
  record.at_ms = at;
  record.collective = line.substr(static_cast<size_t>(used), what - static_cast<size_t>(used));
  if (record.collective == "-") record.collective.clear();
  record.what = line.substr(what + 6);
  return record;
}

FailureRecord failure_record(bool peer_lost, const CollectiveCall* call, const std::string& what) {
  FailureRecord record;
  record.peer_lost = peer_lost;
  if (call != nullptr) record.collective = describe(*call);
  record.at_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                     std::chrono::system_clock::now().time_since_epoch())
                     .count();
  record.what = what.substr(0, std::min<size_t>(what.find('\n'), 1000));
  return record;
}

void report_failure(bool peer_lost, const CollectiveCall* call, const std::string& what) {
  static pid_t reported_in = -1;
  const int fd = heartbeat_fd();
  const pid_t pid = ::getpid();
  if (fd < 0 || reported_in == pid) return;
  reported_in = pid;
  const std::string line = encode(failure_record(peer_lost, call, what)) + "\n";
  write_all(fd, line.data(), line.size());
}

std::string seconds_text(std::chrono::steady_clock::duration d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f",
                static_cast<double>(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()) /
                    1000.0);
  return buf;
}

}  // namespace fulgur::detail
