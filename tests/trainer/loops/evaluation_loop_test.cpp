// validate, test and predict.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>

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

// Records every evaluation hook of a callback into the module's events,
// with the mode the module is in at the start hooks.
class EvaluationHooks : public fulgur::Callback {
 public:
  explicit EvaluationHooks(std::vector<std::string>* events) : events_(events) {}
  std::string state_key() const override { return "EvaluationHooks"; }
  void on_validation_start(fulgur::Trainer&, fulgur::Module& m) override { start("validation", m); }
  void on_validation_end(fulgur::Trainer&, fulgur::Module&) override { add("validation_end"); }
  void on_validation_epoch_start(fulgur::Trainer&, fulgur::Module&) override {
    add("validation_epoch_start");
  }
  void on_validation_epoch_end(fulgur::Trainer&, fulgur::Module&) override {
    add("validation_epoch_end");
  }
  void on_test_start(fulgur::Trainer&, fulgur::Module& m) override { start("test", m); }
  void on_test_end(fulgur::Trainer&, fulgur::Module&) override { add("test_end"); }
  void on_test_epoch_start(fulgur::Trainer&, fulgur::Module&) override { add("test_epoch_start"); }
  void on_test_epoch_end(fulgur::Trainer&, fulgur::Module&) override { add("test_epoch_end"); }
  void on_predict_start(fulgur::Trainer&, fulgur::Module& m) override { start("predict", m); }
  void on_predict_end(fulgur::Trainer&, fulgur::Module&) override { add("predict_end"); }

 private:
  void start(const std::string& stage, fulgur::Module& m) {
    add(stage + "_start" + (m.is_training() ? " (train mode)" : ""));
  }
  void add(const std::string& hook) { events_->push_back("cb:" + hook); }
  std::vector<std::string>* events_;
};

// Trainer::validate, test and predict call their callbacks' start and end
// hooks (and epoch hooks after the module's), as fit's validation does.
TEST(Evaluation, EveryStageCallsItsCallbacksStartEpochAndEndHooks) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.callbacks = {std::make_shared<EvaluationHooks>(&model.events)};
  fulgur::Trainer trainer(options);
  auto hooks = [&] {
    std::vector<std::string> seen;
    for (const auto& e : model.events) {
      if (e.rfind("cb:", 0) == 0 || e.find("epoch_start") != std::string::npos) seen.push_back(e);
    }
    model.events.clear();
    return seen;
  };
  trainer.validate(model, uneven_loader());
  EXPECT_THAT(hooks(),
              ElementsAre("cb:validation_start", "on_validation_epoch_start",
                          "cb:validation_epoch_start", "cb:validation_epoch_end",
                          "cb:validation_end"));
  trainer.test(model, uneven_loader());
  EXPECT_THAT(hooks(), ElementsAre("cb:test_start", "on_test_epoch_start", "cb:test_epoch_start",
                                   "cb:test_epoch_end", "cb:test_end"));
  trainer.predict(model, uneven_loader());
  EXPECT_THAT(hooks(),
              ElementsAre("cb:predict_start", "on_predict_epoch_start", "cb:predict_end"));
  // Fit's validation (sanity check, then the epoch's): the same hooks.
  trainer.fit(model, uneven_loader(), uneven_loader());
  const auto fit = hooks();
  EXPECT_EQ(std::count(fit.begin(), fit.end(), "cb:validation_start"), 2);
  EXPECT_EQ(std::count(fit.begin(), fit.end(), "cb:validation_epoch_start"), 2);
  EXPECT_EQ(std::count(fit.begin(), fit.end(), "cb:validation_end"), 2);
}

// A standalone validate after fit is no part of the fit: ModelCheckpoint
// saves nothing, EarlyStopping counts nothing, and EMA does not swap its
// average in (the module's own weights are evaluated).
TEST(Evaluation, AStandaloneValidateSavesStopsAndSwapsNothing) {
  TempDir dir;
  torch::manual_seed(1);
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.enable_checkpointing = true;
  auto checkpoint = std::make_shared<fulgur::ModelCheckpoint>(
      fulgur::ModelCheckpointOptions{.monitor = "val_loss", .save_top_k = -1});
  // A min_delta no change meets: every check after the first counts.
  auto stopping = std::make_shared<fulgur::EarlyStopping>(
      fulgur::EarlyStoppingOptions{.monitor = "val_loss", .min_delta = 1e9, .patience = 100});
  options.callbacks = {checkpoint, stopping,
                       std::make_shared<fulgur::EMA>(
                           fulgur::EMAOptions{.decay = 0.5, .apply_at_end = false})};
  fulgur::Trainer trainer(options);
  trainer.fit(model, uneven_loader(), uneven_loader());
  const auto files = fulgur::test::list_files(dir.file("checkpoints"));
  const int64_t waited = stopping->wait_count();
  ASSERT_EQ(waited, 1);  // the fit's second check
  auto metrics = trainer.validate(model, uneven_loader());
  EXPECT_EQ(fulgur::test::list_files(dir.file("checkpoints")), files);
  EXPECT_EQ(stopping->wait_count(), waited);
  EXPECT_NEAR(metrics.at("val_loss"), full_mse(model), 1e-6);
}

