// The fit loop's semantics, with exact counts: epochs, steps, limits, the
// validation schedule, the sanity check, fast_dev_run, gradient accumulation
// and the order of hooks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::list_files;
using fulgur::test::only;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using fulgur::test::ValidationRecorder;
using ::testing::ElementsAre;
using ::testing::IsEmpty;

// ---- Run length.

TEST(FitLoop, MaxEpochsRunsEveryBatchOfEveryEpoch) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = 3;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(5));
  EXPECT_EQ(model.training_steps, 15);
  EXPECT_EQ(model.count("on_train_epoch_start"), 3);
  EXPECT_EQ(model.count("on_train_epoch_end"), 3);
  EXPECT_EQ(model.count("on_train_batch_start"), 15);
  EXPECT_EQ(model.count("on_train_batch_end"), 15);
  EXPECT_EQ(model.count("on_fit_start"), 1);
  EXPECT_EQ(model.count("on_fit_end"), 1);
  EXPECT_EQ(model.count("on_train_start"), 1);
  EXPECT_EQ(model.count("on_train_end"), 1);
  EXPECT_EQ(model.count("configure_optimizers"), 1);
  EXPECT_EQ(result.global_step, 15);
  EXPECT_EQ(result.epochs, 3);
  EXPECT_EQ(result.stop_reason, "max_epochs");
  EXPECT_EQ(trainer.global_step(), 15);
  EXPECT_EQ(trainer.current_epoch(), 3);
  EXPECT_EQ(trainer.num_training_batches(), 5);
}

// A loader read before (a fit stopped mid-epoch, a validate that read it to
// its end) starts each epoch of the next fit at its first batch: only a
// checkpoint's resume leaves it where it was.
TEST(FitLoop, ALoaderReadBeforeStartsTheNextFitsEpochAtItsFirstBatch) {
  TempDir dir;
  auto loader = regression_loader(5);
  {
    LinearRegression model;
    auto options = test_options(dir);
    options.max_epochs = std::nullopt;
    options.max_steps = 3;
    fulgur::Trainer trainer(options);
    trainer.fit(model, loader);
    EXPECT_EQ(model.training_steps, 3);
  }
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = 1;
  fulgur::Trainer trainer(options);
  trainer.fit(model, loader);
  EXPECT_EQ(model.training_steps, 5);
  trainer.validate(model, loader);
  LinearRegression again;
  fulgur::Trainer another(options);
  another.fit(again, loader);
  EXPECT_EQ(again.training_steps, 5);
}

// One loader object for training and validation would share one position:
// each validation restarted it and read it to its end, and training went on
// from there (6 of 8 batches after the sanity check; 4 of 16 steps in two
// epochs validating every 2 batches). Refused, with what to pass instead.
TEST(FitLoop, TheTrainingLoaderAsTheValidationLoaderIsRefused) {
  TempDir dir;
  auto loader = regression_loader(8);
  LinearRegression model;
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, loader, loader),
                     {"the validation loader is the training loader (one DataLoader object)",
                      "Pass a second loader for validation"});
  EXPECT_EQ(model.training_steps, 0);
  struct OneLoader : fulgur::DataModule {
    std::shared_ptr<fulgur::DataLoader> loader = regression_loader(8);
    std::shared_ptr<fulgur::DataLoader> train_dataloader() override { return loader; }
    std::shared_ptr<fulgur::DataLoader> val_dataloader() override { return loader; }
  } data;
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, data),
                     {"the DataModule's val_dataloader() returned the loader its "
                      "train_dataloader() returned",
                      "Return a loader of its own from val_dataloader()"});
  // Two loaders over one dataset train every batch.
  fulgur::Trainer two(test_options(dir));
  two.fit(model, regression_loader(8), regression_loader(8));
  EXPECT_EQ(model.training_steps, 8);
}

// A training loader that gives no batch (an empty dataset): said, not a
// silent fit of no steps (its stop reason read "limit_train_batches=0").
TEST(FitLoop, ALoaderOfNoBatchesTrainsNothingAndSaysSo) {
  TempDir dir;
  LinearRegression model;
  fulgur::Trainer trainer(test_options(dir));
  auto empty = fulgur::make_data_loader(
      std::make_shared<fulgur::TensorDataset>(torch::zeros({0, 3}), torch::zeros({0, 1})),
      {.batch_size = 4});
  ::testing::internal::CaptureStderr();
  const auto result = trainer.fit(model, empty);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(model.training_steps, 0);
  EXPECT_EQ(result.stop_reason, "no training batches");
  EXPECT_NE(err.find("the training loader gives no batch in an epoch"), std::string::npos) << err;
}

// configure_optimizers sizes a schedule with estimated_stepping_batches()
// (a OneCycleLR's total_steps): the batches are counted before it (it read
// -1, max_steps unset, where the fit ran 8).
TEST(FitLoop, EstimatedSteppingBatchesIsKnownInConfigureOptimizers) {
  struct Sizing : LinearRegression {
    int64_t seen = 0;
    fulgur::OptimizerConfig configure_optimizers() override {
      seen = trainer().estimated_stepping_batches();
      return LinearRegression::configure_optimizers();
    }
  };
  TempDir dir;
  auto options = test_options(dir);
  options.max_epochs = 2;
  Sizing model;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(4));
  EXPECT_EQ(model.seen, 8);
  EXPECT_EQ(trainer.estimated_stepping_batches(), 8);
}

