// AsyncCheckpointIO: what is written is the state at the save point even
// though training changes it right after; one save in flight, removals after
// the saves before them; a failed write is raised (never lost) and stops the
// removals queued behind it; fit waits for its last save; any IO can be
// wrapped. The snapshot itself: state_snapshot_test.cpp.
#include "fulgur/plugins/io/async_checkpoint_io.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using fulgur::test::LinearRegression;
using fulgur::test::list_files;
using fulgur::test::load_tensor;
using fulgur::test::regression_loader;
using fulgur::test::save_tensor;
using fulgur::test::TempDir;

TEST(AsyncCheckpointIO, WritesTheStateAtTheSavePointWhileTrainingChangesIt) {
  TempDir dir;
  fulgur::AsyncCheckpointIO io;
  fulgur::TorchCheckpointIO torch_io;  // reads what the async IO wrote
  at::Tensor state = torch::arange(1 << 20, torch::kFloat);
  const at::Tensor at_save = state.clone();
  for (int save = 0; save < 3; ++save) {
    const std::string path = dir.file(fulgur::str("step-", save, ".ckpt"));
    save_tensor(io, state, path);
    state.add_(1);  // the next step, at once
    io.wait_until_durable();
    EXPECT_TRUE(torch::equal(load_tensor(torch_io, path), at_save + save)) << path;
    EXPECT_EQ(torch_io.verify(path), "") << path;
  }
  // The snapshot is the state's size (4 MiB), kept between saves.
  EXPECT_EQ(io.snapshot_bytes(), size_t{4} << 20);
}

// The save takes the state (the caller's dict is left empty) and writes it
// whole: its sections, its values, its tensors as they were at the save.
TEST(AsyncCheckpointIO, TakesTheStateAndWritesEverySection) {
  TempDir dir;
  fulgur::AsyncCheckpointIO io;
  at::Tensor weight = torch::arange(6, torch::kFloat);
  fulgur::StateDict checkpoint;
  checkpoint.set("epoch", int64_t{2});
  checkpoint.section("state_dict").set("weight", weight);
  checkpoint.section("optimizer_states").section("0").set("lr", 0.1);
  io.save_checkpoint(checkpoint, dir.file("a.ckpt"));
  EXPECT_TRUE(checkpoint.empty()) << "the state was not handed over";
  weight.add_(1);  // the next step
  // The load waits for the write.
  const fulgur::StateDict loaded = io.load_checkpoint(dir.file("a.ckpt"));
  EXPECT_EQ(loaded.keys(), (std::vector<std::string>{"epoch", "state_dict", "optimizer_states"}));
  EXPECT_EQ(loaded.integer("epoch"), 2);
  EXPECT_TRUE(torch::equal(loaded.section_at("state_dict").tensor("weight"),
                           torch::arange(6, torch::kFloat)));
  EXPECT_EQ(loaded.section_at("optimizer_states").section_at("0").real("lr"), 0.1);
  EXPECT_FALSE(loaded.contains(fulgur::TorchCheckpointIO::kIntegrityKey));
}

// The torch IO, with each write held until the test lets it go, and every
// save and removal recorded in order.
class GatedIO : public fulgur::TorchCheckpointIO {
 public:
  void save_checkpoint(fulgur::StateDict& checkpoint, const std::string& path) override {
    record("save start " + fs::path(path).filename().string());
    gate_.wait();
    fulgur::TorchCheckpointIO::save_checkpoint(checkpoint, path);
    record("save end " + fs::path(path).filename().string());
  }
  void remove_checkpoint(const std::string& path) override {
    fulgur::TorchCheckpointIO::remove_checkpoint(path);
    record("remove " + fs::path(path).filename().string());
  }
  void open_gate() { open_.set_value(); }
  std::vector<std::string> events() {
    std::lock_guard<std::mutex> lock(mutex_);
    return events_;
  }

 private:
  void record(std::string event) {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back(std::move(event));
  }
  std::promise<void> open_;
  std::shared_future<void> gate_ = open_.get_future().share();
  std::mutex mutex_;
  std::vector<std::string> events_;
};

