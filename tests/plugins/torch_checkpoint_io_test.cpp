#include "fulgur/plugins/io/torch_checkpoint_io.h"

#include <caffe2/serialize/inline_container.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>

#include "fulgur/core/errors.h"
#include "fulgur/utilities/checksum.h"
#include "support/run_in_child.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using fulgur::test::list_files;
using fulgur::test::TempDir;
using ::testing::ElementsAre;

using fulgur::test::load_tensor;
using fulgur::test::save_tensor;

TEST(TorchCheckpointIO, SaveThenLoadRoundTrips) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  EXPECT_EQ(io.name(), "torch");
  save_tensor(io, torch::arange(5), dir.file("a.ckpt"));
  EXPECT_TRUE(torch::equal(load_tensor(io, dir.file("a.ckpt")), torch::arange(5)));
}

// The state comes back as it was saved (its entries in order, its sections,
// its values), without the marker the IO adds to the file.
TEST(TorchCheckpointIO, LoadGivesBackTheStateSavedWithoutTheIntegrityMarker) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  fulgur::StateDict checkpoint;
  checkpoint.set("epoch", int64_t{3});
  fulgur::StateDict& weights = checkpoint.section("state_dict");
  weights.set("weight", torch::arange(6, torch::kFloat).reshape({2, 3}));
  weights.set_buffer("running_mean", torch::ones({3}));
  checkpoint.set("name", std::string("run"));
  checkpoint.set("lrs", std::vector<double>{0.1, 0.01});
  io.save_checkpoint(checkpoint, dir.file("a.ckpt"));
  const fulgur::StateDict loaded = io.load_checkpoint(dir.file("a.ckpt"));
  EXPECT_THAT(loaded.keys(), ElementsAre("epoch", "state_dict", "name", "lrs"));
  EXPECT_FALSE(loaded.contains(fulgur::TorchCheckpointIO::kIntegrityKey));
  EXPECT_EQ(loaded.integer("epoch"), 3);
  EXPECT_EQ(loaded.string("name"), "run");
  EXPECT_EQ(loaded.reals("lrs"), (std::vector<double>{0.1, 0.01}));
  const fulgur::StateDict& loaded_weights = loaded.section_at("state_dict");
  EXPECT_THAT(loaded_weights.keys(), ElementsAre("weight", "running_mean"));
  EXPECT_TRUE(torch::equal(loaded_weights.tensor("weight"),
                           torch::arange(6, torch::kFloat).reshape({2, 3})));
  EXPECT_TRUE(torch::equal(loaded_weights.tensor("running_mean"), torch::ones({3})));
  EXPECT_EQ(loaded_weights.path(), "state_dict");
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
  // Not damage: no earlier checkpoint is offered in its place.
  save_tensor(io, torch::arange(3), dir.file("last.ckpt"));
  EXPECT_THROWS_WITH(fulgur::CheckpointError, load_tensor(io, path),
                     {"\"" + path + "\" is not a checkpoint", "no zip archive",
                      "Pass a checkpoint file written by fulgur"});
  try {
    load_tensor(io, path);
  } catch (const fulgur::CheckpointError& e) {
    EXPECT_EQ(std::string(e.what()).find("earlier"), std::string::npos) << e.what();
  }
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

// ---- Integrity.

// A checkpoint large enough to have several records: two tensors and a value.
void save_model_like(fulgur::CheckpointIO& io, const std::string& path, double scale = 1.0) {
  fulgur::StateDict checkpoint;
  checkpoint.set("weight", torch::arange(4096, torch::kFloat) * scale);
  checkpoint.set("bias", torch::ones({64}) * scale);
  checkpoint.set("step", static_cast<int64_t>(7));
  io.save_checkpoint(checkpoint, path);
}

std::string load_error(fulgur::CheckpointIO& io, const std::string& path) {
  try {
    (void)io.load_checkpoint(path);
  } catch (const fulgur::CheckpointError& e) {
    return e.what();
  }
  return "loaded";
}