// The sanity check's draws from the generators are put back (Lightning's
// isolate_rng): training draws as without it, so a resumed run (whose
// generators the checkpoint set before its sanity check) draws as the
// uninterrupted one.
TEST(FitLoop, TheSanityCheckLeavesTheGeneratorsAsItFoundThem) {
  auto first_draw = [](int64_t sanity_steps) {
    TempDir dir;
    auto options = test_options(dir);
    options.seed = 123;
    options.num_sanity_val_steps = sanity_steps;
    LinearRegression model;
    model.val_hook = [](LinearRegression&, fulgur::Batch&, int64_t) { (void)torch::rand({4}); };
    double drawn = 0;
    model.train_hook = [&drawn](LinearRegression&, fulgur::Batch&, int64_t batch_idx) {
      if (batch_idx == 0) drawn = torch::rand({1}).item<double>();
    };
    fulgur::Trainer(options).fit(model, regression_loader(2), regression_loader(2));
    return drawn;
  };
  EXPECT_EQ(first_draw(2), first_draw(0));
}

// A value logged in on_train_start was dropped at the first epoch's start
// (with a sanity check), or log() said it was called outside a Trainer run
// (without one): refused, saying where to log it. So is one logged in
// on_fit_start (as Lightning refuses it), which said "outside a Trainer run".
TEST(FitLoop, ALogInOnTrainStartIsRefusedWithWhereToLogIt) {
  struct LogsAtStart : LinearRegression {
    bool at_fit_start = false;
    void on_fit_start() override {
      LinearRegression::on_fit_start();
      if (at_fit_start) log("start_metric", 1.0);
    }
    void on_train_start() override {
      LinearRegression::on_train_start();
      log("start_metric", 1.0);
    }
  };
  for (const bool at_fit_start : {false, true}) {
    for (const int64_t sanity : {0, 2}) {
      TempDir dir;
      auto options = test_options(dir);
      options.num_sanity_val_steps = sanity;
      LogsAtStart model;
      model.at_fit_start = at_fit_start;
      fulgur::Trainer trainer(options);
      EXPECT_THROWS_WITH(fulgur::ConfigError,
                         trainer.fit(model, regression_loader(2), regression_loader(1)),
                         {at_fit_start ? "log(\"start_metric\"): on_fit_start runs before"
                                       : "log(\"start_metric\"): on_train_start runs before the "
                                         "first epoch",
                          "on_train_epoch_start"});
    }
  }
}

// A validation limit that cannot work is named at the fit's start, not at
// the first validation after a training epoch (without a sanity check).
TEST(FitLoop, AValidationLimitThatRoundsToNoBatchIsNamedBeforeTraining) {
  TempDir dir;
  auto options = test_options(dir);
  options.num_sanity_val_steps = 0;
  options.limit_val_batches = 0.1;
  LinearRegression model;
  fulgur::Trainer trainer(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     trainer.fit(model, regression_loader(3), regression_loader(2)),
                     {"limit_val_batches=0.1 of 2 batches rounds down to 0 batches"});
  EXPECT_EQ(model.training_steps, 0);
}

TEST(FitLoop, MaxStepsStopsMidEpoch) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = std::nullopt;  // unlimited because max_steps is set
  options.max_steps = 7;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(5));
  EXPECT_EQ(model.training_steps, 7);
  EXPECT_EQ(result.global_step, 7);
  EXPECT_EQ(model.count("on_train_epoch_start"), 2);
  EXPECT_EQ(model.count("on_train_epoch_end"), 2);  // the interrupted epoch still ends
  EXPECT_EQ(result.stop_reason, "max_steps");
}

TEST(FitLoop, MaxEpochsWinsOverALargerMaxSteps) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.max_steps = 100;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(5));
  EXPECT_EQ(model.training_steps, 10);
  EXPECT_EQ(result.stop_reason, "max_epochs");
}

TEST(FitLoop, RequestStopEndsAfterTheCurrentBatch) {
  TempDir dir;
  LinearRegression model;
  model.train_hook = [](LinearRegression& self, fulgur::Batch&, int64_t batch_idx) {
    if (batch_idx == 1) self.trainer().request_stop();
  };
  auto options = test_options(dir);
  options.max_epochs = 5;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(4));
  EXPECT_EQ(model.training_steps, 2);
  EXPECT_EQ(result.global_step, 2);
  EXPECT_EQ(model.count("on_train_epoch_end"), 1);
  EXPECT_EQ(result.stop_reason, "should_stop");
  EXPECT_TRUE(trainer.should_stop());
}

TEST(FitLoop, MinEpochsDelaysAStopRequestedInTheFirstEpoch) {
  TempDir dir;
  LinearRegression model;
  // Asks to stop at every step, from the very first one.
  model.train_hook = [](LinearRegression& self, fulgur::Batch&, int64_t) {
    self.trainer().request_stop();
  };
  auto options = test_options(dir);
  options.max_epochs = 10;
  options.min_epochs = 3;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(4));
  // Exactly min_epochs complete epochs, then the stop is honoured.
  EXPECT_EQ(model.count("on_train_epoch_end"), 3);
  EXPECT_EQ(model.training_steps, 12);
  EXPECT_EQ(result.global_step, 12);
  EXPECT_EQ(result.epochs, 3);
  EXPECT_EQ(result.stop_reason, "should_stop");
}

