// The process group's backends and its store, in one process: which
// backends this build has, the errors for the others, and a store's clone
// (a second client of the same server, which LibTorch 2.x's NCCL uses), its
// bounded connect and its server's handling of a malformed request.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <thread>

#include "fulgur/core/errors.h"
#include "fulgur/distributed/process_group.h"
#include "distributed/tcp_store.h"
#include "support/test_support.h"

namespace {

bool has(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

fulgur::ProcessGroupOptions one_rank(const std::string& backend) {
  fulgur::ProcessGroupOptions o;
  o.main_port = fulgur::find_free_port();
  o.timeout = std::chrono::seconds(20);
  o.backend = backend;
  return o;
}

// A rank that never comes (it failed before it joined): the rendezvous
// says now and then that it still waits, and gives up at the timeout.
TEST(ProcessGroup, ARendezvousWaitingForARankThatNeverComesSaysSoUntilItGivesUp) {
  fulgur::ProcessGroupOptions o = one_rank("gloo");
  o.world_size = 2;
  o.timeout = std::chrono::milliseconds(2500);
  o.rendezvous_note_after = std::chrono::milliseconds(500);
  testing::internal::CaptureStderr();
  EXPECT_THROW(fulgur::ProcessGroup::connect(o), fulgur::DistributedError);
  const std::string notes = testing::internal::GetCapturedStderr();
  for (const char* after : {"0.5", "1.0", "2.0"}) {
    EXPECT_NE(notes.find(fulgur::str(
                  "fulgur: rank 0 of 2: the rendezvous at 127.0.0.1:", o.main_port, " has waited ",
                  after, " s for the other ranks (it gives up after 2.5 s")),
              std::string::npos)
        << notes;
  }
  EXPECT_NE(notes.find("A rank that failed before it joined"), std::string::npos) << notes;
  // None once every rank has come: two ranks that meet at once, and wait
  // past the note's time in the group.
  o.main_port = fulgur::find_free_port();
  o.timeout = std::chrono::seconds(20);
  testing::internal::CaptureStderr();
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([o, rank] {
      fulgur::ProcessGroupOptions mine = o;
      mine.rank = rank;
      auto group = fulgur::ProcessGroup::connect(mine);
      std::this_thread::sleep_for(std::chrono::milliseconds(800));
      group->barrier();
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

// Checks in a death test's child, which reports by its exit status: each
// failed one is written to stderr and counted.
struct ChildChecks {
  int failed = 0;
  void operator()(bool ok, const std::string& what) {
    if (ok) return;
    std::cerr << "check failed: " << what << "\n";
    ++failed;
  }
};

void set_open_file_limit(rlim_t soft, rlim_t hard) {
  const rlimit limit{soft, hard};
  if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) std::exit(100);
}

rlim_t soft_open_file_limit() {
  rlimit limit{};
  ::getrlimit(RLIMIT_NOFILE, &limit);
  return limit.rlim_cur;
}

// Ranks (threads here) whose rendezvous waits for one that failed before it
// joined: it tells them through the store, and their rendezvous fails at
// once naming it, not at the 60 s timeout.
struct EarlyFailure {
  std::vector<std::string> errors;                // each waiting rank's
  bool told = false;                              // what the failed rank's announcement returned
  std::chrono::steady_clock::duration longest{};  // the longest rank's time in connect()
};

EarlyFailure rendezvous_with_a_failed_rank(fulgur::ProcessGroupOptions o, int failed,
                                           const std::string& what) {
  o.timeout = std::chrono::seconds(60);
  EarlyFailure out;
  out.errors.resize(static_cast<size_t>(o.world_size));
  std::mutex mutex;
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < o.world_size; ++rank) {
    ranks.emplace_back([&, rank] {
      fulgur::ProcessGroupOptions mine = o;
      mine.rank = rank;
      if (rank == failed) {
        // It fails after its peers started waiting.
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        out.told = fulgur::ProcessGroup::announce_failure_before_joining(mine, what);
        return;
      }
      const auto start = std::chrono::steady_clock::now();
      std::string error;
      try {
        fulgur::ProcessGroup::connect(mine);
      } catch (const fulgur::DistributedError& e) {
        error = e.what();
      }
      std::lock_guard<std::mutex> lock(mutex);
      out.errors[static_cast<size_t>(rank)] = error;
      out.longest = std::max(out.longest, std::chrono::steady_clock::now() - start);
    });
  }
  for (auto& t : ranks) t.join();
  return out;
}

TEST(ProcessGroup, ARankThatFailsBeforeItJoinsIsNamedByTheRanksWaitingForIt) {
  // Four ranks: those whose Gloo connection to a peer waits on a rank held
  // up by the failed one fail too (they wait in the store first).
  fulgur::ProcessGroupOptions o = one_rank("gloo");
  o.world_size = 4;
  auto r = rendezvous_with_a_failed_rank(
      o, 1, "rank 1: devices=4, but this machine has 2 CUDA devices.\nmore of its error");
  EXPECT_TRUE(r.told);
  for (int rank : {0, 2, 3}) {
    const std::string& error = r.errors[static_cast<size_t>(rank)];
    EXPECT_TRUE(fulgur::test::message_contains(
        error, {fulgur::str("rank ", rank,
                            " of 4: rank 1 failed before it joined the rendezvous "
                            "at 127.0.0.1:",
                            o.main_port,
                            ": rank 1: devices=4, but this machine has 2 CUDA devices. The "
                            "rendezvous cannot complete without it")}))
        << error;
    EXPECT_EQ(error.find("more of its error"), std::string::npos) << error;
  }
  // Not at the timeout (60 s): within seconds, even on a loaded machine.
  EXPECT_LT(r.longest, std::chrono::seconds(30));
  // Rank 0 itself, whose store the others wait to reach: it hosts one
  // until they have read why.
  o.main_port = fulgur::find_free_port();
  o.world_size = 3;
  r = rendezvous_with_a_failed_rank(o, 0, "train.yaml: no such file");
  EXPECT_TRUE(r.told) << "rank 0 ended before every rank had read its failure";
  for (int rank : {1, 2}) {
    EXPECT_TRUE(fulgur::test::message_contains(
        r.errors[static_cast<size_t>(rank)],
        {fulgur::str("rank ", rank, " of 3: rank 0 failed before it joined the rendezvous"),
         ": train.yaml: no such file"}))
        << r.errors[static_cast<size_t>(rank)];
  }
  EXPECT_LT(r.longest, std::chrono::seconds(30));
}

// Every rank fails alike (a flag wrong everywhere): each tells, and rank 0
// ends once every rank has, not after its bound. A rank that has begun the
// rendezvous tells nothing: its failure there (a timeout, here) is no
// failure before it joined.
TEST(ProcessGroup, RanksThatAllFailBeforeJoiningEndTogetherAndARankInTheRendezvousTellsNothing) {
  fulgur::ProcessGroupOptions o = one_rank("gloo");
  o.world_size = 2;
  bool told[2] = {false, false};
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&told, o, rank] {
      fulgur::ProcessGroupOptions mine = o;
      mine.rank = rank;
      told[rank] =
          fulgur::ProcessGroup::announce_failure_before_joining(mine, "max_epochs=-1 is negative");
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_TRUE(told[0]) << "rank 0 gave up before rank 1 had told";
  EXPECT_TRUE(told[1]);

  // Three ranks, one never comes: rank 1 times out in the rendezvous (2 s)
  // while rank 0 still waits there (8 s).
  o.main_port = fulgur::find_free_port();
  o.world_size = 3;
  std::string error;
  std::thread waiting([&] {
    fulgur::ProcessGroupOptions first = o;
    first.timeout = std::chrono::seconds(8);
    try {
      fulgur::ProcessGroup::connect(first);
    } catch (const fulgur::DistributedError& e) {
      error = e.what();
    }
  });
  fulgur::ProcessGroupOptions second = o;
  second.rank = 1;
  second.timeout = std::chrono::seconds(2);
  EXPECT_THROW(fulgur::ProcessGroup::connect(second), fulgur::DistributedError);
  EXPECT_FALSE(fulgur::ProcessGroup::announce_failure_before_joining(second, "its timeout"));
  waiting.join();
  EXPECT_EQ(error.find("failed before it joined"), std::string::npos) << error;
  EXPECT_NE(error.find("no answer within 8 s"), std::string::npos) << error;
}

// Hundreds of ranks need more open files than Linux's usual soft limit of
// 1024 (rank 0's store alone holds two connections per rank): the group
// raises the soft limit as far as the hard one allows, and says when that
// is not enough. (In children: a lowered hard limit cannot be raised again.)
TEST(ProcessGroup, RaisesTheOpenFileLimitItsRanksNeedAndSaysWhenTheHardLimitIsBelow) {
  rlimit limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  if (limit.rlim_max != RLIM_INFINITY && limit.rlim_max < 2000) {
    GTEST_SKIP() << "this machine's hard limit of open files is " << limit.rlim_max;
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ChildChecks check;
        // The group: two ranks (threads) raise it to what 2 ranks need (256
        // and a few more than now), from a limit just above now.
        set_open_file_limit(fulgur::detail::open_files_in_use() + 40, limit.rlim_max);
        fulgur::ProcessGroupOptions o = one_rank("gloo");
        o.world_size = 2;
        std::vector<std::thread> ranks;
        for (int rank = 0; rank < 2; ++rank) {
          ranks.emplace_back([o, rank] {
            fulgur::ProcessGroupOptions mine = o;
            mine.rank = rank;
            fulgur::ProcessGroup::connect(mine)->barrier();
          });
        }
        for (auto& t : ranks) t.join();
        check(soft_open_file_limit() >=
                  static_cast<rlim_t>(fulgur::detail::open_files_in_use()) + 256,
              "connect raised the soft limit to " + std::to_string(soft_open_file_limit()));
        set_open_file_limit(256, limit.rlim_max);
        check(fulgur::detail::raise_open_file_limit(1500).empty(), "1500 is within the hard limit");
        check(soft_open_file_limit() == 1500, "the soft limit is raised to 1500");
        check(fulgur::detail::raise_open_file_limit(700).empty(), "700 is within it");
        check(soft_open_file_limit() == 1500, "a lower need leaves the limit");
        set_open_file_limit(300, 300);
        const std::string note = fulgur::detail::raise_open_file_limit(1500);
        check(fulgur::test::message_contains(
                  note, {"about 1500 open files", "its limit is 300", "hard limit 300",
                         "Too many open files", "ulimit -Hn", "LimitNOFILE"}),
              "the note: " + note);
        std::exit(check.failed);
      },
      testing::ExitedWithCode(0), "");
}

// Outside the ports outgoing connections take: none of the connections
// other tests open can take it before its store binds it.
TEST(ProcessGroup, AFreePortIsOutsideTheRangeOutgoingConnectionsTake) {
  int first = 32768, last = 60999;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> first >> last;
  if (first < 11000) GTEST_SKIP() << "this machine's ip_local_port_range leaves no room below it";
  for (int i = 0; i < 20; ++i) {
    const int port = fulgur::find_free_port();
    EXPECT_GE(port, 10000);
    EXPECT_LT(port, first) << "in the ephemeral range " << first << "-" << last;
    int sock = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << port;
    ::close(sock);
  }
}

TEST(ProcessGroup, GlooIsAlwaysThereAndTheDefaultOnCpu) {
  auto backends = fulgur::available_process_group_backends();
  EXPECT_TRUE(has(backends, "gloo"));
  EXPECT_EQ(fulgur::default_process_group_backend(c10::Device(c10::kCPU)), "gloo");
  // A CUDA device takes nccl exactly when this build has it.
  EXPECT_EQ(fulgur::default_process_group_backend(c10::Device(c10::kCUDA, 0)),
            has(backends, "nccl") ? "nccl" : "gloo");
}

TEST(ProcessGroup, ABackendThisBuildLacksIsNamedWithTheAvailableOnes) {
  auto backends = fulgur::available_process_group_backends();
  for (const std::string name : {"nccl", "mpi"}) {
    if (has(backends, name)) continue;
    EXPECT_THROWS_WITH(fulgur::DistributedError, fulgur::ProcessGroup::connect(one_rank(name)),
                       {"\"" + name + "\"", "built without it", "Available: gloo"});
  }
  EXPECT_THROWS_WITH(fulgur::DistributedError, fulgur::ProcessGroup::connect(one_rank("glo")),
                     {"\"glo\"", "is not a backend", "Available: gloo"});
}

TEST(ProcessGroup, NcclNeedsACudaDevice) {
  if (!has(fulgur::available_process_group_backends(), "nccl")) {
    GTEST_SKIP() << "this LibTorch has no NCCL";
  }
  EXPECT_THROWS_WITH(fulgur::DistributedError, fulgur::ProcessGroup::connect(one_rank("nccl")),
                     {"runs on CUDA devices", "cpu", "gloo"});
}

TEST(ProcessGroup, OneRankCollectivesReturnTheirInput) {
  auto group = fulgur::ProcessGroup::connect(one_rank("gloo"));
  at::Tensor t = torch::tensor({1.0, 2.0});
  group->all_reduce_(t, fulgur::ReduceOp::kMean);
  EXPECT_TRUE(torch::equal(t, torch::tensor({1.0, 2.0})));
  group->broadcast_(t, 0);
  EXPECT_TRUE(torch::equal(t, torch::tensor({1.0, 2.0})));
  EXPECT_EQ(group->broadcast_bytes("path/to/best.ckpt"), "path/to/best.ckpt");
  EXPECT_TRUE(torch::equal(group->all_gather(t), t.unsqueeze(0)));
  group->barrier();
}

TEST(ProcessGroup, TwoRankCollectivesCombineEveryRanksValues) {
  at::Tensor sum[2], mean[2], max[2], min[2], int_max[2], int_min[2], from_one[2], gathered[2];
  std::string bytes[2];
  const std::string long_path = std::string(5000, 'x').append("/best.ckpt");
  fulgur::test::on_ranks(2, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    // Rank 0 holds {1, 5}, rank 1 holds {4, 2}: each op picks differently.
    const auto mine = rank == 0 ? torch::tensor({1.0, 5.0}) : torch::tensor({4.0, 2.0});
    auto reduce = [&](fulgur::ReduceOp op, const at::Tensor& t) {
      at::Tensor out = t.clone();
      group->all_reduce_(out, op);
      return out;
    };
    sum[rank] = reduce(fulgur::ReduceOp::kSum, mine);
    mean[rank] = reduce(fulgur::ReduceOp::kMean, mine);
    max[rank] = reduce(fulgur::ReduceOp::kMax, mine);
    min[rank] = reduce(fulgur::ReduceOp::kMin, mine);
    // reduce_boolean_decision's form: one int, all = Min, any = Max.
    const auto vote = torch::tensor({rank}, torch::kInt);
    int_max[rank] = reduce(fulgur::ReduceOp::kMax, vote);
    int_min[rank] = reduce(fulgur::ReduceOp::kMin, vote);
    from_one[rank] = mine.clone();
    group->broadcast_(from_one[rank], /*src=*/1);
    // Rank 1's bytes are longer than rank 0's: every rank gets all of them.
    bytes[rank] = group->broadcast_bytes(rank == 1 ? long_path : "", /*src=*/1);
    gathered[rank] = group->all_gather(mine);
    group->barrier();
  });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(torch::equal(sum[r], torch::tensor({5.0, 7.0})));
    EXPECT_TRUE(torch::equal(mean[r], torch::tensor({2.5, 3.5})));
    EXPECT_TRUE(torch::equal(max[r], torch::tensor({4.0, 5.0})));
    EXPECT_TRUE(torch::equal(min[r], torch::tensor({1.0, 2.0})));
    EXPECT_EQ(int_max[r].item<int>(), 1);
    EXPECT_EQ(int_min[r].item<int>(), 0);
    EXPECT_TRUE(torch::equal(from_one[r], torch::tensor({4.0, 2.0})));
    EXPECT_EQ(bytes[r], long_path);
    EXPECT_TRUE(torch::equal(gathered[r], torch::tensor({{1.0, 5.0}, {4.0, 2.0}})));
  }
}

