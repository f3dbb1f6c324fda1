// The process group's backends and its store, in one process: which
// backends this build has, the errors for the others, and a store's clone
// (a second client of the same server, which LibTorch 2.x's NCCL uses).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/core/errors.h"
#include "fulgur/strategies/process_group.h"
#include "strategies/tcp_store.h"
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
  group->all_reduce_(t, fulgur::ReduceOp::Mean);
  EXPECT_TRUE(torch::equal(t, torch::tensor({1.0, 2.0})));
  group->broadcast_(t, 0);
  EXPECT_TRUE(torch::equal(t, torch::tensor({1.0, 2.0})));
  EXPECT_EQ(group->broadcast_bytes("path/to/best.ckpt"), "path/to/best.ckpt");
  EXPECT_TRUE(torch::equal(group->all_gather(t), t.unsqueeze(0)));
  group->barrier();
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

}  // namespace
