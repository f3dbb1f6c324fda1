#include "fulgur/strategies/checkpoint_layout.h"

#include <torch/torch.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "fulgur/core/errors.h"
#include "fulgur/core/reduce_op.h"
#include "fulgur/plugins/io/checkpoint_io.h"
#include "fulgur/strategies/fsdp.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/utilities/checksum.h"
#include "strategies/every_rank.h"
#include "utilities/remove_tree.h"
#include "utilities/small_file.h"

namespace fulgur {

namespace fs = std::filesystem;

CheckpointLayout::~CheckpointLayout() = default;

// ---- One file, written by global rank 0.

bool SingleFileCheckpoint::is_writer(const Strategy& strategy) const {
  return strategy.is_global_zero();
}

void SingleFileCheckpoint::save(Strategy& strategy, StateDict& checkpoint,
                                const std::string& path) {
  if (is_writer(strategy)) strategy.checkpoint_io().save_checkpoint(checkpoint, path);
}

StateDict SingleFileCheckpoint::load(Strategy& strategy, const std::string& path) {
  return strategy.checkpoint_io().load_checkpoint(path);
}

void SingleFileCheckpoint::remove(Strategy& strategy, const std::string& path) {
  if (is_writer(strategy)) strategy.checkpoint_io().remove_checkpoint(path);
}

std::string SingleFileCheckpoint::verify(Strategy& strategy, const std::string& path) {
  return strategy.checkpoint_io().verify(path);
}

void SingleFileCheckpoint::remove_stale_files(Strategy& strategy, const std::string& dir) {
  if (is_writer(strategy)) strategy.checkpoint_io().remove_stale_files(dir);
}

// ---- Per-rank shards and a manifest.

namespace {

// v2 ends with a line "crc32c=XXXXXXXX", the CRC32C of every byte before it;
// v1 (fulgur 0.1) has none and is read unverified.
constexpr const char* kManifestHeader = "fulgur sharded checkpoint v2";
constexpr const char* kManifestHeaderV1 = "fulgur sharded checkpoint v1";
// Lines a v2 manifest gained later (an older fulgur skips them).
constexpr const char* kFingerprintKey = "fingerprint=";

std::string hex32(uint32_t value) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", value);
  return buf;
}

using Manifest = ShardedCheckpoint::Manifest;

}  // namespace

std::string ShardedCheckpoint::missing_shards(const std::string& path, const Manifest& manifest) {
  std::vector<std::string> missing;
  std::error_code ec;
  for (const auto& shard : manifest.shards) {
    if (!fs::exists(fs::path(path) / shard, ec)) missing.push_back(shard);
  }
  if (missing.empty()) return {};
  return str("checkpoint \"", path, "\" is missing shard(s) ", join(missing), " of the ",
             manifest.world_size, " listed in ", ShardedCheckpoint::kManifest,
             ". Restore them, or resume from another checkpoint.");
}

