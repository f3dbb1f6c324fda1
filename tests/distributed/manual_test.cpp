// strategy = "manual" over real processes: the Module owns its parallelism
// (no device move, no wrapping, no gradient averaging by the strategy), the
// process group exists in configure_model(), callbacks use collectives, and
// checkpoints are per rank with a manifest.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "support/process.h"
#include "support/test_support.h"

namespace {

using fulgur::test::load_tensors;
using fulgur::test::ProcessResult;
using fulgur::test::result_value;
using fulgur::test::TempDir;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

ProcessResult run_manual(std::vector<std::string> args) {
  args.insert(args.begin(), FULGUR_MANUAL_WORKER);
  auto r = fulgur::test::run_process(args, {}, 120s);
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.leftover_processes, 0) << r.output;
  return r;
}

TEST(ManualStrategy, LeavesPlacementWrappingAndGradientsToTheModule) {
  auto r = run_manual({"--devices", "2", "--steps", "6"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank : {0, 1}) {
    const auto k = std::to_string(rank);
    EXPECT_EQ(result_value(r.output, "rank" + k + "_to_calls"), "0") << r.output;
    // The group existed in configure_model(), and callbacks reach every rank.
    EXPECT_EQ(result_value(r.output, "rank" + k + "_configure_model_world"), "2") << r.output;
    EXPECT_EQ(result_value(r.output, "rank" + k + "_callback_sum"), "3") << r.output;
    EXPECT_EQ(result_value(r.output, "rank" + k + "_global_step"), "6") << r.output;
  }
  // The replicated layer saw different data on each rank and nobody averaged
  // its gradients: the ranks' copies differ.
  EXPECT_NE(result_value(r.output, "rank0_fc_sum"), result_value(r.output, "rank1_fc_sum"))
      << r.output;
}

TEST(ManualStrategy, EveryRankWritesItsShardAndResumeRestoresEachExactly) {
  TempDir dir;
  const std::string root = dir.path() + "/run";
  const std::string first = dir.path() + "/first";
  const std::string second = dir.path() + "/second";
  fs::create_directories(first);
  fs::create_directories(second);
  auto r1 = run_manual({"--devices", "2", "--steps", "6", "--ckpt-root", root, "--out", first});
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  const fs::path last = fs::path(root) / "checkpoints" / "last.ckpt";
  ASSERT_TRUE(fs::is_directory(last)) << r1.output;
  EXPECT_TRUE(fs::exists(last / "rank-0-of-2.ckpt"));
  EXPECT_TRUE(fs::exists(last / "rank-1-of-2.ckpt"));
  EXPECT_TRUE(fs::exists(last / "manifest.txt"));
  // Resuming at the step it stopped trains no further: the weights each rank
  // loads are exactly the ones it saved.
  auto r2 = run_manual(
      {"--devices", "2", "--steps", "6", "--ckpt-root", root, "--resume", "last", "--out", second});
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  for (int rank : {0, 1}) {
    auto a = load_tensors(first + "/rank-" + std::to_string(rank) + ".pt");
    auto b = load_tensors(second + "/rank-" + std::to_string(rank) + ".pt");
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(torch::equal(a[i], b[i])) << "rank " << rank << " parameter " << i;
    }
  }
  // The shards differ: each rank restored its own.
  // (The table, a parameter of the module itself, comes first.)
  EXPECT_FALSE(torch::equal(load_tensors(first + "/rank-0.pt").front(),
                            load_tensors(first + "/rank-1.pt").front()));
}

TEST(ManualStrategy, ResumingOnAnotherWorldSizeOrWithoutAShardIsAClearError) {
  TempDir dir;
  const std::string root = dir.path() + "/run";
  auto r1 = run_manual({"--devices", "2", "--steps", "4", "--ckpt-root", root});
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  auto one =
      run_manual({"--devices", "1", "--steps", "8", "--ckpt-root", root, "--resume", "last"});
  EXPECT_NE(one.exit_code, 0);
  EXPECT_TRUE(fulgur::test::message_contains(
      one.output, {"was saved by 2 ranks, and this run has 1", "devices x num_nodes = 2"}));
  const std::string last = (fs::path(root) / "checkpoints" / "last.ckpt").string();
  fs::remove(fs::path(last) / "rank-1-of-2.ckpt");
  auto missing =
      run_manual({"--devices", "2", "--steps", "8", "--ckpt-root", root, "--resume", last});
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_TRUE(
      fulgur::test::message_contains(missing.output, {"is missing shard(s) rank-1-of-2.ckpt"}));
  // "last" skips it, says so, and resumes from the newest complete one.
  auto skipped =
      run_manual({"--devices", "2", "--steps", "8", "--ckpt-root", root, "--resume", "last"});
  EXPECT_EQ(skipped.exit_code, 0) << skipped.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      skipped.output, {"ckpt_path=\"last\": skipped", last, "is missing shard(s) rank-1-of-2.ckpt",
                       "Resuming from"}));
}

