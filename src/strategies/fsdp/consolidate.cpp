// `fulgur checkpoint consolidate`: a sharded fsdp checkpoint (a directory
// of per-rank files) as the one file state_dict_type "full" writes.
//
// Every rank's file holds the same module state (gathered whole for the
// save), loops, RNG and callbacks as rank 0's; what differs is each
// optimizer's state, which every rank keeps for its shard only: chunk
// elements of the flattened parameter, padded to a multiple of the world
// size. The sharded save records, per optimizer position, the whole shape
// of the parameter its shard belongs to (FSDPStrategy::kShardRecordKey);
// concatenating the ranks' chunks in rank order, cutting the padding and
// taking that shape gives the state one process would hold.
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fulgur/core/errors.h"
#include "fulgur/plugins/io/torch_checkpoint_io.h"
#include "fulgur/strategies/checkpoint_layout.h"
#include "fulgur/strategies/fsdp.h"

namespace fulgur {

namespace {

namespace fs = std::filesystem;
using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

// Entry `key` of `from` (a value, a tensor or a sub-archive, copied
// whole) into `to`.
void copy_entry(InputArchive& from, const std::string& key, OutputArchive& to);

// Every entry of `from` into `to`; `skip` names top-level keys left out.
void copy_archive(InputArchive& from, OutputArchive& to, const std::set<std::string>& skip = {}) {
  for (const auto& key : from.keys()) {
    if (skip.count(key) == 0) copy_entry(from, key, to);
  }
}

void copy_entry(InputArchive& from, const std::string& key, OutputArchive& to) {
  c10::IValue value;
  if (!from.try_read(key, value)) return;
  if (value.isModule()) {
    InputArchive sub;
    from.try_read(key, sub);
    OutputArchive copy(to.compilation_unit());
    copy_archive(sub, copy);
    to.write(key, copy);
  } else if (value.isTensor()) {
    to.write(key, value.toTensor());
  } else {
    to.write(key, value);
  }
}

InputArchive section(InputArchive& archive, const std::string& key, const std::string& file) {
  InputArchive sub;
  if (!archive.try_read(key, sub)) {
    throw CheckpointError(str("\"", file, "\" has no section \"", key,
                              "\": it is not a checkpoint fulgur's Trainer wrote."));
  }
  return sub;
}

int64_t integer(InputArchive& archive, const std::string& key, const std::string& file) {
  c10::IValue v;
  if (archive.try_read(key, v) && v.isInt()) return v.toInt();
  // LibTorch's optimizers write their counts as one-element tensors.
  if (v.isTensor() && v.toTensor().numel() == 1) return v.toTensor().item<int64_t>();
  throw CheckpointError(
      str("\"", file, "\" is incomplete: entry \"", key, "\" is missing or not an integer."));
}

// One rank's state of one optimizer: the state archive of each position
// (over its parameter groups, in order), or none where it has no state.
struct RankState {
  std::vector<std::string> keys;  // the optimizer's key of each position
  std::vector<std::optional<InputArchive>> by_position;
};

RankState rank_state(InputArchive& optimizer, const std::string& file) {
  InputArchive groups = section(optimizer, "param_groups", file);
  InputArchive state = section(optimizer, "state", file);
  RankState out;
  const int64_t group_count = integer(groups, "param_groups/size", file);
  for (int64_t g = 0; g < group_count; ++g) {
    InputArchive group = section(groups, str("param_groups/", g), file);
    const int64_t size = integer(group, "params/size", file);
    for (int64_t p = 0; p < size; ++p) {
      c10::IValue key;
      if (!group.try_read(str("params/", p), key) || !key.isString()) {
        throw CheckpointError(str("\"", file, "\" is incomplete: parameter ", p, " of group ", g,
                                  " of an optimizer has no key."));
      }
      out.keys.push_back(key.toStringRef());
      InputArchive one;
      if (state.try_read(key.toStringRef(), one)) {
        out.by_position.emplace_back(std::move(one));
      } else {
        out.by_position.emplace_back(std::nullopt);
      }
    }
  }
  return out;
}

// What the sharded save recorded of one optimizer's shards.
struct ShardRecord {
  int64_t world_size = 0, rank = 0, positions = 0;
  std::map<int64_t, std::vector<int64_t>> whole_sizes;  // by position; sharded ones only
};

ShardRecord shard_record(InputArchive& optimizer, const std::string& file, int64_t index) {
  InputArchive record;
  if (!optimizer.try_read(FSDPStrategy::kShardRecordKey, record)) {
    throw CheckpointError(
        str("\"", file, "\": optimizer ", index,
            " has no record of its shards, so this is not a sharded checkpoint of strategy "
            "fsdp (per-rank checkpoints of strategy \"manual\" hold each rank's own state and "
            "do not consolidate). Only an fsdp checkpoint with state_dict_type \"sharded\" "
            "consolidates."));
  }
  ShardRecord r;
  r.world_size = integer(record, "world_size", file);
  r.rank = integer(record, "rank", file);
  r.positions = integer(record, "positions", file);
  for (int64_t p = 0; p < r.positions; ++p) {
    c10::IValue sizes;
    if (record.try_read(str("sizes/", p), sizes) && sizes.isIntList()) {
      r.whole_sizes[p] = sizes.toIntVector();
    }
  }
  return r;
}

int64_t elements(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

// The whole state of one optimizer position: rank 0's entries, each
// per-element tensor (chunk elements) replaced by the ranks' chunks
// concatenated, cut to the parameter's elements and shaped as it.
void write_whole_state(const std::vector<InputArchive*>& ranks, const std::vector<int64_t>& sizes,
                       int64_t world_size, OutputArchive& out, const std::string& what) {
  const int64_t numel = elements(sizes);
  const int64_t chunk = (numel + world_size - 1) / world_size;
  for (const auto& key : ranks[0]->keys()) {
    c10::IValue value;
    ranks[0]->try_read(key, value);
    // The same rule as the strategy's own full save: a per-element state
    // tensor has exactly a shard's elements.
    if (!value.isTensor() || !value.toTensor().defined() || value.toTensor().numel() != chunk) {
      copy_entry(*ranks[0], key, out);
      continue;
    }
    std::vector<at::Tensor> chunks;
    for (size_t r = 0; r < ranks.size(); ++r) {
      c10::IValue part;
      if (!ranks[r]->try_read(key, part) || !part.isTensor() || part.toTensor().numel() != chunk) {
        throw CheckpointError(str("rank ", r, "'s shard of ", what, " has no \"", key, "\" of ",
                                  chunk,
                                  " elements (rank 0's has): the shards are "
                                  "not of one save."));
      }
      chunks.push_back(part.toTensor().reshape({-1}));
    }
    out.write(key, torch::cat(chunks).narrow(0, 0, numel).view(sizes).clone());
  }
}

}  // namespace

void consolidate_sharded_checkpoint(const std::string& dir, const std::string& out) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw CheckpointError(str("\"", dir, "\" is ",
                              fs::exists(dir, ec) ? "a file: a checkpoint in one file is whole "
                                                    "already (it loads on any world size)"
                                                  : "not there",
                              ". Pass the directory of a sharded fsdp checkpoint (it holds ",
                              ShardedCheckpoint::kManifest, " and rank-<k>-of-<n>.ckpt)."));
  }
  if (fs::exists(out, ec) || fs::is_symlink(out, ec)) {
    throw CheckpointError(str("\"", out,
                              "\" exists; consolidate writes a new file and never "
                              "replaces one. Remove it or choose another path."));
  }
  fs::path parent = fs::path(out).parent_path();
  if (!parent.empty() && !fs::is_directory(parent, ec)) {
    throw CheckpointError(str("cannot write \"", out, "\": its directory \"", parent.string(),
                              "\" does not exist. Create it first."));
  }
  const auto manifest = ShardedCheckpoint::read_manifest(dir);
  if (auto missing = ShardedCheckpoint::missing_shards(dir, manifest); !missing.empty()) {
    throw CheckpointError(missing);
  }
  const int64_t world = manifest.world_size;
  TorchCheckpointIO io;
  auto shard_file = [&](int64_t r) {
    return ShardedCheckpoint::shard_path(dir, static_cast<int>(r), static_cast<int>(world));
  };

