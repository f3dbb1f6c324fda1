#include "fulgur/data/data_loader.h"

#include <torch/torch.h>

#include <sstream>

#include "data/prefetcher.h"
#include "data/sample_scope.h"
#include "fulgur/core/errors.h"
#include "fulgur/utilities/seed.h"

namespace fulgur {

// ---- Samplers.

void Sampler::set_shard(int64_t rank, int64_t world_size, bool even) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw ConfigError(str("Sampler::set_shard(rank=", rank, ", world_size=", world_size,
                          "): rank must be in [0, world_size) and world_size >= 1."));
  }
  shard_rank_ = rank;
  shard_world_size_ = world_size;
  shard_even_ = even;
}

int64_t Sampler::shard_size(int64_t dataset_size) const {
  const int64_t n = epoch_size(dataset_size);
  const int64_t w = shard_world_size_;
  if (w == 1) return n;
  return shard_even_ ? (n + w - 1) / w : (n - shard_rank_ + w - 1) / w;
}

StateDict Sampler::state_dict() const { return {}; }
void Sampler::load_state_dict(const StateDict&) {}

at::Tensor Sampler::shard(const at::Tensor& indices) const {
  if (shard_world_size_ == 1) return indices;
  at::Tensor all = indices;
  const int64_t n = indices.size(0);
  const int64_t padded =
      shard_even_ ? (n + shard_world_size_ - 1) / shard_world_size_ * shard_world_size_ : n;
  if (padded > n && n > 0) {
    all = torch::cat({indices, indices.repeat({(padded - n + n - 1) / n}).slice(0, 0, padded - n)});
  }
  return all.slice(0, shard_rank_, all.size(0), shard_world_size_);
}

at::Tensor SequentialSampler::epoch_indices(int64_t, int64_t dataset_size) {
  return shard(torch::arange(dataset_size, torch::kLong));
}

at::Tensor RandomSampler::epoch_indices(int64_t epoch, int64_t dataset_size) {
  // A private generator seeded from (seed, epoch): the order depends on
  // nothing else, so it is the same after a resume and on every rank.
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed_ * 0x9E3779B97F4A7C15ULL +
                                                            static_cast<uint64_t>(epoch));
  return shard(torch::randperm(dataset_size, generator, torch::kLong));
}

// ---- DataLoader.

namespace {
// A resume asked for more batches than the epoch now has.
[[noreturn]] void throw_data_changed(int64_t wanted, int64_t epoch, int64_t available) {
  throw CheckpointError(str("cannot resume the data loader at batch ", wanted, " of epoch ", epoch,
                            ": the epoch has only ", available,
                            " batches. The data changed since the checkpoint was written."));
}
}  // namespace

void DataLoader::start_epoch(int64_t epoch) {
  epoch_ = epoch;
  position_ = 0;
  do_start_epoch(epoch);
}

std::optional<Batch> DataLoader::next() {
  if (epoch_ < 0) start_epoch(0);
  auto batch = do_next();
  if (batch) ++position_;
  return batch;
}

void DataLoader::seek(int64_t epoch, int64_t position) {
  if (position < 0) {
    throw ConfigError(str("DataLoader::seek(epoch=", epoch, ", position=", position,
                          "): position must be >= 0."));
  }
  start_epoch(epoch);
  if (position > 0) do_skip(position);
  position_ = position;
}

void DataLoader::do_skip(int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!do_next()) {
      throw_data_changed(n, epoch_, i);
    }
  }
}

StateDict DataLoader::state_dict() const {
  StateDict state;
  state.set("epoch", epoch_);
  state.set("position", position_);
  do_state_dict(state);
  return state;
}

void DataLoader::load_state_dict(const StateDict& state, std::optional<int64_t> position) {
  const int64_t saved_epoch = state.integer("epoch");
  const int64_t saved_position = state.integer("position");
  if (saved_epoch >= 0 && position.value_or(saved_position) > 0) {
    check_resume(state, position.value_or(saved_position));
  }
  do_load_state_dict(state);
  if (saved_epoch >= 0) {
    seek(saved_epoch, position.value_or(saved_position));
    return;
  }
  // Saved before its first epoch: back to that (next() starts epoch 0),
  // without starting an epoch -1 (an iterable loader's factory would be
  // asked for it).
  epoch_ = -1;
  position_ = 0;
}