TEST(FitLoop, MinEpochsKeepsAOneTimeStopRequest) {
  TempDir dir;
  LinearRegression model;
  model.train_hook = [](LinearRegression& self, fulgur::Batch&, int64_t batch_idx) {
    if (self.current_epoch() == 0 && batch_idx == 0) self.trainer().request_stop();
  };
  auto options = test_options(dir);
  options.max_epochs = 10;
  options.min_epochs = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(4));
  EXPECT_EQ(model.training_steps, 8);
  EXPECT_EQ(model.count("on_train_epoch_end"), 2);
}

TEST(FitLoop, MinStepsDelaysAStopRequest) {
  TempDir dir;
  LinearRegression model;
  model.train_hook = [](LinearRegression& self, fulgur::Batch&, int64_t) {
    self.trainer().request_stop();
  };
  auto options = test_options(dir);
  options.max_epochs = 10;
  options.min_steps = 7;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(5));
  EXPECT_EQ(model.training_steps, 7);
  EXPECT_EQ(result.global_step, 7);
  EXPECT_EQ(result.stop_reason, "should_stop");
}

// Nothing to train runs no training hook (as Lightning's fit loop skips
// itself): on_train_start and on_train_end ran around no epoch.
TEST(FitLoop, ZeroMaxEpochsTrainsNothing) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = 0;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(3));
  EXPECT_EQ(model.training_steps, 0);
  EXPECT_EQ(result.global_step, 0);
  EXPECT_EQ(result.stop_reason, "max_epochs");
  EXPECT_EQ(model.count("on_train_start"), 0);
  EXPECT_EQ(model.count("on_train_end"), 0);
  EXPECT_EQ(model.count("on_fit_start"), 1);
  EXPECT_EQ(model.count("on_fit_end"), 1);
}

// ---- Batch limits.

TEST(FitLoop, LimitTrainBatchesAsACount) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.limit_train_batches = 10;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(40, /*batch_size=*/1));
  EXPECT_EQ(trainer.num_training_batches(), 10);
  EXPECT_EQ(model.training_steps, 20);
  EXPECT_EQ(result.global_step, 20);
  EXPECT_EQ(model.count("on_train_epoch_end"), 2);
}

TEST(FitLoop, LimitTrainBatchesAsAFraction) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.limit_train_batches = 0.25;  // of 40 batches: 10
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(40, /*batch_size=*/1));
  EXPECT_EQ(trainer.num_training_batches(), 10);
  EXPECT_EQ(model.training_steps, 20);
}

TEST(FitLoop, LimitTrainBatchesZeroSkipsTraining) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.limit_train_batches = 0;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(4));
  EXPECT_EQ(model.training_steps, 0);
  EXPECT_EQ(result.global_step, 0);
}

TEST(FitLoop, LimitValBatchesAsACountAndAFraction) {
  for (fulgur::BatchLimit limit : {fulgur::BatchLimit(3), fulgur::BatchLimit(0.3)}) {
    TempDir dir;
    LinearRegression model;
    auto options = test_options(dir);
    options.max_epochs = 2;
    options.limit_val_batches = limit;
    options.num_sanity_val_steps = 0;
    fulgur::Trainer trainer(options);
    trainer.fit(model, regression_loader(2), regression_loader(10));
    EXPECT_EQ(model.validation_steps, 6) << "limit_val_batches=" << limit.text();
    EXPECT_EQ(model.sanity_steps, 0);
  }
}

TEST(FitLoop, LimitValBatchesZeroDisablesValidation) {
  TempDir dir;
  LinearRegression model;
  auto recorder = std::make_shared<ValidationRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.limit_val_batches = 0;
  options.callbacks = {recorder};
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), regression_loader(4));
  EXPECT_EQ(model.validation_steps + model.sanity_steps, 0);
  EXPECT_THAT(recorder->steps_at_validation, IsEmpty());
  EXPECT_EQ(recorder->sanity_runs, 0);
}

// ---- Validation schedule.

TEST(FitLoop, ValidatesAtTheEndOfEveryEpochByDefault) {
  TempDir dir;
  LinearRegression model;
  auto recorder = std::make_shared<ValidationRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 3;
  options.num_sanity_val_steps = 0;
  options.callbacks = {recorder};
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(4), regression_loader(2));
  EXPECT_THAT(recorder->steps_at_validation, ElementsAre(4, 8, 12));
  EXPECT_EQ(model.validation_steps, 6);
}

TEST(FitLoop, FractionalValCheckIntervalValidatesTwicePerEpoch) {
  TempDir dir;
  LinearRegression model;
  auto recorder = std::make_shared<ValidationRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.val_check_interval = 0.5;
  options.num_sanity_val_steps = 0;
  options.callbacks = {recorder};
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(10), regression_loader(3));
  EXPECT_THAT(recorder->steps_at_validation, ElementsAre(5, 10, 15, 20));
  EXPECT_EQ(model.validation_steps, 12);
}

