// The checkpoint layouts as Strategy components: the default single file,
// the sharded directory on any strategy, and a user's own layout, which the
// Trainer and ModelCheckpoint reach only through the strategy. Sharded
// checkpoints across ranks and their errors: tests/strategies/manual_test.cpp
// and tests/distributed/manual_test.cpp.
#include "fulgur/strategies/checkpoint_layout.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "fulgur/fulgur.h"
#include "support/test_support.h"
#include "strategies/strategy_driver.h"

namespace {

namespace fs = std::filesystem;
using fulgur::test::TempDir;

struct Linear : fulgur::Module {
  torch::nn::Linear fc{nullptr};
  Linear() { fc = register_module("fc", torch::nn::Linear(3, 1)); }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    auto& [x, y] = batch.pair();
    return torch::mse_loss(fc(x), y);
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(parameters(), 0.05)};
  }
};

TEST(CheckpointLayout, TheDefaultIsOneFileWrittenByRankZero) {
  TempDir dir;
  fulgur::SingleDeviceStrategy strategy;
  strategy.set_accelerator(std::make_unique<fulgur::CPUAccelerator>());
  EXPECT_EQ(strategy.checkpoint_layout().name(), "single_file");
  EXPECT_TRUE(fulgur::detail::drive(strategy).is_checkpoint_writer());
  EXPECT_TRUE(
      fulgur::test::message_contains(strategy.describe(), {"checkpoint_layout: single_file"}));
  Linear model;
  {
    fulgur::StateDict state = fulgur::detail::drive(strategy).module_state(model);
    fulgur::detail::drive(strategy).save_checkpoint(state, dir.file("one.ckpt"));
  }
  EXPECT_TRUE(fs::is_regular_file(dir.file("one.ckpt")));
  EXPECT_EQ(fulgur::detail::drive(strategy).verify_checkpoint(dir.file("one.ckpt")), "");
  fulgur::detail::drive(strategy).remove_checkpoint(dir.file("one.ckpt"));
  EXPECT_FALSE(fs::exists(dir.file("one.ckpt")));
  EXPECT_THROWS_WITH(fulgur::ConfigError, strategy.set_checkpoint_layout(nullptr),
                     {"set_checkpoint_layout(nullptr)", "ShardedCheckpoint"});
}

// The sharded layout is not manual's own: any strategy can take it, and one
// rank writes a directory of one shard and the manifest.
TEST(CheckpointLayout, ShardedOnOneDeviceWritesOneShardAndTheManifest) {
  TempDir dir;
  auto options = fulgur::test::test_options(dir);
  options.enable_checkpointing = true;
  options.max_epochs = 2;
  auto strategy = std::make_shared<fulgur::SingleDeviceStrategy>();
  strategy->set_checkpoint_layout(std::make_shared<fulgur::ShardedCheckpoint>());
  options.strategy = strategy;
  Linear model;
  fulgur::Trainer trainer(options);
  trainer.fit(model, fulgur::test::regression_loader(4));
  const fs::path last = fs::path(dir.path()) / "checkpoints" / "last.ckpt";
  ASSERT_TRUE(fs::is_directory(last));
  EXPECT_TRUE(fs::is_regular_file(last / "rank-0-of-1.ckpt"));
  const auto manifest = fulgur::ShardedCheckpoint::read_manifest(last.string());
  EXPECT_EQ(manifest.world_size, 1);
  EXPECT_EQ(manifest.shards, std::vector<std::string>{"rank-0-of-1.ckpt"});
  EXPECT_EQ(fulgur::detail::drive(trainer.strategy()).verify_checkpoint(last.string()), "");

  // A single-file strategy is told what it was given.
  Linear other;
  auto plain = fulgur::test::test_options(dir);
  plain.max_epochs = 3;
  fulgur::Trainer single(plain);
  EXPECT_THROWS_WITH(fulgur::CheckpointError,
                     single.fit(other, fulgur::test::regression_loader(4), nullptr,
                                fulgur::FitOptions{.ckpt_path = last.string()}),
                     {last.string()});
}

// A layout of the user's: records what the strategy asks of it, then
// writes single files as the default does.
struct RecordingLayout : fulgur::SingleFileCheckpoint {
  std::vector<std::string> calls;

