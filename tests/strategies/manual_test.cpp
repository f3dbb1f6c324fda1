// The `manual` strategy in one process: it never moves or wraps the Module,
// its process group is there in configure_model(), and its checkpoints are a
// directory of per-rank shards with a manifest whose every failure is named.
// Two-rank runs: tests/distributed/manual_test.cpp.
#include "fulgur/strategies/manual.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "fulgur/fulgur.h"
#include "fulgur/utilities/checksum.h"
#include "strategies/strategy_driver.h"
#include "utilities/remove_tree.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using fulgur::test::TempDir;

// Records every device move asked of it.
struct MoveRecorder : fulgur::Module {
  torch::nn::Linear fc{nullptr};
  std::vector<std::string> moves;
  bool group_seen_in_configure_model = false;

  MoveRecorder() { fc = register_module("fc", torch::nn::Linear(3, 1)); }
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking) override {
    moves.push_back("to(device, dtype)");
    fulgur::Module::to(device, dtype, non_blocking);
  }
  void to(torch::Dtype dtype, bool non_blocking) override {
    moves.push_back("to(dtype)");
    fulgur::Module::to(dtype, non_blocking);
  }
  void to(torch::Device device, bool non_blocking) override {
    moves.push_back("to(device)");
    fulgur::Module::to(device, non_blocking);
  }
  void configure_model() override {
    try {
      group_seen_in_configure_model = process_group() != nullptr;
    } catch (const fulgur::ConfigError&) {  // a strategy without a group
      group_seen_in_configure_model = false;
    }
  }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    auto& [x, y] = batch.pair();
    return torch::mse_loss(fc(x), y);
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(parameters(), 0.05)};
  }
};

fulgur::TrainerOptions manual_options(const TempDir& dir) {
  auto options = fulgur::test::test_options(dir);
  options.strategy = "manual";
  options.max_steps = 3;
  return options;
}

TEST(ManualStrategy, NeverMovesTheModule) {
  TempDir dir;
  MoveRecorder model;
  fulgur::Trainer trainer(manual_options(dir));
  EXPECT_EQ(trainer.strategy().name(), "manual");
  trainer.fit(model, fulgur::test::regression_loader(4));
  EXPECT_TRUE(model.moves.empty()) << fulgur::join(model.moves);
  EXPECT_TRUE(model.group_seen_in_configure_model);
  // The control: single_device does move it, so the recorder records.
  MoveRecorder moved;
  auto options = fulgur::test::test_options(dir);
  options.max_steps = 1;
  fulgur::Trainer single(options);
  single.fit(moved, fulgur::test::regression_loader(2));
  EXPECT_FALSE(moved.moves.empty());
}

TEST(ManualStrategy, ResolvesWithItsLauncherWithoutAModule) {
  auto result = fulgur::connect(
      fulgur::TrainerOptions{.accelerator = "cpu", .strategy = "manual", .devices = 2},
      fulgur::EnvView(std::map<std::string, std::string>{}));
  EXPECT_EQ(result.resolution.strategy, "manual");
  EXPECT_EQ(result.resolution.launcher, "subprocess_script");
  EXPECT_EQ(result.resolution.world_size, 2);
}

// ManualOptions is DDP's ParallelOptions: the same backend choice and checks.
TEST(ManualStrategy, TakesTheProcessGroupOptionsDdpTakes) {
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::ManualStrategy(fulgur::ManualOptions{.process_group_backend = "glo"}),
                     {"ManualStrategy: process_group_backend=\"glo\" is not one of gloo"});
  auto manual = std::make_shared<fulgur::ManualStrategy>(fulgur::ManualOptions{
      .process_group_timeout = std::chrono::seconds(7), .process_group_backend = "gloo"});
  EXPECT_EQ(manual->process_group_timeout(), std::chrono::seconds(7));
  auto result = fulgur::connect(
      fulgur::TrainerOptions{.accelerator = "cpu", .strategy = manual, .devices = 2},
      fulgur::EnvView(std::map<std::string, std::string>{}));
  EXPECT_EQ(manual->process_group_backend(), "gloo");
  // Chosen, not defaulted: no note explains it.
  EXPECT_EQ(fulgur::join(result.resolution.notes, "\n").find("process_group_backend="),
            std::string::npos);
}