TEST(FitLoop, IntegerValCheckIntervalCountsBatchesWithinTheEpoch) {
  TempDir dir;
  LinearRegression model;
  auto recorder = std::make_shared<ValidationRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.val_check_interval = 3;
  options.num_sanity_val_steps = 0;
  options.callbacks = {recorder};
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(10), regression_loader(1));
  // Batches 3, 6, 9 of each epoch; the 10th is not a multiple of 3.
  EXPECT_THAT(recorder->steps_at_validation, ElementsAre(3, 6, 9, 13, 16, 19));
}

TEST(FitLoop, IntegerValCheckIntervalAcrossEpochs) {
  TempDir dir;
  LinearRegression model;
  auto recorder = std::make_shared<ValidationRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.val_check_interval = 4;
  options.check_val_every_n_epoch = std::nullopt;
  options.num_sanity_val_steps = 0;
  options.callbacks = {recorder};
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(10), regression_loader(1));
  EXPECT_THAT(recorder->steps_at_validation, ElementsAre(4, 8, 12, 16, 20));
}

TEST(FitLoop, ValCheckIntervalLargerThanTheEpochIsAConfigError) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.val_check_interval = 20;
  fulgur::Trainer trainer(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     trainer.fit(model, regression_loader(10), regression_loader(1)),
                     {"val_check_interval=20", "10"});
}

TEST(FitLoop, CheckValEveryNEpochs) {
  TempDir dir;
  LinearRegression model;
  auto recorder = std::make_shared<ValidationRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 5;
  options.check_val_every_n_epoch = 2;
  options.num_sanity_val_steps = 0;
  options.callbacks = {recorder};
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), regression_loader(1));
  // The ends of epochs 1 and 3 (0-based), after 4 and 8 steps.
  EXPECT_THAT(recorder->steps_at_validation, ElementsAre(4, 8));
}

TEST(FitLoop, ValidationRunsInEvalModeAndTrainingResumesInTrainMode) {
  TempDir dir;
  LinearRegression model;
  std::vector<bool> training_mode;
  model.train_hook = [&](LinearRegression& self, fulgur::Batch&, int64_t) {
    training_mode.push_back(self.is_training());
  };
  auto options = test_options(dir);
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), regression_loader(1));
  EXPECT_FALSE(model.validated_in_training_mode);
  EXPECT_THAT(training_mode, ElementsAre(true, true, true, true));
}

// ---- Sanity check.

TEST(FitLoop, SanityCheckRunsTwoBatchesByDefault) {
  TempDir dir;
  LinearRegression model;
  auto recorder = std::make_shared<ValidationRecorder>();
  auto options = test_options(dir);
  options.callbacks = {recorder};
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), regression_loader(5));
  EXPECT_EQ(model.sanity_steps, 2);
  EXPECT_EQ(model.validation_steps, 5);
  EXPECT_EQ(recorder->sanity_runs, 1);
}

TEST(FitLoop, SanityCheckZeroAndAll) {
  struct Case {
    int64_t num_sanity_val_steps;
    int64_t expected;
  };
  for (const Case& c : {Case{0, 0}, Case{2, 2}, Case{-1, 5}, Case{9, 5}}) {
    TempDir dir;
    LinearRegression model;
    auto options = test_options(dir);
    options.num_sanity_val_steps = c.num_sanity_val_steps;
    fulgur::Trainer trainer(options);
    trainer.fit(model, regression_loader(2), regression_loader(5));
    EXPECT_EQ(model.sanity_steps, c.expected) << "num_sanity_val_steps=" << c.num_sanity_val_steps;
    EXPECT_EQ(model.validation_steps, 5);
  }
}

TEST(FitLoop, SanityCheckAllRespectsLimitValBatches) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.num_sanity_val_steps = -1;
  options.limit_val_batches = 3;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), regression_loader(5));
  EXPECT_EQ(model.sanity_steps, 3);
}

class MetricsAtTrainStart : public fulgur::Callback {
 public:
  std::string state_key() const override { return "MetricsAtTrainStart"; }
  void on_train_start(fulgur::Trainer& trainer, fulgur::Module&) override {
    metrics = trainer.callback_metrics();
    sanity_checking = trainer.sanity_checking();
  }
  fulgur::Metrics metrics;
  bool sanity_checking = true;
};

TEST(FitLoop, SanityCheckRunsBeforeTrainingAndItsMetricsAreDropped) {
  TempDir dir;
  LinearRegression model;
  auto probe = std::make_shared<MetricsAtTrainStart>();
  auto options = test_options(dir);
  options.callbacks = {probe};
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(2), regression_loader(3));
  EXPECT_EQ(model.sanity_steps, 2);
  EXPECT_EQ(probe->metrics.count("val_loss"), 0u) << "sanity-check metrics must not be kept";
  EXPECT_FALSE(probe->sanity_checking);
  EXPECT_EQ(result.metrics.count("val_loss"), 1u) << "the real validation's metrics are kept";
  auto order = only(model.events, {"on_fit_start", "validation_step", "on_train_start"});
  EXPECT_THAT(order,
              ElementsAre("on_fit_start", "validation_step", "validation_step", "on_train_start",
                          "validation_step", "validation_step", "validation_step"));
}

// ---- fast_dev_run.

