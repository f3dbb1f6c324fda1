#include "fulgur/strategies/checkpoint_layout.h"

#include <sys/stat.h>
#include <torch/torch.h>

#include <cctype>
#include <cerrno>
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
#include "utilities/durable_file.h"
#include "utilities/remove_tree.h"
#include "utilities/small_file.h"

namespace fulgur {

namespace fs = std::filesystem;

CheckpointLayout::~CheckpointLayout() = default;

FileFingerprint CheckpointLayout::fingerprint(Strategy& strategy, const std::string& path) {
  return strategy.checkpoint_io().fingerprint(path);
}

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

// `text` as printed in an error: unprintable bytes as '?', at most `limit`
// of them ("..." after).
std::string printable(const std::string& text, size_t limit) {
  std::string shown;
  for (char c : text.substr(0, limit)) {
    shown += std::isprint(static_cast<unsigned char>(c)) ? c : '?';
  }
  if (text.size() > limit) shown += "...";
  return shown;
}

// What a CheckpointIO said of a shard it could not write, without what it
// says of every file it saves (its path, the partial file removed and the
// previous one untouched: the save's own message says what is kept).
std::string shard_failure(std::string message, const std::string& shard) {
  const std::string prefix = str("saving checkpoint \"", shard, "\": ");
  if (message.rfind(prefix, 0) == 0) message.erase(0, prefix.size());
  const std::string kept =
      " The partial file was removed; the previous checkpoint at this path (if any) is untouched.";
  if (const auto at = message.find(kept); at != std::string::npos) message.erase(at, kept.size());
  return message;
}

// For a checkpoint that is not at `path`: where a save's replacement of it
// stopped between two renames (detail::replace_path), the one before it.
std::string set_aside_hint(const std::string& path) {
  const std::string previous = detail::previous_path(path);
  std::error_code ec;
  if (!fs::exists(previous, ec)) return {};
  return str(
      " A save at this path stopped as it replaced the checkpoint there (this file system "
      "cannot exchange two names at once, so the old one was set aside first), and left "
      "that checkpoint whole at \"",
      previous, "\": rename it to \"", path,
      "\" (the next save at this path does), or resume from it.");
}

}  // namespace

std::string ShardedCheckpoint::missing_shards(const std::string& path, const Manifest& manifest) {
  std::vector<std::string> missing, unreadable;
  for (const auto& shard : manifest.shards) {
    struct stat st {};
    if (::stat((fs::path(path) / shard).c_str(), &st) == 0) continue;
    if (errno == ENOENT || errno == ENOTDIR) {
      missing.push_back(shard);
    } else {  // a link loop, no permission on the directory, an I/O error
      unreadable.push_back(str(shard, " (", std::strerror(errno), ")"));
    }
  }
  if (missing.empty() && unreadable.empty()) return {};
  std::string what;
  if (!missing.empty()) what = str(" is missing shard(s) ", join(missing));
  if (!unreadable.empty()) {
    what += str(missing.empty() ? " has" : ", and has",
                " shard(s) that cannot be looked up: ", join(unreadable));
  }
  return str("checkpoint \"", path, "\"", what, " of the ", manifest.world_size, " listed in ",
             ShardedCheckpoint::kManifest, ". Restore them, or resume from another checkpoint.");
}

namespace {

// The bytes of the manifest of the checkpoint directory `path`, as they are
// (checked by read_manifest).
std::string read_manifest_text(const std::string& path) {
  const fs::path file = fs::path(path) / ShardedCheckpoint::kManifest;
  // A manifest lists one line per rank: 16 MiB is half a million ranks.
  constexpr uint64_t kMaxManifestBytes = uint64_t{16} << 20;
  detail::SmallFileRead read = detail::read_small_file(file.string(), kMaxManifestBytes);
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
  return std::move(read.text);
}

}  // namespace

FileFingerprint ShardedCheckpoint::fingerprint(Strategy& strategy, const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return CheckpointLayout::fingerprint(strategy, path);
  const std::string text = read_manifest_text(path);
  return {text.size(), crc32c(text.data(), text.size())};
}