// A shard copied in from another save (here: rank 1's of step 4 into the
// save of step 8) verifies on its own; the manifest's fingerprints tell it
// apart. Both ranks stop with the reason (neither waits for the other),
// inspect names the shard, and a resume from "last" skips the checkpoint.
TEST(ManualStrategy, AShardOfAnotherSaveIsRefusedOnEveryRank) {
  TempDir dir;
  const std::string root = dir.path() + "/run";
  const fs::path last = fs::path(root) / "checkpoints" / "last.ckpt";
  auto r1 = run_manual({"--devices", "2", "--steps", "4", "--ckpt-root", root});
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  const std::string older = dir.path() + "/rank-1-step-4.ckpt";
  fs::copy_file(last / "rank-1-of-2.ckpt", older);
  auto r2 = run_manual({"--devices", "2", "--steps", "8", "--ckpt-root", root, "--resume", "last"});
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  auto inspected =
      fulgur::test::run_process({FULGUR_CLI, "checkpoint", "inspect", last.string()}, {}, 60s);
  EXPECT_EQ(inspected.exit_code, 0) << inspected.output;
  fs::copy_file(older, last / "rank-1-of-2.ckpt", fs::copy_options::overwrite_existing);

  auto mixed = run_manual(
      {"--devices", "2", "--steps", "12", "--ckpt-root", root, "--resume", last.string()});
  EXPECT_NE(mixed.exit_code, 0);
  EXPECT_TRUE(fulgur::test::message_contains(
      mixed.output, {"mixes saves: its shard rank-1-of-2.ckpt", "is not the one its save wrote",
                     "Put back the shard this save wrote"}));
  // Rank 0's shard is its own, and it stops with rank 1's reason.
  EXPECT_NE(mixed.output.find("rank 1 of 2 cannot load its shard, so no rank resumes"),
            std::string::npos)
      << mixed.output;
  inspected =
      fulgur::test::run_process({FULGUR_CLI, "checkpoint", "inspect", last.string()}, {}, 60s);
  EXPECT_EQ(inspected.exit_code, 1) << inspected.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      inspected.output,
      {"shard rank-1-of-2.ckpt", "CRC32C verified", "shard rank-1-of-2.ckpt: FROM ANOTHER SAVE"}));
  // ("last" resumes from an earlier checkpoint, and saves last.ckpt anew.)
  auto skipped =
      run_manual({"--devices", "2", "--steps", "12", "--ckpt-root", root, "--resume", "last"});
  EXPECT_EQ(skipped.exit_code, 0) << skipped.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      skipped.output,
      {"ckpt_path=\"last\": skipped", last.string(), "mixes saves", "Resuming from"}));
}

// A shard that one rank cannot write (a file size limit on rank 1) stops
// the save on every rank, each naming rank 1's reason; the new save was
// being made beside the checkpoint, so the one before it is as it was,
// nothing is left beside it, and a resume from it continues.
TEST(ManualStrategy, AShardOneRankCannotWriteStopsTheSaveOnEveryRankAndKeepsTheOneBefore) {
  TempDir dir;
  const std::string root = dir.path() + "/run";
  const fs::path last = fs::path(root) / "checkpoints" / "last.ckpt";
  auto first = run_manual({"--devices", "2", "--steps", "4", "--ckpt-root", root});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string manifest = fulgur::test::read_text((last / "manifest.txt").string());
  // Rank 1 resumes, trains on and cannot write its shard (a file size limit).
  auto failed = run_manual({"--devices", "2", "--steps", "8", "--ckpt-root", root, "--resume",
                            "last", "--file-size-limit", "1:256"});
  EXPECT_NE(failed.exit_code, 0) << failed.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      failed.output, {"rank 1 of 2 cannot write its shard, so the new checkpoint is not complete",
                      "rank-1-of-2.ckpt", "File too large", "is as it was"}))
      << failed.output;
  // The checkpoint of step 4 is as it was, and nothing is left beside it.
  EXPECT_EQ(fulgur::test::read_text((last / "manifest.txt").string()), manifest);
  for (const auto& entry : fs::directory_iterator(last.parent_path())) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << entry.path();
  }
  auto resumed = run_manual(
      {"--devices", "2", "--steps", "8", "--ckpt-root", root, "--resume", last.string()});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("RESULT rank1_global_step=8"), std::string::npos) << resumed.output;
  EXPECT_NE(fulgur::test::read_text((last / "manifest.txt").string()), manifest);
}

}  // namespace
