// validate, test and predict.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::only;
using fulgur::test::parameters_equal;
using fulgur::test::regression_dataset;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using fulgur::test::uneven_loader;
using ::testing::ElementsAre;

/// The MSE over the whole dataset, computed outside fulgur.
double full_mse(LinearRegression& model) {
  torch::NoGradGuard no_grad;
  auto data = regression_dataset(10);
  return torch::nn::functional::mse_loss(model.forward(data->tensors()[0]), data->tensors()[1])
      .item<double>();
}

TEST(Evaluation, PredictReturnsOneBatchPerBatchInOrder) {
  TempDir dir;
  torch::manual_seed(1);
  LinearRegression model;
  fulgur::Trainer trainer(test_options(dir));
  auto predictions = trainer.predict(model, uneven_loader());
  ASSERT_EQ(predictions.size(), 3u);
  EXPECT_EQ(model.predict_steps, 3);
  EXPECT_EQ(predictions[0].batch_size(), 4);
  EXPECT_EQ(predictions[1].batch_size(), 4);
  EXPECT_EQ(predictions[2].batch_size(), 2);
  auto x = regression_dataset(10)->tensors()[0];
  torch::NoGradGuard no_grad;
  auto expected = model.forward(x);
  auto got =
      torch::cat({predictions[0].tensor(), predictions[1].tensor(), predictions[2].tensor()});
  EXPECT_TRUE(torch::allclose(got.detach(), expected, 1e-6, 1e-7));
}

TEST(Evaluation, PredictHooksAndLimit) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.limit_predict_batches = 2;
  fulgur::Trainer trainer(options);
  auto predictions = trainer.predict(model, uneven_loader());
  EXPECT_EQ(predictions.size(), 2u);
  EXPECT_THAT(
      only(model.events, {"on_predict_epoch_start", "predict_step", "on_predict_epoch_end"}),
      ElementsAre("on_predict_epoch_start", "predict_step", "predict_step",
                  "on_predict_epoch_end"));
}

TEST(Evaluation, TestReturnsTheLoggedMetricsWeightedByBatchSize) {
  TempDir dir;
  torch::manual_seed(1);
  LinearRegression model;
  fulgur::Trainer trainer(test_options(dir));
  auto metrics = trainer.test(model, uneven_loader());
  EXPECT_EQ(model.test_steps, 3);
  ASSERT_EQ(metrics.count("test_loss"), 1u);
  // Batch means weighted by 4, 4, 2 are the mean over all 10 samples.
  EXPECT_NEAR(metrics.at("test_loss"), full_mse(model), 1e-6);
  EXPECT_THAT(only(model.events, {"on_test_epoch_start", "test_step", "on_test_epoch_end"}),
              ElementsAre("on_test_epoch_start", "test_step", "test_step", "test_step",
                          "on_test_epoch_end"));
}

TEST(Evaluation, ValidateReturnsTheValidationMetrics) {
  TempDir dir;
  torch::manual_seed(1);
  LinearRegression model;
  fulgur::Trainer trainer(test_options(dir));
  auto metrics = trainer.validate(model, uneven_loader());
  EXPECT_EQ(model.validation_steps, 3);
  EXPECT_EQ(model.sanity_steps, 0);
  EXPECT_NEAR(metrics.at("val_loss"), full_mse(model), 1e-6);
  EXPECT_FALSE(model.validated_in_training_mode);
  EXPECT_THAT(only(model.events,
                   {"on_validation_epoch_start", "validation_step", "on_validation_epoch_end"}),
              ElementsAre("on_validation_epoch_start", "validation_step", "validation_step",
                          "validation_step", "on_validation_epoch_end"));
}

TEST(Evaluation, LimitTestBatches) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.limit_test_batches = 2;
  fulgur::Trainer trainer(options);
  trainer.test(model, uneven_loader());
  EXPECT_EQ(model.test_steps, 2);
}

TEST(Evaluation, EvaluationDoesNotChangeTheParameters) {
  TempDir dir;
  torch::manual_seed(1);
  LinearRegression model;
  LinearRegression copy;
  fulgur::test::copy_parameters(model, copy);
  fulgur::Trainer trainer(test_options(dir));
  trainer.validate(model, uneven_loader());
  trainer.test(model, uneven_loader());
  trainer.predict(model, uneven_loader());
  EXPECT_TRUE(parameters_equal(model, copy));
  EXPECT_EQ(model.count("configure_optimizers"), 0);
}

TEST(Evaluation, StageIsReportedDuringEachRun) {
  TempDir dir;
  LinearRegression model;
  std::vector<fulgur::Stage> stages;
  model.val_hook = [&](LinearRegression& self, fulgur::Batch&, int64_t) {
    stages.push_back(self.trainer().stage());
  };
  model.test_hook = model.val_hook;
  fulgur::Trainer trainer(test_options(dir));
  trainer.validate(model, fulgur::test::regression_loader(1));
  trainer.test(model, fulgur::test::regression_loader(1));
  EXPECT_THAT(stages, ElementsAre(fulgur::Stage::kValidate, fulgur::Stage::kTest));
}

TEST(Evaluation, NoDataIsAConfigError) {
  TempDir dir;
  LinearRegression model;
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.validate(model, nullptr),
                     {"validate", "no data"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.test(model, nullptr), {"test", "no data"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.predict(model, nullptr), {"predict", "no data"});
}

// Under the fork launcher the calling process is not a rank and gets back
// only what rank 0 sends: predictions cannot travel, so predict is refused
// before any rank starts (nothing runs, nothing is predicted).
TEST(Evaluation, PredictUnderTheForkLauncherIsRefusedBeforeAnyRankStarts) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.accelerator = "cpu";
  options.strategy = "ddp_fork";
  options.devices = 2;
  fulgur::Trainer trainer(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.predict(model, uneven_loader()),
                     {"Trainer.predict under strategy \"ddp_fork\" (launcher fork)",
                      "never come back to this process", "strategy=\"ddp\""});
  EXPECT_EQ(model.predict_steps, 0);
  EXPECT_FALSE(model.has_trainer());
}

TEST(Evaluation, ModuleWithoutTestStepIsAConfigError) {
  class NoTestStep : public fulgur::Module {
   public:
    NoTestStep() : fulgur::Module("NoTestStep") {}
  };
  TempDir dir;
  NoTestStep model;
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.test(model, fulgur::test::regression_loader(1)),
                     {"NoTestStep", "test_step"});
}

}  // namespace