ShardedCheckpoint::Manifest ShardedCheckpoint::read_manifest(const std::string& path) {
  const fs::path file = fs::path(path) / ShardedCheckpoint::kManifest;
  const std::string text = read_manifest_text(path);
  std::istringstream lines(text);
  Manifest m;
  std::string line;
  std::getline(lines, line);
  const bool v1 = line == kManifestHeaderV1;
  if (line != kManifestHeader && !v1) {
    // What it starts with, printable and short (it may be any file).
    throw CheckpointError(str(file.string(), " is not a fulgur manifest (first line \"",
                              printable(line, 60), "\", expected \"", kManifestHeader, "\")."));
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
  // Each shard is the file its rank's save names in this directory (every
  // manifest fulgur wrote lists those): a name leading elsewhere ("../x", an
  // absolute path), even under a checksum that holds, is not followed.
  for (size_t k = 0; k < m.shards.size(); ++k) {
    const std::string expected =
        fs::path(shard_path("", static_cast<int>(k), m.world_size)).filename().string();
    if (m.shards[k] != expected) {
      throw CheckpointError(str(file.string(), " is damaged: it lists shard ", k, " as \"",
                                printable(m.shards[k], 80), "\", not ", expected,
                                " (the shards of a checkpoint are its own directory's "
                                "rank-<k>-of-<n>.ckpt). Resume from an earlier checkpoint, or "
                                "restore the directory from a copy."));
    }
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
  // The save is made whole beside `path`, in rank 0's temporary directory
  // "<path>.tmp.<pid>.<host>", and only then put at `path` in one step: the
  // checkpoint there stays whole and loads until the new one replaces it,
  // whatever fails (a full disk, a rank lost mid-save). Every rank has come
  // to the save (none still reads the checkpoint at this path) first.
  std::string staging = rank == 0 ? detail::temporary_path_for(path) : std::string();
  if (world > 1) {
    staging = strategy.broadcast_bytes(staging, 0);
  }
  const auto discard = [&] {
    if (rank != 0) return;
    std::error_code ec;
    detail::remove_tree(staging, ec);
  };
  try {
    // 1. Rank 0 makes the empty directory (after putting back a checkpoint
    //    that an interrupted replacement left aside, detail::replace_path).
    on_every_rank(strategy, "cannot prepare the checkpoint's directory, so no rank saves", [&] {
      if (rank != 0) return;
      detail::restore_previous(path);
      std::error_code ec;
      detail::remove_tree(staging, ec);
      if (std::string problem = detail::create_directories_durably(staging); !problem.empty()) {
        throw CheckpointError(str("saving checkpoint \"", path, "\": ", problem,
                                  ". The checkpoint at this path (if any) is as it was."));
      }
    });
    // 2. Every rank writes its shard and fingerprints it. The manifest may
    //    claim only shards that are durable (an asynchronous checkpoint IO
    //    has handed its shard to a writer thread).
    FileFingerprint own;
    on_every_rank(strategy, "cannot write its shard, so the new checkpoint is not complete", [&] {
      const std::string shard = shard_path(staging, rank, world);
      try {
        strategy.checkpoint_io().save_checkpoint(checkpoint, shard);
        strategy.checkpoint_io().wait_until_durable();
      } catch (const CheckpointError& e) {
        throw CheckpointError(str("saving sharded checkpoint \"", path, "\": rank ", rank,
                                  "'s shard: ", shard_failure(e.what(), shard),
                                  " The new checkpoint is not kept; the one at \"", path,
                                  "\" (if any) is as it was."));
      }
      own = strategy.checkpoint_io().fingerprint(shard);
    });
    const at::Tensor fingerprints =
        strategy
            .all_gather(
                torch::tensor({static_cast<int64_t>(own.size), int64_t{own.crc32c}}, torch::kLong))
            .cpu();
    // 3. The manifest marks the checkpoint complete, and rank 0 puts it at
    //    `path`.
    on_every_rank(strategy, "cannot complete the new checkpoint", [&] {
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
      const std::string manifest = (fs::path(staging) / kManifest).string();
      if (std::string problem = detail::write_file_atomically(manifest, text.str());
          !problem.empty()) {
        throw CheckpointError(str("saving checkpoint \"", path, "\": its ", kManifest, ": ",
                                  problem, ". The checkpoint at this path (if any) is as it was."));
      }
      if (std::string problem = detail::replace_path(staging, path); !problem.empty()) {
        throw CheckpointError(str("saving checkpoint \"", path, "\": ", problem,
                                  ". The checkpoint at this path (if any) is as it was."));
      }
    });
  } catch (...) {
    discard();
    throw;
  }
}

namespace {

// This rank's part of the sharded checkpoint at `path` (ShardedCheckpoint::load).
StateDict load_own_part(Strategy& strategy, const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw CheckpointError(str("checkpoint \"", path, "\" does not exist.", set_aside_hint(path)));
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
    if (!fs::exists(path, ec)) return str("it does not exist.", set_aside_hint(path));
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
    if (!it->is_directory(type_ec)) continue;
    if (detail::is_dead_writers_temporary(it->path().filename().string())) {
      // A save's directory that its rank 0 did not put in place.
      std::error_code remove_ec;
      detail::remove_tree(it->path().string(), remove_ec);
    } else {
      strategy.checkpoint_io().remove_stale_files(it->path().string());
    }
  }
}

}  // namespace fulgur
