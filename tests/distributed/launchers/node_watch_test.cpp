// The launchers of a multi-node run watching each other, in one process
// over 127.0.0.1: two NodeWatch objects are two nodes' launchers. (Across
// real network namespaces, with links cut, nodes killed and frozen:
// AcrossNamespaces.* in tests/distributed/multi_node_test.cpp.)
#include "distributed/launchers/node_watch.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <thread>

#include "fulgur/core/errors.h"
#include "fulgur/distributed/process_group.h"
#include "distributed/tcp_store.h"

namespace fulgur::detail {
namespace {

using namespace std::chrono_literals;

NodeWatchOptions node(int rank, int port) {
  return {.node_rank = rank,
          .num_nodes = 2,
          .main_address = "127.0.0.1",
          .port = port,
          .heartbeat_timeout = 1s,
          .rejoin_timeout = 3s};
}

TEST(NodeWatch, ANodeWhoseLauncherStopsIsNamedWithWhatItsRanksDidWithinTheTimeout) {
  const int port = find_free_port("127.0.0.1");
  NodeWatch zero(node(0, port));
  auto one = std::make_unique<NodeWatch>(node(1, port));
  one->publish("rank 2 in all_reduce #57 (4.0 KiB) for 0.3 s; rank 3 last reported \"train batch\"");
  std::this_thread::sleep_for(1500ms);
  EXPECT_FALSE(zero.lost().has_value()) << zero.lost()->report;
  EXPECT_FALSE(one->lost().has_value()) << one->lost()->report;
  one.reset();  // node 1's launcher is gone
  const auto t0 = std::chrono::steady_clock::now();
  auto loss = zero.wait_for_loss(5s);
  ASSERT_TRUE(loss.has_value());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2500ms);
  EXPECT_FALSE(loss->final);
  EXPECT_NE(loss->cause.find("node 1 is lost: no heartbeat from its launcher for"),
            std::string::npos)
      << loss->cause;
  EXPECT_NE(loss->report.find("heartbeat_timeout is 1.0 s"), std::string::npos) << loss->report;
  EXPECT_NE(loss->report.find("rank 2 in all_reduce #57"), std::string::npos) << loss->report;

  // After a restart, node 1 must come back within the rejoin timeout.
  zero.begin_attempt(1);
  EXPECT_FALSE(zero.lost().has_value());
  auto gone = zero.wait_for_loss(6s);
  ASSERT_TRUE(gone.has_value());
  EXPECT_TRUE(gone->final);
  EXPECT_NE(gone->cause.find("node 1 did not come back"), std::string::npos) << gone->cause;
  EXPECT_NE(gone->cause.find("rejoin timeout is the process_group_timeout, 3.0 s"),
            std::string::npos)
      << gone->cause;
}

TEST(NodeWatch, NodeZeroGoneIsNamedByItsStoreAndANodeThatFinishedIsNotLost) {
  const int port = find_free_port("127.0.0.1");
  {
    // Node 1 finishes first: node 0 does not take its silence for a loss.
    NodeWatch zero(node(0, port));
    NodeWatch one(node(1, port));
    std::this_thread::sleep_for(500ms);
    one.finish();
    std::this_thread::sleep_for(1500ms);
    EXPECT_FALSE(zero.lost().has_value()) << zero.lost()->report;
  }
  const int port2 = find_free_port("127.0.0.1");
  auto zero = std::make_unique<NodeWatch>(node(0, port2));
  NodeWatch one(node(1, port2));
  std::this_thread::sleep_for(800ms);
  zero.reset();  // node 0 and its store are gone, unfinished
  auto loss = one.wait_for_loss(5s);
  ASSERT_TRUE(loss.has_value());
  EXPECT_NE(loss->cause.find("node 0 is lost: the launchers' store it keeps at 127.0.0.1:" +
                             std::to_string(port2) + " has not answered for"),
            std::string::npos)
      << loss->cause;
}

// Node 0's beats stop while its store still answers (600 ms), then the
// store goes too: node 1 names the store, whose silence hides the beats,
// not node 0's missing beats, which only the store's 600 ms of answers
// showed missing (less than the 1 s timeout). Counted up to the time of
// judging, node 0's silence passed the timeout first.
TEST(NodeWatch, APeersSilenceCountsOnlyWhileTheStoreAnswers) {
  const int port = find_free_port("127.0.0.1");
  auto store = std::make_unique<TcpStore>("127.0.0.1", port, /*server=*/true, 5s);
  const std::string beat = "1 0 rank 0 last reported \"train batch\"";
  store->set("fulgur/launcher/node/0", std::vector<uint8_t>(beat.begin(), beat.end()));
  NodeWatch one(node(1, port));
  std::this_thread::sleep_for(600ms);
  EXPECT_FALSE(one.lost().has_value()) << one.lost()->report;
  store.reset();  // node 0's store is gone too
  auto loss = one.wait_for_loss(5s);
  ASSERT_TRUE(loss.has_value());
  EXPECT_NE(loss->cause.find("node 0 is lost: the launchers' store it keeps at 127.0.0.1:" +
                             std::to_string(port) + " has not answered for"),
            std::string::npos)
      << loss->cause;
}

TEST(NodeWatch, TheStorePortIsMasterPortPlusOneOrFulgurLauncherPort) {
  ::unsetenv("FULGUR_LAUNCHER_PORT");
  EXPECT_EQ(launcher_store_port(29500), 29501);
  EXPECT_THROW(
      {
        try {
          launcher_store_port(65535);
        } catch (const ConfigError& e) {
          EXPECT_NE(std::string(e.what()).find("MASTER_PORT=65535"), std::string::npos);
          throw;
        }
      },
      ConfigError);
  ::setenv("FULGUR_LAUNCHER_PORT", "31000", 1);
  EXPECT_EQ(launcher_store_port(29500), 31000);
  for (const char* bad : {"0", "70000", "port", "12x"}) {
    ::setenv("FULGUR_LAUNCHER_PORT", bad, 1);
    try {
      launcher_store_port(29500);
      ADD_FAILURE() << bad;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("FULGUR_LAUNCHER_PORT=\"") + bad + "\""),
                std::string::npos)
          << e.what();
    }
  }
  ::unsetenv("FULGUR_LAUNCHER_PORT");
}

}  // namespace
}  // namespace fulgur::detail
