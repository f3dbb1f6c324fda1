#include "fulgur/data/data_module.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::only;
using fulgur::test::RecordingDataModule;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using fulgur::test::with_prefix;
using ::testing::ElementsAre;

// Stage events without prepare_data (fit is the stage that must call it).
std::vector<std::string> stage_events(const RecordingDataModule& data) {
  std::vector<std::string> out;
  for (const auto& e : data.events) {
    if (e.rfind("setup:", 0) == 0 || e.rfind("teardown:", 0) == 0) out.push_back(e);
  }
  return out;
}

TEST(DataModule, StageNames) {
  EXPECT_STREQ(fulgur::to_string(fulgur::Stage::kFit), "fit");
  EXPECT_STREQ(fulgur::to_string(fulgur::Stage::kValidate), "validate");
  EXPECT_STREQ(fulgur::to_string(fulgur::Stage::kTest), "test");
  EXPECT_STREQ(fulgur::to_string(fulgur::Stage::kPredict), "predict");
}

TEST(DataModule, FitPreparesOnceThenSetsUpAndTearsDownFit) {
  TempDir dir;
  LinearRegression model;
  RecordingDataModule data(/*train_batches=*/3, /*val_batches=*/2);
  auto options = test_options(dir);
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, data);
  EXPECT_THAT(only(data.events, {"prepare_data", "setup:fit", "teardown:fit"}),
              ElementsAre("prepare_data", "setup:fit", "teardown:fit"));
  // prepare_data comes before setup, loaders after setup and before teardown.
  EXPECT_EQ(data.events.front(), "prepare_data");
  EXPECT_EQ(data.events.back(), "teardown:fit");
  EXPECT_EQ(std::count(data.events.begin(), data.events.end(), "train_dataloader"), 1);
  EXPECT_EQ(model.training_steps, 6);
  EXPECT_EQ(model.validation_steps, 4);  // val_dataloader was used
}

TEST(DataModule, ValidateUsesTheValidateStage) {
  TempDir dir;
  LinearRegression model;
  RecordingDataModule data(3, 2);
  fulgur::Trainer trainer(test_options(dir));
  auto metrics = trainer.validate(model, data);
  EXPECT_THAT(stage_events(data), ElementsAre("setup:validate", "teardown:validate"));
  EXPECT_THAT(with_prefix(data.events, "train_"), ::testing::IsEmpty());
  EXPECT_EQ(model.validation_steps, 2);
  EXPECT_EQ(metrics.count("val_loss"), 1u);
}

TEST(DataModule, TestUsesTheTestStage) {
  TempDir dir;
  LinearRegression model;
  RecordingDataModule data(3, 2);
  fulgur::Trainer trainer(test_options(dir));
  trainer.test(model, data);
  EXPECT_THAT(stage_events(data), ElementsAre("setup:test", "teardown:test"));
  EXPECT_EQ(model.test_steps, 2);
}

TEST(DataModule, PredictUsesThePredictStage) {
  TempDir dir;
  LinearRegression model;
  RecordingDataModule data(3, 2);
  fulgur::Trainer trainer(test_options(dir));
  auto predictions = trainer.predict(model, data);
  EXPECT_THAT(stage_events(data), ElementsAre("setup:predict", "teardown:predict"));
  EXPECT_EQ(predictions.size(), 2u);
}

TEST(DataModule, NoValidationLoaderMeansNoValidation) {
  TempDir dir;
  LinearRegression model;
  RecordingDataModule data(/*train_batches=*/2, /*val_batches=*/0);
  fulgur::Trainer trainer(test_options(dir));
  trainer.fit(model, data);
  EXPECT_EQ(model.validation_steps + model.sanity_steps, 0);
}

TEST(DataModule, MissingTrainLoaderIsAConfigError) {
  struct NoTrain : fulgur::DataModule {};
  TempDir dir;
  LinearRegression model;
  NoTrain data;
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, data), {"train_dataloader"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.test(model, data), {"test_dataloader"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.predict(model, data), {"predict_dataloader"});
  EXPECT_EQ(model.training_steps, 0);
}

TEST(DataModule, ValidateWithoutValidationLoaderIsAConfigError) {
  struct NoVal : fulgur::DataModule {};
  TempDir dir;
  LinearRegression model;
  NoVal data;
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.validate(model, data),
                     {"validate", "val_dataloader"});
}