bool DataLoader::set_shard(int64_t, int64_t, bool) { return false; }

// ---- DatasetLoader.

DatasetLoader::DatasetLoader(std::shared_ptr<Dataset> dataset, DataLoaderOptions options,
                             std::shared_ptr<Sampler> sampler)
    : dataset_(std::move(dataset)), options_(options), sampler_(std::move(sampler)) {
  if (!dataset_) throw ConfigError("DatasetLoader(dataset=nullptr): pass a dataset.");
  if (options_.batch_size < 1) {
    throw ConfigError(str("DataLoaderOptions{.batch_size = ", options_.batch_size,
                          "}: batch_size must be >= 1."));
  }
  if (options_.num_workers < 0 || options_.prefetch_factor < 1) {
    throw ConfigError(str("DataLoaderOptions{.num_workers = ", options_.num_workers,
                          ", .prefetch_factor = ", options_.prefetch_factor,
                          "}: num_workers must be >= 0 (0: load on the training thread) and "
                          "prefetch_factor >= 1."));
  }
  if (int64_t in_flight = 0;
      __builtin_mul_overflow(options_.num_workers, options_.prefetch_factor, &in_flight)) {
    throw ConfigError(str("DataLoaderOptions{.num_workers = ", options_.num_workers,
                          ", .prefetch_factor = ", options_.prefetch_factor,
                          "}: num_workers x prefetch_factor batches loaded ahead is more than "
                          "an int64 holds. prefetch_factor is the batches each worker loads "
                          "ahead (2 by default): pass a few."));
  }
  if (options_.shuffle && sampler_) {
    throw ConfigError(
        str("DataLoaderOptions{.shuffle = true} with a sampler: the sampler "
            "chooses the order, and shuffle would be ignored. Leave shuffle false "
            "with a sampler (a RandomSampler shuffles), or pass no sampler."));
  }
  if (options_.num_workers == 0 && (options_.persistent_workers || options_.prefetch_factor != 2)) {
    throw ConfigError(str("DataLoaderOptions{.num_workers = 0, .prefetch_factor = ",
                          options_.prefetch_factor, ", .persistent_workers = ",
                          options_.persistent_workers ? "true" : "false",
                          "}: prefetch_factor and persistent_workers apply to worker threads; set "
                          "num_workers, or leave them at their defaults."));
  }
  seed_ = options_.seed.value_or(0);
  if (!sampler_) {
    if (options_.shuffle) {
      sampler_ = std::make_shared<RandomSampler>(options_.seed.value_or(0));
      owns_random_sampler_ = !options_.seed.has_value();
    } else {
      sampler_ = std::make_shared<SequentialSampler>();
    }
  }
}

int64_t DatasetLoader::samples_per_epoch() const { return sampler_->shard_size(dataset_->size()); }

namespace {
// The batches `samples` make: the last one short, or dropped.
int64_t batches_of(int64_t samples, const DataLoaderOptions& options) {
  // No samples + b - 1: it overflows for a batch size near INT64_MAX.
  const int64_t b = options.batch_size;
  return samples / b + (!options.drop_last && samples % b != 0 ? 1 : 0);
}
}  // namespace

std::optional<int64_t> DatasetLoader::num_batches() const {
  return batches_of(samples_per_epoch(), options_);
}

bool DatasetLoader::set_shard(int64_t rank, int64_t world_size, bool even) {
  sampler_->set_shard(rank, world_size, even);
  if (in_order_) in_order_->set_shard(rank, world_size, even);
  return true;
}

std::optional<at::Tensor> DatasetLoader::sample_indices(int64_t batch_idx) const {
  const int64_t b = options_.batch_size;
  const int64_t n = order_.defined() ? order_.size(0) : 0;
  const int64_t batches = batches_of(n, options_);
  if (batch_idx < 0 || batch_idx >= batches) {
    throw ConfigError(str("DatasetLoader::sample_indices(", batch_idx, "): the current epoch (",
                          epoch(), ") has ", batches, " batch(es); pass an index in [0, ", batches,
                          ")."));
  }
  const int64_t begin = batch_idx * b;  // < n: batch_idx is a batch of the epoch
  return order_.slice(0, begin, begin + std::min(b, n - begin)).clone();
}