TEST(FitLoop, FastDevRunTrueRunsOneBatchOfEachAndWritesNothing) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = 5;
  options.fast_dev_run = true;
  options.enable_checkpointing = true;  // turned off by fast_dev_run
  options.logger = true;                // turned off by fast_dev_run
  fulgur::Trainer trainer(options);
  EXPECT_TRUE(trainer.loggers().empty());
  auto result = trainer.fit(model, regression_loader(40), regression_loader(10));
  EXPECT_EQ(model.training_steps, 1);
  EXPECT_EQ(model.validation_steps, 1);
  EXPECT_EQ(model.sanity_steps, 0);
  EXPECT_EQ(model.count("on_train_epoch_start"), 1);
  EXPECT_EQ(result.global_step, 1);
  EXPECT_THAT(list_files(dir.path()), IsEmpty());
}

TEST(FitLoop, FastDevRunNRunsNBatchesOfTrainAndVal) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = 5;
  options.fast_dev_run = 3;
  options.enable_checkpointing = true;
  options.logger = true;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(40), regression_loader(10));
  EXPECT_EQ(model.training_steps, 3);
  EXPECT_EQ(model.validation_steps, 3);
  EXPECT_EQ(model.sanity_steps, 0);
  EXPECT_EQ(model.count("on_train_epoch_start"), 1);
  EXPECT_EQ(result.global_step, 3);
  EXPECT_THAT(list_files(dir.path()), IsEmpty());
}

TEST(FitLoop, FastDevRunSilencesAnExplicitModelCheckpoint) {
  TempDir dir;
  LinearRegression model;
  auto options = fulgur::test::checkpointed_options(
      dir, {.dirpath = dir.file("ckpts"), .save_top_k = -1, .every_n_train_steps = 1});
  options.fast_dev_run = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(10));
  EXPECT_EQ(model.training_steps, 2);
  EXPECT_THAT(list_files(dir.path()), IsEmpty());
}

// ---- Debugging flags.

// The x of each batch a step saw, per epoch.
using SeenBatches = std::vector<std::vector<at::Tensor>>;

// The first `n` batches of `loader` in the dataset's order.
std::vector<at::Tensor> first_batches_in_order(int64_t n, int64_t batch_size, int64_t samples) {
  auto in_order = fulgur::make_data_loader(fulgur::test::regression_dataset(samples),
                                           {.batch_size = batch_size});
  in_order->start_epoch(0);
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(in_order->next()->pair().first);
  return out;
}

TEST(FitLoop, OverfitBatchesTrainsAndValidatesOnTheSameFirstBatchesInOrder) {
  TempDir dir;
  LinearRegression model;
  SeenBatches trained(3), validated(3);
  model.train_hook = [&](LinearRegression& self, fulgur::Batch& batch, int64_t) {
    trained[self.trainer().current_epoch()].push_back(batch.pair().first.clone());
  };
  model.val_hook = [&](LinearRegression& self, fulgur::Batch& batch, int64_t) {
    if (!self.trainer().sanity_checking()) {
      validated[self.trainer().current_epoch()].push_back(batch.pair().first.clone());
    }
  };
  auto options = test_options(dir);
  options.max_epochs = 3;
  options.seed = 7;
  options.overfit_batches = 2;
  fulgur::Trainer trainer(options);
  EXPECT_TRUE(fulgur::test::message_contains(
      trainer.describe(), {"overfit_batches=2", "same first 2 batch(es)", "(in order)"}));
  // A shuffling training loader: the fit says it visits its samples in order.
  auto train = regression_loader(6, /*batch_size=*/2, /*shuffle=*/true);
  testing::internal::CaptureStderr();
  auto result = trainer.fit(model, train, regression_loader(5, /*batch_size=*/3));
  const std::string notes = testing::internal::GetCapturedStderr();
  EXPECT_EQ(fulgur::test::count_occurrences(notes, "the training loader shuffles"), 1) << notes;
  EXPECT_EQ(result.global_step, 6);
  EXPECT_EQ(trainer.num_training_batches(), 2);
  const auto train_expected = first_batches_in_order(2, 2, 12);
  const auto val_expected = first_batches_in_order(2, 3, 15);
  for (int epoch = 0; epoch < 3; ++epoch) {
    SCOPED_TRACE(epoch);
    fulgur::test::expect_tensors_equal(trained[epoch], train_expected);
    fulgur::test::expect_tensors_equal(validated[epoch], val_expected);
  }

  // The next fit without overfit_batches shuffles the same loader again.
  LinearRegression next;
  std::vector<at::Tensor> seen;
  next.train_hook = [&](LinearRegression&, fulgur::Batch& batch, int64_t) {
    seen.push_back(batch.pair().first.clone());
  };
  options.overfit_batches = 0;
  options.max_epochs = 1;
  fulgur::Trainer plain(options);
  plain.fit(next, train);
  const auto in_order = first_batches_in_order(6, 2, 12);
  ASSERT_EQ(seen.size(), 6u);
  bool same_order = true;
  for (size_t i = 0; i < seen.size(); ++i) same_order &= torch::equal(seen[i], in_order[i]);
  EXPECT_FALSE(same_order);
}