// ---- reload_dataloaders_every_n_epochs.

/// Loaders that grow with the epoch they are made for: 2 + e shuffled
/// training batches and 1 + e validation batches at DataModule::
/// current_epoch() e. Records the epoch of every loader it makes.
struct GrowingData : fulgur::DataModule {
  std::shared_ptr<fulgur::DataLoader> train_dataloader() override {
    train_epochs.push_back(current_epoch());
    return regression_loader(2 + current_epoch(), /*batch_size=*/2, /*shuffle=*/true);
  }
  std::shared_ptr<fulgur::DataLoader> val_dataloader() override {
    val_epochs.push_back(current_epoch());
    return regression_loader(1 + current_epoch());
  }
  std::vector<int64_t> train_epochs, val_epochs;
};

TEST(DataModule, ReloadsItsLoadersEveryNEpochsForTheEpochTheyAreMadeFor) {
  TempDir dir;
  LinearRegression model;
  std::map<int64_t, int64_t> batches;
  model.train_hook = [&](LinearRegression& m, fulgur::Batch&, int64_t) {
    ++batches[m.current_epoch()];
  };
  GrowingData data;
  auto options = test_options(dir);
  options.max_epochs = 5;
  options.seed = 3;
  options.reload_dataloaders_every_n_epochs = 2;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, data);
  EXPECT_THAT(data.train_epochs, ElementsAre(0, 2, 4));
  EXPECT_THAT(data.val_epochs, ElementsAre(0, 2, 4));
  EXPECT_THAT(batches, ElementsAre(std::pair<const int64_t, int64_t>{0, 2}, std::pair{1, 2},
                                   std::pair{2, 4}, std::pair{3, 4}, std::pair{4, 6}));
  EXPECT_EQ(result.global_step, 18);
  // Each epoch validated on the loader made for it (a sanity batch first).
  EXPECT_EQ(model.sanity_steps, 1);
  EXPECT_EQ(model.validation_steps, 1 + 1 + 3 + 3 + 5);
  // Another stage makes its loaders for epoch 0 again.
  trainer.validate(model, data);
  EXPECT_EQ(data.val_epochs.back(), 0);

  // Off (0): made once per fit.
  GrowingData once;
  options.reload_dataloaders_every_n_epochs = 0;
  LinearRegression plain;
  fulgur::Trainer(options).fit(plain, once);
  EXPECT_THAT(once.train_epochs, ElementsAre(0));
  EXPECT_EQ(plain.training_steps, 5 * 2);
}

TEST(DataModule, AResumedFitTrainsOnTheLoadersItsEpochHadInTheUninterruptedRun) {
  // Epochs of 2, 2, 4 and 4 batches (reloaded at epochs 0 and 2); a
  // checkpoint every 5 steps: step 5 is in epoch 2, step 10 in epoch 3,
  // whose loaders were made at epoch 2.
  // And one at each epoch's end: epoch=1-step=4 resumes into epoch 2.
  auto options_in = [](const TempDir& root) {
    auto options = test_options(root);
    options.max_epochs = 4;
    options.seed = 11;
    options.reload_dataloaders_every_n_epochs = 2;
    options.enable_checkpointing = true;
    options.callbacks = {
        std::make_shared<fulgur::ModelCheckpoint>(fulgur::ModelCheckpointOptions{
            .dirpath = root.file("steps"), .save_top_k = -1, .every_n_train_steps = 5}),
        std::make_shared<fulgur::ModelCheckpoint>(fulgur::ModelCheckpointOptions{
            .dirpath = root.file("epochs"), .save_top_k = -1, .every_n_epochs = 1})};
    return options;
  };
  TempDir whole;
  LinearRegression uninterrupted({.momentum = 0.9});
  GrowingData data;
  auto full = fulgur::Trainer(options_in(whole)).fit(uninterrupted, data);
  ASSERT_EQ(full.global_step, 12);
  for (const char* name :
       {"steps/epoch=2-step=5.ckpt", "steps/epoch=3-step=10.ckpt", "epochs/epoch=1-step=4.ckpt"}) {
    SCOPED_TRACE(name);
    TempDir other;
    LinearRegression resumed({.momentum = 0.9});
    GrowingData again;
    auto result =
        fulgur::Trainer(options_in(other)).fit(resumed, again, {.ckpt_path = whole.file(name)});
    EXPECT_EQ(result.global_step, 12);
    // Made for epoch 0 when the fit starts, then for epoch 2 when the
    // checkpoint says where the run is.
    EXPECT_THAT(again.train_epochs, ElementsAre(0, 2));
    EXPECT_TRUE(fulgur::test::parameters_equal(uninterrupted, resumed));
  }
}

