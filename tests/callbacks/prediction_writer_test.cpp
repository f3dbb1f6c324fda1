// PredictionWriter: its hooks get each prediction with the dataset indices
// of its samples; PredictionFileWriter writes a rank's predictions and reads
// every rank's back in the dataset's order (two real ranks: DDP's
// EveryRanksPredictionsReadBackInTheDatasetsOrder).
#include "fulgur/callbacks/prediction_writer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::TempDir;
using fulgur::test::test_options;

// A shuffled loader over `n` regression samples in batches of `batch_size`.
std::shared_ptr<fulgur::DatasetLoader> shuffled(std::shared_ptr<fulgur::TensorDataset> data,
                                                int64_t batch_size) {
  return fulgur::make_data_loader(std::move(data),
                                  {.batch_size = batch_size, .shuffle = true, .seed = 3});
}

// A Trainer of test_options with `callback` as its one callback.
fulgur::Trainer trainer_with(const TempDir& dir, std::shared_ptr<fulgur::Callback> callback) {
  auto options = test_options(dir);
  options.callbacks = {std::move(callback)};
  return fulgur::Trainer(options);
}

class Recorder : public fulgur::PredictionWriter {
 public:
  using PredictionWriter::PredictionWriter;
  void write_on_batch_end(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch& prediction,
                          const at::Tensor& indices, const fulgur::Batch& batch,
                          int64_t batch_idx) override {
    batch_predictions.push_back(prediction.tensor());
    batch_indices.push_back(indices);
    inputs.push_back(batch.pair().first);
    batch_ids.push_back(batch_idx);
  }
  void write_on_epoch_end(fulgur::Trainer&, fulgur::Module&,
                          const std::vector<fulgur::Batch>& predictions,
                          const std::vector<at::Tensor>& indices) override {
    ++epoch_calls;
    epoch_predictions = predictions;
    epoch_indices = indices;
  }
  std::vector<at::Tensor> batch_predictions, batch_indices, inputs;
  std::vector<int64_t> batch_ids;
  int epoch_calls = 0;
  std::vector<fulgur::Batch> epoch_predictions;
  std::vector<at::Tensor> epoch_indices;
};

TEST(PredictionWriter, GetsEachPredictionWithItsSamplesIndicesAndAllOfThemAtTheEnd) {
  TempDir dir;
  LinearRegression model;
  auto recorder = std::make_shared<Recorder>(fulgur::WriteInterval::kBatchAndEpoch);
  fulgur::Trainer trainer = trainer_with(dir, recorder);
  auto data = fulgur::test::regression_dataset(10);
  const auto returned = trainer.predict(model, shuffled(data, 4));
  EXPECT_EQ(trainer.predict_dataloader(), nullptr);  // only while predict runs
  ASSERT_EQ(recorder->batch_ids, (std::vector<int64_t>{0, 1, 2}));
  std::vector<at::Tensor> all;
  for (size_t b = 0; b < 3; ++b) {
    SCOPED_TRACE(b);
    const at::Tensor& idx = recorder->batch_indices[b];
    ASSERT_TRUE(idx.defined());
    EXPECT_EQ(idx.scalar_type(), torch::kLong);
    // The indices name the batch's samples: their rows are its inputs.
    EXPECT_TRUE(torch::equal(data->tensors()[0].index_select(0, idx), recorder->inputs[b]));
    EXPECT_TRUE(torch::equal(recorder->batch_predictions[b], returned[b].tensor()));
    all.push_back(idx);
  }
  // Every sample once, shuffled.
  const at::Tensor every = torch::cat(all);
  EXPECT_TRUE(torch::equal(std::get<0>(torch::sort(every)), torch::arange(10, torch::kLong)));
  EXPECT_FALSE(torch::equal(every, torch::arange(10, torch::kLong)));
  EXPECT_EQ(recorder->epoch_calls, 1);
  ASSERT_EQ(recorder->epoch_predictions.size(), 3u);
  for (size_t b = 0; b < 3; ++b) {
    EXPECT_TRUE(torch::equal(recorder->epoch_predictions[b].tensor(), returned[b].tensor()));
    EXPECT_TRUE(torch::equal(recorder->epoch_indices[b], all[b]));
  }
}

TEST(PredictionWriter, WritesOnlyAtTheIntervalItWasGiven) {
  TempDir dir;
  for (auto interval : {fulgur::WriteInterval::kBatch, fulgur::WriteInterval::kEpoch}) {
    LinearRegression model;
    auto recorder = std::make_shared<Recorder>(interval);
    fulgur::Trainer trainer = trainer_with(dir, recorder);
    trainer.predict(model, fulgur::test::regression_loader(3));
    const bool batches = interval == fulgur::WriteInterval::kBatch;
    EXPECT_EQ(recorder->batch_ids.size(), batches ? 3u : 0u);
    EXPECT_EQ(recorder->epoch_calls, batches ? 0 : 1);
  }
}