// The collectives of sharded data parallel, on 3 ranks (chunks that do not
// line up with the world of 2): a reduce-scatter gives each rank its chunk
// of the sum; an all-gather into one buffer concatenates the shards.
TEST(ProcessGroup, ReduceScatterAndAllGatherIntoOnThreeRanks) {
  constexpr int kWorld = 3;
  at::Tensor scattered[kWorld], gathered[kWorld], one_rank_sum;
  std::string bad_input[kWorld], bad_output[kWorld];
  // Rank r holds r * 100 + [0, 1, ..., 11]: 4 elements per rank.
  auto input_of = [](int rank) { return torch::arange(12, torch::kFloat) + 100.0 * rank; };
  fulgur::test::on_ranks(kWorld, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    scattered[rank] = group->reduce_scatter_sum(input_of(rank));
    at::Tensor out = torch::full({6}, -1.0);
    group->all_gather_into(out, torch::full({2}, static_cast<double>(rank)));
    gathered[rank] = out;
    try {
      group->reduce_scatter_sum(torch::zeros({10}));  // 10 is not a multiple of 3
    } catch (const fulgur::DistributedError& e) {
      bad_input[rank] = e.what();
    }
    try {
      at::Tensor small = torch::zeros({5});
      group->all_gather_into(small, torch::zeros({2}));
    } catch (const fulgur::DistributedError& e) {
      bad_output[rank] = e.what();
    }
    group->barrier();  // the refused calls started no collective: still in step
  });
  const at::Tensor sum = input_of(0) + input_of(1) + input_of(2);
  for (int r = 0; r < kWorld; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(torch::equal(scattered[r], sum.narrow(0, 4 * r, 4)));
    EXPECT_TRUE(torch::equal(gathered[r], torch::tensor({0.0, 0.0, 1.0, 1.0, 2.0, 2.0})));
    EXPECT_TRUE(fulgur::test::message_contains(
        bad_input[r], {"reduce_scatter", "[10]", "divisible by 3", "Pad it"}));
    EXPECT_TRUE(fulgur::test::message_contains(bad_output[r], {"all_gather_into", "[5]"}));
  }
  auto single = fulgur::ProcessGroup::connect(one_rank("gloo"));
  EXPECT_TRUE(torch::equal(single->reduce_scatter_sum(input_of(1)), input_of(1)));
}