TEST(TorchCheckpointIOIntegrity, EndsWithAFooterAndVerifies) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  save_model_like(io, dir.file("a.ckpt"));
  const std::string bytes = fulgur::test::read_text(dir.file("a.ckpt"));
  ASSERT_GT(bytes.size(), 32u);
  EXPECT_EQ(bytes.substr(bytes.size() - 32, 8), "FULGURCK");
  EXPECT_EQ(fulgur::TorchCheckpointIO().verify(dir.file("a.ckpt")), "");
  EXPECT_EQ(load_error(io, dir.file("a.ckpt")), "loaded");
}

// One flipped bit anywhere (the archive's header, its tensors' bytes, its
// directory, the footer) is refused before LibTorch reads anything.
TEST(TorchCheckpointIOIntegrity, EveryFlippedByteIsRefused) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  const std::string path = dir.file("a.ckpt");
  save_model_like(io, path);
  const std::string good = fulgur::test::read_text(path);
  std::vector<size_t> positions = {0,
                                   1,
                                   30,
                                   good.size() / 2,
                                   good.size() - 33,
                                   good.size() - 32,
                                   good.size() - 20,
                                   good.size() - 1};
  std::mt19937 rng(5);
  for (int i = 0; i < 40; ++i) positions.push_back(rng() % good.size());
  int named_a_tensor = 0;
  for (size_t pos : positions) {
    std::string bad = good;
    bad[pos] = static_cast<char>(bad[pos] ^ (1 << (pos % 8)));
    fulgur::test::write_text(path, bad);
    const std::string error = load_error(io, path);
    EXPECT_TRUE(
        fulgur::test::message_contains(error, {path, "is corrupt", "use an earlier checkpoint"}))
        << "byte " << pos << " of " << good.size() << ": " << error;
    EXPECT_NE(fulgur::TorchCheckpointIO().verify(path), "") << "byte " << pos;
    if (error.find("the bytes of a tensor (record data/") != std::string::npos) ++named_a_tensor;
  }
  // Most of the file is the tensors' bytes: the damaged record is named.
  EXPECT_GT(named_a_tensor, 10);
  fulgur::test::write_text(path, good);
  EXPECT_EQ(load_error(io, path), "loaded");
}

// Reads of 1 MiB and more are split between two threads, each half read
// and checksummed in pieces: a tensor of 3.2 MB and one of an odd size
// (1.5 MB) load intact, and a flipped byte in either half of either, at a
// piece's edge or at the split, is refused naming the tensor's record.
TEST(TorchCheckpointIOIntegrity, LargeRecordsAreVerifiedInBothHalves) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  const std::string path = dir.file("a.ckpt");
  const auto big = torch::arange(800000, torch::kFloat);
  const auto odd = torch::arange(393217, torch::kFloat) * -1;
  {
    fulgur::StateDict checkpoint;
    checkpoint.set("big", big);
    checkpoint.set("small", torch::ones({16}));
    checkpoint.set("odd", odd);
    io.save_checkpoint(checkpoint, path);
  }
  {
    const fulgur::StateDict loaded = io.load_checkpoint(path);
    EXPECT_TRUE(torch::equal(loaded.tensor("big"), big));
    EXPECT_TRUE(torch::equal(loaded.tensor("odd"), odd));
  }
  const std::string good = fulgur::test::read_text(path);
  for (const auto& tensor : {big, odd}) {
    const std::string head(static_cast<const char*>(tensor.data_ptr()), 64);
    const size_t start = good.find(head);
    ASSERT_NE(start, std::string::npos);
    const size_t bytes = static_cast<size_t>(tensor.numel()) * 4;
    const size_t half = (bytes / 2) & ~size_t{4095};
    for (size_t offset : {size_t{0}, size_t{256} << 10, half - 1, half, half + (size_t{256} << 10),
                          bytes / 2 + bytes / 4, bytes - 1}) {
      std::string bad = good;
      bad[start + offset] = static_cast<char>(~bad[start + offset]);
      fulgur::test::write_text(path, bad);
      const std::string error = load_error(io, path);
      EXPECT_TRUE(fulgur::test::message_contains(
          error, {path, "is corrupt", "the bytes of a tensor (record data/"}))
          << "tensor of " << bytes << " bytes, offset " << offset << ": " << error;
    }
  }
  fulgur::test::write_text(path, good);
  EXPECT_EQ(load_error(io, path), "loaded");
}

