// Ranks no launcher of fulgur's supervises, watching each other through
// the store: the desync judgement alone, then PeerWatch objects of two
// "ranks" in one process over a real store on 127.0.0.1, their ending
// recorded instead of ending the process. (Real ranks under srun's
// variables: LaunchPaths.Unsupervised* in launch_paths_test.cpp.)
#include "distributed/peer_watch.h"

#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <thread>

#include "fulgur/distributed/process_group.h"
#include "distributed/tcp_store.h"

namespace fulgur::detail {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

WaitReport in(const char* kind, int64_t seq, int64_t beat) { return {beat, kind, seq, 64}; }

TEST(WaitReport, EncodesAndDecodesAWaitAndNoWait) {
  EXPECT_EQ(encode(in("all_reduce", 57, 3)), "3 all_reduce 57 64");
  EXPECT_EQ(encode(WaitReport{4, "", 0, 0}), "4 -");
  auto wait = decode_wait("3 all_reduce 57 64");
  ASSERT_TRUE(wait.has_value());
  EXPECT_EQ(wait->beat, 3);
  EXPECT_EQ(wait->kind, "all_reduce");
  EXPECT_EQ(wait->seq, 57);
  EXPECT_EQ(wait->bytes, 64);
  auto none = decode_wait("4 -");
  ASSERT_TRUE(none.has_value());
  EXPECT_TRUE(none->kind.empty());
  EXPECT_FALSE(decode_wait("").has_value());
  EXPECT_FALSE(decode_wait("3 all_reduce 57").has_value());
  EXPECT_FALSE(decode_wait("3 - extra").has_value());
}

TEST(DesyncJudge, NamesRanksThatWaitUnmovingInDifferentCollectivesOfOneCallNumber) {
  DesyncJudge judge(3, 10s, 3s);
  const auto t0 = Clock::now();
  for (int s = 0; s <= 11; ++s) {
    const auto now = t0 + std::chrono::seconds(s);
    judge.observe(0, in("all_reduce", 5, s), now);
    judge.observe(1, in("all_reduce", 5, s), now);
    judge.observe(2, in("barrier", 5, s), now);
    if (s < 10) {
      EXPECT_FALSE(judge.verdict(now).has_value()) << s;
    }
  }
  auto verdict = judge.verdict(t0 + 11s);
  ASSERT_TRUE(verdict.has_value());
  EXPECT_NE(verdict->find("waited 11.0 s in different collectives of one call number"),
            std::string::npos)
      << *verdict;
  EXPECT_NE(verdict->find("ranks 0, 1: in all_reduce #5 (64 B); rank 2: in barrier #5 (64 B)"),
            std::string::npos)
      << *verdict;
  EXPECT_NE(verdict->find("a desync"), std::string::npos) << *verdict;
  // One kind, another size: a desync too.
  DesyncJudge sizes(2, 1s, 3s);
  for (int s = 0; s <= 2; ++s) {
    sizes.observe(0, in("all_reduce", 8, s), t0 + std::chrono::seconds(s));
    sizes.observe(1, WaitReport{s, "all_reduce", 8, 4096}, t0 + std::chrono::seconds(s));
  }
  ASSERT_TRUE(sizes.verdict(t0 + 2s).has_value());
  EXPECT_NE(sizes.verdict(t0 + 2s)->find("rank 0: in all_reduce #8 (64 B); rank 1: in all_reduce "
                                         "#8 (4.0 KiB)"),
            std::string::npos)
      << *sizes.verdict(t0 + 2s);
}

TEST(DesyncJudge, NoVerdictUnlessEveryRankWaitsAliveAndUnmovingInAnotherCollective) {
  const auto t0 = Clock::now();
  // All in the same collective (a slow link, a large transfer): no desync.
  {
    DesyncJudge judge(2, 1s, 3s);
    for (int s = 0; s <= 5; ++s) {
      judge.observe(0, in("all_reduce", 5, s), t0 + std::chrono::seconds(s));
      judge.observe(1, in("all_reduce", 5, s), t0 + std::chrono::seconds(s));
    }
    EXPECT_FALSE(judge.verdict(t0 + 5s).has_value());
  }
  // At different call numbers: a rank that left #5 saw every rank post it,
  // so this is a stalled transfer (the timeout names it), not a desync.
  {
    DesyncJudge judge(2, 1s, 3s);
    for (int s = 0; s <= 5; ++s) {
      judge.observe(0, in("all_reduce", 6, s), t0 + std::chrono::seconds(s));
      judge.observe(1, in("broadcast", 5, s), t0 + std::chrono::seconds(s));
    }
    EXPECT_FALSE(judge.verdict(t0 + 5s).has_value());
  }
  // One rank outside any collective (a long step), or with no report yet:
  // it may still come.
  {
    DesyncJudge judge(2, 1s, 3s);
    for (int s = 0; s <= 5; ++s) {
      judge.observe(0, in("all_reduce", 5, s), t0 + std::chrono::seconds(s));
      judge.observe(1, WaitReport{s, "", 0, 0}, t0 + std::chrono::seconds(s));
    }
    EXPECT_FALSE(judge.verdict(t0 + 5s).has_value());
    judge.observe(1, std::nullopt, t0 + 6s);
    EXPECT_FALSE(judge.verdict(t0 + 6s).has_value());
  }
  // A rank whose beat stopped (frozen: its last report may be stale).
  {
    DesyncJudge judge(2, 1s, 3s);
    for (int s = 0; s <= 6; ++s) {
      judge.observe(0, in("all_reduce", 6, s), t0 + std::chrono::seconds(s));
      judge.observe(1, in("broadcast", 6, 1), t0 + std::chrono::seconds(s));
    }
    EXPECT_FALSE(judge.verdict(t0 + 6s).has_value());
  }
  // A rank that moves on starts its count again.
  {
    DesyncJudge judge(2, 2s, 3s);
    for (int s = 0; s <= 3; ++s) {
      judge.observe(0, in("all_reduce", 9, s), t0 + std::chrono::seconds(s));
      judge.observe(1, in(s == 3 ? "barrier" : "all_reduce", 6 + s, s),
                    t0 + std::chrono::seconds(s));
    }
    EXPECT_FALSE(judge.verdict(t0 + 3s).has_value());
  }
}

// Two ranks' watches over one store, fast; their endings recorded.
struct TwoRanks {
  explicit TwoRanks(std::chrono::milliseconds period = 50ms) {
    const int port = find_free_port("127.0.0.1");
    server = c10::make_intrusive<TcpStore>("127.0.0.1", port, /*server=*/true, 5s);
    for (int r = 0; r < 2; ++r) {
      PeerWatchOptions o;
      o.rank = r;
      o.world = 2;
      o.stop_grace = 300ms;
      o.desync_after = 8 * period;
      o.period = period;
      auto connect = [port]() -> c10::intrusive_ptr<c10d::Store> {
        return c10::make_intrusive<TcpStore>("127.0.0.1", port, /*server=*/false, 1s);
      };
      watch[r] =
          std::make_unique<PeerWatch>(connect(), connect, o, [this, r](const std::string& message) {
            std::lock_guard<std::mutex> lock(mutex);
            ended[r] = message;
          });
    }
  }
  ~TwoRanks() {
    for (auto& w : watch) w.reset();
  }
  // Waits (bounded) until `rank`'s watch ended it; its message.
  std::string wait_for_end(int rank) {
    for (auto deadline = Clock::now() + 20s; Clock::now() < deadline;) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (!ended[rank].empty()) return ended[rank];
      }
      std::this_thread::sleep_for(20ms);
    }
    return "";
  }
  std::string end_of(int rank) {
    std::lock_guard<std::mutex> lock(mutex);
    return ended[rank];
  }

  c10::intrusive_ptr<TcpStore> server;
  std::unique_ptr<PeerWatch> watch[2];
  std::mutex mutex;
  std::string ended[2];
};

