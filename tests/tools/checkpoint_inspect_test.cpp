// `fulgur checkpoint inspect PATH`, run as the installed program would be: a
// Trainer's checkpoint is described and verifies (exit status 0); a damaged
// one, a damaged shard of a per-rank checkpoint and a missing path are named
// as such (1); a wrong command line is a usage error (2).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "fulgur/fulgur.h"
#include "support/process.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using fulgur::test::TempDir;

fulgur::test::ProcessResult inspect(const std::string& path) {
  return fulgur::test::run_process({FULGUR_CLI, "checkpoint", "inspect", path}, {}, 60s);
}

// Two epochs of 4 steps with checkpointing; returns last.ckpt's path (a
// directory of shards with strategy "manual").
std::string train(const TempDir& dir, const std::string& strategy = "auto") {
  auto options = fulgur::test::test_options(dir);
  options.max_epochs = 2;
  options.strategy = strategy;
  options.enable_checkpointing = true;
  fulgur::test::LinearRegression model;
  return fulgur::Trainer(options).fit(model, fulgur::test::regression_loader(4)).last_model_path;
}

TEST(CheckpointInspect, DescribesAVerifiedCheckpoint) {
  TempDir dir;
  const std::string last = train(dir);
  auto r = inspect(last);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      r.output,
      {"checkpoint: " + last, "CRC32C verified", "format: fulgur checkpoint version 1",
       "written by fulgur", "progress: epoch 1, global step 8, batch position 4",
       "module state: 2 tensor(s)", "fc.weight", "Float [1, 3]", "fc.bias", "optimizers: 1",
       "lr schedulers", "callbacks: ModelCheckpoint{", "RNG states:", "hyper-parameters:"}));
}

TEST(CheckpointInspect, ADamagedFileIsCorruptWithStatus1) {
  TempDir dir;
  const std::string last = train(dir);
  fulgur::test::damage_middle_byte(last);
  auto r = inspect(last);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      r.output, {"CORRUPT", "does not match the CRC32C", "the damage is in"}));
  EXPECT_EQ(r.output.find("module state"), std::string::npos) << r.output;
}

TEST(CheckpointInspect, APerRankCheckpointVerifiesEveryShard) {
  TempDir dir;
  const std::string last = train(dir, "manual");
  ASSERT_TRUE(fs::is_directory(last));
  auto good = inspect(last);
  EXPECT_EQ(good.exit_code, 0) << good.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      good.output, {"per-rank checkpoint: 1 shard(s), manifest.txt verified",
                    "shard rank-0-of-1.ckpt", "CRC32C verified", "contents of shard",
                    "progress: epoch 1, global step 8, batch position 4", "fc.weight"}));
  fulgur::test::damage_middle_byte((fs::path(last) / "rank-0-of-1.ckpt").string());
  auto bad = inspect(last);
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_TRUE(fulgur::test::message_contains(bad.output, {"shard rank-0-of-1.ckpt", "CORRUPT"}));
}

TEST(CheckpointInspect, AMissingPathAndAWrongCommandLine) {
  TempDir dir;
  auto missing = inspect(dir.file("nope.ckpt"));
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_TRUE(fulgur::test::message_contains(missing.output, {"nope.ckpt", "does not exist"}));
  auto usage = fulgur::test::run_process({FULGUR_CLI, "checkpoint", "show"}, {}, 60s);
  EXPECT_EQ(usage.exit_code, 2) << usage.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      usage.output,
      {"expected \"inspect PATH\"", "usage: fulgur resolve", "fulgur checkpoint inspect PATH"}));
}

}  // namespace
