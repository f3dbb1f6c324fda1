#include "fulgur/data/data_loader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <numeric>
#include <sstream>
#include <thread>

#include "fulgur/core/errors.h"
#include "fulgur/fulgur.h"
#include "support/run_in_child.h"
#include "support/test_support.h"

namespace {

using fulgur::test::index_dataset;
using fulgur::test::to_vector;
using ::testing::ElementsAre;

/// The sample indices of every batch of epoch `epoch`, batch by batch.
std::vector<std::vector<int64_t>> read_epoch(fulgur::DataLoader& loader, int64_t epoch) {
  loader.start_epoch(epoch);
  std::vector<std::vector<int64_t>> out;
  while (auto batch = loader.next()) out.push_back(to_vector(batch->tensor()));
  return out;
}

/// All sample indices of the rest of the current epoch, flattened.
std::vector<int64_t> read_rest(fulgur::DataLoader& loader) {
  std::vector<int64_t> out;
  while (auto batch = loader.next()) {
    auto values = to_vector(batch->tensor());
    out.insert(out.end(), values.begin(), values.end());
  }
  return out;
}

std::vector<int64_t> flatten(const std::vector<std::vector<int64_t>>& batches) {
  std::vector<int64_t> out;
  for (const auto& b : batches) out.insert(out.end(), b.begin(), b.end());
  return out;
}

// ---- TensorDataset.

TEST(TensorDataset, BatchKindFollowsTheNumberOfTensors) {
  auto idx = torch::arange(3, torch::kLong);
  fulgur::TensorDataset one({torch::arange(4)});
  fulgur::TensorDataset two(torch::arange(4), torch::arange(4) * 2);
  fulgur::TensorDataset three({torch::arange(4), torch::arange(4), torch::arange(4)});
  EXPECT_EQ(one.size(), 4);
  EXPECT_TRUE(one.get_batch(idx).is_tensor());
  EXPECT_TRUE(two.get_batch(idx).is_pair());
  EXPECT_TRUE(three.get_batch(idx).is_list());
  auto batch = two.get_batch(torch::tensor({3, 1}, torch::kLong));
  EXPECT_THAT(to_vector(batch[0]), ElementsAre(3, 1));
  EXPECT_THAT(to_vector(batch[1]), ElementsAre(6, 2));
}

TEST(TensorDataset, RejectsMismatchedOrEmptyTensors) {
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::TensorDataset(torch::zeros({4, 2}), torch::zeros({3})),
                     {"4", "3", "samples"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::TensorDataset(std::vector<at::Tensor>{}),
                     {"TensorDataset"});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::TensorDataset(std::vector<at::Tensor>{torch::tensor(1.0)}),
                     {"scalar"});
}

// ---- DatasetLoader.

TEST(DatasetLoader, NumBatchesRoundsUpUnlessDropLast) {
  auto keep = fulgur::make_data_loader(index_dataset(10), {.batch_size = 3});
  auto drop = fulgur::make_data_loader(index_dataset(10), {.batch_size = 3, .drop_last = true});
  EXPECT_EQ(keep->num_batches(), std::optional<int64_t>(4));
  EXPECT_EQ(drop->num_batches(), std::optional<int64_t>(3));
  auto exact = fulgur::make_data_loader(index_dataset(9), {.batch_size = 3, .drop_last = true});
  EXPECT_EQ(exact->num_batches(), std::optional<int64_t>(3));
}

// A batch size near INT64_MAX is one batch of every sample (it overflowed
// into none: validation and test were skipped without a word).
TEST(DatasetLoader, ABatchSizeNearInt64MaxIsOneBatchOfEverySample) {
  const int64_t huge = std::numeric_limits<int64_t>::max() - 5;
  auto loader = fulgur::make_data_loader(index_dataset(10), {.batch_size = huge});
  EXPECT_EQ(loader->num_batches(), std::optional<int64_t>(1));
  auto batches = read_epoch(*loader, 0);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].size(), 10u);
  EXPECT_EQ(loader->sample_indices(0)->numel(), 10);
  auto dropped =
      fulgur::make_data_loader(index_dataset(10), {.batch_size = huge, .drop_last = true});
  EXPECT_EQ(dropped->num_batches(), std::optional<int64_t>(0));
}

TEST(DatasetLoader, SequentialBatchesInOrder) {
  auto loader = fulgur::make_data_loader(index_dataset(10), {.batch_size = 3});
  auto batches = read_epoch(*loader, 0);
  ASSERT_EQ(batches.size(), 4u);
  EXPECT_THAT(batches[0], ElementsAre(0, 1, 2));
  EXPECT_THAT(batches[3], ElementsAre(9));
  // Every epoch is the same without shuffling.
  EXPECT_EQ(read_epoch(*loader, 1), batches);
}