TEST(PredictionWriter, AnIterableLoaderGivesNoIndices) {
  TempDir dir;
  LinearRegression model;
  auto recorder = std::make_shared<Recorder>(fulgur::WriteInterval::kBatch);
  fulgur::Trainer trainer = trainer_with(dir, recorder);
  auto batches = std::make_shared<std::vector<fulgur::Batch>>();
  auto source = fulgur::test::regression_loader(2);
  source->start_epoch(0);
  while (auto b = source->next()) batches->push_back(*b);
  trainer.predict(model, fulgur::make_iterable_loader(batches));
  ASSERT_EQ(recorder->batch_indices.size(), 2u);
  EXPECT_FALSE(recorder->batch_indices[0].defined());
}

TEST(PredictionFileWriter, ReadsOneRanksFileBackInTheDatasetsOrder) {
  TempDir dir;
  LinearRegression model;
  fulgur::Trainer trainer =
      trainer_with(dir, std::make_shared<fulgur::PredictionFileWriter>(dir.file("preds")));
  auto data = fulgur::test::regression_dataset(11);
  trainer.predict(model, shuffled(data, 4));
  EXPECT_TRUE(
      std::filesystem::exists(fulgur::PredictionFileWriter::file_of_rank(dir.file("preds"), 0)));
  const fulgur::Batch read = fulgur::PredictionFileWriter::read(dir.file("preds"));
  ASSERT_TRUE(read.is_tensor());
  torch::NoGradGuard no_grad;
  const at::Tensor in_order = model.forward(data->tensors()[0]);
  ASSERT_EQ(read.tensor().sizes(), in_order.sizes());
  EXPECT_TRUE(torch::allclose(read.tensor(), in_order, /*rtol=*/1e-6, /*atol=*/1e-7));
}

// predict_step returning a map of two tensors: both come back, keyed.
class TwoOutputs : public LinearRegression {
 public:
  fulgur::Batch predict_step(fulgur::Batch& batch, int64_t) override {
    const at::Tensor y = forward(batch.pair().first);
    return fulgur::Batch(fulgur::Batch::Map{{"y", y}, {"twice", 2 * y}});
  }
};

TEST(PredictionFileWriter, KeepsAMapsKeys) {
  TempDir dir;
  TwoOutputs model;
  fulgur::Trainer trainer =
      trainer_with(dir, std::make_shared<fulgur::PredictionFileWriter>(dir.path()));
  trainer.predict(model, shuffled(fulgur::test::regression_dataset(6), 4));
  const fulgur::Batch read = fulgur::PredictionFileWriter::read(dir.path());
  ASSERT_TRUE(read.is_map());
  EXPECT_TRUE(torch::allclose(read["twice"], 2 * read["y"]));
  EXPECT_EQ(read["y"].size(0), 6);
}

TEST(PredictionFileWriter, MissingDamagedAndStaleFilesAreNamed) {
  TempDir dir;
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::PredictionFileWriter(""), {"dirpath=\"\""});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::PredictionFileWriter::read(dir.path()),
                     {"predictions-rank0.pt is missing", "has returned on every rank"});
  LinearRegression model;
  fulgur::Trainer trainer =
      trainer_with(dir, std::make_shared<fulgur::PredictionFileWriter>(dir.path()));
  trainer.predict(model, fulgur::test::regression_loader(2));
  const std::string rank0 = fulgur::PredictionFileWriter::file_of_rank(dir.path(), 0);
  // A rank 1 file left by an earlier run is not read: this run had one rank.
  std::filesystem::copy_file(rank0, fulgur::PredictionFileWriter::file_of_rank(dir.path(), 1));
  EXPECT_EQ(fulgur::PredictionFileWriter::read(dir.path()).tensor().size(0), 4);
  // Files as two runs of two ranks would leave them.
  const std::string two = dir.file("two");
  std::filesystem::create_directories(two);
  auto write = [&](int rank, const std::string& run) {
    fulgur::StateDict state;
    state.set("run", run);
    state.set("rank", static_cast<int64_t>(rank));
    state.set("world_size", static_cast<int64_t>(2));
    state.set("batches", static_cast<int64_t>(0));
    fulgur::TorchCheckpointIO io;
    io.save_checkpoint(state, fulgur::PredictionFileWriter::file_of_rank(two, rank));
  };
  write(0, "a");
  EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::PredictionFileWriter::read(two),
                     {"predictions-rank1.pt is missing", "from a run of more ranks"});
  write(1, "b");
  EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::PredictionFileWriter::read(two),
                     {"predictions-rank1.pt is from another predict run than predictions-rank0.pt",
                      "empty directory"});
  write(1, "a");
  EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::PredictionFileWriter::read(two),
                     {"no rank predicted any batch"});
  // Damaged: the checksum names it.
  {
    std::fstream f(rank0, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    f.put('\x7f');
  }
  EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::PredictionFileWriter::read(dir.path()),
                     {"predictions-rank0.pt is not a predictions file of a PredictionFileWriter, "
                      "or is damaged (",
                      "Predict again into this directory"});
  // Another file in its place (a training checkpoint's state): the same,
  // not advice about resuming.
  {
    fulgur::StateDict other;
    other.set("epoch", int64_t{3});
    fulgur::TorchCheckpointIO io;
    io.save_checkpoint(other, rank0);
  }
  EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::PredictionFileWriter::read(dir.path()),
                     {"predictions-rank0.pt is not a predictions file", "\"run\""});
  // The wrong kind of path: a file for the directory, a directory for a
  // rank's file.
  EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::PredictionFileWriter::read(rank0),
                     {"it is a file, not the directory a PredictionFileWriter wrote to"});
  const std::string holes = dir.file("holes");
  std::filesystem::create_directories(fulgur::PredictionFileWriter::file_of_rank(holes, 0));
  EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::PredictionFileWriter::read(holes),
                     {"predictions-rank0.pt is a directory, not a predictions file"});
}