// Four ranks (a ring of three steps): the in-place reduce-scatter leaves
// each rank's sum in its own chunk of the input and returns that view; an
// all-gather whose shard is already the rank's chunk of the output fills the
// rest around it.
TEST(ProcessGroup, InPlaceReduceScatterAndAllGatherOnFourRanks) {
  constexpr int kWorld = 4;
  at::Tensor scattered[kWorld], gathered[kWorld];
  bool is_view[kWorld] = {};
  auto input_of = [](int rank) { return torch::arange(16, torch::kFloat) * (rank + 1); };
  fulgur::test::on_ranks(kWorld, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    at::Tensor input = input_of(rank);
    at::Tensor mine = group->reduce_scatter_sum_(input);
    is_view[rank] = mine.data_ptr() == input.narrow(0, 4 * rank, 4).data_ptr();
    scattered[rank] = mine.clone();
    at::Tensor out = torch::full({8}, -1.0);
    out.narrow(0, 2 * rank, 2).fill_(rank);
    group->all_gather_into(out, out.narrow(0, 2 * rank, 2));
    gathered[rank] = out;
  });
  const at::Tensor sum = torch::arange(16, torch::kFloat) * 10;  // 1 + 2 + 3 + 4
  for (int r = 0; r < kWorld; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(is_view[r]);
    EXPECT_TRUE(torch::equal(scattered[r], sum.narrow(0, 4 * r, 4)));
    EXPECT_TRUE(torch::equal(gathered[r], torch::tensor({0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0})));
  }
}