TEST(DatasetLoader, DropLastDropsTheShortBatch) {
  auto loader = fulgur::make_data_loader(index_dataset(10), {.batch_size = 3, .drop_last = true});
  auto batches = read_epoch(*loader, 0);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_THAT(batches[2], ElementsAre(6, 7, 8));
}

TEST(DatasetLoader, SampleIndicesNameEachBatchsSamples) {
  auto loader = fulgur::make_data_loader(
      index_dataset(10), {.batch_size = 3, .shuffle = true, .drop_last = true, .seed = 5});
  loader->start_epoch(1);
  for (int64_t b = 0; b < 3; ++b) {
    auto batch = loader->next();
    ASSERT_TRUE(batch.has_value());
    // index_dataset's samples are their own indices.
    EXPECT_EQ(to_vector(*loader->sample_indices(b)), to_vector(batch->tensor())) << b;
  }
  EXPECT_THROWS_WITH(fulgur::ConfigError, loader->sample_indices(3),
                     {"sample_indices(3)", "has 3 batch(es)"});
}

TEST(DatasetLoader, PositionCountsBatchesHandedOut) {
  auto loader = fulgur::make_data_loader(index_dataset(10), {.batch_size = 4});
  loader->start_epoch(2);
  EXPECT_EQ(loader->epoch(), 2);
  EXPECT_EQ(loader->position(), 0);
  loader->next();
  loader->next();
  EXPECT_EQ(loader->position(), 2);
  loader->next();
  EXPECT_FALSE(loader->next().has_value());
  EXPECT_EQ(loader->position(), 3);  // the end of the epoch is not a batch
}

TEST(DatasetLoader, NextWithoutStartEpochStartsEpochZero) {
  auto loader = fulgur::make_data_loader(index_dataset(4), {.batch_size = 2});
  auto batch = loader->next();
  ASSERT_TRUE(batch.has_value());
  EXPECT_EQ(loader->epoch(), 0);
  EXPECT_THAT(to_vector(batch->tensor()), ElementsAre(0, 1));
}

TEST(DatasetLoader, ShuffleVisitsEverySampleOnce) {
  auto loader =
      fulgur::make_data_loader(index_dataset(32), {.batch_size = 5, .shuffle = true, .seed = 7});
  auto order = flatten(read_epoch(*loader, 0));
  auto sorted = order;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> all(32);
  for (int64_t i = 0; i < 32; ++i) all[static_cast<size_t>(i)] = i;
  EXPECT_EQ(sorted, all);
  EXPECT_NE(order, all);  // 1 / 32! chance of a false failure
}

TEST(DatasetLoader, ShuffleIsDeterministicPerSeedAndEpoch) {
  auto a =
      fulgur::make_data_loader(index_dataset(32), {.batch_size = 4, .shuffle = true, .seed = 7});
  auto b =
      fulgur::make_data_loader(index_dataset(32), {.batch_size = 4, .shuffle = true, .seed = 7});
  auto c =
      fulgur::make_data_loader(index_dataset(32), {.batch_size = 4, .shuffle = true, .seed = 8});
  auto a0 = read_epoch(*a, 0);
  auto a1 = read_epoch(*a, 1);
  EXPECT_EQ(read_epoch(*b, 0), a0);  // same seed, same epoch: same order
  EXPECT_EQ(read_epoch(*b, 1), a1);
  EXPECT_NE(a1, a0);                 // another epoch: another order
  EXPECT_NE(read_epoch(*c, 0), a0);  // another seed: another order
  EXPECT_EQ(read_epoch(*a, 0), a0);  // going back to epoch 0 repeats it
}

TEST(DatasetLoader, DefaultSeedAppliesOnlyWhenTheSeedIsUnset) {
  auto unset = fulgur::make_data_loader(index_dataset(32), {.batch_size = 4, .shuffle = true});
  auto five =
      fulgur::make_data_loader(index_dataset(32), {.batch_size = 4, .shuffle = true, .seed = 5});
  auto seven =
      fulgur::make_data_loader(index_dataset(32), {.batch_size = 4, .shuffle = true, .seed = 7});
  auto seven_order = read_epoch(*seven, 0);
  unset->set_default_seed(5);
  seven->set_default_seed(5);
  EXPECT_EQ(read_epoch(*unset, 0), read_epoch(*five, 0));
  EXPECT_EQ(read_epoch(*seven, 0), seven_order);
}

TEST(DatasetLoader, SeekGivesTheSameBatchesAsReadingThrough) {
  auto loader =
      fulgur::make_data_loader(index_dataset(30), {.batch_size = 4, .shuffle = true, .seed = 3});
  auto epoch1 = read_epoch(*loader, 1);
  loader->seek(1, 3);
  EXPECT_EQ(loader->epoch(), 1);
  EXPECT_EQ(loader->position(), 3);
  std::vector<std::vector<int64_t>> rest;
  while (auto batch = loader->next()) rest.push_back(to_vector(batch->tensor()));
  EXPECT_EQ(rest, std::vector<std::vector<int64_t>>(epoch1.begin() + 3, epoch1.end()));
  EXPECT_EQ(loader->position(), static_cast<int64_t>(epoch1.size()));
}