TEST(PeerWatch, RanksWaitingInDifferentCollectivesAllEndNamingADesync) {
  TwoRanks ranks;
  ranks.watch[0]->enter({"all_reduce", 3, 4096});
  ranks.watch[1]->enter({"barrier", 3, 0});
  for (int r = 0; r < 2; ++r) {
    const std::string message = ranks.wait_for_end(r);
    EXPECT_NE(message.find(str("rank ", r, " of 2 ends: the ranks have waited")), std::string::npos)
        << message;
    EXPECT_NE(message.find("rank 0: in all_reduce #3 (4.0 KiB); rank 1: in barrier #3 (0 B)"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("a desync"), std::string::npos) << message;
  }
}

TEST(PeerWatch, ARankWaitingForAPeerThatFailedEndsAfterTheGraceNamingIt) {
  TwoRanks ranks;
  ranks.watch[1]->publish_failure(/*peer_lost=*/false, nullptr,
                                  "ConfigError: a bad flag on rank 1\nits second line");
  EXPECT_EQ(ranks.watch[0]->known_failure(),
            "rank 1 failed first: ConfigError: a bad flag on rank 1");
  // Its peer has not waited yet: nothing ends it.
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(ranks.end_of(0), "");
  ranks.watch[0]->enter({"all_reduce", 7, 2600});
  const std::string message = ranks.wait_for_end(0);
  EXPECT_NE(message.find("rank 0 of 2 ends: rank 1 failed (ConfigError: a bad flag on rank 1), "
                         "and this rank has waited for it in all_reduce #7 (2.5 KiB)"),
            std::string::npos)
      << message;
  // The failed rank ends by its own failure, not by its watch.
  ranks.watch[1]->enter({"barrier", 9, 0});
  std::this_thread::sleep_for(700ms);
  EXPECT_EQ(ranks.end_of(1), "");
}

TEST(PeerWatch, AFailureAnnouncedInAStageIsForgottenWhenTheRankStartsAnother) {
  TwoRanks ranks;
  ranks.watch[1]->publish_failure(/*peer_lost=*/false, nullptr, "OSError: disk full");
  EXPECT_EQ(ranks.watch[0]->known_failure(), "rank 1 failed first: OSError: disk full");
  // The program caught it, and both ranks go on to test().
  ranks.watch[1]->new_stage();
  ranks.watch[0]->new_stage();
  EXPECT_EQ(ranks.watch[0]->known_failure(), "");
  ranks.watch[0]->enter({"all_reduce", 12, 64});
  std::this_thread::sleep_for(700ms);
  EXPECT_EQ(ranks.end_of(0), "");
  // A failure in the new stage counts again.
  ranks.watch[1]->publish_failure(/*peer_lost=*/false, nullptr, "OSError: disk still full");
  const std::string message = ranks.wait_for_end(0);
  EXPECT_NE(message.find("rank 1 failed (OSError: disk still full)"), std::string::npos) << message;
}

TEST(PeerWatch, NoStoreTrafficWhileNoCollectiveWaitsAPeriodAndNoEndForOneCollective) {
  TwoRanks ranks(400ms);
  // Short collectives (well under the period): nothing reaches the store.
  for (int i = 0; i < 20; ++i) {
    ranks.watch[0]->enter({"all_reduce", i, 64});
    ranks.watch[1]->enter({"all_reduce", i, 64});
    std::this_thread::sleep_for(5ms);
    ranks.watch[0]->leave();
    ranks.watch[1]->leave();
  }
  std::this_thread::sleep_for(900ms);
  EXPECT_EQ(ranks.server->getNumKeys(), 0);
  EXPECT_EQ(ranks.watch[0]->known_failure(), "");
  // Both in the same long collective (a slow peer, a large transfer): they
  // report it, and nothing ends them.
  ranks.watch[0]->enter({"all_reduce", 21, 64});
  ranks.watch[1]->enter({"all_reduce", 21, 64});
  std::this_thread::sleep_for(1500ms);
  EXPECT_GT(ranks.server->getNumKeys(), 0);
  EXPECT_EQ(ranks.end_of(0), "");
  EXPECT_EQ(ranks.end_of(1), "");
}

TEST(PeerWatch, ARankThatOnlyLostAPeerIsNotNamedAsTheCause) {
  TwoRanks ranks;
  ranks.watch[0]->enter({"all_reduce", 21, 64});
  ranks.watch[1]->publish_failure(/*peer_lost=*/true, nullptr, "all_reduce #21 failed: reset");
  EXPECT_EQ(ranks.watch[0]->known_failure(), "");
  const std::string message = ranks.wait_for_end(0);
  EXPECT_NE(message.find("rank 1 lost a peer (all_reduce #21 failed: reset) and no rank said that "
                         "it failed on its own"),
            std::string::npos)
      << message;
}

TEST(PeerWatch, AStoreThatNoLongerAnswersIsNamedAsRankZerosEnd) {
  TwoRanks ranks;
  EXPECT_EQ(ranks.watch[1]->known_failure(), "");
  ranks.server.reset();  // rank 0's process, and its store, are gone
  EXPECT_EQ(ranks.watch[1]->known_failure(),
            "Rank 0, which holds the ranks' store, does not answer either: it failed or died, and "
            "its own output says why");
  // Its watch ends nothing for it: the collective's own error says it.
  ranks.watch[1]->enter({"all_reduce", 4, 64});
  std::this_thread::sleep_for(700ms);
  EXPECT_EQ(ranks.end_of(1), "");
}

}  // namespace
}  // namespace fulgur::detail
