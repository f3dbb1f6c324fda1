#include "fulgur/data/data_module.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::only;
using fulgur::test::RecordingDataModule;
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

}  // namespace