TEST(DatasetLoader, SeekToTheStartAndToTheEnd) {
  auto loader = fulgur::make_data_loader(index_dataset(10), {.batch_size = 5});
  loader->seek(0, 0);
  EXPECT_THAT(read_rest(*loader), ElementsAre(0, 1, 2, 3, 4, 5, 6, 7, 8, 9));
  loader->seek(4, 2);
  EXPECT_FALSE(loader->next().has_value());
}

TEST(DatasetLoader, SeekRejectsNegativePositions) {
  auto loader = fulgur::make_data_loader(index_dataset(10), {.batch_size = 5});
  EXPECT_THROWS_WITH(fulgur::ConfigError, loader->seek(0, -1), {"position=-1"});
}

TEST(DatasetLoader, SaveAndLoadStateResumeMidEpoch) {
  auto loader =
      fulgur::make_data_loader(index_dataset(30), {.batch_size = 4, .shuffle = true, .seed = 11});
  loader->start_epoch(2);
  loader->next();
  loader->next();
  const fulgur::StateDict state = loader->state_dict();
  EXPECT_EQ(state.keys(), (std::vector<std::string>{"epoch", "position", "sampler", "batch_size",
                                                    "shards", "dataset_size", "shuffle_seed"}));
  EXPECT_EQ(state.integer("epoch"), 2);
  EXPECT_EQ(state.integer("position"), 2);
  const std::string bytes = fulgur::to_bytes(state);
  auto expected = read_rest(*loader);

  // From the state itself, and through the archive codec.
  for (const fulgur::StateDict& saved : {state, fulgur::from_bytes(bytes)}) {
    auto resumed = fulgur::make_data_loader(index_dataset(30),
                                            {.batch_size = 4, .shuffle = true, .seed = 11});
    resumed->load_state_dict(saved);
    EXPECT_EQ(resumed->epoch(), 2);
    EXPECT_EQ(resumed->position(), 2);
    EXPECT_EQ(read_rest(*resumed), expected);
  }
}

// A state saved in the middle of an epoch names a batch of that loader's:
// another global batch size, dataset size or shuffling seed resumes at
// other samples (some repeated, some skipped). A note names what differs,
// and the loader goes on; one rank's batch of 20 reads what two ranks' of
// 10 did, so that resume says nothing, nor one at an epoch's start. A state
// without these entries (written before them) onto fewer batches still
// says the data changed.
TEST(DatasetLoader, AMidEpochStateOfALoaderWithOtherBatchesIsNoted) {
  auto saving =
      fulgur::make_data_loader(index_dataset(100), {.batch_size = 10, .shuffle = true, .seed = 1});
  saving->set_shard(0, 2, /*even=*/true);
  saving->start_epoch(0);
  for (int i = 0; i < 3; ++i) saving->next();
  const fulgur::StateDict state = saving->state_dict();
  auto note_of = [&](fulgur::DataLoader& loader, std::optional<int64_t> position) {
    ::testing::internal::CaptureStderr();
    loader.load_state_dict(state, position);
    return ::testing::internal::GetCapturedStderr();
  };
  struct Case {
    int64_t size, batch;
    std::optional<uint64_t> seed;
    std::string differs;
  };
  for (const Case& c :
       {Case{100, 10, 1, "batches of 10 on each of 2 rank(s) there, of 10 on each of 1 here"},
        Case{1000, 20, 1, "a dataset of 100 samples there, of 1000 here"},
        Case{100, 20, 2, "shuffled with seed 1 there, 2 here"},
        Case{100, 20, std::nullopt, "shuffled there, in order here"}}) {
    SCOPED_TRACE(c.differs);
    auto loader = fulgur::make_data_loader(
        index_dataset(c.size),
        {.batch_size = c.batch, .shuffle = c.seed.has_value(), .seed = c.seed});
    const std::string note = note_of(*loader, std::nullopt);
    EXPECT_TRUE(fulgur::test::message_contains(
        note, {"resuming at batch 3 of epoch 0", c.differs, "some samples repeat",
               "the run goes on", "epoch's end"}))
        << note;
    EXPECT_EQ(loader->position(), 3);
    EXPECT_EQ(note_of(*loader, /*position=*/0), "");
  }
  // The same samples: 20 on one rank, or 10 on each of two.
  auto one_rank =
      fulgur::make_data_loader(index_dataset(100), {.batch_size = 20, .shuffle = true, .seed = 1});
  EXPECT_EQ(note_of(*one_rank, std::nullopt), "");
  auto second_rank =
      fulgur::make_data_loader(index_dataset(100), {.batch_size = 10, .shuffle = true, .seed = 1});
  second_rank->set_shard(1, 2, /*even=*/true);
  EXPECT_EQ(note_of(*second_rank, std::nullopt), "");
  fulgur::StateDict old;
  old.set("epoch", int64_t{0});
  old.set("position", int64_t{3});
  auto fewer = fulgur::make_data_loader(index_dataset(20), {.batch_size = 10});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, fewer->load_state_dict(old),
                     {"batch 3", "only 2 batches", "data changed"});
}