// LibTorch parses a file while its checksum is computed as it reads: damage
// in the archive's structure (its first records, the pickled description of
// its tensors, its directory of records at the end) must still end in the
// corrupt-file error, never a crash, a hang or a different error. Every
// byte of the last KiB, every third of the first 2 KiB, and a sample of the
// rest.
TEST(TorchCheckpointIOIntegrity, DamagedStructureIsRefusedWhileParsedBeside) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  const std::string path = dir.file("a.ckpt");
  save_model_like(io, path);
  const std::string good = fulgur::test::read_text(path);
  ASSERT_GT(good.size(), size_t{4096});
  std::vector<size_t> positions;
  for (size_t pos = good.size() - 1024; pos < good.size(); ++pos) positions.push_back(pos);
  for (size_t pos = 0; pos < 2048; pos += 3) positions.push_back(pos);
  for (size_t pos = 2048; pos < good.size() - 1024; pos += 509) positions.push_back(pos);
  for (size_t pos : positions) {
    std::string bad = good;
    bad[pos] = static_cast<char>(~bad[pos]);
    fulgur::test::write_text(path, bad);
    const std::string error = load_error(io, path);
    ASSERT_TRUE(fulgur::test::message_contains(error, {path, "is corrupt"}))
        << "byte " << pos << " of " << good.size() << ": " << error;
  }
}

// Runs of bytes overwritten (changed, or zeroed) anywhere in a checkpoint's
// data, most of them in what LibTorch's reader parses (its directory of
// records, the pickled description, the TorchScript code records at the
// archive's end), with its footer intact: every load of a changed file ends
// in the corrupt-file error, never a crash (LibTorch's reader and unpickler
// trust the archive; each load runs in a child, which reads every tensor it
// gets). The same damage to a checkpoint without a footer (written by
// LibTorch alone) is refused or loads intact tensors. Seeded.
TEST(TorchCheckpointIOIntegrity, OverwrittenRunsOfBytesAreRefusedNeverACrash) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  const std::string path = dir.file("a.ckpt");
  save_model_like(io, path);
  const std::string with_footer = fulgur::test::read_text(path);
  torch::serialize::OutputArchive plain;
  plain.write("weight", torch::arange(4096, torch::kFloat));
  plain.write("bias", torch::ones({64}));
  plain.write("step", c10::IValue(int64_t{7}));
  std::ostringstream plain_bytes;
  plain.save_to(plain_bytes);
  // 0: loaded, with the tensors saved; 1: refused as corrupt; 2: another
  // error; 3: loaded, with other tensors.
  auto load = [&io, &path] {
    try {
      const fulgur::StateDict state = io.load_checkpoint(path);
      const bool same = torch::equal(state.tensor("weight"), torch::arange(4096, torch::kFloat)) &&
                        torch::equal(state.tensor("bias"), torch::ones({64}));
      return same ? 0 : 3;
    } catch (const fulgur::CheckpointError& e) {
      return fulgur::test::message_contains(e.what(), {path, "is corrupt"}) ? 1 : 2;
    }
  };
  // A tensor record's stated CRC and sizes zeroed in the directory: its
  // data descriptor still says what they were.
  {
    std::string bad = plain_bytes.str();
    const size_t name = bad.rfind("/data/0");
    ASSERT_NE(name, std::string::npos);
    const size_t entry = bad.rfind("PK\x01\x02", name);
    ASSERT_NE(entry, std::string::npos);
    std::fill(bad.begin() + static_cast<std::ptrdiff_t>(entry + 16),
              bad.begin() + static_cast<std::ptrdiff_t>(entry + 28), '\0');
    fulgur::test::write_text(path, bad);
    const auto r = fulgur::test::run_in_child(load);
    EXPECT_EQ(r.exit_code, 1) << r.describe();
  }
  std::mt19937 rng(11);
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  for (int i = 0; i < 240; ++i) {
    const bool footer = i % 2 == 0;
    const std::string& good = footer ? with_footer : plain_bytes.str();
    std::string bad = good;
    const size_t data = footer ? bad.size() - 32 : bad.size();
    // Three cases in four within the archive's last 3 KiB.
    size_t at = i % 4 == 3 ? pick(data) : data - 1 - pick(std::min<size_t>(data, 3072));
    const bool zeroed = i % 5 == 1;
    for (size_t n = 1 + pick(i % 3 == 0 ? 256 : 8); n > 0 && at < data; --n, ++at) {
      bad[at] = zeroed ? '\0' : static_cast<char>(bad[at] ^ (1 + pick(255)));
    }
    fulgur::test::write_text(path, bad);
    const auto r = fulgur::test::run_in_child(load);
    const bool changed = bad != good;
    EXPECT_TRUE(footer ? r.exit_code == (changed ? 1 : 0) : r.exit_code == 0 || r.exit_code == 1)
        << "case " << i << (footer ? " (with its footer)" : " (without a footer)")
        << (zeroed ? ", zeroed" : "") << ": " << r.describe();
  }
}