// A sampler that visits samples 2, 0, 1, 0, 1 of five: the repeats are
// predicted twice (as a padded shard's are) and read back once.
class Repeating : public fulgur::Sampler {
 public:
  at::Tensor epoch_indices(int64_t, int64_t) override {
    return torch::tensor({2, 0, 1, 0, 1}, torch::kLong);
  }
};

TEST(PredictionFileWriter, ASamplePredictedTwiceIsReadOnce) {
  TempDir dir;
  LinearRegression model;
  fulgur::Trainer trainer =
      trainer_with(dir, std::make_shared<fulgur::PredictionFileWriter>(dir.path()));
  auto data = fulgur::test::regression_dataset(5);
  const auto returned = trainer.predict(
      model, fulgur::make_data_loader(data, {.batch_size = 2}, std::make_shared<Repeating>()));
  int64_t rows = 0;
  for (const auto& p : returned) rows += p.batch_size();
  EXPECT_EQ(rows, 5);
  const at::Tensor read = fulgur::PredictionFileWriter::read(dir.path()).tensor();
  torch::NoGradGuard no_grad;
  const at::Tensor in_order = model.forward(data->tensors()[0].slice(0, 0, 3));
  ASSERT_EQ(read.sizes(), in_order.sizes());
  EXPECT_TRUE(torch::allclose(read, in_order, /*rtol=*/1e-6, /*atol=*/1e-7));
}

TEST(PredictionFileWriter, APredictionWithoutABatchDimensionIsRefused) {
  TempDir dir;
  struct Scalar : LinearRegression {
    fulgur::Batch predict_step(fulgur::Batch& batch, int64_t) override {
      return fulgur::Batch(forward(batch.pair().first).sum());
    }
  } model;
  fulgur::Trainer trainer =
      trainer_with(dir, std::make_shared<fulgur::PredictionFileWriter>(dir.path()));
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     trainer.predict(model, fulgur::test::regression_loader(2)),
                     {"tensor 0 of batch 0's prediction has no dimensions"});
}

TEST(PredictionFileWriter, AnEmptyPredictionAndRowsThatDoNotMatchTheSamplesAreRefused) {
  TempDir dir;
  struct Empty : LinearRegression {
    fulgur::Batch predict_step(fulgur::Batch&, int64_t) override { return fulgur::Batch(); }
  } empty;
  fulgur::Trainer trainer =
      trainer_with(dir, std::make_shared<fulgur::PredictionFileWriter>(dir.path()));
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     trainer.predict(empty, fulgur::test::regression_loader(2)),
                     {"batch 0's prediction", "Return the batch's predictions"});
  // A pair whose second tensor has one row for the whole batch.
  struct Summed : LinearRegression {
    fulgur::Batch predict_step(fulgur::Batch& batch, int64_t) override {
      const at::Tensor y = forward(batch.pair().first);
      return fulgur::Batch(y, y.sum(0, /*keepdim=*/true));
    }
  } summed;
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     trainer.predict(summed, fulgur::test::regression_loader(2)),
                     {"tensor 1 of batch 0's prediction has 1 row(s), but the batch has 2 "
                      "sample(s)"});
}

}  // namespace