// Samplers and datasets that would give empty, missing or unreadable
// batches, options that overflowed into a loader waiting forever, and a
// shuffle a sampler would ignore: each named.
TEST(DatasetLoader, BadSamplersDatasetsAndOptionsAreNamed) {
  struct Returns : fulgur::Sampler {
    std::function<at::Tensor(int64_t)> order;
    at::Tensor epoch_indices(int64_t, int64_t n) override { return shard(order(n)); }
  };
  auto sampler = [](std::function<at::Tensor(int64_t)> order) {
    auto s = std::make_shared<Returns>();
    s->order = std::move(order);
    return s;
  };
  // int32 indices are taken (they were read as int64 in an error's text).
  auto int32 = fulgur::make_data_loader(index_dataset(5), {.batch_size = 2}, sampler([](int64_t n) {
                                          return torch::arange(n, torch::kInt).flip(0);
                                        }));
  int32->start_epoch(0);
  EXPECT_EQ(read_rest(*int32), (std::vector<int64_t>{4, 3, 2, 1, 0}));
  auto shorter = fulgur::make_data_loader(
      index_dataset(10), {.batch_size = 2, .num_workers = 2},
      sampler([](int64_t n) { return torch::arange(n / 2, torch::kLong); }));
  EXPECT_THROWS_WITH(fulgur::ConfigError, shorter->start_epoch(0),
                     {"epoch_indices(0, 10) returned", "Long tensor of shape [5]", "[10]",
                      "epoch_size(10) = 10", "says how many in epoch_size()"});
  // A sampler of a subset that says how many it visits: its batches are
  // counted from that (with workers too).
  struct Half : fulgur::Sampler {
    at::Tensor epoch_indices(int64_t, int64_t n) override {
      return shard(torch::arange(n / 2, torch::kLong));
    }
    int64_t epoch_size(int64_t n) const override { return n / 2; }
  };
  auto half = fulgur::make_data_loader(index_dataset(10), {.batch_size = 2, .num_workers = 2},
                                       std::make_shared<Half>());
  EXPECT_EQ(half->num_batches().value(), 3);
  half->start_epoch(0);
  EXPECT_EQ(read_rest(*half), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  // Its shards padded to one length: rank 1 of 4 reads samples 1 and 5 of
  // the 5, the second a repeat (of sample 0), which an evaluation leaves out.
  ASSERT_TRUE(half->set_shard(1, 4, /*even=*/true));
  half->start_epoch(0);
  EXPECT_EQ(read_rest(*half), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(half->padded_rows(0), 1);
  ASSERT_TRUE(half->set_shard(0, 4, /*even=*/true));
  EXPECT_EQ(half->padded_rows(0), 0);
  auto outside = fulgur::make_data_loader(
      index_dataset(4), {.batch_size = 2},
      sampler([](int64_t n) { return torch::arange(n, torch::kLong) + 1; }));
  EXPECT_THROWS_WITH(fulgur::ConfigError, outside->start_epoch(0),
                     {"sample index 4", "outside the dataset's [0, 4)"});
  auto floats =
      fulgur::make_data_loader(index_dataset(4), {.batch_size = 2},
                               sampler([](int64_t n) { return torch::arange(n, torch::kFloat); }));
  EXPECT_THROWS_WITH(fulgur::ConfigError, floats->start_epoch(0), {"Float tensor", "integer"});
  struct Negative : fulgur::Dataset {
    int64_t size() const override { return -1; }
    fulgur::Batch get_batch(const at::Tensor& i) const override { return fulgur::Batch(i); }
  };
  auto negative = fulgur::make_data_loader(std::make_shared<Negative>(), {.batch_size = 2});
  EXPECT_THROWS_WITH(fulgur::ConfigError, negative->start_epoch(0), {"size() is -1", ">= 0"});

  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      fulgur::make_data_loader(index_dataset(4),
                               {.batch_size = 2, .num_workers = 2, .prefetch_factor = 1LL << 62}),
      {".prefetch_factor = 4611686018427387904", "more than an int64 holds"});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::make_data_loader(index_dataset(4), {.batch_size = 2, .shuffle = true},
                                              std::make_shared<fulgur::SequentialSampler>()),
                     {".shuffle = true} with a sampler", "a RandomSampler shuffles"});
  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      fulgur::make_iterable_loader([](int64_t) { return fulgur::BatchGenerator(); }, -5),
      {"num_batches=-5", ">= 0"});
}