TEST(TorchCheckpointIOIntegrity, NamesTheNewestOtherCheckpointThatVerifies) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  save_model_like(io, dir.file("epoch=0.ckpt"));
  save_model_like(io, dir.file("epoch=1.ckpt"));
  save_model_like(io, dir.file("epoch=2.ckpt"));
  save_model_like(io, dir.file("last.ckpt"));
  const auto now = fs::file_time_type::clock::now();
  fs::last_write_time(dir.file("epoch=0.ckpt"), now - std::chrono::hours(3));
  fs::last_write_time(dir.file("epoch=1.ckpt"), now - std::chrono::hours(2));
  fs::last_write_time(dir.file("epoch=2.ckpt"), now - std::chrono::hours(1));
  // epoch=2 is damaged too: the alternative is epoch=1.
  for (const char* name : {"epoch=2.ckpt", "last.ckpt"}) {
    std::string bytes = fulgur::test::read_text(dir.file(name));
    bytes[bytes.size() / 3] = static_cast<char>(bytes[bytes.size() / 3] ^ 1);
    fulgur::test::write_text(dir.file(name), bytes);
  }
  fs::last_write_time(dir.file("epoch=2.ckpt"), now - std::chrono::hours(1));
  EXPECT_TRUE(fulgur::test::message_contains(load_error(io, dir.file("last.ckpt")),
                                             {"\"" + dir.file("epoch=1.ckpt") +
                                              "\" is the newest other one in its directory that "
                                              "verifies"}));
  fs::remove(dir.file("epoch=0.ckpt"));
  fs::remove(dir.file("epoch=1.ckpt"));
  EXPECT_TRUE(fulgur::test::message_contains(load_error(io, dir.file("last.ckpt")),
                                             {"no other checkpoint in its directory verifies"}));
}

// Written before checkpoints had checksums: still loads.
TEST(TorchCheckpointIOIntegrity, ACheckpointWithoutChecksumStillLoads) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  torch::serialize::OutputArchive archive;
  archive.write("value", torch::arange(5));
  archive.save_to(dir.file("old.ckpt"));
  EXPECT_TRUE(torch::equal(load_tensor(io, dir.file("old.ckpt")), torch::arange(5)));
  // It verifies as loadable, and is told apart by has_checksum().
  EXPECT_EQ(io.verify(dir.file("old.ckpt")), "");
  EXPECT_FALSE(fulgur::TorchCheckpointIO::has_checksum(dir.file("old.ckpt")));
  // Cut short, it does not.
  const auto size = fs::file_size(dir.file("old.ckpt"));
  fs::resize_file(dir.file("old.ckpt"), size / 2);
  EXPECT_TRUE(fulgur::test::message_contains(io.verify(dir.file("old.ckpt")),
                                             {"no checksum footer", "cannot read it"}));
}

