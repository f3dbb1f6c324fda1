// File: fulgur/data/data_loader.h
//
// A DataLoader yields the batches of one epoch at a time. The Trainer drives
// it: start_epoch(e), then next() until it returns nullopt or the loop's
// batch limit is reached. The base class counts the batches handed out, so
// every loader can be checkpointed mid-epoch and resumed exactly: resuming
// restarts the saved epoch and skips the batches already consumed (O(1) for
// index-based loaders, by reading for plain iterables).
//
//   auto loader = fulgur::make_data_loader(
//       std::make_shared<fulgur::TensorDataset>(x, y),
//       {.batch_size = 64, .shuffle = true, .seed = 42});
//
// Any iterable of batches works too:
//   auto loader = fulgur::make_iterable_loader(
//       [](int64_t epoch) { return my_generator(epoch); });
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "fulgur/data/batch.h"
#include "fulgur/data/dataset.h"
#include "fulgur/data/sampler.h"

namespace fulgur {

class DataLoader {
 public:
  virtual ~DataLoader() = default;

  /// Batches per epoch when known; nullopt for open-ended iterables.
  virtual std::optional<int64_t> num_batches() const = 0;

  /// Starts epoch `epoch` from its first batch.
  void start_epoch(int64_t epoch);
  /// The next batch of the current epoch, or nullopt at its end.
  std::optional<Batch> next();
  /// Positions the loader at batch `position` of epoch `epoch`.
  void seek(int64_t epoch, int64_t position);

  /// The loop is done reading for now (an epoch ended, or a limit cut it:
  /// limit_train_batches, max_steps, a stop): a loader whose worker threads
  /// are not persistent ends them and drops the batches they loaded ahead,
  /// as Lightning's loader iterator does at an epoch's end. A later next()
  /// in the same epoch starts them again from position(). Default: nothing.
  void release_workers() { do_release_workers(); }

  /// Epoch and number of batches handed out in it.
  int64_t epoch() const { return epoch_; }
  int64_t position() const { return position_; }

  /// "epoch" and "position" (ints), then what do_state_dict adds (a
  /// DatasetLoader: its sampler's state, under "sampler").
  StateDict state_dict() const;
  /// Restores what state_dict() returned and positions the loader there, or
  /// at `position` of the saved epoch when given. CheckpointError when
  /// epoch or position is missing. A DatasetLoader notes a state saved in
  /// the middle of an epoch by a loader whose batches differ (another
  /// global batch size, dataset size or shuffling seed): the rest of the
  /// epoch then is not what the interrupted run would have read.
  void load_state_dict(const StateDict& state,
                       std::optional<int64_t> position = std::nullopt);

  /// Restricts the loader to shard `rank` of `world_size` (`even`: padded
  /// so every rank gets as many batches; see Sampler::set_shard). Returns
  /// false when the loader cannot be sharded (the caller then reports it).
  virtual bool set_shard(int64_t rank, int64_t world_size, bool even = false);
  /// How many trailing rows of batch `batch_idx` of an epoch repeat samples
  /// the epoch already gave some rank (a shard padded to the others'
  /// length; see Sampler::set_shard): an evaluation's metrics leave them
  /// out. 0 unless sharded with `even`.
  virtual int64_t padded_rows(int64_t /*batch_idx*/) const { return 0; }
  /// Visit the samples in the dataset's order, past a shuffling sampler
  /// (`in_order`, the Trainer's overfit_batches), or in the sampler's order
  /// (false, as built). Returns true when `in_order` changes the order: the
  /// loader shuffles. Default: false (a loader that cannot keeps its order).
  virtual bool set_in_order(bool /*in_order*/) { return false; }
  /// The dataset indices (an int64 CPU tensor) of the samples in batch
  /// `batch_idx` of the current epoch, where the loader knows them (a
  /// DatasetLoader: from its sampler's order); nullopt otherwise. A
  /// PredictionWriter records them, so that the predictions of every rank
  /// can be put back in the dataset's order.
  virtual std::optional<at::Tensor> sample_indices(int64_t /*batch_idx*/) const {
    return std::nullopt;
  }
  /// The Trainer's seed, for loaders whose own seed is unset.
  virtual void set_default_seed(uint64_t /*seed*/) {}
  /// Whether the Trainer's device wants page-locked batches (a GPU), for
  /// loaders whose own pin_memory is unset.
  virtual void set_default_pin_memory(bool /*pin*/) {}

 protected:
  virtual void do_start_epoch(int64_t epoch) = 0;
  virtual std::optional<Batch> do_next() = 0;
  /// Skips `n` batches of the current epoch. Default: reads and drops them.
  virtual void do_skip(int64_t n);
  /// See release_workers().
  virtual void do_release_workers() {}
  /// Adds a subclass's entries to the state (beside epoch and position).
  virtual void do_state_dict(StateDict& /*state*/) const {}
  /// Restores them, before the loader seeks to the saved position.
  virtual void do_load_state_dict(const StateDict& /*state*/) {}
  /// Before a resume in the middle of an epoch (`position` > 0), e.g. a
  /// note when `state` was saved by a loader whose batches differ from
  /// this one's (position names other samples). Default: nothing.
  virtual void check_resume(const StateDict& /*state*/, int64_t /*position*/) const {}