// y = 0 * w under a square root: its backward divides by sqrt(0), and
// the product's backward turns that infinity into NaN.
class NaNInBackward : public fulgur::Module {
 public:
  NaNInBackward() : fulgur::Module("NaNInBackward") {
    w = register_parameter("w", torch::ones({1}));
  }
  at::Tensor training_step(fulgur::Batch&, int64_t) override { return torch::sqrt(w * 0.0).sum(); }
  fulgur::OptimizerConfig configure_optimizers() override {
    return fulgur::OptimizerConfig(
        std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.1)));
  }
  at::Tensor w;
};

TEST(FitLoop, DetectAnomalyStopsTheFitAtTheBackwardThatReturnsNaN) {
  TempDir dir;
  auto options = test_options(dir);
  {
    // Without it the fit goes on, and the parameter is NaN.
    NaNInBackward model;
    fulgur::Trainer trainer(options);
    trainer.fit(model, regression_loader(2));
    EXPECT_TRUE(torch::isnan(model.w).all().item<bool>());
  }
  NaNInBackward model;
  options.detect_anomaly = true;
  fulgur::Trainer trainer(options);
  EXPECT_TRUE(fulgur::test::message_contains(trainer.describe(), {"detect_anomaly=true"}));
  // LibTorch 1.13 throws a std::runtime_error, 2.x a c10::Error.
  try {
    trainer.fit(model, regression_loader(2));
    ADD_FAILURE() << "the fit ended without an error";
  } catch (const std::exception& e) {
    EXPECT_TRUE(fulgur::test::message_contains(e.what(),
                                               {"Function 'MulBackward", "returned nan values"}));
  }
  EXPECT_TRUE(torch::equal(model.w, torch::ones({1})));  // no step was taken
  // The process's anomaly mode is set back after the fit: off, or on where
  // it was on before.
  EXPECT_FALSE(torch::autograd::AnomalyMode::is_enabled());
  torch::autograd::AnomalyMode::set_enabled(true);
  NaNInBackward again;
  fulgur::Trainer second(options);
  EXPECT_THROW(second.fit(again, regression_loader(2)), std::exception);
  EXPECT_TRUE(torch::autograd::AnomalyMode::is_enabled());
  torch::autograd::AnomalyMode::set_enabled(false);
}

// ---- Gradient accumulation.

TEST(FitLoop, AccumulationStepsOncePerGroupAndAtTheEpochEnd) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.accumulate_grad_batches = 4;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(10));
  // ceil(10 / 4) = 3 steps per epoch: after batches 4, 8 and the last (10).
  EXPECT_EQ(result.global_step, 6);
  EXPECT_EQ(model.training_steps, 20);
  EXPECT_EQ(model.count("on_before_backward"), 20);
  EXPECT_EQ(model.count("on_before_optimizer_step"), 6);
  EXPECT_EQ(model.count("on_before_zero_grad"), 6);
}

TEST(FitLoop, AccumulationUsesTheLimitedEpochLength) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.accumulate_grad_batches = 2;
  options.limit_train_batches = 5;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(10));
  EXPECT_EQ(model.training_steps, 5);
  EXPECT_EQ(result.global_step, 3);  // after batches 2, 4 and 5
}

TEST(FitLoop, StepsAtValidationWithAccumulation) {
  TempDir dir;
  LinearRegression model;
  auto recorder = std::make_shared<ValidationRecorder>();
  auto options = test_options(dir);
  options.accumulate_grad_batches = 3;
  options.num_sanity_val_steps = 0;
  options.callbacks = {recorder};
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(7), regression_loader(1));
  EXPECT_THAT(recorder->steps_at_validation, ElementsAre(3));
}

// ---- Order of hooks.

TEST(FitLoop, HookOrderForOneBatch) {
  TempDir dir;
  LinearRegression model;
  fulgur::Trainer trainer(test_options(dir));
  trainer.fit(model, regression_loader(1));
  EXPECT_THAT(model.events,
              ElementsAre("configure_model", "configure_optimizers", "on_fit_start",
                          "on_train_start", "on_train_epoch_start", "on_train_batch_start",
                          "training_step", "on_before_backward", "on_after_backward",
                          "on_before_optimizer_step", "on_before_zero_grad", "on_train_batch_end",
                          "on_train_epoch_end", "on_train_end", "on_fit_end"));
}

TEST(FitLoop, HookOrderWithAccumulation) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.accumulate_grad_batches = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2));
  auto batch_events =
      only(model.events,
           {"on_train_batch_start", "training_step", "on_before_backward", "on_after_backward",
            "on_before_optimizer_step", "on_before_zero_grad", "on_train_batch_end"});
  EXPECT_THAT(batch_events, ElementsAre(
                                // batch 0: accumulate only
                                "on_train_batch_start", "training_step", "on_before_backward",
                                "on_after_backward", "on_train_batch_end",
                                // batch 1: accumulate, then step
                                "on_train_batch_start", "training_step", "on_before_backward",
                                "on_after_backward", "on_before_optimizer_step",
                                "on_before_zero_grad", "on_train_batch_end"));
}