// An archive written as one saved on `device` writes it: the archive
// `write` makes, its tensors' location rewritten from "cpu" (the records
// copied through LibTorch's own reader and writer, which give each its
// CRC-32).
std::string as_saved_on(const std::string& device,
                        const std::function<void(torch::serialize::OutputArchive&)>& write) {
  torch::serialize::OutputArchive archive;
  write(archive);
  std::ostringstream saved;
  archive.save_to(saved);
  std::istringstream in(saved.str());
  caffe2::serialize::PyTorchStreamReader reader(&in);
  std::string out;
  caffe2::serialize::PyTorchStreamWriter writer([&out](const void* data, size_t n) {
    out.append(static_cast<const char*>(data), n);
    return n;
  });
  writer.setMinVersion(reader.version());
  // The pickled location: BINUNICODE, its length, its text.
  const auto location = [](const std::string& name) {
    const char length[4] = {static_cast<char>(name.size()), 0, 0, 0};
    return "X" + std::string(length, 4) + name;
  };
  int relocated = 0;
  for (const std::string& name : reader.getAllRecords()) {
    // The writer adds its own.
    if (name == "version" || name == ".data/version" || name == ".data/serialization_id") continue;
    auto [data, size] = reader.getRecord(name);
    std::string bytes(static_cast<const char*>(data.get()), size);
    if (name == "data.pkl") {
      for (size_t at = bytes.find(location("cpu")); at != std::string::npos;
           at = bytes.find(location("cpu"), at + 1), ++relocated) {
        bytes.replace(at, location("cpu").size(), location(device));
      }
    }
    writer.writeRecord(name, bytes.data(), bytes.size());
  }
  writer.writeEndOfFile();
  EXPECT_GT(relocated, 0) << "no tensor location in data.pkl";
  return out;
}

// A checkpoint written on a GPU loads where there is none (its tensors into
// host memory; what restores them copies each to its own device), here
// from a device this build cannot use: LibTorch's reader alone moves each
// tensor to the device it was saved on, and refused the file.
TEST(TorchCheckpointIO, TensorsSavedOnAnotherDeviceLoadIntoHostMemory) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  const at::Tensor weight = torch::arange(12, torch::kFloat).reshape({3, 4});
  for (const std::string device : {"cuda", "xpu"}) {
    SCOPED_TRACE(device);
    {
      std::ofstream(dir.file("gpu.ckpt"), std::ios::binary)
          << as_saved_on(device, [&](torch::serialize::OutputArchive& archive) {
               archive.write("weight", weight);
               archive.write("bias", torch::ones({4}));
               archive.write("step", c10::IValue(int64_t{7}));
             });
    }
    EXPECT_EQ(io.verify(dir.file("gpu.ckpt")), "");
    const fulgur::StateDict loaded = io.load_checkpoint(dir.file("gpu.ckpt"));
    EXPECT_TRUE(loaded.tensor("weight").device().is_cpu());
    EXPECT_TRUE(torch::equal(loaded.tensor("weight"), weight));
    EXPECT_TRUE(torch::equal(loaded.tensor("bias"), torch::ones({4})));
    EXPECT_EQ(loaded.integer("step"), 7);
  }
}