  // Rank 0's file gives everything but the optimizers' state; every rank's
  // gives its chunks of that state. Each file is read (and verified) once,
  // and only its optimizer sections are kept.
  InputArchive rank0;
  std::vector<std::vector<InputArchive>> optimizers(static_cast<size_t>(world));
  std::vector<ShardRecord> records;  // rank 0's, one per optimizer
  int64_t count = 0;
  for (int64_t r = 0; r < world; ++r) {
    const std::string file = shard_file(r);
    InputArchive archive;
    io.load_checkpoint(file, archive);
    InputArchive states = section(archive, "optimizer_states", file);
    const int64_t n = integer(states, "count", file);
    if (r == 0) count = n;
    if (n != count) {
      throw CheckpointError(str("\"", file, "\" holds ", n, " optimizers and rank 0's ", count,
                                ": the shards are not of one save."));
    }
    for (int64_t o = 0; o < n; ++o) {
      optimizers[r].push_back(section(states, std::to_string(o), file));
      ShardRecord record = shard_record(optimizers[r].back(), file, o);
      if (record.world_size != world || record.rank != r) {
        throw CheckpointError(str("\"", file, "\" was written by rank ", record.rank, " of ",
                                  record.world_size, ", but ", ShardedCheckpoint::kManifest,
                                  " lists it as rank ", r, " of ", world,
                                  ": the directory mixes saves. Use an earlier checkpoint."));
      }
      if (r == 0) records.push_back(std::move(record));
    }
    if (r == 0) rank0 = std::move(archive);
  }