// Exchanges under way at once on 3 ranks (each ring has a tag of its own),
// with a blocking collective between their start and their end, waited in
// the other order: each lands where it should.
TEST(ProcessGroup, AsyncExchangesOverlapEachOtherAndACollective) {
  constexpr int kWorld = 3;
  at::Tensor gathered[kWorld], scattered[kWorld], reduced[kWorld];
  fulgur::test::on_ranks(kWorld, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    at::Tensor out = torch::zeros({3 * 4});
    at::Tensor input = torch::arange(9, torch::kFloat) + 10.0 * rank;
    auto gather = group->all_gather_into_async(out, torch::full({4}, static_cast<float>(rank)));
    auto scatter = group->reduce_scatter_sum_async_(input);
    EXPECT_TRUE(gather.pending());
    at::Tensor one = torch::ones({2});
    group->all_reduce_(one, fulgur::ReduceOp::kSum);
    scatter.wait();
    gather.wait();
    EXPECT_FALSE(gather.pending());
    gathered[rank] = out;
    scattered[rank] = input.narrow(0, 3 * rank, 3).clone();
    reduced[rank] = one;
  });
  const at::Tensor sum = torch::arange(9, torch::kFloat) * 3 + 30.0;  // 0 + 10 + 20
  for (int r = 0; r < kWorld; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(torch::equal(gathered[r], torch::arange(3, torch::kFloat).repeat_interleave(4)));
    EXPECT_TRUE(torch::equal(scattered[r], sum.narrow(0, 3 * r, 3)));
    EXPECT_TRUE(torch::equal(reduced[r], torch::full({2}, 3.0f)));
  }
}