ShardedCheckpoint::Manifest ShardedCheckpoint::read_manifest(const std::string& path) {
  const fs::path file = fs::path(path) / ShardedCheckpoint::kManifest;
  // A manifest lists one line per rank: 16 MiB is half a million ranks.
  constexpr uint64_t kMaxManifestBytes = uint64_t{16} << 20;
  const detail::SmallFileRead read = detail::read_small_file(file.string(), kMaxManifestBytes);
  if (read.problem == detail::SmallFileRead::Problem::kMissing) {
    throw CheckpointError(str("checkpoint \"", path, "\" has no ", ShardedCheckpoint::kManifest,
                              ": its save did not complete (rank 0 writes it after every shard). "
                              "Resume from an earlier checkpoint."));
  }
  if (!read.ok()) {
    throw CheckpointError(str("checkpoint \"", path, "\": its ", ShardedCheckpoint::kManifest, " ",
                              read.describe(kMaxManifestBytes),
                              ". Rank 0 writes it as the save's last step; resume from an "
                              "earlier checkpoint, or restore the directory from a copy."));
  }
  const std::string& text = read.text;
  std::istringstream lines(text);
  Manifest m;
  std::string line;
  std::getline(lines, line);
  const bool v1 = line == kManifestHeaderV1;
  if (line != kManifestHeader && !v1) {
    // What it starts with, printable and short (it may be any file).
    std::string shown;
    for (char c : line.substr(0, 60)) {
      shown += std::isprint(static_cast<unsigned char>(c)) ? c : '?';
    }
    if (line.size() > 60) shown += "...";
    throw CheckpointError(str(file.string(), " is not a fulgur manifest (first line \"", shown,
                              "\", expected \"", kManifestHeader, "\")."));
  }
  if (!v1) {
    const auto at = text.rfind("crc32c=");
    const bool has_crc = at != std::string::npos && (at == 0 || text[at - 1] == '\n');
    const std::string stored = has_crc ? text.substr(at + 7, 8) : std::string();
    const std::string actual = hex32(crc32c(text.data(), has_crc ? at : text.size()));
    if (!has_crc || stored != actual) {
      throw CheckpointError(
          str("checkpoint \"", path, "\" is corrupt: its ", ShardedCheckpoint::kManifest,
              has_crc ? str(" does not match the CRC32C written with it (expected ", stored,
                            ", got ", actual, ")")
                      : std::string(" lost its checksum line (cut short)"),
              ". The file is corrupt; use an earlier checkpoint."));
    }
  }
  std::vector<std::string> fingerprinted;  // the shards named by fingerprint lines
  while (std::getline(lines, line)) {
    if (line.rfind("world_size=", 0) == 0) {
      m.world_size = std::atoi(line.c_str() + 11);
    } else if (line.rfind("shard=", 0) == 0) {
      m.shards.push_back(line.substr(6));
    } else if (line.rfind(kFingerprintKey, 0) == 0) {
      // "fingerprint=<shard> <size> <crc32c in hex>"
      std::istringstream fields(line.substr(std::strlen(kFingerprintKey)));
      std::string name, crc;
      FileFingerprint f;
      if (!(fields >> name >> f.size >> crc) || crc.size() != 8 ||
          crc.find_first_not_of("0123456789abcdef") != std::string::npos) {
        throw CheckpointError(str(file.string(), " is damaged: its line \"", line, "\" is not \"",
                                  kFingerprintKey, "<shard> <size> <crc32c>\"."));
      }
      f.crc32c = static_cast<uint32_t>(std::stoul(crc, nullptr, 16));
      fingerprinted.push_back(name);
      m.fingerprints.push_back(f);
    }
  }
  if (m.world_size < 1 || static_cast<int>(m.shards.size()) != m.world_size) {
    throw CheckpointError(str(file.string(), " is damaged: world_size=", m.world_size, " with ",
                              m.shards.size(), " shards listed."));
  }
  if (!fingerprinted.empty() && fingerprinted != m.shards) {
    throw CheckpointError(str(file.string(), " is damaged: it lists the shards ", join(m.shards),
                              " and fingerprints of ", join(fingerprinted), "."));
  }
  return m;
}

std::string ShardedCheckpoint::foreign_shard(CheckpointIO& io, const std::string& path,
                                             const Manifest& manifest, size_t index) {
  if (index >= manifest.fingerprints.size()) return {};  // an older manifest
  const std::string& shard = manifest.shards.at(index);
  const FileFingerprint& saved = manifest.fingerprints[index];
  const std::string file = (fs::path(path) / shard).string();
  const FileFingerprint found = io.fingerprint(file);
  if (found == saved) return {};
  // A damaged shard differs too: that is said as such.
  if (std::string problem = io.verify(file); !problem.empty()) {
    return str("checkpoint \"", path, "\" is corrupt: its shard ", shard, ": ", problem,
               ". Use an earlier checkpoint.");
  }
  return str("checkpoint \"", path, "\" mixes saves: its shard ", shard, " (", found.size,
             " bytes, CRC32C ", hex32(found.crc32c), ") is not the one its save wrote (",
             saved.size, " bytes, CRC32C ", hex32(saved.crc32c), " in ", kManifest,
             "); it was copied from another save or replaced since. Put back the shard this "
             "save wrote, or resume from another checkpoint.");
}