// A dataset's LibTorch error reaches the loader's error without LibTorch's
// stack frames (they hid the collation's message under a page of frames).
TEST(DatasetLoader, ADatasetsLibTorchErrorKeepsItsMessageWithoutFrames) {
  struct Ragged : fulgur::Dataset {
    int64_t size() const override { return 4; }
    fulgur::Batch get_batch(const at::Tensor& indices) const override {
      std::vector<at::Tensor> rows;
      for (int64_t i = 0; i < indices.numel(); ++i) {
        rows.push_back(torch::zeros({3 + indices[i].item<int64_t>() % 2}));
      }
      return fulgur::Batch(torch::stack(rows));
    }
  };
  for (int64_t workers : {0, 2}) {
    SCOPED_TRACE(workers);
    auto loader = fulgur::make_data_loader(std::make_shared<Ragged>(),
                                           {.batch_size = 2, .num_workers = workers});
    loader->start_epoch(0);
    try {
      loader->next();
      ADD_FAILURE() << "no error";
    } catch (const fulgur::DataLoaderError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("loading samples 0, 1 (2) (batch 0 of epoch 0) failed: stack expects "
                          "each tensor to be equal size"),
                std::string::npos)
          << what;
      EXPECT_EQ(what.find("frame #"), std::string::npos) << what;
      EXPECT_EQ(what.find("Exception raised from"), std::string::npos) << what;
    }
  }
}

TEST(DatasetLoader, LoadStateNamesAMissingEntry) {
  fulgur::StateDict state;
  state.set("epoch", int64_t{1});
  auto loader = fulgur::make_data_loader(index_dataset(12), {.batch_size = 2});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, loader->load_state_dict(state),
                     {"\"position\"", "missing", "epoch"});
}

TEST(DatasetLoader, LoadStateAtAnExplicitPosition) {
  auto loader = fulgur::make_data_loader(index_dataset(12), {.batch_size = 2});
  loader->start_epoch(1);
  loader->next();
  const fulgur::StateDict state = fulgur::from_bytes(fulgur::to_bytes(loader->state_dict()));
  auto resumed = fulgur::make_data_loader(index_dataset(12), {.batch_size = 2});
  resumed->load_state_dict(state, /*position=*/4);
  EXPECT_EQ(resumed->epoch(), 1);
  EXPECT_EQ(resumed->position(), 4);
  EXPECT_THAT(read_rest(*resumed), ElementsAre(8, 9, 10, 11));
}

TEST(DatasetLoader, ShardsSplitRoundRobin) {
  auto rank0 = fulgur::make_data_loader(index_dataset(10), {.batch_size = 2});
  auto rank1 = fulgur::make_data_loader(index_dataset(10), {.batch_size = 2});
  EXPECT_TRUE(rank0->set_shard(0, 2));
  EXPECT_TRUE(rank1->set_shard(1, 2));
  EXPECT_EQ(rank1->num_batches(), std::optional<int64_t>(3));
  EXPECT_THAT(flatten(read_epoch(*rank0, 0)), ElementsAre(0, 2, 4, 6, 8));
  EXPECT_THAT(flatten(read_epoch(*rank1, 0)), ElementsAre(1, 3, 5, 7, 9));
}

TEST(DatasetLoader, RejectsBadOptions) {
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::make_data_loader(index_dataset(4), {.batch_size = 0}),
                     {"batch_size", "0"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::make_data_loader(nullptr), {"dataset"});
}

TEST(DatasetLoader, ExplicitSampler) {
  auto loader = fulgur::make_data_loader(index_dataset(6), {.batch_size = 3},
                                         std::make_shared<fulgur::SequentialSampler>());
  EXPECT_THAT(flatten(read_epoch(*loader, 5)), ElementsAre(0, 1, 2, 3, 4, 5));
}

// ---- Samplers.

TEST(Sampler, SequentialAndRandom) {
  fulgur::SequentialSampler sequential;
  EXPECT_THAT(to_vector(sequential.epoch_indices(3, 4)), ElementsAre(0, 1, 2, 3));
  fulgur::RandomSampler a(9), b(9);
  EXPECT_EQ(to_vector(a.epoch_indices(1, 20)), to_vector(b.epoch_indices(1, 20)));
  EXPECT_NE(to_vector(a.epoch_indices(1, 20)), to_vector(a.epoch_indices(2, 20)));
  EXPECT_EQ(a.seed(), 9u);
}

TEST(Sampler, RandomSamplerIgnoresTheGlobalGenerator) {
  fulgur::RandomSampler sampler(4);
  torch::manual_seed(1);
  auto first = to_vector(sampler.epoch_indices(0, 16));
  torch::manual_seed(2);
  EXPECT_EQ(to_vector(sampler.epoch_indices(0, 16)), first);
}