/// A ModelCheckpoint that records the training batches of each epoch at
/// its end.
struct EpochEndBatches : fulgur::ModelCheckpoint {
  using fulgur::ModelCheckpoint::ModelCheckpoint;
  void on_train_epoch_end(fulgur::Trainer& trainer, fulgur::Module& module) override {
    seen[trainer.current_epoch()] = trainer.num_training_batches();
    fulgur::ModelCheckpoint::on_train_epoch_end(trainer, module);
  }
  std::map<int64_t, int64_t> seen;
};

// Resumed from a checkpoint of an epoch's end that a second ModelCheckpoint
// had not reached, the resume runs that one's epoch end with the loaders
// of the epoch that ended, as the uninterrupted run did (it ran with the
// next epoch's, made before).
TEST(DataModule, AResumedEpochsEndSeesTheLoadersOfTheEpochThatEnded) {
  auto fit = [](const TempDir& root, const std::string& ckpt_path, LinearRegression& model,
                GrowingData& data) {
    auto options = test_options(root);
    options.max_epochs = 3;
    options.seed = 5;
    options.reload_dataloaders_every_n_epochs = 1;
    options.enable_checkpointing = true;
    auto recorder = std::make_shared<EpochEndBatches>(fulgur::ModelCheckpointOptions{
        .dirpath = root.file("b"), .mode = "max", .save_top_k = -1, .save_last = false});
    options.callbacks = {std::make_shared<fulgur::ModelCheckpoint>(fulgur::ModelCheckpointOptions{
                             .dirpath = root.file("a"), .save_top_k = -1, .save_last = false}),
                         recorder};
    fulgur::Trainer(options).fit(model, data, {.ckpt_path = ckpt_path});
    return recorder->seen;
  };
  TempDir whole;
  LinearRegression uninterrupted;
  GrowingData data;
  // Epochs of 2, 3 and 4 batches.
  const std::map<int64_t, int64_t> expected = {{0, 2}, {1, 3}, {2, 4}};
  ASSERT_EQ(fit(whole, "", uninterrupted, data), expected);
  TempDir other;
  LinearRegression resumed;
  GrowingData again;
  EXPECT_EQ(fit(other, whole.file("a/epoch=0-step=2.ckpt"), resumed, again), expected);
  EXPECT_THAT(again.train_epochs, ElementsAre(0, 1, 2));
  EXPECT_TRUE(fulgur::test::parameters_equal(uninterrupted, resumed));
}

TEST(DataModule, ReloadingNeedsADataModuleAndATrainingLoaderForEveryEpoch) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.reload_dataloaders_every_n_epochs = 1;
  EXPECT_THROWS_WITH(
      fulgur::ConfigError, fulgur::Trainer(options).fit(model, regression_loader(2)),
      {"reload_dataloaders_every_n_epochs=1", "fit was given its loaders", "Pass a DataModule"});
  struct ShortLived : fulgur::DataModule {
    std::shared_ptr<fulgur::DataLoader> train_dataloader() override {
      return current_epoch() < 2 ? regression_loader(2) : nullptr;
    }
  };
  ShortLived data;
  options.max_epochs = 3;
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer(options).fit(model, data),
                     {"train_dataloader() returned no loader for epoch 2"});
  EXPECT_EQ(model.training_steps, 4);

  // A reloaded loader that breaks a check made against the first one's
  // length: the error says which loaders.
  struct Shrinking : fulgur::DataModule {
    std::shared_ptr<fulgur::DataLoader> train_dataloader() override {
      return regression_loader(current_epoch() == 0 ? 4 : 2);
    }
    std::shared_ptr<fulgur::DataLoader> val_dataloader() override { return regression_loader(1); }
  };
  Shrinking shrinking;
  options.val_check_interval = 3;
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer(options).fit(model, shrinking),
                     {"reload_dataloaders_every_n_epochs=1, the loaders made for epoch 1",
                      "val_check_interval=3 is larger than the 2 training batches"});
}

}  // namespace