std::string ShardedCheckpoint::shard_path(const std::string& path, int rank, int world_size) {
  return (fs::path(path) / str("rank-", rank, "-of-", world_size, ".ckpt")).string();
}

bool ShardedCheckpoint::is_writer(const Strategy&) const { return true; }

using detail::on_every_rank;

void ShardedCheckpoint::save(Strategy& strategy, StateDict& checkpoint, const std::string& path) {
  const int rank = strategy.global_rank();
  const int world = strategy.world_size();
  // Every rank has come to the save (none still reads the checkpoint at
  // this path) before rank 0 changes it.
  strategy.barrier("sharded checkpoint save: start");
  // 1. Rank 0 clears what a save at this path left before (a single-file
  //    checkpoint, the manifest, shards of another world size), so a crash
  //    from here on leaves a directory without a manifest, never a mix.
  on_every_rank(strategy, "cannot prepare the checkpoint directory, so no rank saves", [&] {
    if (rank != 0) return;
    std::error_code ec;
    if (fs::exists(path, ec) && !fs::is_directory(path, ec)) fs::remove(path, ec);
    fs::remove(fs::path(path) / kManifest, ec);
    fs::create_directories(path, ec);
    if (ec) {
      throw CheckpointError(
          str("cannot create the checkpoint directory \"", path, "\": ", ec.message(), "."));
    }
    for (const auto& entry : fs::directory_iterator(path, ec)) {
      const auto name = entry.path().filename().string();
      if (name.rfind("rank-", 0) == 0 &&
          name.find(str("-of-", world, ".ckpt")) == std::string::npos) {
        fs::remove(entry.path(), ec);
      }
    }
  });
  // 2. Every rank writes its shard and fingerprints it. The manifest may
  //    claim only shards that are durable (an asynchronous checkpoint IO
  //    has handed its shard to a writer thread).
  FileFingerprint own;
  on_every_rank(strategy, "cannot write its shard, so the checkpoint is not complete", [&] {
    strategy.checkpoint_io().save_checkpoint(checkpoint, shard_path(path, rank, world));
    strategy.checkpoint_io().wait_until_durable();
    own = strategy.checkpoint_io().fingerprint(shard_path(path, rank, world));
  });
  const at::Tensor fingerprints =
      strategy
          .all_gather(
              torch::tensor({static_cast<int64_t>(own.size), int64_t{own.crc32c}}, torch::kLong))
          .cpu();
  // 3. The manifest marks the checkpoint complete.
  on_every_rank(strategy, "cannot write the manifest, so the checkpoint is not complete", [&] {
    if (rank != 0) return;
    std::ostringstream text;
    text << kManifestHeader << "\nworld_size=" << world << "\n";
    for (int r = 0; r < world; ++r) {
      text << "shard=" << fs::path(shard_path(path, r, world)).filename().string() << "\n";
    }
    for (int r = 0; r < world; ++r) {
      text << kFingerprintKey << fs::path(shard_path(path, r, world)).filename().string() << " "
           << fingerprints[r][0].item<int64_t>() << " "
           << hex32(static_cast<uint32_t>(fingerprints[r][1].item<int64_t>())) << "\n";
    }
    const std::string body = text.str();
    text << "crc32c=" << hex32(crc32c(body.data(), body.size())) << "\n";
    const fs::path tmp = fs::path(path) / (std::string(kManifest) + ".tmp");
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << text.str();
      if (!out) throw CheckpointError(str("cannot write ", tmp.string(), "."));
    }
    std::error_code ec;
    fs::rename(tmp, fs::path(path) / kManifest, ec);
    if (ec) {
      throw CheckpointError(str("cannot rename ", tmp.string(), " to ", kManifest, ": ",
                                ec.message(), "."));
    }
  });
}