// A file's fingerprint is its size and the CRC32C of all its bytes: the
// footer gives it without reading the data, and it equals what the default
// (reading the file whole) and an independent checksum of the bytes give.
// A file whose tensors claim more than their storages hold (crafted, or
// written by a tool other than LibTorch's save of those tensors) verifies
// against its checksums, which are not authentication: each tensor's extent
// is checked against its storage as it loads. It loaded, and reading the
// tensor read past its storage (a crash, or another object's bytes).
TEST(TorchCheckpointIOIntegrity, ATensorLargerThanItsStorageIsRefusedNamingIt) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  auto claims_more = [](at::Tensor t, std::vector<int64_t> sizes, std::vector<int64_t> strides,
                        int64_t offset) {
    // What a crafted file's description makes of it; LibTorch's own
    // set_() would refuse it.
    t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides);
    t.unsafeGetTensorImpl()->set_storage_offset(offset);
    return t;
  };
  struct Case {
    const char* name;
    std::function<void(fulgur::StateDict&)> fill;
    std::vector<std::string> named;
  };
  const std::vector<Case> cases = {
      {"sizes beyond the storage",
       [&](fulgur::StateDict& s) {
         s.set("weight", claims_more(torch::zeros({4}), {1 << 20}, {1}, 0));
       },
       {"\"weight\"", "[1048576]", "4194304 bytes", "holds 16"}},
      {"an offset past its end",
       [&](fulgur::StateDict& s) { s.set("bias", claims_more(torch::zeros({4}), {2}, {1}, 3)); },
       {"\"bias\"", "offset 3", "holds 16"}},
      {"strides that overflow",
       [&](fulgur::StateDict& s) {
         s.set("grid", claims_more(torch::zeros({4}), {2, 2}, {int64_t{1} << 62, 1}, 0));
       },
       {"\"grid\"", "holds 16"}},
      {"within a nested section's list",
       [&](fulgur::StateDict& s) {
         fulgur::StateDict optimizer;
         c10::List<at::Tensor> buffers;
         buffers.push_back(torch::ones({2}));
         buffers.push_back(claims_more(torch::zeros({2}, torch::kFloat64), {3}, {1}, 0));
         optimizer.set("momentum", c10::IValue(buffers));
         s.set_section("optimizer", std::move(optimizer));
       },
       {"\"optimizer/momentum\"", "holds 16"}},
      {"a sparse tensor's index past its sizes",
       [&](fulgur::StateDict& s) {
         s.set("embedding_grad",
               at::_sparse_coo_tensor_unsafe(torch::tensor({{0, 100}}), torch::ones({2}), {4}));
       },
       {"\"embedding_grad\"", "sparse tensor", "[4]"}},
      {"a sparse CSR tensor's column past its sizes",
       [&](fulgur::StateDict& s) {
         s.set("adjacency",
               at::_sparse_csr_tensor_unsafe(torch::tensor({0, 1, 2}), torch::tensor({0, 1000}),
                                             torch::ones({2}), {2, 2}));
       },
       {"\"adjacency\"", "sparse CSR tensor", "[2, 2]"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    fulgur::StateDict state;
    state.set("step", static_cast<int64_t>(7));
    c.fill(state);
    const std::string path = dir.file(std::string(c.name) + ".ckpt");
    io.save_checkpoint(state, path);
    EXPECT_EQ(io.verify(path), "");  // its checksums hold
    auto expected = c.named;
    expected.push_back(path);
    expected.push_back("not written by");
    EXPECT_THROWS_WITH(fulgur::CheckpointError, io.load_checkpoint(path), (expected));
  }
  // A tensor that uses part of its storage (a view) loads as it was.
  fulgur::StateDict view;
  view.set("part", torch::arange(10, torch::kFloat).narrow(0, 4, 3));
  io.save_checkpoint(view, dir.file("view.ckpt"));
  EXPECT_TRUE(torch::equal(io.load_checkpoint(dir.file("view.ckpt")).tensor("part"),
                           torch::tensor({4.0f, 5.0f, 6.0f})));
}

TEST(TorchCheckpointIOIntegrity, TheFingerprintIsTheFilesSizeAndChecksumFromItsFooter) {
  struct ReadsWhole : fulgur::TorchCheckpointIO {
    fulgur::FileFingerprint fingerprint(const std::string& path) override {
      return CheckpointIO::fingerprint(path);  // NOLINT(bugprone-parent-virtual-call)
    }
  };
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  ReadsWhole whole;
  const std::string path = dir.file("a.ckpt");
  save_model_like(io, path);
  const std::string bytes = fulgur::test::read_text(path);
  const fulgur::FileFingerprint expected{bytes.size(), fulgur::crc32c(bytes.data(), bytes.size())};
  EXPECT_EQ(io.fingerprint(path), expected);
  EXPECT_EQ(whole.fingerprint(path), expected);
  // Another save's differs.
  save_tensor(io, torch::arange(5), path);
  EXPECT_NE(io.fingerprint(path), expected);
  // Without a footer (one from before checksums, or one that lost it), the
  // file is read whole: still its bytes' size and checksum.
  fs::resize_file(path, fs::file_size(path) - 32);
  const std::string cut = fulgur::test::read_text(path);
  EXPECT_EQ(io.fingerprint(path),
            (fulgur::FileFingerprint{cut.size(), fulgur::crc32c(cut.data(), cut.size())}));
  EXPECT_TRUE(fulgur::test::throws_with<fulgur::CheckpointError>(
      [&] { (void)io.fingerprint(dir.file("missing.ckpt")); }, {"missing.ckpt", "does not exist"}));
}

// A checkpoint that had a footer and lost it (cut at its end, or its footer
// overwritten) is corrupt, not an old one.
TEST(TorchCheckpointIOIntegrity, ALostFooterIsCorruption) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  const std::string path = dir.file("a.ckpt");
  save_model_like(io, path);
  fs::resize_file(path, fs::file_size(path) - 32);
  EXPECT_TRUE(fulgur::test::message_contains(
      load_error(io, path), {path, "is corrupt", "checksum footer is missing or damaged"}));
  EXPECT_TRUE(
      fulgur::test::message_contains(io.verify(path), {"checksum footer is missing or damaged"}));
}