TEST(ManualStrategy, CheckpointIsADirectoryOfShardsWithAManifest) {
  TempDir dir;
  MoveRecorder model;
  auto options = manual_options(dir);
  options.enable_checkpointing = true;
  fulgur::Trainer trainer(options);
  trainer.fit(model, fulgur::test::regression_loader(4));
  const fs::path last = fs::path(dir.path()) / "checkpoints" / "last.ckpt";
  ASSERT_TRUE(fs::is_directory(last));
  EXPECT_TRUE(fs::is_regular_file(last / "rank-0-of-1.ckpt"));
  std::ifstream manifest(last / "manifest.txt");
  std::string text((std::istreambuf_iterator<char>(manifest)), std::istreambuf_iterator<char>());
  // The shard's size and CRC32C, of its bytes as they are on disk.
  const std::string shard = fulgur::test::read_text((last / "rank-0-of-1.ckpt").string());
  auto hex = [](uint32_t value) {
    char out[9];
    std::snprintf(out, sizeof(out), "%08x", value);
    return std::string(out);
  };
  const std::string body =
      "fulgur sharded checkpoint v2\nworld_size=1\nshard=rank-0-of-1.ckpt\n"
      "fingerprint=rank-0-of-1.ckpt " +
      std::to_string(shard.size()) + " " + hex(fulgur::crc32c(shard.data(), shard.size())) + "\n";
  EXPECT_EQ(text, body + "crc32c=" + hex(fulgur::crc32c(body.data(), body.size())) + "\n");

  // Resuming restores the shard exactly.
  auto saved = fulgur::test::clone_parameters(model);
  MoveRecorder resumed;
  fulgur::Trainer again(options);
  again.fit(resumed, fulgur::test::regression_loader(4), nullptr,
            fulgur::FitOptions{.ckpt_path = "last"});
  EXPECT_EQ(again.global_step(), 3);
  auto restored = fulgur::test::clone_parameters(resumed);
  for (size_t i = 0; i < saved.size(); ++i) EXPECT_TRUE(torch::equal(saved[i], restored[i]));
}

class ManualCheckpointErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    MoveRecorder model;
    auto options = manual_options(dir_);
    options.enable_checkpointing = true;
    fulgur::Trainer trainer(options);
    trainer.fit(model, fulgur::test::regression_loader(4));
    last_ = (fs::path(dir_.path()) / "checkpoints" / "last.ckpt").string();
  }
  void resume_expecting(const std::vector<std::string>& fragments) {
    MoveRecorder model;
    fulgur::Trainer trainer(manual_options(dir_));
    EXPECT_TRUE(fulgur::test::throws_with<fulgur::CheckpointError>(
        [&] {
          trainer.fit(model, fulgur::test::regression_loader(4), nullptr,
                      fulgur::FitOptions{.ckpt_path = last_});
        },
        fragments));
  }
  TempDir dir_;
  std::string last_;
};

TEST_F(ManualCheckpointErrors, OtherWorldSizeNamesBoth) {
  std::ofstream(fs::path(last_) / "manifest.txt", std::ios::trunc)
      << "fulgur sharded checkpoint "
         "v1\nworld_size=2\nshard=rank-0-of-2.ckpt\nshard=rank-1-of-2.ckpt\n";
  resume_expecting({"was saved by 2 ranks, and this run has 1", "devices x num_nodes = 2"});
}

// A v1 manifest (fulgur 0.1, no checksum) is still read: the test above.
// A v2 manifest verifies its CRC32C; every shard verifies its own.
TEST_F(ManualCheckpointErrors, CorruptManifestOrShardIsNamed) {
  const fs::path manifest = fs::path(last_) / "manifest.txt";
  std::string text;
  {
    std::ifstream in(manifest);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::string flipped = text;
  flipped[flipped.find("world_size=1") + 11] = '3';
  std::ofstream(manifest, std::ios::trunc) << flipped;
  resume_expecting(
      {"is corrupt: its manifest.txt does not match the CRC32C", "use an earlier checkpoint"});
  std::ofstream(manifest, std::ios::trunc) << text.substr(0, text.find("crc32c="));
  resume_expecting({"manifest.txt lost its checksum line"});
  std::ofstream(manifest, std::ios::trunc) << text;
  const fs::path shard = fs::path(last_) / "rank-0-of-1.ckpt";
  std::string bytes = fulgur::test::read_text(shard.string());
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x10);
  fulgur::test::write_text(shard.string(), bytes);
  resume_expecting({shard.string(), "is corrupt", "use an earlier checkpoint",
                    "a shard of the sharded checkpoint \"" + last_ + "\""});
}