 private:
  int64_t epoch_ = -1;
  int64_t position_ = 0;
};

struct DataLoaderOptions {
  int64_t batch_size = 1;
  /// Visit samples in a random order drawn from `seed` and the epoch.
  bool shuffle = false;
  /// Drop the last batch when it is smaller than batch_size.
  bool drop_last = false;
  /// Shuffle seed, and the seed of sample_generator(); unset: the Trainer's
  /// `seed` (0 when it has none).
  std::optional<uint64_t> seed = std::nullopt;
  /// Threads that load batches (Dataset::get_batch) ahead of the training
  /// step; 0: the training thread loads each batch when it needs it. The
  /// batches, their order and a mid-epoch resume are the same for any
  /// number of workers. A worker's exception reaches the training thread as
  /// a DataLoaderError naming the sample.
  int64_t num_workers = 0;
  /// Batches loaded ahead, per worker.
  int64_t prefetch_factor = 2;
  /// Batches in page-locked memory, for faster copies to a GPU (and copies
  /// that overlap the step: Trainer's prefetch_to_device); applies only
  /// where CUDA is available. Unset: pinned when the Trainer running the
  /// loader trains on a GPU.
  std::optional<bool> pin_memory = std::nullopt;
  /// Keep the worker threads from one epoch to the next (default: they
  /// end with each epoch).
  bool persistent_workers = false;
};

namespace detail {
class Prefetcher;
}  // namespace detail

/// Batches of a map-style Dataset, in the order its Sampler gives.
class DatasetLoader : public DataLoader {
 public:
  /// `sampler` defaults to Random(seed) when shuffle is set, else Sequential.
  /// Throws ConfigError on batch_size < 1 or a null dataset.
  DatasetLoader(std::shared_ptr<Dataset> dataset, DataLoaderOptions options,
                std::shared_ptr<Sampler> sampler = nullptr);
  ~DatasetLoader() override;

  std::optional<int64_t> num_batches() const override;
  bool set_shard(int64_t rank, int64_t world_size, bool even = false) override;
  /// The shard's last sample is a repeat when its place in the padded
  /// epoch order is past the dataset's end. Assumes the sampler's epoch is
  /// the dataset's indices split by Sampler::shard (every built-in
  /// sampler); a loader whose sampler pads otherwise overrides this.
  int64_t padded_rows(int64_t batch_idx) const override;
  /// In order past a RandomSampler (a sampler of another kind keeps its own
  /// order: false).
  bool set_in_order(bool in_order) override;
  /// The samples of the batch in the epoch's order (a padded shard's
  /// repeats included). Throws ConfigError when the epoch has no such batch.
  std::optional<at::Tensor> sample_indices(int64_t batch_idx) const override;
  void set_default_seed(uint64_t seed) override;
  void set_default_pin_memory(bool pin) override { default_pin_memory_ = pin; }

  const Dataset& dataset() const { return *dataset_; }
  Sampler& sampler() { return *sampler_; }
  const DataLoaderOptions& options() const { return options_; }

 protected:
  void do_start_epoch(int64_t epoch) override;
  std::optional<Batch> do_next() override;
  void do_skip(int64_t n) override;
  void do_release_workers() override;
  /// The sampler's state_dict(), under "sampler" (a section, empty for
  /// the built-in samplers; optional on load).
  void do_state_dict(StateDict& state) const override;
  void do_load_state_dict(const StateDict& state) override;
  void check_resume(const StateDict& state, int64_t position) const override;

 private:
  int64_t samples_per_epoch() const;
  // Batch `index` of the epoch whose order is `order`; on any thread.
  Batch load_batch(const at::Tensor& order, uint64_t seed, int64_t epoch, int64_t index) const;
  // Workers load from batch `first` of the current epoch on.
  void start_workers(int64_t first);

  std::shared_ptr<Dataset> dataset_;
  uint64_t seed_ = 0;
  bool default_pin_memory_ = false;
  std::unique_ptr<detail::Prefetcher> prefetcher_;
  bool workers_started_ = false;
  DataLoaderOptions options_;
  std::shared_ptr<Sampler> sampler_;
  bool owns_random_sampler_ = false;
  // Set while set_in_order(true) bypasses a RandomSampler: the dataset's
  // order, sharded as sampler_ is.
  std::shared_ptr<SequentialSampler> in_order_;
  at::Tensor order_;
  int64_t cursor_ = 0;
};

std::shared_ptr<DatasetLoader> make_data_loader(std::shared_ptr<Dataset> dataset,
                                                DataLoaderOptions options = {},
                                                std::shared_ptr<Sampler> sampler = nullptr);

/// A generator of one epoch's batches: returns nullopt at the epoch's end.
using BatchGenerator = std::function<std::optional<Batch>()>;

/// Wraps any user iterable: `factory(epoch)` returns the epoch's generator.
/// `num_batches` is the epoch length when known (needed for fractional
/// limits and val_check_interval as a fraction).
class IterableLoader : public DataLoader {
 public:
  IterableLoader(std::function<BatchGenerator(int64_t epoch)> factory,
                 std::optional<int64_t> num_batches = std::nullopt);
  std::optional<int64_t> num_batches() const override { return num_batches_; }

 protected:
  void do_start_epoch(int64_t epoch) override;
  std::optional<Batch> do_next() override;

 private:
  std::function<BatchGenerator(int64_t)> factory_;
  std::optional<int64_t> num_batches_;
  BatchGenerator current_;
};

std::shared_ptr<IterableLoader> make_iterable_loader(
    std::function<BatchGenerator(int64_t epoch)> factory,
    std::optional<int64_t> num_batches = std::nullopt);

/// Any container of batches (e.g. std::vector<Batch>, or of pairs), replayed
/// in order every epoch. The container is shared, not copied.
template <class Container>
std::shared_ptr<IterableLoader> make_iterable_loader(std::shared_ptr<Container> batches) {
  auto size = static_cast<int64_t>(std::size(*batches));
  return make_iterable_loader(
      [batches](int64_t) -> BatchGenerator {
        auto it = std::begin(*batches);
        return [batches, it]() mutable -> std::optional<Batch> {
          if (it == std::end(*batches)) return std::nullopt;
          return Batch(*it++);
        };
      },
      size);
}

}  // namespace fulgur