TEST(Sampler, ShardValidation) {
  fulgur::SequentialSampler sampler;
  EXPECT_THROWS_WITH(fulgur::ConfigError, sampler.set_shard(2, 2), {"rank=2", "world_size=2"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, sampler.set_shard(0, 0), {"world_size=0"});
  sampler.set_shard(1, 3);
  EXPECT_EQ(sampler.shard_rank(), 1);
  EXPECT_EQ(sampler.shard_world_size(), 3);
  EXPECT_THAT(to_vector(sampler.epoch_indices(0, 7)), ElementsAre(1, 4));
}

// ---- IterableLoader.

std::shared_ptr<std::vector<fulgur::Batch>> three_batches() {
  auto batches = std::make_shared<std::vector<fulgur::Batch>>();
  for (int64_t i = 0; i < 3; ++i) batches->emplace_back(torch::full({2}, i, torch::kLong));
  return batches;
}

TEST(IterableLoader, ReplaysAContainerOfBatchesEveryEpoch) {
  auto loader = fulgur::make_iterable_loader(three_batches());
  EXPECT_EQ(loader->num_batches(), std::optional<int64_t>(3));
  auto epoch0 = read_epoch(*loader, 0);
  ASSERT_EQ(epoch0.size(), 3u);
  EXPECT_THAT(epoch0[2], ElementsAre(2, 2));
  EXPECT_EQ(read_epoch(*loader, 1), epoch0);
}

TEST(IterableLoader, AcceptsAContainerOfPairs) {
  auto pairs = std::make_shared<std::vector<fulgur::Batch::Pair>>();
  pairs->emplace_back(torch::ones({2, 3}), torch::zeros({2}));
  pairs->emplace_back(torch::ones({1, 3}), torch::zeros({1}));
  auto loader = fulgur::make_iterable_loader(pairs);
  loader->start_epoch(0);
  auto first = loader->next();
  ASSERT_TRUE(first.has_value());
  EXPECT_TRUE(first->is_pair());
  EXPECT_EQ(first->batch_size(), 2);
}

TEST(IterableLoader, SeekReadsAndDrops) {
  auto loader = fulgur::make_iterable_loader(three_batches());
  loader->seek(0, 2);
  EXPECT_EQ(loader->position(), 2);
  auto batch = loader->next();
  ASSERT_TRUE(batch.has_value());
  EXPECT_THAT(to_vector(batch->tensor()), ElementsAre(2, 2));
  EXPECT_FALSE(loader->next().has_value());
}

TEST(IterableLoader, SeekPastTheEndIsACheckpointError) {
  auto loader = fulgur::make_iterable_loader(three_batches());
  EXPECT_THROWS_WITH(fulgur::CheckpointError, loader->seek(0, 5), {"5", "only 3"});
}

TEST(IterableLoader, FactoryReceivesTheEpoch) {
  auto loader = fulgur::make_iterable_loader([](int64_t epoch) -> fulgur::BatchGenerator {
    return [epoch, i = int64_t{0}]() mutable -> std::optional<fulgur::Batch> {
      if (i >= 2) return std::nullopt;
      ++i;
      return fulgur::Batch(torch::full({1}, epoch, torch::kLong));
    };
  });
  EXPECT_EQ(loader->num_batches(), std::nullopt);
  EXPECT_THAT(flatten(read_epoch(*loader, 4)), ElementsAre(4, 4));
  EXPECT_THAT(flatten(read_epoch(*loader, 7)), ElementsAre(7, 7));
}

TEST(IterableLoader, CannotBeSharded) {
  auto loader = fulgur::make_iterable_loader(three_batches());
  EXPECT_FALSE(loader->set_shard(0, 2));
}

TEST(IterableLoader, EmptyFactoryIsAConfigError) {
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::make_iterable_loader(nullptr), {"factory"});
}

}  // namespace

// ---- Worker threads.

namespace {

/// x[i] = i plus noise drawn from sample_generator(i) (an augmentation);
/// throws for sample `bad` when set. Each sample costs a little CPU time.
class AugmentedDataset : public fulgur::Dataset {
 public:
  explicit AugmentedDataset(int64_t n, int64_t bad = -1) : n_(n), bad_(bad) {}
  int64_t size() const override { return n_; }
  fulgur::Batch get_batch(const at::Tensor& indices) const override {
    std::vector<at::Tensor> rows;
    const auto* p = indices.data_ptr<int64_t>();
    for (int64_t k = 0; k < indices.numel(); ++k) {
      if (p[k] == bad_) throw std::runtime_error("cannot decode image " + std::to_string(p[k]));
      auto noise = torch::rand({8}, fulgur::sample_generator(p[k]));
      rows.push_back(noise.cumsum(0) + static_cast<double>(p[k]));
    }
    return fulgur::Batch(torch::stack(rows));
  }

 private:
  int64_t n_;
  int64_t bad_;
};

/// Every batch of epochs 0 and 1, in order.
std::vector<at::Tensor> two_epochs(fulgur::DataLoader& loader) {
  std::vector<at::Tensor> out;
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    loader.start_epoch(epoch);
    while (auto batch = loader.next()) out.push_back(batch->tensor());
  }
  return out;
}

}  // namespace