// ranks_arrive: true when every rank comes with the key in time; false for
// the one that waited in vain, and for a rank that comes after it gave up.
TEST(ProcessGroup, RanksArriveOnlyWhenEveryRankComesInTime) {
  bool together[2] = {}, waited = true, late = true;
  fulgur::test::on_ranks(2, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    together[rank] = group->ranks_arrive("together", std::chrono::seconds(20));
    if (rank == 0) waited = group->ranks_arrive("alone", std::chrono::milliseconds(200));
    group->barrier();  // rank 0 gave up by now
    if (rank == 1) late = group->ranks_arrive("alone", std::chrono::seconds(20));
  });
  EXPECT_TRUE(together[0]);
  EXPECT_TRUE(together[1]);
  EXPECT_FALSE(waited);
  EXPECT_FALSE(late);
}

// A peer that leaves instead of joining a ring: the rank waiting in it gets
// an error naming the exchange, the step and the peer, not a hang or an
// abort.
TEST(ProcessGroup, ARingWhosePeerLeavesIsAnErrorNamingTheStepAndThePeer) {
  std::string error;
  fulgur::test::on_ranks(2, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    group->barrier();
    if (rank == 1) return;  // leaves: its group is destroyed, its sockets closed
    at::Tensor out = torch::zeros({1 << 20});
    try {
      group->all_gather_into(out, torch::ones({1 << 19}));
    } catch (const fulgur::DistributedError& e) {
      error = e.what();
    }
  });
  EXPECT_TRUE(fulgur::test::message_contains(
      error, {"all_gather", "ring step 1 of 1", "rank 0 of 2", "rank 1", "failed"}))
      << error;
}