TEST(AsyncCheckpointIO, OneSaveInFlightAndRemovalsAfterTheSavesBeforeThem) {
  TempDir dir;
  fulgur::test::write_text(dir.file("old.ckpt"), "an older checkpoint\n");
  auto gated = std::make_shared<GatedIO>();
  fulgur::AsyncCheckpointIO io(gated);
  fulgur::TorchCheckpointIO torch_io;  // reads what the async IO wrote
  save_tensor(io, torch::full({4}, 1.0),
              dir.file("a.ckpt"));  // returns; its write waits at the gate
  io.remove_checkpoint(dir.file("old.ckpt"));
  std::atomic<bool> second_returned{false};
  std::thread second([&] {
    save_tensor(io, torch::full({4}, 2.0), dir.file("b.ckpt"));
    second_returned = true;
  });
  // Whatever the timing, the second save cannot return while the first is
  // held: the snapshot's buffers are still being written.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(second_returned);
  EXPECT_TRUE(fs::exists(dir.file("old.ckpt")));
  gated->open_gate();
  second.join();
  io.wait_until_durable();
  EXPECT_THAT(gated->events(),
              ::testing::ElementsAre("save start a.ckpt", "save end a.ckpt", "remove old.ckpt",
                                     "save start b.ckpt", "save end b.ckpt"));
  EXPECT_TRUE(torch::equal(load_tensor(torch_io, dir.file("a.ckpt")), torch::full({4}, 1.0)));
  EXPECT_TRUE(torch::equal(load_tensor(torch_io, dir.file("b.ckpt")), torch::full({4}, 2.0)));
}

TEST(AsyncCheckpointIO, AFailedWriteIsRaisedOnceAndStopsTheRemovalsBehindIt) {
  TempDir dir;
  fulgur::test::write_text(dir.file("taken"), "a file where a directory should be\n");
  fulgur::test::write_text(dir.file("good.ckpt"), "the newest good checkpoint\n");
  fulgur::AsyncCheckpointIO io;
  const std::string bad = dir.file("taken/checkpoints/last.ckpt");
  save_tensor(io, torch::full({4}, 1.0), bad);  // fails in the background
  io.remove_checkpoint(dir.file("good.ckpt"));
  EXPECT_THROWS_WITH(fulgur::CheckpointError, io.wait_until_durable(),
                     {"a checkpoint written in the background failed", bad,
                      "cannot create directory", "Not a directory"});
  EXPECT_TRUE(fs::exists(dir.file("good.ckpt"))) << "removed after a failed save";
  EXPECT_NO_THROW(io.wait_until_durable());  // raised once
  // The next save raises a failure that happened since, before snapshotting.
  save_tensor(io, torch::full({4}, 2.0), bad);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_THROWS_WITH(fulgur::CheckpointError,
                     save_tensor(io, torch::full({4}, 3.0), dir.file("next.ckpt")),
                     {"a checkpoint written in the background failed", bad});
  io.wait_until_durable();
  EXPECT_FALSE(fs::exists(dir.file("next.ckpt")));
}

// An IO of the user's own, which knows nothing of threads: its
// save_checkpoint runs on the writer thread with the snapshot.
TEST(AsyncCheckpointIO, WrapsAnyIO) {
  struct InMemory : fulgur::CheckpointIO {
    std::map<std::string, std::string> files;
    std::string_view name() const override { return "in_memory"; }
    void save_checkpoint(fulgur::StateDict& checkpoint, const std::string& path) override {
      files[path] = fulgur::to_bytes(checkpoint);
    }
    fulgur::StateDict load_checkpoint(const std::string& path) override {
      return fulgur::from_bytes(files.at(path));
    }
    void remove_checkpoint(const std::string& path) override { files.erase(path); }
  };
  auto memory = std::make_shared<InMemory>();
  fulgur::AsyncCheckpointIO io(memory);
  at::Tensor state = torch::full({1000}, 1.0);
  save_tensor(io, state, "a");
  state.add_(1);
  save_tensor(io, state, "b");  // waits for "a"
  state.add_(1);
  EXPECT_TRUE(torch::equal(load_tensor(io, "a"), torch::full({1000}, 1.0)));
  EXPECT_TRUE(torch::equal(load_tensor(io, "b"), torch::full({1000}, 2.0)));
  EXPECT_EQ(memory->files.size(), 2u);
}

// Every tensor of `a` (sections included) equals the one of `b` under the
// same key.
void expect_same_tensors(const fulgur::StateDict& a, const fulgur::StateDict& b,
                         const std::string& where) {
  EXPECT_EQ(a.keys(), b.keys()) << where;
  for (const auto& key : a.keys()) {
    if (const fulgur::StateDict* na = a.find_section(key)) {
      const fulgur::StateDict* nb = b.find_section(key);
      ASSERT_NE(nb, nullptr) << where << "." << key;
      expect_same_tensors(*na, *nb, where + "." + key);
    } else if (const c10::IValue* va = a.find(key); va != nullptr && va->isTensor()) {
      const c10::IValue* vb = b.find(key);
      ASSERT_TRUE(vb != nullptr && vb->isTensor()) << where << "." << key;
      EXPECT_TRUE(torch::equal(va->toTensor(), vb->toTensor())) << where << "." << key;
    }
  }
}