bool DatasetLoader::set_in_order(bool in_order) {
  if (!in_order || dynamic_cast<const RandomSampler*>(sampler_.get()) == nullptr) {
    in_order_.reset();
    return false;
  }
  in_order_ = std::make_shared<SequentialSampler>();
  if (sampler_->shard_world_size() > 1) {
    in_order_->set_shard(sampler_->shard_rank(), sampler_->shard_world_size(),
                         sampler_->shard_even());
  }
  return true;
}

int64_t DatasetLoader::padded_rows(int64_t batch_idx) const {
  const Sampler& s = *sampler_;
  const int64_t n = s.epoch_size(dataset_->size());
  const int64_t w = s.shard_world_size();
  if (!s.shard_even() || w <= 1 || n == 0) return 0;
  // ceil(n / w) (shard_size takes the dataset's size): the last is position (m-1)*w + rank.
  const int64_t m = s.shard_size(dataset_->size());
  if ((m - 1) * w + s.shard_rank() < n) return 0;
  const int64_t b = options_.batch_size;
  if (options_.drop_last && m % b != 0) return 0;  // the sample is in the dropped remainder
  return batch_idx == m / b + (m % b != 0 ? 1 : 0) - 1 ? 1 : 0;
}

DatasetLoader::~DatasetLoader() {
  // Loads in flight read this loader's members: they end first.
  if (prefetcher_) prefetcher_->stop();
}

void DatasetLoader::set_default_seed(uint64_t seed) {
  if (!options_.seed) seed_ = seed;
  if (!owns_random_sampler_) return;
  auto sharded = sampler_;
  sampler_ = std::make_shared<RandomSampler>(seed);
  if (sharded->shard_world_size() > 1) {
    sampler_->set_shard(sharded->shard_rank(), sharded->shard_world_size(), sharded->shard_even());
  }
}

namespace {

// "sample 17", or the samples of a batch: "samples 3, 9, 12 (3)".
std::string samples_text(const at::Tensor& indices) {
  const int64_t n = indices.numel();
  const auto* p = indices.data_ptr<int64_t>();
  if (n == 1) return str("sample ", p[0]);
  std::ostringstream out;
  out << "samples ";
  for (int64_t i = 0; i < std::min<int64_t>(n, 8); ++i) out << (i ? ", " : "") << p[i];
  if (n > 8) out << ", ... " << p[n - 1];
  out << " (" << n << ")";
  return out.str();
}

}  // namespace

Batch DatasetLoader::load_batch(const at::Tensor& order, uint64_t seed, int64_t epoch,
                                int64_t index) const {
  const int64_t begin = index * options_.batch_size;
  const int64_t end = begin + std::min(options_.batch_size, order.size(0) - begin);
  const at::Tensor indices = order.slice(0, begin, end).contiguous();
  detail::SampleScope scope(seed, epoch);
  Batch batch;
  // What the dataset threw, without LibTorch's stack frames.
  auto what_of = [](std::exception_ptr thrown) -> std::string {
    try {
      std::rethrow_exception(std::move(thrown));
    } catch (const std::exception& e) {
      return error_message(e);
    } catch (...) {
      return "it threw something that is not a std::exception";
    }
  };
  try {
    batch = dataset_->get_batch(indices);
  } catch (...) {
    // Which sample: each alone, until one fails the same way.
    std::string culprit = samples_text(indices);
    std::string what = what_of(std::current_exception());
    if (indices.numel() > 1) {
      for (int64_t i = 0; i < indices.numel(); ++i) {
        try {
          (void)dataset_->get_batch(indices.slice(0, i, i + 1));
        } catch (...) {
          culprit = samples_text(indices.slice(0, i, i + 1));
          what = what_of(std::current_exception());
          break;
        }
      }
    }
    throw DataLoaderError(str("DataLoader: loading ", culprit, " (batch ", index, " of epoch ",
                              epoch, ") failed: ", what));
  }
  if (options_.pin_memory.value_or(default_pin_memory_) && cuda_usable()) {
    // Host tensors only: a dataset's tensors on the GPU stay there.
    batch = batch.map_tensors(
        [](const at::Tensor& t) { return !t.is_cpu() || t.is_pinned() ? t : t.pin_memory(); });
  }
  return batch;
}

