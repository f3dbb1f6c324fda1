// The rank's side of supervision: failure records, one line each, that the
// launcher decodes (the launcher's use of them runs with real ranks in
// DDPFaults.TheCauseComesFromFailureRecordsNotFromWhatARankPrinted).
#include "distributed/launchers/heartbeat.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <string>

namespace fulgur::detail {
namespace {

// Everything written to the pipe `fd` reads from, until every writer
// closed it; closes `fd`.
std::string read_until_closed(int fd) {
  std::string out;
  char buf[512];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return out;
}

TEST(FailureRecord, EncodesToOneLineAndDecodesBack) {
  FailureRecord record{.peer_lost = true,
                       .collective = "all_reduce #57 (4.0 KiB)",
                       .at_ms = 1790000000123,
                       .what = "all_reduce failed: Connection reset by peer\nsecond line"};
  const std::string line = encode(record);
  EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  auto back = decode_failure(line);
  ASSERT_TRUE(back.has_value()) << line;
  EXPECT_TRUE(back->peer_lost);
  EXPECT_EQ(back->collective, "all_reduce #57 (4.0 KiB)");
  EXPECT_EQ(back->at_ms, 1790000000123);
  EXPECT_EQ(back->what, "all_reduce failed: Connection reset by peer / second line");

  // Outside a collective, on its own; a text that holds " what=" itself.
  auto own = decode_failure(
      encode({.peer_lost = false, .collective = "", .at_ms = 5, .what = "bad what=x"}));
  ASSERT_TRUE(own.has_value());
  EXPECT_FALSE(own->peer_lost);
  EXPECT_EQ(own->collective, "");
  EXPECT_EQ(own->what, "bad what=x");
}

TEST(FailureRecord, OtherLinesAreNotRecords) {
  for (const char* line : {"train batch", "collective", "pulse cpu=3 main=S coll=-", "failure",
                           "failure peer=1", "failure peer=x at=1 coll=- what=y",
                           "failure peer=1 at=2 coll=- no text"}) {
    EXPECT_FALSE(decode_failure(line).has_value()) << line;
  }
}

TEST(FailureRecord, AProcessReportsOnceOnItsSupervisorsPipeAndNothingWithoutOne) {
  // Without a supervisor: nothing happens (no pipe to write to).
  ::unsetenv("FULGUR_HEARTBEAT_FD");
  report_failure(false, nullptr, "no supervisor");

  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    ::setenv("FULGUR_HEARTBEAT_FD", std::to_string(fds[1]).c_str(), 1);
    ::setenv("FULGUR_HEARTBEAT_PID", std::to_string(::getpid()).c_str(), 1);
    const CollectiveCall call{"broadcast", 4, 2048};
    report_failure(true, &call, "broadcast #4 failed: timeout\nmore");
    // The first record wins: the error this raises later is not a cause.
    report_failure(false, nullptr, "the same error, as the Trainer sees it");
    ::_exit(0);
  }
  ::close(fds[1]);
  const std::string out = read_until_closed(fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_EQ(out.find('\n'), out.size() - 1) << "one line: " << out;
  auto record = decode_failure(out.substr(0, out.size() - 1));
  ASSERT_TRUE(record.has_value()) << out;
  EXPECT_TRUE(record->peer_lost);
  EXPECT_EQ(record->collective, "broadcast #4 (2.0 KiB)");
  EXPECT_EQ(record->what, "broadcast #4 failed: timeout");
  EXPECT_GT(record->at_ms, 0);
}

// The variables reach what a rank starts (a program it runs, a loader
// worker it forks): those are no ranks, and write nothing to the pipe;
// neither does a process given the pipe's variable without the pid.
TEST(FailureRecord, AProcessTheVariablesWereNotMadeForWritesNothing) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  // Runs `body` in a child (a process of its own: the pipe is looked up
  // anew) with the pipe's variable set, and waits for it.
  const auto in_child = [&](const std::function<void()>& body) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      ::setenv("FULGUR_HEARTBEAT_FD", std::to_string(fds[1]).c_str(), 1);
      body();
      ::_exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  };
  const auto report = [] {
    send_heartbeat("train batch");
    report_failure(false, nullptr, "not a rank");
  };
  in_child([&] {
    ::unsetenv("FULGUR_HEARTBEAT_PID");
    report();
  });
  in_child([&] {
    ::setenv("FULGUR_HEARTBEAT_PID", std::to_string(::getppid()).c_str(), 1);  // another's
    report();
  });
  in_child([&] {
    // A rank's own variables; what it forks is no rank.
    ::setenv("FULGUR_HEARTBEAT_PID", std::to_string(::getpid()).c_str(), 1);
    const pid_t worker = ::fork();
    if (worker == 0) {
      report();
      ::_exit(0);
    }
    ::waitpid(worker, nullptr, 0);
  });
  ::close(fds[1]);
  EXPECT_EQ(read_until_closed(fds[0]), "");
}

}  // namespace
}  // namespace fulgur::detail