// The manifest records each shard's size and CRC32C: a shard of another
// save, intact on its own, is refused, and a damaged one is called so.
TEST_F(ManualCheckpointErrors, AShardOfAnotherSaveIsToldFromADamagedOne) {
  const fs::path shard = fs::path(last_) / "rank-0-of-1.ckpt";
  const std::string own = fulgur::test::read_text(shard.string());
  TempDir other;
  {
    MoveRecorder model;  // other weights: the RNG moved on
    auto options = manual_options(other);
    options.enable_checkpointing = true;
    fulgur::Trainer trainer(options);
    trainer.fit(model, fulgur::test::regression_loader(4));
  }
  fs::copy_file(fs::path(other.path()) / "checkpoints" / "last.ckpt" / "rank-0-of-1.ckpt", shard,
                fs::copy_options::overwrite_existing);
  resume_expecting(
      {"mixes saves: its shard rank-0-of-1.ckpt", "is not the one its save wrote", "manifest.txt"});
  // Cut short, it has lost its footer: damaged, not foreign.
  fulgur::test::write_text(shard.string(), own.substr(0, own.size() - 10));
  resume_expecting({"is corrupt", "rank-0-of-1.ckpt"});
  fulgur::test::write_text(shard.string(), own);

  // A fingerprint line that says nothing usable, under a checksum that holds.
  const fs::path manifest = fs::path(last_) / "manifest.txt";
  const std::string text = fulgur::test::read_text(manifest.string());
  auto write_manifest = [&](const std::string& body) {
    char crc[9];
    std::snprintf(crc, sizeof(crc), "%08x", fulgur::crc32c(body.data(), body.size()));
    fulgur::test::write_text(manifest.string(), body + "crc32c=" + crc + "\n");
  };
  auto rewritten = [&](const std::string& from, const std::string& to) {
    std::string body = text.substr(0, text.find("crc32c="));
    body.replace(body.find(from), from.size(), to);
    write_manifest(body);
  };
  rewritten("fingerprint=rank-0-of-1.ckpt ", "fingerprint=rank-0-of-1.ckpt x");
  resume_expecting({"manifest.txt is damaged: its line", "fingerprint=rank-0-of-1.ckpt x"});
  rewritten("fingerprint=rank-0-of-1.ckpt ", "fingerprint=rank-0-of-7.ckpt ");
  resume_expecting(
      {"is damaged: it lists the shards rank-0-of-1.ckpt and fingerprints of "
       "rank-0-of-7.ckpt"});
  // A shard named outside the checkpoint's directory, its fingerprint line
  // and checksum agreeing, is not followed.
  for (const std::string name : {"../rank-0-of-1.ckpt", "/etc/passwd", "rank-1-of-1.ckpt"}) {
    const std::string own_name = "rank-0-of-1.ckpt";
    std::string body = text.substr(0, text.find("crc32c="));
    for (auto at = body.find(own_name); at != std::string::npos;
         at = body.find(own_name, at + name.size())) {
      body.replace(at, own_name.size(), name);
    }
    write_manifest(body);
    resume_expecting(
        {"manifest.txt is damaged: it lists shard 0 as \"" + name + "\", not rank-0-of-1.ckpt"});
  }
  // A manifest written before fingerprints (no such line) still resumes.
  write_manifest(text.substr(0, text.find("fingerprint=")));
  MoveRecorder model;
  fulgur::Trainer trainer(manual_options(dir_));
  trainer.fit(model, fulgur::test::regression_loader(4), nullptr,
              fulgur::FitOptions{.ckpt_path = last_});
  EXPECT_EQ(trainer.global_step(), 3);
}

TEST_F(ManualCheckpointErrors, MissingShardIsNamed) {
  fs::remove(fs::path(last_) / "rank-0-of-1.ckpt");
  resume_expecting({"is missing shard(s) rank-0-of-1.ckpt"});
}

TEST_F(ManualCheckpointErrors, NoManifestMeansTheSaveDidNotComplete) {
  fs::remove(fs::path(last_) / "manifest.txt");
  resume_expecting({"has no manifest.txt", "did not complete"});
}

TEST_F(ManualCheckpointErrors, AOneFileCheckpointIsNamed) {
  std::error_code ec;
  fulgur::detail::remove_tree(last_, ec);
  ASSERT_FALSE(ec) << last_ << ": " << ec.message();
  {
    MoveRecorder model;
    auto options = fulgur::test::test_options(dir_);
    options.max_steps = 1;
    fulgur::Trainer single(options);
    single.fit(model, fulgur::test::regression_loader(2));
    single.save_checkpoint(last_);
  }
  resume_expecting({"is one file", "per-rank shards"});
}

TEST(ManualStrategy, BringsItsOwnProcessGroupOnlyIfItFits) {
  fulgur::ManualStrategy strategy;
  strategy.set_cluster_environment(std::make_shared<fulgur::LightningEnvironment>(
      fulgur::EnvView(std::map<std::string, std::string>{})));
  strategy.set_parallel_devices({c10::Device(c10::kCPU), c10::Device(c10::kCPU)});
  fulgur::ProcessGroupOptions options;
  options.main_address = "127.0.0.1";
  options.main_port = fulgur::find_free_port("127.0.0.1");
  options.world_size = 1;
  options.rank = 0;
  options.timeout = std::chrono::seconds(20);
  auto group = fulgur::ProcessGroup::connect(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError, strategy.set_process_group(group),
                     {"the group has rank 0 of 1 but this process is rank 0 of 2"});
  strategy.set_parallel_devices({c10::Device(c10::kCPU)});
  EXPECT_NO_THROW(strategy.set_process_group(group));
  EXPECT_EQ(strategy.shared_process_group(), group);
  // Given later to a Trainer of another world (a reused instance): the
  // group it keeps is named, not used for collectives over other ranks.
  strategy.set_parallel_devices({c10::Device(c10::kCPU), c10::Device(c10::kCPU)});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::detail::drive(strategy).setup_environment(),
                     {"keeps the process group it made for an earlier Trainer (rank 0 of 1), but "
                      "this Trainer's world is rank 0 of 2"});
}

}  // namespace