namespace {

// This rank's part of the sharded checkpoint at `path` (ShardedCheckpoint::load).
StateDict load_own_part(Strategy& strategy, const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw CheckpointError(str("checkpoint \"", path, "\" does not exist."));
  }
  if (!fs::is_directory(path, ec)) {
    // One file of every rank's whole state ("full", consolidated, or
    // single_device's and ddp's): fsdp takes each rank's shard from it.
    if (dynamic_cast<const FSDPStrategy*>(&strategy) != nullptr) {
      return strategy.checkpoint_io().load_checkpoint(path);
    }
    throw CheckpointError(str("checkpoint \"", path,
                              "\" is one file, written by a strategy that "
                              "saves whole models; strategy \"",
                              strategy.name(),
                              "\" reads a directory of "
                              "per-rank shards written under it. Resume with the strategy that "
                              "wrote it, or load its weights in configure_model()."));
  }
  const Manifest manifest = ShardedCheckpoint::read_manifest(path);
  if (manifest.world_size != strategy.world_size()) {
    throw CheckpointError(str("checkpoint \"", path, "\" was saved by ", manifest.world_size,
                              " ranks, and this run has ", strategy.world_size(),
                              ": each rank holds its "
                              "own shard, so resuming needs the same world size. Run with "
                              "devices x num_nodes = ",
                              manifest.world_size,
                              strategy.name().rfind("fsdp", 0) == 0
                                  ? str(", or make it one file that loads on any world size "
                                        "with `fulgur checkpoint consolidate ",
                                        path, " FILE`.")
                                  : std::string(".")));
  }
  if (auto missing = ShardedCheckpoint::missing_shards(path, manifest); !missing.empty()) {
    throw CheckpointError(missing);
  }
  const int rank = strategy.global_rank();
  CheckpointIO& io = strategy.checkpoint_io();
  const std::string foreign =
      ShardedCheckpoint::foreign_shard(io, path, manifest, static_cast<size_t>(rank));
  if (!foreign.empty()) throw CheckpointError(foreign);
  return io.load_checkpoint(ShardedCheckpoint::shard_path(path, rank, strategy.world_size()));
}

}  // namespace

StateDict ShardedCheckpoint::load(Strategy& strategy, const std::string& path) {
  // What one rank finds wrong stops them all (a rank failing alone would
  // leave its peers waiting in the fit's first collective), each with that
  // rank's reason.
  StateDict state;
  on_every_rank(strategy, "cannot load its shard, so no rank resumes",
                [&] { state = load_own_part(strategy, path); });
  return state;
}

void ShardedCheckpoint::remove(Strategy& strategy, const std::string& path) {
  strategy.barrier("sharded checkpoint remove");
  if (strategy.global_rank() == 0) {
    std::error_code ec;
    detail::remove_tree(path, ec);
  }
}

std::string ShardedCheckpoint::verify(Strategy& strategy, const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    if (!fs::exists(path, ec)) return "it does not exist";
    // fsdp loads one file too (load).
    if (dynamic_cast<const FSDPStrategy*>(&strategy) != nullptr) {
      return strategy.checkpoint_io().verify(path);
    }
    return "it is one file, not a directory of per-rank shards";
  }
  try {
    const Manifest manifest = read_manifest(path);
    if (auto missing = missing_shards(path, manifest); !missing.empty()) return missing;
    CheckpointIO& io = strategy.checkpoint_io();
    for (size_t i = 0; i < manifest.shards.size(); ++i) {
      const std::string& shard = manifest.shards[i];
      const std::string problem = io.verify((fs::path(path) / shard).string());
      if (!problem.empty()) return str("its shard ", shard, ": ", problem);
      if (auto foreign = foreign_shard(io, path, manifest, i); !foreign.empty()) return foreign;
    }
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return {};
}

void ShardedCheckpoint::remove_stale_files(Strategy& strategy, const std::string& dir) {
  if (strategy.local_rank() != 0) return;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code type_ec;
    if (it->is_directory(type_ec)) strategy.checkpoint_io().remove_stale_files(it->path().string());
  }
}

}  // namespace fulgur
