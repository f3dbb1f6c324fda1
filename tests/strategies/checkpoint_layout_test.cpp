// The checkpoint layouts as Strategy components: the default single file,
// the sharded directory on any strategy, and a user's own layout, which the
// Trainer and ModelCheckpoint reach only through the strategy. Sharded
// checkpoints across ranks and their errors: tests/strategies/manual_test.cpp
// and tests/distributed/manual_test.cpp.
#include "fulgur/strategies/checkpoint_layout.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "fulgur/fulgur.h"
#include "fulgur/utilities/checksum.h"
#include "support/run_in_child.h"
#include "support/test_support.h"
#include "strategies/strategy_driver.h"
#include "utilities/durable_file.h"

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
  // What tells it from another save: its manifest's size and CRC32C (which
  // records its shards'), the same under another name.
  auto drive = fulgur::detail::drive(trainer.strategy());
  std::ifstream in(last / fulgur::ShardedCheckpoint::kManifest, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const fulgur::FileFingerprint own = drive.checkpoint_fingerprint(last.string());
  EXPECT_EQ(own.size, text.size());
  EXPECT_EQ(own.crc32c, fulgur::crc32c(text.data(), text.size()));
  const fs::path copy = fs::path(dir.path()) / "copy.ckpt";
  fs::copy(last, copy);
  EXPECT_EQ(drive.checkpoint_fingerprint(copy.string()), own);
  fs::remove(copy / fulgur::ShardedCheckpoint::kManifest);
  EXPECT_THROWS_WITH(fulgur::CheckpointError, drive.checkpoint_fingerprint(copy.string()),
                     {copy.string(), "has no manifest.txt"});

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

// consolidate names what it was given when it is no sharded checkpoint's
// directory: a path not there, a loop of symbolic links (the OS's reason,
// not "not there"), a file.
TEST(CheckpointLayout, ConsolidateNamesAPathThatIsNoDirectoryByWhatItIs) {
  TempDir dir;
  const fs::path loop = fs::path(dir.path()) / "loop";
  fs::create_symlink(loop, loop);
  const std::string out = dir.file("whole.ckpt");
  EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::consolidate_sharded_checkpoint(loop, out),
                     {"\"" + loop.string() + "\" is not to be looked up (", std::strerror(ELOOP),
                      "Pass the directory of a sharded fsdp checkpoint"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError,
                     fulgur::consolidate_sharded_checkpoint(dir.file("absent"), out),
                     {"absent\" is not there."});
  fulgur::test::write_text(dir.file("one.ckpt"), "x");
  EXPECT_THROWS_WITH(fulgur::CheckpointError,
                     fulgur::consolidate_sharded_checkpoint(dir.file("one.ckpt"), out),
                     {"one.ckpt\" is a file: a checkpoint in one file is whole already"});
  EXPECT_FALSE(fs::exists(out));
}

// A checkpoint IO whose saves fail while `fail` is set (a disk that stops
// taking writes mid-run).
struct FailingIO : fulgur::TorchCheckpointIO {
  bool fail = false;
  void save_checkpoint(fulgur::StateDict& checkpoint, const std::string& path) override {
    if (fail)
      throw fulgur::CheckpointError("saving checkpoint \"" + path + "\": the disk is gone.");
    TorchCheckpointIO::save_checkpoint(checkpoint, path);
  }
};

// One rank's strategy with the sharded layout, saving {"w": value} at `path`.
struct ShardedSaves {
  std::shared_ptr<FailingIO> io = std::make_shared<FailingIO>();
  fulgur::SingleDeviceStrategy strategy;
  ShardedSaves() {
    strategy.set_accelerator(std::make_unique<fulgur::CPUAccelerator>());
    strategy.set_checkpoint_layout(std::make_shared<fulgur::ShardedCheckpoint>());
    strategy.set_checkpoint_io(io);
  }
  void save(const std::string& path, double value) {
    fulgur::StateDict state;
    state.set("w", torch::full({64}, value));
    fulgur::detail::drive(strategy).save_checkpoint(state, path);
  }
  double loaded(const std::string& path) {
    return fulgur::detail::drive(strategy).load_checkpoint(path).tensor("w")[0].item<double>();
  }
  std::string verify(const std::string& path) {
    return fulgur::detail::drive(strategy).verify_checkpoint(path);
  }
};

// A sharded save is made whole beside its path and put there in one step: a
// save whose shard cannot be written keeps the checkpoint before it whole and
// loading, says so, and leaves nothing beside it; a save that completes
// replaces the checkpoint, a one-file one too.
TEST(CheckpointLayout, AFailedShardedSaveKeepsTheCheckpointBeforeItAndLeavesNothing) {
  TempDir dir;
  ShardedSaves saves;
  const std::string path = dir.file("last.ckpt");
  saves.save(path, 1);
  saves.io->fail = true;
  EXPECT_THROWS_WITH(
      fulgur::CheckpointError, saves.save(path, 2),
      {"saving sharded checkpoint \"" + path + "\"", "the disk is gone", "is as it was"});
  EXPECT_EQ(saves.verify(path), "");
  EXPECT_EQ(saves.loaded(path), 1);
  EXPECT_EQ(fulgur::test::entries_of(dir.path()), std::vector<std::string>{"last.ckpt"});
  EXPECT_EQ(fulgur::test::entries_of(path),
            (std::vector<std::string>{"manifest.txt", "rank-0-of-1.ckpt"}));

  saves.io->fail = false;
  saves.save(path, 3);
  EXPECT_EQ(saves.loaded(path), 3);
  EXPECT_EQ(fulgur::test::entries_of(dir.path()), std::vector<std::string>{"last.ckpt"});
  // Over a checkpoint in one file (the strategy changed between runs).
  const std::string single = dir.file("single.ckpt");
  fulgur::TorchCheckpointIO plain;
  fulgur::StateDict state;
  state.set("w", torch::full({64}, 4.0));
  plain.save_checkpoint(state, single);
  saves.save(single, 5);
  EXPECT_EQ(saves.loaded(single), 5);
  EXPECT_EQ(fulgur::test::entries_of(dir.path()),
            (std::vector<std::string>{"last.ckpt", "single.ckpt"}));
}

// A disk that fills up during a sharded save (a tmpfs): the error names the
// reason, and the checkpoint before it still verifies and loads.
TEST(CheckpointLayout, AFullDiskDuringAShardedSaveKeepsTheCheckpointBeforeIt) {
  TempDir dir;
  const auto r = fulgur::test::run_on_tmpfs(dir.path(), "512k", [&] {
    at::set_num_threads(1);  // the parent's thread pool did not survive fork
    ShardedSaves saves;
    const std::string path = dir.file("last.ckpt");
    saves.save(path, 1);
    try {
      fulgur::StateDict big;
      big.set("w", torch::ones({200000}));  // 800 KB: does not fit
      fulgur::detail::drive(saves.strategy).save_checkpoint(big, path);
      return 10;
    } catch (const fulgur::CheckpointError& e) {
      if (!fulgur::test::message_contains(e.what(),
                                          {path, "No space left on device", "is as it was"})) {
        return 11;
      }
    }
    if (!saves.verify(path).empty() || saves.loaded(path) != 1) return 12;
    if (fulgur::test::entries_of(dir.path()) != std::vector<std::string>{"last.ckpt"}) return 13;
    return 0;
  });
  if (r.exit_code == fulgur::test::kCannotMountTmpfs) GTEST_SKIP() << "cannot mount a tmpfs here";
  EXPECT_EQ(r.exit_code, 0) << r.describe()
                            << " (10: saved anyway, 11: wrong message, 12: the previous "
                               "checkpoint is lost, 13: something left beside it)";
}

// Where the file system cannot exchange two names, a replacement sets the
// old checkpoint aside first; one interrupted between its renames left it at
// "<path>.previous": loading the path names it, and the next save puts it
// back before replacing it. A save's directory that a dead process left is
// removed with the stale files; a live process's stays.
TEST(CheckpointLayout, ACheckpointSetAsideByAnInterruptedReplacementIsNamedAndPutBack) {
  TempDir dir;
  ShardedSaves saves;
  const std::string path = dir.file("last.ckpt");
  saves.save(path, 1);
  fs::rename(path, fulgur::detail::previous_path(path));
  EXPECT_THROWS_WITH(fulgur::CheckpointError, saves.loaded(path),
                     {"does not exist", "left that checkpoint whole at \"" + path + ".previous\"",
                      "rename it to"});
  EXPECT_TRUE(fulgur::test::message_contains(saves.verify(path), {path + ".previous"}));
  saves.io->fail = true;
  EXPECT_THROW(saves.save(path, 2), fulgur::CheckpointError);
  EXPECT_EQ(saves.loaded(path), 1);  // put back even though the save failed
  EXPECT_EQ(fulgur::test::entries_of(dir.path()), std::vector<std::string>{"last.ckpt"});

  const pid_t pid = fulgur::test::dead_pid();
  const std::string dead = fulgur::str(path, ".tmp.", pid, ".", fulgur::detail::this_host());
  const std::string live = fulgur::detail::temporary_path_for(dir.file("epoch=1.ckpt"));
  fs::create_directories(dead);
  fulgur::test::write_text(dead + "/rank-0-of-1.ckpt", "half a save");
  fs::create_directories(live);
  fulgur::detail::drive(saves.strategy).remove_stale_checkpoint_files(dir.path());
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live));
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