TEST(DataLoaderWorkers, TheSameBatchesForZeroOneAndThreeWorkers) {
  std::vector<std::vector<at::Tensor>> runs;
  for (int64_t workers : {0, 1, 3}) {
    for (bool persistent : {false, true}) {
      if (workers == 0 && persistent) continue;  // no workers to keep
      auto loader = fulgur::make_data_loader(
          std::make_shared<AugmentedDataset>(45),
          {.batch_size = 4, .shuffle = true, .seed = 7, .num_workers = workers,
           .prefetch_factor = 2, .persistent_workers = persistent});
      runs.push_back(two_epochs(*loader));
    }
  }
  ASSERT_EQ(runs[0].size(), 2u * 12u);
  EXPECT_FALSE(torch::equal(runs[0][0], runs[0][12])) << "epochs differ (shuffle, augmentation)";
  for (size_t r = 1; r < runs.size(); ++r) {
    ASSERT_EQ(runs[r].size(), runs[0].size()) << "run " << r;
    for (size_t b = 0; b < runs[0].size(); ++b) {
      EXPECT_TRUE(torch::equal(runs[r][b], runs[0][b])) << "run " << r << ", batch " << b;
    }
  }
}

TEST(DataLoaderWorkers, ASeekMidEpochGivesTheRestOfTheSameEpoch) {
  auto reference = fulgur::make_data_loader(std::make_shared<AugmentedDataset>(30),
                                            {.batch_size = 3, .shuffle = true, .seed = 3});
  auto workers = fulgur::make_data_loader(
      std::make_shared<AugmentedDataset>(30),
      {.batch_size = 3, .shuffle = true, .seed = 3, .num_workers = 3});
  workers->start_epoch(1);
  (void)workers->next();  // in flight: batches the seek drops
  reference->seek(1, 4);
  workers->seek(1, 4);
  int64_t compared = 0;
  while (auto expected = reference->next()) {
    auto got = workers->next();
    ASSERT_TRUE(got.has_value());
    EXPECT_TRUE(torch::equal(got->tensor(), expected->tensor())) << "batch " << 4 + compared;
    ++compared;
  }
  EXPECT_EQ(compared, 10 - 4);
  EXPECT_FALSE(workers->next().has_value());
}

// Threads of this process.
int64_t thread_count() {
  int64_t n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    (void)entry;
    ++n;
  }
  return n;
}

// Released workers (the loop is done with the epoch for now) end and drop
// what they loaded ahead; the next batch of the same epoch comes from the
// loader's position. A fit whose epochs a limit cuts (limit_train_batches)
// releases them at each epoch's end, as an evaluation does at its pass's
// end: they stayed alive, holding their prefetched batches, until the
// loader was destroyed. Persistent workers stay.
TEST(DataLoaderWorkers, WorkersReleasedAtAnEpochsEndEndUnlessPersistent) {
  auto reference = fulgur::make_data_loader(std::make_shared<AugmentedDataset>(30),
                                            {.batch_size = 3, .shuffle = true, .seed = 3});
  auto workers =
      fulgur::make_data_loader(std::make_shared<AugmentedDataset>(30),
                               {.batch_size = 3, .shuffle = true, .seed = 3, .num_workers = 2});
  reference->start_epoch(0);
  workers->start_epoch(0);
  for (int k = 0; k < 2; ++k) {
    auto expected = reference->next();
    auto got = workers->next();
    ASSERT_TRUE(got && expected);
    EXPECT_TRUE(torch::equal(got->tensor(), expected->tensor()));
  }
  const int64_t with_workers = thread_count();
  workers->release_workers();
  EXPECT_EQ(thread_count(), with_workers - 2);
  int64_t compared = 2;
  while (auto expected = reference->next()) {
    auto got = workers->next();
    ASSERT_TRUE(got.has_value()) << "batch " << compared;
    EXPECT_TRUE(torch::equal(got->tensor(), expected->tensor())) << "batch " << compared;
    ++compared;
  }
  EXPECT_EQ(compared, 10);

  // In a fit cut by a limit, and in its validations.
  for (const bool persistent : {false, true}) {
    SCOPED_TRACE(persistent ? "persistent" : "not persistent");
    fulgur::test::TempDir dir;
    auto options = fulgur::test::test_options(dir);
    options.max_epochs = 2;
    options.limit_train_batches = 2;
    options.limit_val_batches = 1;
    auto data = fulgur::test::regression_dataset(40);
    auto fit = [&](int64_t num_workers) {
      fulgur::test::LinearRegression model;
      const fulgur::DataLoaderOptions loading{.batch_size = 4,
                                              .num_workers = num_workers,
                                              .persistent_workers = persistent && num_workers > 0};
      auto train = fulgur::make_data_loader(data, loading);
      auto val = fulgur::make_data_loader(data, loading);
      fulgur::Trainer(options).fit(model, train, val);
      return std::make_pair(thread_count(), std::make_pair(train, val));
    };
    // A fit without workers first: LibTorch's own thread pools start in it.
    const int64_t before = fit(0).first;
    const auto [after, loaders] = fit(2);
    EXPECT_EQ(after, before + (persistent ? 4 : 0));
  }
}