// Each submodule's mode comes back as it was after an evaluation, as
// Lightning's: a submodule kept in eval mode (a frozen BatchNorm) stayed in
// train mode after a validation within the epoch (train(true) of the
// whole module), and a standalone validate, test or predict left the
// module in eval mode.
TEST(Evaluation, EachSubmodulesModeComesBackAfterAnEvaluation) {
  TempDir dir;
  struct FrozenLayer : LinearRegression {
    void on_train_epoch_start() override {
      LinearRegression::on_train_epoch_start();
      fc->eval();
    }
  } model;
  std::vector<bool> fc_training;
  model.train_hook = [&fc_training](LinearRegression& m, fulgur::Batch&, int64_t) {
    fc_training.push_back(m.fc->is_training());
  };
  auto options = test_options(dir);
  options.val_check_interval = 0.5;
  options.num_sanity_val_steps = 0;
  fulgur::Trainer trainer(options);
  trainer.fit(model, fulgur::test::regression_loader(4), fulgur::test::regression_loader(1));
  EXPECT_EQ(fc_training, std::vector<bool>(4, false));
  EXPECT_TRUE(model.is_training());

  model.train();
  trainer.validate(model, fulgur::test::regression_loader(1));
  EXPECT_TRUE(model.is_training());
  EXPECT_TRUE(model.fc->is_training());
  trainer.test(model, fulgur::test::regression_loader(1));
  trainer.predict(model, fulgur::test::regression_loader(1));
  EXPECT_TRUE(model.fc->is_training());
  model.eval();
  trainer.test(model, fulgur::test::regression_loader(1));
  EXPECT_FALSE(model.is_training());
}

// A stage's callback metrics are its own: after fit then test, the fit's
// train_loss was still in callback_metrics() (what callbacks and the
// progress bar read during the test).
TEST(Evaluation, EachStageStartsWithCallbackMetricsOfItsOwn) {
  TempDir dir;
  LinearRegression model;
  fulgur::Trainer trainer(test_options(dir));
  trainer.fit(model, fulgur::test::regression_loader(2), fulgur::test::regression_loader(1));
  ASSERT_EQ(trainer.callback_metrics().count("train_loss"), 1u);
  trainer.test(model, fulgur::test::regression_loader(1));
  EXPECT_EQ(trainer.callback_metrics().count("train_loss"), 0u);
  EXPECT_EQ(trainer.callback_metrics().count("val_loss"), 0u);
  EXPECT_EQ(trainer.callback_metrics().count("test_loss"), 1u);
}

// A value logged in an evaluation batch's hooks weighs its batch's size in
// the epoch's mean, as in the step (batches of 4, 4 and 2, 1.0 logged at the
// last: 0.2, where it weighed 1 per batch: 0.333).
TEST(Evaluation, TheBatchHooksLogWithTheBatchsSize) {
  struct LogsAtBatchEnd : LinearRegression {
    int64_t batches = 0;
    void on_validation_batch_end(const fulgur::Batch&, int64_t) override {
      log("at_end", ++batches == 3 ? 1.0 : 0.0);
    }
  } model;
  TempDir dir;
  fulgur::Trainer trainer(test_options(dir));
  const auto data = regression_dataset(10);
  const fulgur::Metrics metrics =
      trainer.validate(model, fulgur::make_data_loader(data, {.batch_size = 4}));
  EXPECT_DOUBLE_EQ(metrics.at("at_end"), 0.2);
}

// A value logged per step only in an evaluation went nowhere (not in the
// results, callback metrics or loggers): refused, naming it.
TEST(Evaluation, AValueLoggedPerStepOnlyIsRefused) {
  TempDir dir;
  LinearRegression model;
  model.val_hook = [](LinearRegression& m, fulgur::Batch&, int64_t) {
    m.log("per_step", 1.0, {.on_step = true, .on_epoch = false});
  };
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(
      fulgur::ConfigError, trainer.validate(model, fulgur::test::regression_loader(1)),
      {"log(\"per_step\", on_step=true, on_epoch=false) in an evaluation", "Drop on_step"});
  // Both: its epoch value, as before.
  LinearRegression both;
  both.val_hook = [](LinearRegression& m, fulgur::Batch&, int64_t) {
    m.log("both", 1.0, {.on_step = true, .on_epoch = true});
  };
  EXPECT_EQ(trainer.validate(both, fulgur::test::regression_loader(1)).count("both_epoch"), 1u);
}

// A callback's on_validation_epoch_end runs after the Module's and after
// the epoch's values are published: what it logged went nowhere. Refused,
// naming where to log instead.
TEST(Evaluation, ALogAfterTheEpochsValuesArePublishedIsRefused) {
  struct LateLogger : fulgur::Callback {
    std::string state_key() const override { return "LateLogger"; }
    void on_validation_epoch_end(fulgur::Trainer&, fulgur::Module& module) override {
      module.log("cb_metric", 1.0);
    }
  };
  TempDir dir;
  auto options = test_options(dir);
  options.callbacks = {std::make_shared<LateLogger>()};
  LinearRegression model;
  fulgur::Trainer trainer(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     trainer.validate(model, fulgur::test::regression_loader(1)),
                     {"log(\"cb_metric\"): this epoch's values are already published",
                      "Log it from the Module's epoch-end hook"});
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