// A footer of a version this fulgur does not know (its own checksum
// holding): a newer fulgur's file, said as such, not "corrupt".
TEST(TorchCheckpointIOIntegrity, ANewerFootersFileIsNotCalledCorrupt) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  const std::string path = dir.file("a.ckpt");
  save_model_like(io, path);
  std::string bytes = fulgur::test::read_text(path);
  char* footer = bytes.data() + bytes.size() - 32;
  footer[8] = 2;  // version 2 (little-endian)
  const uint32_t crc = fulgur::crc32c(footer, 28);
  for (int i = 0; i < 4; ++i) footer[28 + i] = static_cast<char>((crc >> (8 * i)) & 0xff);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  const std::string error = load_error(io, path);
  EXPECT_TRUE(
      fulgur::test::message_contains(error, {path, "cannot be read by this fulgur", "version 2",
                                             "a newer fulgur wrote it", "not known to be damaged"}))
      << error;
  EXPECT_EQ(error.find("corrupt"), std::string::npos) << error;
}

TEST(TorchCheckpointIOIntegrity, AFifoIsRefusedWithoutOpeningIt) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  const std::string path = dir.file("pipe.ckpt");
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  // Opening a FIFO for reading would block until a writer comes: it is
  // refused from its type alone.
  EXPECT_TRUE(fulgur::test::message_contains(
      load_error(io, path), {path, "is a FIFO (named pipe), not a checkpoint file"}));
}

TEST(TorchCheckpointIOIntegrity, AnUnreadableFileNamesTheOsReason) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  const std::string path = dir.file("a.ckpt");
  save_model_like(io, path);
  fs::permissions(path, fs::perms::owner_write);
  // The directory stays searchable: the open, not the lookup, is refused.
  fs::permissions(dir.path(),
                  fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
  if (::geteuid() != 0) {
    EXPECT_TRUE(fulgur::test::message_contains(
        load_error(io, path), {path, "cannot open it for reading: Permission denied"}));
    return;
  }
  // Root reads anything: the check runs as nobody, in a child.
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    at::set_num_threads(1);  // the parent's thread pool did not survive fork
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    const std::string error = load_error(io, path);
    ::_exit(fulgur::test::message_contains(error,
                                           {path, "cannot open it for reading: Permission denied",
                                            "Give this user read permission"})
                ? 0
                : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 3) GTEST_SKIP() << "cannot switch to user nobody here";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's error did not name the OS reason";
}

// In a forked child with its own mount namespace and a tmpfs of
// `tmpfs_size` over a new directory: a first checkpoint is saved to
// last.ckpt, `make_it_fail` prepares the failure (false: it cannot here),
// then `failing_save` to last.ckpt must throw a CheckpointError naming the
// path and each of `expected`, leave no file beside last.ckpt, and leave
// last.ckpt loading. Skipped where a tmpfs cannot be mounted (root only).
void expect_failed_save_loses_nothing(
    const char* tmpfs_size, const std::function<bool(const std::string& dir)>& make_it_fail,
    const std::function<void(fulgur::TorchCheckpointIO&, const std::string&)>& failing_save,
    const std::vector<std::string>& expected) {
  if (::geteuid() != 0) GTEST_SKIP() << "mounting a tmpfs needs root";
  TempDir dir;
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    at::set_num_threads(1);  // the parent's thread pool did not survive fork
    if (::unshare(CLONE_NEWNS) != 0 ||
        ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("tmpfs", dir.path().c_str(), "tmpfs", 0,
                fulgur::str("size=", tmpfs_size).c_str()) != 0) {
      ::_exit(3);
    }
    fulgur::TorchCheckpointIO io;
    const std::string path = dir.file("last.ckpt");
    save_model_like(io, path);  // ~17 KB: fits
    if (!make_it_fail(dir.path())) ::_exit(3);
    int code = 0;
    try {
      failing_save(io, path);
      code = 10;
    } catch (const fulgur::CheckpointError& e) {
      std::vector<std::string> wanted = expected;
      wanted.push_back(path);
      if (!fulgur::test::message_contains(e.what(), wanted)) {
        std::cerr << e.what() << std::endl;
        code = 11;
      }
    }
    if (code == 0 && list_files(dir.path()) != std::vector<std::string>{"last.ckpt"}) code = 12;
    if (code == 0 && load_error(io, path) != "loaded") code = 13;
    std::fflush(nullptr);
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the saving child died (signal " << WTERMSIG(status) << ")";
  if (WEXITSTATUS(status) == 3) GTEST_SKIP() << "cannot mount a tmpfs here";
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "10: saved anyway, 11: wrong message, 12: a file left behind, 13: the previous "
         "checkpoint does not load";
}