TEST(FitLoop, HookOrderWithValidation) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.num_sanity_val_steps = 1;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), regression_loader(1));
  auto order = only(model.events, {"on_fit_start", "on_fit_end", "on_train_start", "on_train_end",
                                   "on_train_epoch_start", "on_train_epoch_end", "training_step",
                                   "validation_step", "on_train_batch_end"});
  EXPECT_THAT(order, ElementsAre("on_fit_start",
                                 "validation_step",  // sanity check
                                 "on_train_start", "on_train_epoch_start", "training_step",
                                 "on_train_batch_end", "training_step", "on_train_batch_end",
                                 "validation_step",  // after the last batch's end hook
                                 "on_train_epoch_end", "on_train_end", "on_fit_end"));
}

TEST(FitLoop, ValidationRunsAfterTheBatchEndHookWhenDue) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.val_check_interval = 1;
  options.num_sanity_val_steps = 0;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), regression_loader(1));
  auto order = only(model.events, {"training_step", "on_train_batch_end", "validation_step"});
  EXPECT_THAT(order, ElementsAre("training_step", "on_train_batch_end", "validation_step",
                                 "training_step", "on_train_batch_end", "validation_step"));
}

TEST(FitLoop, CallbackHooksRunRightAfterTheModuleHook) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.callbacks = {std::make_shared<fulgur::test::RecordingCallback>(&model.events)};
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(1));
  for (const char* hook : {"on_fit_start", "on_train_start", "on_train_epoch_start",
                           "on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end",
                           "on_train_epoch_end", "on_train_end", "on_fit_end"}) {
    auto it = std::find(model.events.begin(), model.events.end(), hook);
    ASSERT_NE(it, model.events.end()) << hook;
    ASSERT_NE(it + 1, model.events.end()) << hook;
    EXPECT_EQ(*(it + 1), std::string("cb:") + hook);
  }
}

TEST(FitLoop, StateDuringTheLoop) {
  TempDir dir;
  LinearRegression model;
  std::vector<int64_t> batch_indices;
  std::vector<fulgur::Stage> stages;
  model.train_hook = [&](LinearRegression& self, fulgur::Batch&, int64_t batch_idx) {
    EXPECT_EQ(self.trainer().batch_idx(), batch_idx);
    EXPECT_FALSE(self.trainer().sanity_checking());
    EXPECT_EQ(self.trainer().num_training_batches(), 3);
    batch_indices.push_back(batch_idx);
    stages.push_back(self.trainer().stage());
  };
  auto options = test_options(dir);
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(3));
  EXPECT_THAT(batch_indices, ElementsAre(0, 1, 2, 0, 1, 2));
  EXPECT_THAT(stages, ::testing::Each(fulgur::Stage::kFit));
}

TEST(FitLoop, NoTrainingDataIsAConfigError) {
  TempDir dir;
  LinearRegression model;
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, nullptr), {"no training data"});
}

TEST(FitLoop, FitTwiceWithOneTrainerStartsOver) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(3));
  auto second = trainer.fit(model, regression_loader(3));
  EXPECT_EQ(second.global_step, 6);
  EXPECT_EQ(model.training_steps, 12);
}

// ---- Loaders of unknown length.

using fulgur::test::generator_loader;

TEST(FitLoop, OverfitBatchesAsAFractionNamesItselfWhereTheLoaderHasNoLength) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.overfit_batches = 0.5;
  fulgur::Trainer trainer(options);
  EXPECT_TRUE(fulgur::test::message_contains(trainer.describe(), {"same first fraction 0.5"}));
  EXPECT_TRUE(fulgur::test::throws_with<fulgur::ConfigError>(
      [&] { trainer.fit(model, generator_loader(4)); }, {"overfit_batches=0.5"}));
}

TEST(FitLoop, UnknownLengthLoaderTrainsUntilItEnds) {
  TempDir dir;
  LinearRegression model;
  auto recorder = std::make_shared<ValidationRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.num_sanity_val_steps = 0;
  options.callbacks = {recorder};
  fulgur::Trainer trainer(options);
  auto loader = generator_loader(5);
  ASSERT_EQ(loader->num_batches(), std::nullopt);
  auto result = trainer.fit(model, loader, regression_loader(2));
  EXPECT_EQ(trainer.num_training_batches(), -1);
  EXPECT_EQ(model.training_steps, 10);
  EXPECT_EQ(result.global_step, 10);
  EXPECT_EQ(model.count("on_train_epoch_end"), 2);
  // Validation at the end of each epoch, found by looking ahead.
  EXPECT_THAT(recorder->steps_at_validation, ElementsAre(5, 10));
}

TEST(FitLoop, UnknownLengthLoaderWithACountLimit) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.limit_train_batches = 3;
  fulgur::Trainer trainer(options);
  trainer.fit(model, generator_loader(5));
  EXPECT_EQ(model.training_steps, 6);
}

TEST(FitLoop, UnknownLengthLoaderWithAFractionalLimitIsAConfigError) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.limit_train_batches = 0.5;
  fulgur::Trainer trainer(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, generator_loader(5)),
                     {"limit_train_batches", "0.5"});
  EXPECT_EQ(model.training_steps, 0);
}

TEST(FitLoop, UnknownLengthLoaderWithAFractionalValCheckIntervalIsAConfigError) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.val_check_interval = 0.5;
  fulgur::Trainer trainer(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     trainer.fit(model, generator_loader(5), regression_loader(1)),
                     {"val_check_interval=0.5"});
}