TEST(TcpStore, AClonePointsAtTheSameServer) {
  const int port = fulgur::find_free_port();
  auto store = c10::make_intrusive<fulgur::detail::TcpStore>("127.0.0.1", port, /*server=*/true,
                                                             std::chrono::seconds(10));
  auto copy = store->clone();
  copy->set("written-by-the-clone", std::vector<uint8_t>{1, 2, 3});
  EXPECT_EQ(store->get("written-by-the-clone"), (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_EQ(copy->add("counter", 2), 2);
  EXPECT_EQ(store->add("counter", 1), 3);
}

sockaddr_in loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return addr;
}

TEST(TcpStore, GivesUpAtItsTimeoutWhenTheServerDoesNotAnswer) {
  // A listener whose accept queue is full drops new connections' SYNs, as
  // a firewall would: a blocking connect() would wait about two minutes.
  const int port = fulgur::find_free_port();
  int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr = loopback(port);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(listener, 0), 0);
  int queued = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_EQ(::connect(queued, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROWS_WITH(
      fulgur::DistributedError,
      fulgur::detail::TcpStore("127.0.0.1", port, /*server=*/false, std::chrono::seconds(1)),
      {"cannot reach the main process's store at 127.0.0.1:" + std::to_string(port), "within 1 s"});
  // The timeout, not the kernel's two minutes of SYN retries.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  ::close(queued);
  ::close(listener);
}

// Out of open files: rank 0's store refuses a rank's connection at once and
// says why (the connection left queued would spin the store's thread and
// keep that rank waiting out its timeout), and goes on serving the others;
// a rank out of them itself fails at once naming the limit.
TEST(TcpStore, OutOfOpenFilesAConnectionFailsAtOnceNamingTheLimit) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ChildChecks check;
        const int port = fulgur::find_free_port();
        using fulgur::detail::TcpStore;
        auto server = c10::make_intrusive<TcpStore>("127.0.0.1", port, /*server=*/true,
                                                    std::chrono::seconds(20));
        // Both of the server's connections so far accepted (its own client's
        // and the first rank's), then every descriptor left taken but one:
        // room for the next client's own end, none for the server's.
        auto first = c10::make_intrusive<TcpStore>("127.0.0.1", port, /*server=*/false,
                                                   std::chrono::seconds(20));
        first->set("first", std::vector<uint8_t>{1});
        check(server->get("first") == std::vector<uint8_t>{1}, "the store serves");
        rlimit limit{};
        ::getrlimit(RLIMIT_NOFILE, &limit);
        set_open_file_limit(fulgur::detail::open_files_in_use() + 16, limit.rlim_max);
        std::vector<int> filler;
        for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) filler.push_back(fd);
        ::close(filler.back());
        filler.pop_back();
        // Refused, not left to wait out its 20 s timeout ("no answer within").
        std::string refused;
        try {
          TcpStore second("127.0.0.1", port, /*server=*/false, std::chrono::seconds(20));
          second.set("second", std::vector<uint8_t>{2});
        } catch (const fulgur::DistributedError& e) {
          refused = e.what();
        }
        check(
            fulgur::test::message_contains(refused, {"closed this new connection without an answer",
                                                     "no open file left for the connection"}),
            "the refused rank's error: " + refused);
        check(server->get("first") == std::vector<uint8_t>{1}, "the store still serves");
        // A rank with no descriptor left for its own end (the second's is
        // free again).
        const int last = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
        check(last >= 0, "the last descriptor opens");
        std::string own;
        try {
          TcpStore third("127.0.0.1", port, /*server=*/false, std::chrono::seconds(20));
          third.set("third", std::vector<uint8_t>{3});
        } catch (const fulgur::DistributedError& e) {
          own = e.what();
        }
        check(fulgur::test::message_contains(own, {"cannot open a connection to the store",
                                                   "Too many open files", "ulimit -n"}),
              "the rank out of open files: " + own);
        // Once a connection ends, a new one is served.
        ::close(last);
        for (int fd : filler) ::close(fd);
        first.reset();
        TcpStore fourth("127.0.0.1", port, /*server=*/false, std::chrono::seconds(20));
        check(fourth.get("first") == std::vector<uint8_t>{1}, "a later rank is served");
        std::exit(check.failed);
      },
      testing::ExitedWithCode(0),
      "rank 0: the store at 127.0.0.1:[0-9]+ cannot take another rank's connection: Too many open "
      "files");
}

