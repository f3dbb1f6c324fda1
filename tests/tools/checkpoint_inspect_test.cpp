// `fulgur checkpoint inspect PATH`, run as the installed program would be: a
// Trainer's checkpoint is described and verifies (exit status 0); a damaged
// one, a damaged shard of a per-rank checkpoint and a missing path are named
// as such (1); a wrong command line is a usage error (2). Truncated and
// mutated checkpoints end in 0 or 1, never in a signal or a hang.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "checkpoint_inspect.h"
#include "fulgur/fulgur.h"
#include "support/process.h"
#include "support/run_in_child.h"
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
       "optimizer 0: 1 parameter group(s)", "group 0: 2 parameter(s); lr = 0.05",
       "lr schedulers", "callbacks: ModelCheckpoint{", "RNG states:", "hyper-parameters:"}));
  // LibTorch's keys for the group's parameters are addresses: not shown.
  EXPECT_EQ(r.output.find("0x"), std::string::npos) << r.output;
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
  // A shard that is not there, or no file, is said as such: not damage.
  const std::string shard = (fs::path(last) / "rank-0-of-1.ckpt").string();
  fs::remove(shard);
  auto gone = inspect(last);
  EXPECT_EQ(gone.exit_code, 1) << gone.output;
  EXPECT_TRUE(
      fulgur::test::message_contains(gone.output, {"MISSING: \"" + shard + "\" does not exist"}))
      << gone.output;
  ASSERT_EQ(::mkfifo(shard.c_str(), 0600), 0);
  auto fifo = inspect(last);
  EXPECT_EQ(fifo.exit_code, 1) << fifo.output;
  EXPECT_TRUE(fulgur::test::message_contains(fifo.output, {"NOT A FILE", "a FIFO (named pipe)"}))
      << fifo.output;
  EXPECT_EQ(fifo.output.find("CORRUPT"), std::string::npos) << fifo.output;
}

TEST(CheckpointInspect, AMissingPathAndAWrongCommandLine) {
  TempDir dir;
  auto missing = inspect(dir.file("nope.ckpt"));
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      missing.output, {"not found: \"", "nope.ckpt", "does not exist", "sharded checkpoint's"}));
  // Not found is not damage, and no ckpt_path is suggested to a program.
  EXPECT_EQ(missing.output.find("CORRUPT"), std::string::npos) << missing.output;
  EXPECT_EQ(missing.output.find("ckpt_path"), std::string::npos) << missing.output;
  // consolidate names an empty output path before it reads anything.
  auto nowhere =
      fulgur::test::run_process({FULGUR_CLI, "checkpoint", "consolidate", dir.path(), ""}, {}, 60s);
  EXPECT_EQ(nowhere.exit_code, 1) << nowhere.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      nowhere.output, {"the output path \"\" names no file", "consolidated.ckpt"}));
  auto usage = fulgur::test::run_process({FULGUR_CLI, "checkpoint", "show"}, {}, 60s);
  EXPECT_EQ(usage.exit_code, 2) << usage.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      usage.output,
      {"expected \"inspect PATH\"", "usage: fulgur resolve", "fulgur checkpoint inspect PATH"}));
}

// Hundreds of truncated and mutated checkpoints, with a checksum footer
// (most fail its check) and without (written before checksums: LibTorch's
// reader and unpickler get the damage): status 0 or 1, never a signal or a
// hang. The tool's code runs here for most (it lets no exception out, so only
// a crash or a hang could stop it, and either fails the test binary), in a
// child process under a timeout for every sixth, and the program itself for
// a few (each start costs LibTorch's start-up). Seeded: the same cases on
// every run.
TEST(CheckpointInspect, TruncatedAndMutatedCheckpointsEndInStatus0Or1) {
  TempDir dir;
  const std::string last = train(dir);
  std::vector<std::string> originals{fulgur::test::read_text(last)};
  {
    // A checkpoint as LibTorch alone writes it (no footer, as before fulgur
    // 0.2): nested archives, tensors and values.
    torch::serialize::OutputArchive out, state, loops;
    state.write("fc.weight", torch::randn({4, 3}));
    state.write("fc.bias", torch::zeros({4}));
    loops.write("epoch", c10::IValue(int64_t{1}));
    loops.write("global_step", c10::IValue(int64_t{8}));
    out.write("fulgur_format_version", c10::IValue(int64_t{1}));
    out.write("state_dict", state);
    out.write("loops", loops);
    out.write("lr_schedulers", c10::IValue(std::vector<int64_t>{1, 2}));
    std::ostringstream bytes;
    out.save_to(bytes);
    originals.push_back(bytes.str());
    fulgur::test::write_text(dir.file("plain.ckpt"), originals.back());
    ASSERT_FALSE(fulgur::TorchCheckpointIO::has_checksum(dir.file("plain.ckpt")));
    std::ostringstream text;
    EXPECT_EQ(fulgur_cli::inspect_checkpoint(dir.file("plain.ckpt"), text), 0) << text.str();
    EXPECT_TRUE(fulgur::test::message_contains(text.str(), {"unverified", "fc.weight"}));
  }

  std::mt19937 rng(35);
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  std::vector<std::string> cases;
  for (int i = 0; i < 300; ++i) {
    std::string s = originals[i % 2];
    switch (pick(4)) {
      case 0:  // cut short
        s.resize(pick(s.size()));
        break;
      case 1:  // a few bytes changed
        for (size_t n = 1 + pick(8); n > 0; --n) s[pick(s.size())] = static_cast<char>(pick(256));
        break;
      case 2:  // bytes dropped or repeated
        if (pick(2) == 0) {
          s.erase(pick(s.size()), 1 + pick(64));
        } else {
          const size_t at = pick(s.size());
          s.insert(at, s.substr(pick(s.size()), 1 + pick(64)));
        }
        break;
      case 3:  // a run of bytes overwritten
        for (size_t at = pick(s.size()), n = 1 + pick(512); n > 0 && at < s.size(); --n, ++at) {
          s[at] = static_cast<char>(pick(256));
        }
        break;
    }
    cases.push_back(std::move(s));
  }
  const std::string path = dir.file("fuzzed.ckpt");
  int statuses[2] = {0, 0};
  for (size_t i = 0; i < cases.size(); ++i) {
    fulgur::test::write_text(path, cases[i]);
    auto inspect_here = [&] {
      std::ostringstream out;
      return fulgur_cli::inspect_checkpoint(path, out);
    };
    fulgur::test::ChildResult r;
    if (i % 6 == 0) {
      r = fulgur::test::run_in_child(inspect_here);
    } else {
      r.exit_code = inspect_here();
    }
    const bool ok = r.exit_code == 0 || r.exit_code == 1;
    EXPECT_TRUE(ok) << "case " << i << " (from the " << (i % 2 ? "unverified" : "verified")
                    << " checkpoint): " << r.describe();
    if (ok) ++statuses[r.exit_code];
  }
  EXPECT_GT(statuses[1], 100);
  // The program itself on a few.
  for (size_t i = 0; i < cases.size(); i += 75) {
    fulgur::test::write_text(path, cases[i]);
    const auto r = inspect(path);
    EXPECT_TRUE(r.exit_code == 0 || r.exit_code == 1)
        << "case " << i << ": exit " << r.exit_code << ", signal " << r.signal
        << (r.timed_out ? " (timed out)" : "") << "\n"
        << r.output;
  }
}

}  // namespace