  auto cu = std::make_shared<torch::jit::CompilationUnit>();
  OutputArchive whole(cu);
  copy_archive(rank0, whole, {"optimizer_states", std::string(TorchCheckpointIO::kIntegrityKey)});
  OutputArchive states(cu);
  states.write("count", c10::IValue(count));
  for (int64_t o = 0; o < count; ++o) {
    const std::string file0 = shard_file(0);
    const ShardRecord& record = records[static_cast<size_t>(o)];
    std::vector<RankState> ranks;
    for (int64_t r = 0; r < world; ++r) {
      ranks.push_back(rank_state(optimizers[r][o], shard_file(r)));
      if (ranks[r].keys.size() != ranks[0].keys.size()) {
        throw CheckpointError(str("\"", shard_file(r), "\": optimizer ", o, " steps ",
                                  ranks[r].keys.size(), " parameters and rank 0's ",
                                  ranks[0].keys.size(), ": the shards are not of one save."));
      }
    }
    if (record.positions != static_cast<int64_t>(ranks[0].keys.size())) {
      throw CheckpointError(str("\"", file0, "\": optimizer ", o, " steps ", ranks[0].keys.size(),
                                " parameters but its record of shards has ", record.positions,
                                ". The file is corrupt; use an earlier checkpoint."));
    }
    OutputArchive optimizer(cu);
    copy_archive(optimizers[0][o], optimizer,
                 {"state", std::string(FSDPStrategy::kShardRecordKey)});
    // Under rank 0's keys (its param_groups name them).
    OutputArchive state(cu);
    for (size_t p = 0; p < ranks[0].keys.size(); ++p) {
      auto& mine = ranks[0].by_position[p];
      if (!mine) continue;  // never stepped: no state
      OutputArchive one(cu);
      const auto sizes = record.whole_sizes.find(static_cast<int64_t>(p));
      if (sizes == record.whole_sizes.end()) {
        copy_archive(*mine, one);  // not sharded (frozen): whole on every rank
      } else {
        std::vector<InputArchive*> parts;
        for (int64_t r = 0; r < world; ++r) {
          if (!ranks[r].by_position[p]) {
            throw CheckpointError(str("\"", shard_file(r), "\" has no state for parameter ", p,
                                      " of optimizer ", o,
                                      " while rank 0's has: the shards are not of one save."));
          }
          parts.push_back(&*ranks[r].by_position[p]);
        }
        write_whole_state(parts, sizes->second, world, one,
                          str("parameter ", p, " of optimizer ", o));
      }
      state.write(ranks[0].keys[p], one);
    }
    optimizer.write("state", state);
    states.write(std::to_string(o), optimizer);
  }
  whole.write("optimizer_states", states);
  io.save_checkpoint(whole, out);
}

}  // namespace fulgur
