#include "core/run_program.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/signals.h"
#include "fulgur/core/errors.h"

extern char** environ;

namespace fulgur::detail {

bool ProgramResult::succeeded() const {
  return spawn_error == 0 && !timed_out && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

std::string ProgramResult::how_it_ended() const {
  if (spawn_error != 0) return str("could not start: ", std::strerror(spawn_error));
  if (timed_out) return "did not finish in time and was killed";
  if (WIFEXITED(status)) return str("exited with status ", WEXITSTATUS(status));
  return str("was killed by signal ", WTERMSIG(status), " (", signal_name(WTERMSIG(status)), ")");
}

ProgramResult run_program(const std::vector<std::string>& args, const std::string& input,
                          std::chrono::milliseconds timeout,
                          const std::vector<int>& blocked_signals) {
  ProgramResult result;
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) {
    result.spawn_error = errno;
    return result;
  }
  if (::pipe2(out, O_CLOEXEC) != 0) {
    result.spawn_error = errno;
    ::close(in[0]);
    ::close(in[1]);
    return result;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDERR_FILENO);
  std::vector<std::string> copies = args;
  std::vector<char*> argv;
  for (auto& a : copies) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  if (!blocked_signals.empty()) {
    sigset_t mask;
    ::pthread_sigmask(SIG_SETMASK, nullptr, &mask);
    for (int s : blocked_signals) ::sigaddset(&mask, s);
    posix_spawnattr_setsigmask(&attributes, &mask);
    posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK);
  }
  pid_t pid = -1;
  result.spawn_error = ::posix_spawnp(&pid, argv[0], &actions, &attributes, argv.data(), environ);
  posix_spawnattr_destroy(&attributes);
  posix_spawn_file_actions_destroy(&actions);
  ::close(in[0]);
  ::close(out[1]);
  if (result.spawn_error != 0) {
    ::close(in[1]);
    ::close(out[0]);
    return result;
  }
  // The input (a SIGPIPE if the program died would end the caller).
  struct sigaction ignore {
  }, old{};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ignore, &old);
  size_t off = 0;
  while (off < input.size()) {
    const ssize_t w = ::write(in[1], input.data() + off, input.size() - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) break;
    off += static_cast<size_t>(w);
  }
  ::close(in[1]);
  ::sigaction(SIGPIPE, &old, nullptr);
  // Bounded: a program that hangs must not keep the caller.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    pollfd p{out[0], POLLIN, 0};
    if (::poll(&p, 1, 20) > 0) {
      char buf[4096];
      const ssize_t n = ::read(out[0], buf, sizeof buf);
      if (n > 0) result.output.append(buf, static_cast<size_t>(n));
    }
    const pid_t r = ::waitpid(pid, &result.status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) break;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &result.status, 0);
      result.timed_out = true;
      break;
    }
  }
  // What it wrote just before exiting (without waiting for a child of its
  // own that may still hold the pipe).
  ::fcntl(out[0], F_SETFL, O_NONBLOCK);
  for (;;) {
    char buf[4096];
    const ssize_t n = ::read(out[0], buf, sizeof buf);
    if (n > 0) {
      result.output.append(buf, static_cast<size_t>(n));
    } else if (!(n < 0 && errno == EINTR)) {
      break;
    }
  }
  ::close(out[0]);
  while (!result.output.empty() && result.output.back() == '\n') result.output.pop_back();
  return result;
}

}  // namespace fulgur::detail