// A full disk (a 256 KiB tmpfs): a clear error, the partial file removed,
// the previous checkpoint intact, no abort.
TEST(TorchCheckpointIOIntegrity, AFullDiskIsAClearErrorAndLosesNothing) {
  expect_failed_save_loses_nothing(
      "256k", [](const std::string&) { return true; },
      [](fulgur::TorchCheckpointIO& io, const std::string& path) {
        fulgur::StateDict big;
        big.set("weight", torch::ones({200000}));  // 800 KB: does not fit
        io.save_checkpoint(big, path);
      },
      {"No space left on device", "partial file was removed", "Free space"});
}

// A read-only file system (the tmpfs remounted read-only): a clear error
// naming the OS reason, the previous checkpoint intact, nothing left behind.
TEST(TorchCheckpointIOIntegrity, AReadOnlyFileSystemIsAClearErrorAndLosesNothing) {
  expect_failed_save_loses_nothing(
      "1m",
      [](const std::string& dir) {
        return ::mount(nullptr, dir.c_str(), nullptr, MS_REMOUNT | MS_RDONLY, nullptr) == 0;
      },
      [](fulgur::TorchCheckpointIO& io, const std::string& path) { save_model_like(io, path); },
      {"Read-only file system", "Make the directory writable"});
}

// A directory that cannot be created (a file stands where a parent should
// be): the error names it and the OS reason.
TEST(TorchCheckpointIOIntegrity, AnUncreatableDirectoryIsAClearError) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  fulgur::test::write_text(dir.file("taken"), "a file, not a directory\n");
  const std::string path = dir.file("taken/checkpoints/last.ckpt");
  EXPECT_THROWS_WITH(
      fulgur::CheckpointError, save_model_like(io, path),
      {path, "cannot create directory", dir.file("taken/checkpoints"), "Not a directory"});
  EXPECT_EQ(list_files(dir.path()), std::vector<std::string>{"taken"});
}

// A save killed mid-write leaves `<path>.tmp.<pid>`: the next save in the
// directory removes it once its writer is dead, never a live writer's.
TEST(TorchCheckpointIOIntegrity, ASaveRemovesDeadWritersTemporaryFiles) {
  TempDir dir;
  fulgur::TorchCheckpointIO io;
  const std::string here = "." + fulgur::test::host_name();
  const std::string dead_pid = std::to_string(fulgur::test::dead_pid()),
                    live_pid = std::to_string(::getppid());
  const std::vector<std::string> names = {
      "last.ckpt.tmp." + dead_pid + here,         // a dead writer here: removed
      "epoch=1.ckpt.tmp." + dead_pid,             // fulgur 0.1's name, dead: removed
      "epoch=0.ckpt.tmp." + live_pid + here,      // a live writer: kept
      "epoch=2.ckpt.tmp." + dead_pid + ".node7",  // another host's: kept
      "notes.tmp.txt"};                           // not a temporary checkpoint: kept
  for (const auto& name : names) fulgur::test::write_text(dir.file(name), "partial");
  save_model_like(io, dir.file("last.ckpt"));
  EXPECT_THAT(list_files(dir.path()),
              ElementsAre("epoch=0.ckpt.tmp." + live_pid + here,
                          "epoch=2.ckpt.tmp." + dead_pid + ".node7", "last.ckpt", "notes.tmp.txt"));
}

TEST(TorchCheckpointIO, RegisteredAsTorch) {
  auto io = fulgur::checkpoint_io_registry().create("torch");
  EXPECT_EQ(io->name(), "torch");
}

}  // namespace