  std::string_view name() const override { return "recording"; }
  void save(fulgur::Strategy& strategy, fulgur::StateDict& checkpoint,
            const std::string& path) override {
    calls.push_back("save " + fs::path(path).filename().string());
    SingleFileCheckpoint::save(strategy, checkpoint, path);
  }
  fulgur::StateDict load(fulgur::Strategy& strategy, const std::string& path) override {
    calls.push_back("load " + fs::path(path).filename().string());
    return SingleFileCheckpoint::load(strategy, path);
  }
  void remove(fulgur::Strategy& strategy, const std::string& path) override {
    calls.push_back("remove " + fs::path(path).filename().string());
    SingleFileCheckpoint::remove(strategy, path);
  }
  std::string verify(fulgur::Strategy& strategy, const std::string& path) override {
    calls.push_back("verify " + fs::path(path).filename().string());
    return SingleFileCheckpoint::verify(strategy, path);
  }
  void remove_stale_files(fulgur::Strategy& strategy, const std::string& dir) override {
    calls.push_back("remove_stale_files");
    SingleFileCheckpoint::remove_stale_files(strategy, dir);
  }
  bool called(const std::string& call) const {
    return std::find(calls.begin(), calls.end(), call) != calls.end();
  }
};

// A manifest that is not a regular file (a link to /dev/zero) is refused by
// its type without being read, and one of binary bytes is shown short and
// printable. A sharded checkpoint's directory given where one file is read
// says what it is and what to do.
TEST(CheckpointLayout, AManifestThatIsNoManifestIsRefusedUnreadAndADirectoryOfShardsIsNamed) {
  TempDir dir;
  const fs::path ckpt = fs::path(dir.path()) / "last.ckpt";
  fs::create_directories(ckpt);
  fs::create_symlink("/dev/zero", ckpt / "manifest.txt");
  EXPECT_THROWS_WITH(fulgur::CheckpointError,
                     fulgur::ShardedCheckpoint::read_manifest(ckpt.string()),
                     {"manifest.txt is a character device", "resume from an earlier checkpoint"});
  fs::remove(ckpt / "manifest.txt");
  fulgur::test::write_text((ckpt / "manifest.txt").string(), std::string(200, '\x01') + "\n");
  EXPECT_THROWS_WITH(fulgur::CheckpointError,
                     fulgur::ShardedCheckpoint::read_manifest(ckpt.string()),
                     {"is not a fulgur manifest (first line \"" + std::string(60, '?') + "...\""});
  EXPECT_THROWS_WITH(fulgur::CheckpointError,
                     fulgur::TorchCheckpointIO().load_checkpoint(ckpt.string()),
                     {ckpt.string() + "\" is a sharded checkpoint",
                      "as many ranks as wrote it", "fulgur checkpoint consolidate"});
}

TEST(CheckpointLayout, AUsersLayoutGetsEveryCheckpointOperation) {
  TempDir dir;
  auto layout = std::make_shared<RecordingLayout>();
  auto make_options = [&](int epochs) {
    auto options = fulgur::test::test_options(dir);
    options.enable_checkpointing = true;
    options.max_epochs = epochs;
    auto strategy = std::make_shared<fulgur::SingleDeviceStrategy>();
    strategy->set_checkpoint_layout(layout);
    options.strategy = strategy;
    return options;
  };
  torch::manual_seed(0);
  Linear model;
  fulgur::Trainer first(make_options(2));
  first.fit(model, fulgur::test::regression_loader(4));
  EXPECT_TRUE(layout->called("save epoch=0-step=4.ckpt"));
  EXPECT_TRUE(layout->called("save last.ckpt"));
  // The top-1 checkpoint of epoch 0 gives way to epoch 1's.
  EXPECT_TRUE(layout->called("remove epoch=0-step=4.ckpt")) << fulgur::join(layout->calls, "; ");
  EXPECT_FALSE(layout->called("remove_stale_files"));  // no directory before the first save

  layout->calls.clear();
  Linear resumed;
  fulgur::Trainer again(make_options(3));
  again.fit(resumed, fulgur::test::regression_loader(4), nullptr,
            fulgur::FitOptions{.ckpt_path = "last"});
  EXPECT_EQ(again.global_step(), 12);
  EXPECT_TRUE(layout->called("verify last.ckpt")) << fulgur::join(layout->calls, "; ");
  EXPECT_TRUE(layout->called("load last.ckpt"));
  EXPECT_TRUE(layout->called("remove_stale_files"));
  EXPECT_EQ(again.strategy().checkpoint_layout().name(), "recording");
}

}  // namespace
