#include "fulgur/plugins/io/torch_checkpoint_io.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "fulgur/core/errors.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using fulgur::test::list_files;
using fulgur::test::TempDir;

void save_tensor(fulgur::CheckpointIO& io, const at::Tensor& value, const std::string& path) {
  torch::serialize::OutputArchive archive;
  archive.write("value", value);
  io.save_checkpoint(archive, path);
}

at::Tensor load_tensor(fulgur::CheckpointIO& io, const std::string& path) {
  torch::serialize::InputArchive archive;
  io.load_checkpoint(path, archive);
  at::Tensor value;
  archive.read("value", value);
  return value;
}

TEST(TorchCheckpointIO, SaveThenLoadRoundTrips) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  EXPECT_EQ(io.name(), "torch");
  save_tensor(io, torch::arange(5), dir.file("a.ckpt"));
  EXPECT_TRUE(torch::equal(load_tensor(io, dir.file("a.ckpt")), torch::arange(5)));
}

TEST(TorchCheckpointIO, CreatesParentDirectoriesAndLeavesNoTemporaryFile) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  save_tensor(io, torch::ones({2}), dir.file("deep/er/model.ckpt"));
  EXPECT_THAT(list_files(dir.path()), ElementsAre("deep/er/model.ckpt"));
}

TEST(TorchCheckpointIO, OverwritesAnExistingFile) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  save_tensor(io, torch::ones({2}), dir.file("a.ckpt"));
  save_tensor(io, torch::zeros({3}), dir.file("a.ckpt"));
  EXPECT_TRUE(torch::equal(load_tensor(io, dir.file("a.ckpt")), torch::zeros({3})));
  EXPECT_THAT(list_files(dir.path()), ElementsAre("a.ckpt"));
}

TEST(TorchCheckpointIO, MissingFileNamesThePath) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  auto path = dir.file("missing.ckpt");
  EXPECT_THROWS_WITH(fulgur::CheckpointError, load_tensor(io, path), {path, "does not exist"});
}

TEST(TorchCheckpointIO, DirectoryIsNotACheckpoint) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  EXPECT_THROWS_WITH(fulgur::CheckpointError, load_tensor(io, dir.path()),
                     {dir.path(), "directory"});
}

TEST(TorchCheckpointIO, TruncatedFileNamesThePath) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  auto path = dir.file("a.ckpt");
  save_tensor(io, torch::arange(1000), path);
  fs::resize_file(path, fs::file_size(path) / 2);
  EXPECT_THROWS_WITH(fulgur::CheckpointError, load_tensor(io, path), {path, "truncated"});
}

TEST(TorchCheckpointIO, TextFileNamesThePath) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  auto path = dir.file("notes.txt");
  fulgur::test::write_text(path, "this is not a checkpoint\n");
  EXPECT_THROWS_WITH(fulgur::CheckpointError, load_tensor(io, path), {path});
}

TEST(TorchCheckpointIO, UnwritableLocationIsACheckpointError) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  fulgur::test::write_text(dir.file("file"), "x");
  // A regular file cannot be a parent directory, whatever the permissions.
  auto path = dir.file("file/model.ckpt");
  EXPECT_THROWS_WITH(fulgur::CheckpointError, save_tensor(io, torch::ones({1}), path), {path});
}

TEST(TorchCheckpointIO, RemoveIgnoresMissingFiles) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  save_tensor(io, torch::ones({1}), dir.file("a.ckpt"));
  io.remove_checkpoint(dir.file("a.ckpt"));
  EXPECT_FALSE(fs::exists(dir.file("a.ckpt")));
  EXPECT_NO_THROW(io.remove_checkpoint(dir.file("a.ckpt")));
}

TEST(TorchCheckpointIO, RegisteredAsTorch) {
  auto io = fulgur::checkpoint_io_registry().create("torch");
  EXPECT_EQ(io->name(), "torch");
}

}  // namespace