void DatasetLoader::start_workers(int64_t first) {
  if (!prefetcher_) {
    prefetcher_ = std::make_unique<detail::Prefetcher>(
        options_.num_workers, options_.num_workers * options_.prefetch_factor);
  }
  prefetcher_->start([this, order = order_, seed = seed_, epoch = epoch()](int64_t index) {
    return load_batch(order, seed, epoch, index);
  }, first, *num_batches());
  workers_started_ = true;
}

void DatasetLoader::do_start_epoch(int64_t epoch) {
  const int64_t size = dataset_->size();
  if (size < 0) {
    throw ConfigError(str("DataLoader: the dataset's size() is ", size,
                          "; return the number of samples (>= 0)."));
  }
  Sampler& sampler = in_order_ ? *in_order_ : *sampler_;
  at::Tensor order = sampler.epoch_indices(epoch, size);
  // The batches are cut from these, and counted from shard_size(): a
  // sampler that disagrees would give empty or missing batches.
  const int64_t expected = sampler.shard_size(size);
  if (!order.defined() || order.dim() != 1 || !c10::isIntegralType(order.scalar_type(), false) ||
      order.size(0) != expected) {
    throw ConfigError(str(
        "DataLoader: the sampler's epoch_indices(", epoch, ", ", size, ") returned ",
        !order.defined() ? std::string("an undefined tensor")
                         : str("a ", c10::toString(order.scalar_type()), " tensor of shape ",
                               c10::str(order.sizes())),
        "; the loader needs [", expected, "] sample indices of an integer dtype (its shard_size(",
        size, "), from epoch_size(", size, ") = ", sampler.epoch_size(size),
        "). A sampler that visits another number of samples than the dataset has says how "
        "many in epoch_size(); one restored from a checkpoint of another dataset size gives "
        "this too (resume with the same dataset)."));
  }
  order = order.to(torch::kLong).contiguous();
  if (order.numel() > 0) {
    const auto [low_t, high_t] = at::aminmax(order);
    const int64_t low = low_t.item<int64_t>();
    const int64_t high = high_t.item<int64_t>();
    if (low < 0 || high >= size) {
      throw ConfigError(str("DataLoader: the sampler's epoch_indices(", epoch, ", ", size,
                            ") returned sample index ", low < 0 ? low : high,
                            ", outside the dataset's [0, ", size, ")."));
    }
  }
  order_ = order;
  cursor_ = 0;
  // The workers start at the first next(), from where a seek left the
  // cursor (a previous epoch's loads still in flight end first).
  workers_started_ = false;
}

std::optional<Batch> DatasetLoader::do_next() {
  if (options_.num_workers > 0) {
    if (!workers_started_) start_workers(cursor_ / options_.batch_size);
    auto batch = prefetcher_->next();
    if (!batch && !options_.persistent_workers) prefetcher_->stop();
    return batch;
  }
  int64_t n = order_.size(0);
  if (cursor_ >= n) return std::nullopt;
  int64_t end = std::min(cursor_ + options_.batch_size, n);
  if (options_.drop_last && end - cursor_ < options_.batch_size) return std::nullopt;
  const int64_t index = cursor_ / options_.batch_size;
  cursor_ = end;
  return load_batch(order_, seed_, epoch(), index);
}

void DatasetLoader::do_skip(int64_t n) {
  int64_t available = *num_batches();
  if (n > available) {
    throw_data_changed(n, epoch(), available);
  }
  cursor_ = std::min(cursor_ + n * options_.batch_size, order_.size(0));
  workers_started_ = false;
}

void DatasetLoader::do_release_workers() {
  if (!prefetcher_ || !workers_started_ || options_.persistent_workers) return;
  prefetcher_->stop();
  // The workers ran ahead of the batches handed out; a later next() reads
  // on from the last of those.
  cursor_ = std::min(position() * options_.batch_size, order_.size(0));
  workers_started_ = false;
}

