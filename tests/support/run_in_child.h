// File: tests/support/run_in_child.h
//
// Runs a function in a forked child of the test process, bounded in time:
// for code that must end with an exit status and never crash or hang (a
// parser fed random bytes). Much cheaper than run_process() (no exec, no
// LibTorch start-up), so a fuzz test can run hundreds of cases. The child's
// stdout and stderr go to /dev/null; it leaves through _exit (no atexit
// handlers, no GoogleTest teardown), so an exception the function lets out
// aborts it, as it would abort a program.
//
//   auto r = fulgur::test::run_in_child([&] { return cli.parse(argc, argv).value_or(0); });
//   EXPECT_TRUE(r.exit_code == 0 || r.exit_code == 2) << r.describe();
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>

namespace fulgur::test {

/// The exit status of a run_in_child child whose body threw.
constexpr int kChildThrew = 125;

struct ChildResult {
  int exit_code = -1;  // -1 when it ended by a signal or was killed
  int signal = 0;
  bool timed_out = false;
  std::string exception;  // what() of the exception that left the body, if one did
  std::string describe() const {
    if (timed_out) return "still running at the timeout (killed)";
    if (signal != 0) return "killed by signal " + std::to_string(signal);
    if (exit_code == kChildThrew) {
      return "exit status 125 (an exception left the child's body" +
             (exception.empty() ? std::string() : ": " + exception) + ")";
    }
    return "exit status " + std::to_string(exit_code);
  }
};

inline ChildResult run_in_child(const std::function<int()>& body,
                                std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  // The child writes an escaping exception's message here (its stderr is
  // /dev/null): describe() names it. Non-blocking: a process the child
  // forked may hold the write end on after the child is gone.
  int said[2];
  if (::pipe2(said, O_CLOEXEC | O_NONBLOCK) != 0)
    throw std::runtime_error("run_in_child: pipe failed");
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(said[0]);
    ::close(said[1]);
    throw std::runtime_error("run_in_child: fork failed");
  }
  if (pid == 0) {
    ::close(said[0]);
    const int null = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (null >= 0) {
      ::dup2(null, STDOUT_FILENO);
      ::dup2(null, STDERR_FILENO);
    }
    // An exception must not leave the body: it would unwind into the
    // parent's test, run on in the child and remove the parent's files.
    int code = kChildThrew;
    try {
      code = body();
    } catch (const std::exception& e) {
      const std::string what = std::string(e.what()).substr(0, 4000);
      if (::write(said[1], what.data(), what.size()) < 0) code = kChildThrew;
    } catch (...) {
    }
    std::cout.flush();
    std::cerr.flush();
    ::_exit(code);
  }
  ::close(said[1]);
  ChildResult result;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(50);
  int status = 0;
  while (true) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0) throw std::runtime_error("run_in_child: waitpid failed");
    if (std::chrono::steady_clock::now() > deadline) {
      result.timed_out = true;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ::close(said[0]);
      return result;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(5));
  }
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  // The child is gone; what it wrote is in the pipe.
  char chunk[1024];
  ssize_t got = 0;
  while ((got = ::read(said[0], chunk, sizeof chunk)) > 0) result.exception.append(chunk, got);
  ::close(said[0]);
  return result;
}

/// The exit status of a run_on_tmpfs child that could not mount its tmpfs
/// (not root, or no mount namespace): the caller skips.
constexpr int kCannotMountTmpfs = 77;

/// run_in_child, with a tmpfs of `size` ("256k") mounted over the
/// directory `dir` in the child's own mount namespace (gone with the
/// child): a file system that fills up, without touching the machine's.
inline ChildResult run_on_tmpfs(const std::string& dir, const std::string& size,
                                const std::function<int()>& body,
                                std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  return run_in_child(
      [&] {
        if (::geteuid() != 0 || ::unshare(CLONE_NEWNS) != 0 ||
            ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
            ::mount("tmpfs", dir.c_str(), "tmpfs", 0, ("size=" + size).c_str()) != 0) {
          return kCannotMountTmpfs;
        }
        return body();
      },
      timeout);
}

}  // namespace fulgur::test