TEST(TcpStore, AMalformedRequestDropsThatConnectionOnly) {
  const int port = fulgur::find_free_port();
  auto store = c10::make_intrusive<fulgur::detail::TcpStore>("127.0.0.1", port, /*server=*/true,
                                                             std::chrono::seconds(10));
  // An "add" whose amount is no number, from a client that is not ours.
  int raw = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr = loopback(port);
  ASSERT_EQ(::connect(raw, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  std::string request(1, '\x03');
  for (const std::string part : {"key", "not a number"}) {
    uint32_t n = htonl(static_cast<uint32_t>(part.size()));
    request.append(reinterpret_cast<const char*>(&n), 4);
    request += part;
  }
  ASSERT_EQ(::send(raw, request.data(), request.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(request.size()));
  pollfd p{raw, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 10000), 1) << "the store neither answered nor closed the connection";
  char byte;
  EXPECT_EQ(::recv(raw, &byte, 1, 0), 0) << "the malformed request's connection stays open";
  ::close(raw);
  // The server (rank 0's thread) is still there for everyone else.
  EXPECT_EQ(store->add("key", 2), 2);
  store->set("other", std::vector<uint8_t>{7});
  EXPECT_EQ(store->get("other"), std::vector<uint8_t>{7});
}

}  // namespace