void DatasetLoader::do_state_dict(StateDict& state) const {
  state.set_section("sampler", sampler_->state_dict());
  // What the position means: check_resume compares them.
  state.set("batch_size", options_.batch_size);
  state.set("shards", sampler_->shard_world_size());
  state.set("dataset_size", dataset_->size());
  if (const auto* random = dynamic_cast<const RandomSampler*>(sampler_.get())) {
    state.set("shuffle_seed", static_cast<int64_t>(random->seed()));
  }
}

void DatasetLoader::check_resume(const StateDict& state, int64_t position) const {
  if (!state.contains("batch_size")) return;  // written before these entries
  std::vector<std::string> differ;
  // A position names the same samples when as many are taken per step over
  // every shard (one rank's batch of 16 is two ranks' of 8), in the same
  // order of the same dataset.
  const int64_t saved_batch = state.integer("batch_size");
  const int64_t saved_shards = state.contains("shards") ? state.integer("shards") : 1;
  const int64_t shards = sampler_->shard_world_size();
  if (saved_batch * saved_shards != options_.batch_size * shards) {
    differ.push_back(str("batches of ", saved_batch, " on each of ", saved_shards,
                         " rank(s) there, of ", options_.batch_size, " on each of ", shards,
                         " here"));
  }
  if (const int64_t saved = state.integer("dataset_size"); saved != dataset_->size()) {
    differ.push_back(str("a dataset of ", saved, " samples there, of ", dataset_->size(), " here"));
  }
  const auto* random = dynamic_cast<const RandomSampler*>(sampler_.get());
  if (state.contains("shuffle_seed") != (random != nullptr)) {
    differ.emplace_back(random ? "in order there, shuffled here" : "shuffled there, in order here");
  } else if (random && state.integer("shuffle_seed") != static_cast<int64_t>(random->seed())) {
    differ.push_back(str("shuffled with seed ", state.integer("shuffle_seed"), " there, ",
                         random->seed(), " here"));
  }
  if (differ.empty()) return;
  detail::print_note(
      str("DataLoader: resuming at batch ", position, " of epoch ", state.integer("epoch"),
          ", saved by a loader whose batches differ from this one's (", join(differ, "; "),
          "): the rest of this epoch is not what the interrupted run would have read (some samples "
          "repeat, some are skipped); the run goes on. For an exact resume, resume with the loader "
          "as it was, or from a checkpoint written at an epoch's end."));
}

void DatasetLoader::do_load_state_dict(const StateDict& state) {
  if (const StateDict* sampler = state.find_section("sampler")) sampler_->load_state_dict(*sampler);
}

std::shared_ptr<DatasetLoader> make_data_loader(std::shared_ptr<Dataset> dataset,
                                                DataLoaderOptions options,
                                                std::shared_ptr<Sampler> sampler) {
  return std::make_shared<DatasetLoader>(std::move(dataset), options, std::move(sampler));
}

// ---- IterableLoader.

IterableLoader::IterableLoader(std::function<BatchGenerator(int64_t)> factory,
                               std::optional<int64_t> num_batches)
    : factory_(std::move(factory)), num_batches_(num_batches) {
  if (!factory_) throw ConfigError("IterableLoader(factory=empty): pass a generator factory.");
  if (num_batches_ && *num_batches_ < 0) {
    throw ConfigError(str("IterableLoader(num_batches=", *num_batches_,
                          "): pass the batches an epoch yields (>= 0), or nullopt when unknown."));
  }
}

void IterableLoader::do_start_epoch(int64_t epoch) { current_ = factory_(epoch); }

std::optional<Batch> IterableLoader::do_next() {
  if (!current_) return std::nullopt;
  return current_();
}

std::shared_ptr<IterableLoader> make_iterable_loader(std::function<BatchGenerator(int64_t)> factory,
                                                     std::optional<int64_t> num_batches) {
  return std::make_shared<IterableLoader>(std::move(factory), num_batches);
}

}  // namespace fulgur