// Every tensor under `state`, sorted by size then sum.
void collect_tensors(const fulgur::StateDict& state, std::vector<at::Tensor>& out) {
  state.for_each_tensor([&out](const at::Tensor& t) { out.push_back(t); });
  std::sort(out.begin(), out.end(), [](const at::Tensor& a, const at::Tensor& b) {
    if (a.numel() != b.numel()) return a.numel() < b.numel();
    return a.sum().item<double>() < b.sum().item<double>();
  });
}

// Two epochs checkpointing at every step, once synchronously and once with
// plugins = {"async"}: the same files with the same states (the async saves
// were written while training went on), every one durable and verified when
// fit returns.
TEST(AsyncCheckpointIO, FitWritesWhatASynchronousFitWrites) {
  auto run = [](const TempDir& dir, bool async) {
    auto options = fulgur::test::checkpointed_options(
        dir, {.dirpath = dir.file("ckpts"), .save_top_k = -1, .every_n_train_steps = 1});
    options.max_epochs = 2;
    options.seed = 7;
    if (async) options.plugins.push_back(std::string("async"));
    torch::manual_seed(7);  // the same initial weights in both runs
    LinearRegression model({.momentum = 0.9});
    fulgur::Trainer trainer(options);
    trainer.fit(model, regression_loader(4));
    EXPECT_EQ(trainer.strategy().checkpoint_io().name(), async ? "async" : "torch");
  };
  TempDir sync_dir, async_dir;
  run(sync_dir, false);
  run(async_dir, true);
  const auto names = list_files(sync_dir.file("ckpts"));
  ASSERT_EQ(names, list_files(async_dir.file("ckpts")));
  ASSERT_GE(names.size(), 8u);
  for (const auto& name : names) {
    const std::string a = sync_dir.file("ckpts/" + name), b = async_dir.file("ckpts/" + name);
    ASSERT_EQ(fulgur::TorchCheckpointIO().verify(b), "") << name;
    const fulgur::StateDict ra = fulgur::TorchCheckpointIO().load_checkpoint(a);
    const fulgur::StateDict rb = fulgur::TorchCheckpointIO().load_checkpoint(b);
    expect_same_tensors(ra.section_at("state_dict"), rb.section_at("state_dict"),
                        name + " state_dict");
    // The optimizer's state is keyed by parameter addresses, which differ
    // between runs: its tensors are compared as a sorted list.
    std::vector<at::Tensor> ta, tb;
    collect_tensors(ra.section_at("optimizer_states"), ta);
    collect_tensors(rb.section_at("optimizer_states"), tb);
    ASSERT_EQ(ta.size(), tb.size()) << name;
    ASSERT_FALSE(ta.empty()) << name << ": no momentum buffers";
    for (size_t i = 0; i < ta.size(); ++i) {
      EXPECT_TRUE(torch::equal(ta[i], tb[i])) << name << " optimizer tensor " << i;
    }
  }
}

// The torch IO failing its second write.
class FailingSecondWrite : public fulgur::TorchCheckpointIO {
 public:
  void save_checkpoint(fulgur::StateDict& checkpoint, const std::string& path) override {
    if (++writes_ == 2) {
      throw fulgur::CheckpointError(
          fulgur::str("saving checkpoint \"", path, "\": cannot write: No space left on device."));
    }
    fulgur::TorchCheckpointIO::save_checkpoint(checkpoint, path);
  }

 private:
  int writes_ = 0;
};

TEST(AsyncCheckpointIO, FitRaisesAFailedBackgroundWrite) {
  TempDir dir;
  auto options = fulgur::test::checkpointed_options(
      dir, {.dirpath = dir.file("ckpts"), .every_n_train_steps = 1});
  options.max_epochs = 3;
  options.plugins.push_back(std::shared_ptr<fulgur::CheckpointIO>(
      std::make_shared<fulgur::AsyncCheckpointIO>(std::make_shared<FailingSecondWrite>())));
  LinearRegression model;
  fulgur::Trainer trainer(options);
  EXPECT_THROWS_WITH(fulgur::CheckpointError, trainer.fit(model, regression_loader(4)),
                     {"a checkpoint written in the background failed", "No space left on device",
                      dir.file("ckpts")});
  EXPECT_LT(model.training_steps, 12);  // stopped, not run to the end
}

}  // namespace