TEST(DataLoaderWorkers, AWorkersExceptionNamesTheSampleInTheTrainingThread) {
  for (int64_t workers : {0, 3}) {
    auto loader = fulgur::make_data_loader(std::make_shared<AugmentedDataset>(40, /*bad=*/13),
                                           {.batch_size = 4, .num_workers = workers});
    loader->start_epoch(0);
    try {
      while (loader->next()) {
      }
      FAIL() << "no error with " << workers << " workers";
    } catch (const fulgur::DataLoaderError& e) {
      EXPECT_TRUE(fulgur::test::message_contains(
          e.what(), {"sample 13 (batch 3 of epoch 0)", "cannot decode image 13"}))
          << e.what();
    }
    // The loader still works for the next epoch.
    auto good = fulgur::make_data_loader(std::make_shared<AugmentedDataset>(8),
                                         {.batch_size = 4, .num_workers = workers});
    EXPECT_EQ(two_epochs(*good).size(), 4u);
  }
}

TEST(DataLoaderWorkers, BadOptionsAreNamed) {
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::make_data_loader(index_dataset(4), {.persistent_workers = true}),
                     {"num_workers = 0", "persistent_workers = true", "set num_workers"});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::make_data_loader(index_dataset(4), {.num_workers = -1}),
                     {"num_workers = -1", "num_workers must be >= 0"});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::make_data_loader(index_dataset(4), {.num_workers = 2, .prefetch_factor = 0}),
                     {"prefetch_factor = 0", "prefetch_factor >= 1"});
}

TEST(DataLoaderWorkers, SampleGeneratorDependsOnSeedEpochAndIndexOnly) {
  auto draw = [](int64_t i) { return torch::rand({4}, fulgur::sample_generator(i)); };
  EXPECT_TRUE(torch::equal(draw(5), draw(5)));
  EXPECT_FALSE(torch::equal(draw(5), draw(6)));
}

TEST(DataLoaderWorkers, PinMemoryPinsTheBatchesWhereCudaIsAvailable) {
  auto loader = fulgur::make_data_loader(std::make_shared<AugmentedDataset>(8),
                                         {.batch_size = 4, .num_workers = 2, .pin_memory = true});
  loader->start_epoch(0);
  auto batch = loader->next();
  ASSERT_TRUE(batch.has_value());
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA here: pin_memory applies only where CUDA is available";
  }
  EXPECT_TRUE(batch->tensor().is_pinned());
}

// A fork (the ddp_fork launcher's, a user's) of a process whose loader has
// started its worker threads, loads in flight: the child has none of those
// threads, and its loader waited forever for their batches. It goes on
// with threads of its own, from the batch it had reached, and so does the
// parent.
TEST(DataLoaderWorkers, AForkedChildReadsOnWithThreadsOfItsOwn) {
  struct Slow : fulgur::Dataset {
    int64_t size() const override { return 20; }
    fulgur::Batch get_batch(const at::Tensor& indices) const override {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return fulgur::Batch(indices.clone());
    }
  };
  auto loader = fulgur::make_data_loader(std::make_shared<Slow>(),
                                         {.batch_size = 2, .num_workers = 2, .prefetch_factor = 2});
  loader->start_epoch(0);
  ASSERT_TRUE(loader->next().has_value());
  std::vector<int64_t> rest(18), all(20);
  std::iota(rest.begin(), rest.end(), 2);
  std::iota(all.begin(), all.end(), 0);
  const auto child = fulgur::test::run_in_child(
      [&] {
        if (read_rest(*loader) != rest) return 1;
        loader->start_epoch(1);
        return read_rest(*loader) == all ? 0 : 2;
      },
      std::chrono::seconds(30));
  EXPECT_EQ(child.exit_code, 0) << child.describe();
  EXPECT_EQ(read_rest(*loader), rest);
}

// A dataset whose tensors live on the GPU: pin_memory leaves its batches
// there (it pinned them, a copy to the host and a c10::Error or a copy back).
TEST(DataLoaderWorkers, ABatchOnTheGpuIsNotPinned_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  for (const int64_t workers : {0, 2}) {
    auto loader = fulgur::make_data_loader(
        std::make_shared<fulgur::TensorDataset>(
            std::vector<at::Tensor>{torch::arange(8, torch::kLong).cuda()}),
        {.batch_size = 4, .num_workers = workers, .pin_memory = true});
    loader->start_epoch(0);
    auto batch = loader->next();
    ASSERT_TRUE(batch.has_value());
    EXPECT_TRUE(batch->tensor().is_cuda()) << workers << " workers";
  }
}
