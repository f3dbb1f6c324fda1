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

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "fulgur/core/errors.h"
#include "fulgur/plugins/io/torch_checkpoint_io.h"
#include "fulgur/strategies/checkpoint_layout.h"
#include "fulgur/strategies/fsdp.h"

namespace fulgur {

namespace {

namespace fs = std::filesystem;

int64_t count_of(const StateDict& state, const std::string& key) {
  // LibTorch's optimizers write their counts as one-element tensors.
  const c10::IValue* v = state.find(key);
  if (v != nullptr && v->isTensor() && v->toTensor().numel() == 1) {
    return v->toTensor().item<int64_t>();
  }
  return state.integer(key);
}

// One rank's state of one optimizer: the state of each position (over its
// parameter groups, in order), or null where it has none.
struct RankState {
  std::vector<std::string> keys;  // the optimizer's key of each position
  std::vector<const StateDict*> by_position;
};

RankState rank_state(const StateDict& optimizer, const std::string& file) {
  const StateDict& groups = optimizer.section_at("param_groups");
  const StateDict& state = optimizer.section_at("state");
  RankState out;
  const int64_t group_count = count_of(groups, "param_groups/size");
  for (int64_t g = 0; g < group_count; ++g) {
    const StateDict& group = groups.section_at(str("param_groups/", g));
    const int64_t size = count_of(group, "params/size");
    for (int64_t p = 0; p < size; ++p) {
      const c10::IValue* key = group.find(str("params/", p));
      if (key == nullptr || !key->isString()) {
        throw CheckpointError(str("\"", file, "\" is incomplete: parameter ", p, " of group ", g,
                                  " of an optimizer has no key."));
      }
      out.keys.push_back(key->toStringRef());
      out.by_position.push_back(state.find_section(key->toStringRef()));
    }
  }
  return out;
}

// What the sharded save recorded of one optimizer's shards.
struct ShardRecord {
  int64_t world_size = 0, rank = 0, positions = 0;
  std::map<int64_t, std::vector<int64_t>> whole_sizes;  // by position; sharded ones only
};

ShardRecord shard_record(const StateDict& optimizer, const std::string& file, int64_t index) {
  const StateDict* record = optimizer.find_section(FSDPStrategy::kShardRecordKey);
  if (record == nullptr) {
    throw CheckpointError(
        str("\"", file, "\": optimizer ", index,
            " has no record of its shards, so this is not a sharded checkpoint of strategy "
            "fsdp (per-rank checkpoints of strategy \"manual\" hold each rank's own state and "
            "do not consolidate). Only an fsdp checkpoint with state_dict_type \"sharded\" "
            "consolidates."));
  }
  ShardRecord r;
  r.world_size = record->integer("world_size");
  r.rank = record->integer("rank");
  r.positions = record->integer("positions");
  for (int64_t p = 0; p < r.positions; ++p) {
    const c10::IValue* sizes = record->find(str("sizes/", p));
    if (sizes != nullptr && sizes->isIntList()) r.whole_sizes[p] = sizes->toIntVector();
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
StateDict whole_state(const std::vector<const StateDict*>& ranks, const std::vector<int64_t>& sizes,
                      int64_t world_size, const std::string& what) {
  const int64_t numel = elements(sizes);
  const int64_t chunk = (numel + world_size - 1) / world_size;
  StateDict out = *ranks[0];
  for (const auto& key : ranks[0]->keys()) {
    const c10::IValue* value = ranks[0]->find(key);
    // The same rule as the strategy's own full save: a per-element state
    // tensor has exactly a shard's elements.
    if (value == nullptr || !value->isTensor() || !value->toTensor().defined() ||
        value->toTensor().numel() != chunk) {
      continue;
    }
    std::vector<at::Tensor> chunks;
    for (size_t r = 0; r < ranks.size(); ++r) {
      const c10::IValue* part = ranks[r]->find(key);
      if (part == nullptr || !part->isTensor() || part->toTensor().numel() != chunk) {
        throw CheckpointError(str("rank ", r, "'s shard of ", what, " has no \"", key, "\" of ",
                                  chunk,
                                  " elements (rank 0's has): the shards are "
                                  "not of one save."));
      }
      chunks.push_back(part->toTensor().reshape({-1}));
    }
    out.set(key, torch::cat(chunks).narrow(0, 0, numel).view(sizes).clone());
  }
  return out;
}

}  // namespace

void consolidate_sharded_checkpoint(const std::string& dir, const std::string& out) {
  std::error_code ec;
  if (out.empty() || fs::path(out).filename().empty()) {
    throw CheckpointError(str("the output path \"", out,
                              "\" names no file. Pass the path of the one-file checkpoint to "
                              "write, e.g. consolidated.ckpt."));
  }
  if (const fs::file_status status = fs::status(dir, ec); !fs::is_directory(status)) {
    // Not there, or not to be looked up (a loop of symbolic links, a
    // directory on the way this user may not search): the OS's reason.
    const std::string what =
        fs::exists(status)
            ? std::string(fs::is_regular_file(status) ? "a file: a checkpoint in one file is whole "
                                                        "already (it loads on any world size)"
                                                      : "not a directory")
        : ec && ec != std::errc::no_such_file_or_directory
            ? str("not to be looked up (", ec.message(), ")")
            : std::string("not there");
    throw CheckpointError(str("\"", dir, "\" is ", what,
                              ". Pass the directory of a sharded fsdp checkpoint (it holds ",
                              ShardedCheckpoint::kManifest, " and rank-<k>-of-<n>.ckpt)."));
  }
  if (fs::exists(out, ec) || fs::is_symlink(out, ec)) {
    throw CheckpointError(str("\"", out,
                              "\" exists; consolidate writes a new file and never "
                              "replaces one. Remove it or choose another path."));
  }
  fs::path parent = fs::path(out).parent_path();
  // Inside the sharded checkpoint, OUT would become a stray file of it (and
  // go with it when a save replaces the directory).
  {
    const fs::path within = fs::weakly_canonical(fs::absolute(out, ec), ec);
    const fs::path checkpoint = fs::weakly_canonical(fs::absolute(dir, ec), ec);
    const auto mismatch =
        std::mismatch(checkpoint.begin(), checkpoint.end(), within.begin(), within.end());
    if (!checkpoint.empty() && mismatch.first == checkpoint.end()) {
      throw CheckpointError(str("\"", out, "\" is inside the sharded checkpoint \"", dir,
                                "\" it would be made from. Write it beside the checkpoint "
                                "instead (e.g. ",
                                (fs::path(dir).parent_path() / "consolidated.ckpt").string(),
                                ")."));
    }
  }
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
  // gives its chunks of that state. Each file is read (and verified) once;
  // of the other ranks' files only the optimizers' section is kept (each
  // holds the whole module too).
  std::vector<StateDict> files;
  std::vector<ShardRecord> records;  // rank 0's, one per optimizer
  int64_t count = 0;
  for (int64_t r = 0; r < world; ++r) {
    const std::string file = shard_file(r);
    const std::string foreign =
        ShardedCheckpoint::foreign_shard(io, dir, manifest, static_cast<size_t>(r));
    if (!foreign.empty()) throw CheckpointError(foreign);
    try {
      files.push_back(io.load_checkpoint(file));
      const StateDict& states = files.back().section_at("optimizer_states");
      const int64_t n = states.integer("count");
      if (r == 0) count = n;
      if (n != count) {
        throw CheckpointError(str("\"", file, "\" holds ", n, " optimizers and rank 0's ", count,
                                  ": the shards are not of one save."));
      }
      for (int64_t o = 0; o < n; ++o) {
        ShardRecord record = shard_record(states.section_at(std::to_string(o)), file, o);
        if (record.world_size != world || record.rank != r) {
          throw CheckpointError(str("\"", file, "\" was written by rank ", record.rank, " of ",
                                    record.world_size, ", but ", ShardedCheckpoint::kManifest,
                                    " lists it as rank ", r, " of ", world,
                                    ": the directory mixes saves. Use an earlier checkpoint."));
        }
        if (r == 0) records.push_back(std::move(record));
      }
      if (r > 0) {
        StateDict optimizers_only;
        optimizers_only.set_section("optimizer_states", states);
        files.back() = std::move(optimizers_only);
      }
    } catch (const CheckpointError& e) {
      const std::string what = e.what();
      if (what.find(file) != std::string::npos) throw;
      throw CheckpointError(str("\"", file, "\": ", what,
                                " It is not a checkpoint fulgur's Trainer wrote."));
    }
  }

  StateDict whole = files[0];
  StateDict& states = whole.section("optimizer_states");
  for (int64_t o = 0; o < count; ++o) {
    const std::string file0 = shard_file(0);
    const ShardRecord& record = records[static_cast<size_t>(o)];
    std::vector<RankState> ranks;
    for (int64_t r = 0; r < world; ++r) {
      const StateDict& optimizer = files[static_cast<size_t>(r)]
                                       .section_at("optimizer_states")
                                       .section_at(std::to_string(o));
      try {
        ranks.push_back(rank_state(optimizer, shard_file(r)));
      } catch (const CheckpointError& e) {
        const std::string what = e.what();
        if (what.find(shard_file(r)) != std::string::npos) throw;
        throw CheckpointError(str("\"", shard_file(r), "\": ", what,
                                  " It is not a checkpoint fulgur's Trainer wrote."));
      }
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
    StateDict& optimizer = states.section(std::to_string(o));
    optimizer.erase(FSDPStrategy::kShardRecordKey);
    // Under rank 0's keys (its param_groups name them).
    StateDict state;
    for (size_t p = 0; p < ranks[0].keys.size(); ++p) {
      const StateDict* mine = ranks[0].by_position[p];
      if (mine == nullptr) continue;  // never stepped: no state
      const auto sizes = record.whole_sizes.find(static_cast<int64_t>(p));
      if (sizes == record.whole_sizes.end()) {
        state.set_section(ranks[0].keys[p], *mine);  // not sharded (frozen): whole on every rank
        continue;
      }
      std::vector<const StateDict*> parts;
      for (int64_t r = 0; r < world; ++r) {
        if (ranks[r].by_position[p] == nullptr) {
          throw CheckpointError(str("\"", shard_file(r), "\" has no state for parameter ", p,
                                    " of optimizer ", o,
                                    " while rank 0's has: the shards are not of one save."));
        }
        parts.push_back(ranks[r].by_position[p]);
      }
      state.set_section(ranks[0].keys[p], whole_state(parts, sizes->second, world,
                                                      str("parameter ", p, " of optimizer ", o)));
    }
    optimizer.set_section("state", std::move(state));
  }
  io.save_checkpoint(whole, out);
}

}  // namespace fulgur
