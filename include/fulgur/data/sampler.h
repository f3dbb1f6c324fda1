// File: fulgur/data/sampler.h
//
// A Sampler decides the order in which a DatasetLoader visits a dataset's
// indices in one epoch. fulgur's samplers are pure functions of (seed, epoch),
// so an epoch's order can be recomputed on resume instead of being stored.
// A sampler with hidden state (an adapted torch::data sampler) saves it
// through state_dict/load_state_dict.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

#include "fulgur/core/state_dict.h"

namespace fulgur {

class Sampler {
 public:
  virtual ~Sampler() = default;
  /// The indices (int64 CPU tensor) to visit in epoch `epoch` of a dataset of
  /// `dataset_size` samples.
  virtual at::Tensor epoch_indices(int64_t epoch, int64_t dataset_size) = 0;
  /// Restricts the sampler to shard `rank` of `world_size` (distributed
  /// training). The default splits the epoch's indices round-robin. `even`:
  /// pad the epoch by repeating its first indices so every rank gets the
  /// same count (training: ranks must take the same number of steps);
  /// otherwise each sample is seen exactly once (exact evaluation).
  virtual void set_shard(int64_t rank, int64_t world_size, bool even = false);
  /// What is needed to recompute the current epoch's order (the loader's
  /// checkpoint state keeps it under "sampler"). Default: nothing.
  virtual StateDict state_dict() const;
  /// Restores what state_dict() returned. Default: nothing.
  virtual void load_state_dict(const StateDict& state);

  int64_t shard_rank() const { return shard_rank_; }
  int64_t shard_world_size() const { return shard_world_size_; }
  bool shard_even() const { return shard_even_; }
  /// How many indices epoch_indices() gives for a dataset of
  /// `dataset_size` samples, before sharding: all of them by default. A
  /// sampler that visits a subset (or draws a count of its own) overrides
  /// it: the loader counts its batches from it, and checks each epoch's
  /// order against it.
  virtual int64_t epoch_size(int64_t dataset_size) const { return dataset_size; }
  /// How many of the epoch's epoch_size(dataset_size) indices this shard
  /// visits.
  int64_t shard_size(int64_t dataset_size) const;

 protected:
  /// Applies the shard to a full epoch order (used by subclasses).
  at::Tensor shard(const at::Tensor& indices) const;

 private:
  int64_t shard_rank_ = 0;
  int64_t shard_world_size_ = 1;
  bool shard_even_ = false;
};

/// 0, 1, ..., n-1 every epoch.
class SequentialSampler : public Sampler {
 public:
  at::Tensor epoch_indices(int64_t epoch, int64_t dataset_size) override;
};

/// A permutation drawn from a generator seeded with (seed, epoch): the same
/// seed gives the same order on every run, every rank and after a resume.
class RandomSampler : public Sampler {
 public:
  explicit RandomSampler(uint64_t seed = 0) : seed_(seed) {}
  at::Tensor epoch_indices(int64_t epoch, int64_t dataset_size) override;
  uint64_t seed() const { return seed_; }

 private:
  uint64_t seed_;
};

}  // namespace fulgur