TEST(FitLoop, VectorOfBatchesTrains) {
  TempDir dir;
  LinearRegression model;
  auto batches = std::make_shared<std::vector<fulgur::Batch>>();
  auto data = fulgur::test::regression_dataset(6);
  for (int64_t k = 0; k < 3; ++k) {
    batches->emplace_back(data->tensors()[0].slice(0, 2 * k, 2 * k + 2),
                          data->tensors()[1].slice(0, 2 * k, 2 * k + 2));
  }
  auto options = test_options(dir);
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, fulgur::make_iterable_loader(batches));
  EXPECT_EQ(trainer.num_training_batches(), 3);
  EXPECT_EQ(result.global_step, 6);
}

// Validation every N batches counted across epochs counts the batches each
// epoch had, also where the loader does not say its length (the count
// restarted every epoch: 3, 7, 11), and a run resumed mid-epoch or from an
// epoch's end keeps the count.
TEST(FitLoop, IntegerValCheckIntervalAcrossEpochsOfUnknownLength) {
  auto counted_across_epochs = [](const TempDir& dir,
                                  std::shared_ptr<ValidationRecorder> recorder) {
    auto options = test_options(dir);
    options.max_epochs = 3;
    options.val_check_interval = 3;
    options.check_val_every_n_epoch = std::nullopt;
    options.num_sanity_val_steps = 0;
    options.callbacks = {std::move(recorder)};
    return options;
  };
  TempDir dir;
  auto recorder = std::make_shared<ValidationRecorder>();
  auto options = counted_across_epochs(dir, recorder);
  options.enable_checkpointing = true;
  options.callbacks.push_back(
      std::make_shared<fulgur::ModelCheckpoint>(fulgur::ModelCheckpointOptions{
          .dirpath = dir.file("steps"), .save_top_k = -1, .every_n_train_steps = 5}));
  options.callbacks.push_back(
      std::make_shared<fulgur::ModelCheckpoint>(fulgur::ModelCheckpointOptions{
          .dirpath = dir.file("epochs"), .save_top_k = -1, .save_last = false}));
  {
    LinearRegression model;
    fulgur::Trainer trainer(options);
    trainer.fit(model, generator_loader(4), regression_loader(1));
    EXPECT_THAT(recorder->steps_at_validation, ElementsAre(3, 6, 9, 12));
  }
  for (const std::string name : {"steps/epoch=1-step=5.ckpt", "epochs/epoch=0-step=4.ckpt"}) {
    SCOPED_TRACE(name);
    TempDir dir_b;
    auto resumed_recorder = std::make_shared<ValidationRecorder>();
    LinearRegression model;
    fulgur::Trainer trainer(counted_across_epochs(dir_b, resumed_recorder));
    trainer.fit(model, generator_loader(4), regression_loader(1), {.ckpt_path = dir.file(name)});
    EXPECT_THAT(resumed_recorder->steps_at_validation, ElementsAre(6, 9, 12));
  }
}

// A stop requested mid-epoch validates where it stops (Lightning's
// "allow validation if requesting to stop early"), once, and keeps its
// reason in the last epoch too (it read "max_epochs"); an epoch that does
// not validate (check_val_every_n_epoch) does not for it either.
TEST(FitLoop, ARequestedStopValidatesWhereItStops) {
  struct Case {
    int64_t every, stop_epoch, steps;
    std::vector<int64_t> validations;
  };
  for (const Case& c : {Case{1, 1, 6, {4, 6}}, Case{2, 1, 6, {6}}, Case{2, 0, 2, {}}}) {
    SCOPED_TRACE(::testing::Message() << "every " << c.every << ", stop in epoch " << c.stop_epoch);
    TempDir dir;
    LinearRegression model;
    model.train_hook = [&c](LinearRegression& self, fulgur::Batch&, int64_t batch_idx) {
      if (self.current_epoch() == c.stop_epoch && batch_idx == 1) self.trainer().request_stop();
    };
    auto recorder = std::make_shared<ValidationRecorder>();
    auto options = test_options(dir);
    options.max_epochs = 2;
    options.check_val_every_n_epoch = c.every;
    options.num_sanity_val_steps = 0;
    options.callbacks = {recorder};
    fulgur::Trainer trainer(options);
    auto result = trainer.fit(model, regression_loader(4), regression_loader(1));
    EXPECT_EQ(result.global_step, c.steps);
    EXPECT_EQ(result.stop_reason, "should_stop");
    EXPECT_EQ(recorder->steps_at_validation, c.validations);
  }
}

// A stop decided by a validation (EarlyStopping's) does not validate again.
TEST(FitLoop, AStopDecidedByAValidationDoesNotValidateAgain) {
  TempDir dir;
  LinearRegression model;
  model.val_hook = [](LinearRegression& self, fulgur::Batch&, int64_t) {
    self.trainer().request_stop();
  };
  auto recorder = std::make_shared<ValidationRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 3;
  options.val_check_interval = 0.5;
  options.num_sanity_val_steps = 0;
  options.callbacks = {recorder};
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(4), regression_loader(1));
  EXPECT_EQ(result.global_step, 2);
  EXPECT_THAT(recorder->steps_at_validation, ElementsAre(2));
}

}  // namespace
