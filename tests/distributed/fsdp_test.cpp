// Sharded data parallel (fsdp_shard_grad_op) with real processes and Gloo
// over 127.0.0.1, through tests/distributed/ddp_worker.cpp: two ranks with
// batch b end with the parameters of one process with batch 2b (as DDP
// does), under SGD and Adam, accumulation, manual optimization, a layer
// some steps do not use, and clipping by the norm over every shard; the
// fork launcher; a rank killed and restarted resumes from the sharded
// checkpoint and ends bit-identical to the run never stopped.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "distributed/worker.h"
#include "support/test_support.h"

namespace {

using fulgur::test::expect_equivalent;
using fulgur::test::expect_identical_runs;
using fulgur::test::recovery_training;
using fulgur::test::result_value;
using fulgur::test::run_worker;
using fulgur::test::TempDir;

constexpr const char* kFsdp = "fsdp_shard_grad_op";

TEST(FSDP, ShardGradOpOnTwoRanksMatchesOneProcessWithTheDoubleBatch) {
  expect_equivalent({"--steps", "20"}, kFsdp);
}

TEST(FSDP, ShardGradOpWithShuffleAndAdamMatches) {
  expect_equivalent({"--steps", "20", "--shuffle", "--optimizer", "adam"}, kFsdp);
}

TEST(FSDP, GradientAccumulationReducesOncePerStepAndMatches) {
  expect_equivalent({"--steps", "10", "--accumulate", "2"}, kFsdp);
}

TEST(FSDP, ManualOptimizationMatches) {
  expect_equivalent({"--steps", "20", "--manual-optimization"}, kFsdp);
}

TEST(FSDP, ALayerSomeStepsDoNotUseMatches) {
  expect_equivalent({"--steps", "20", "--unused-layer"}, kFsdp);
}

// The clipping norm is over every rank's shard: the same as one process's
// over the whole gradient (a local norm would clip differently, and fail).
TEST(FSDP, ClippingByNormUsesTheNormOverEveryShard) {
  expect_equivalent({"--steps", "20", "--gradient-clip-val", "0.05"}, kFsdp);
}

TEST(FSDP, TheForkLauncherMatchesToo) {
  expect_equivalent({"--steps", "20", "--optimizer", "adam"}, "fsdp_shard_grad_op_fork");
}

// recovery_training's run (Adam, shuffled, deterministic, a sharded
// checkpoint every 4 steps); a rank SIGKILLed at step 13 and restarted
// resumes from the newest one.
TEST(FSDP, ARankKilledAndRestartedResumesFromTheShardedCheckpointBitIdentical) {
  TempDir dir;
  const std::string d = dir.path();
  for (const auto& [name, more] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"reference", {}}, {"killed", {"--max-restarts", "1", "--kill", "1:13"}}}) {
    auto args = recovery_training(kFsdp, 5, d, name);
    args.insert(args.end(), more.begin(), more.end());
    auto r = run_worker(args);
    EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
    EXPECT_EQ(result_value(r.output, "global_step"), "30") << name << ":\n" << r.output;
    if (name == "killed") {
      EXPECT_NE(r.output.find("fulgur: restart 1 of 1"), std::string::npos) << r.output;
    }
  }
  // The checkpoints are directories of per-rank shards with a manifest.
  EXPECT_TRUE(std::filesystem::exists(d + "/killed/checkpoints/last.ckpt/manifest.txt"));
  expect_identical_runs(d, "reference", "killed");
}

}  // namespace
