#include "fulgur/callbacks/early_stopping.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <vector>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::EarlyStopping;
using fulgur::EarlyStoppingOptions;
using fulgur::test::LinearRegression;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using ::testing::HasSubstr;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Logs scores[epoch] as "score" at the end of every training epoch (the last
// value again after the list ends) and trains up to `max_epochs` epochs of
// 2 batches with `stopper`; returns the epochs completed.
struct ScriptedRun {
  std::vector<double> scores;
  fulgur::FitResult run(const TempDir& dir, std::shared_ptr<EarlyStopping> stopper,
                        int64_t max_epochs = 10, const std::string& ckpt_path = "",
                        bool checkpoints = false) {
    LinearRegression model;
    model.train_epoch_end_hook = [this](LinearRegression& m) {
      const auto epoch = static_cast<size_t>(m.trainer().current_epoch());
      m.log("score", scores[std::min(epoch, scores.size() - 1)]);
    };
    auto options = test_options(dir);
    options.max_epochs = max_epochs;
    options.enable_checkpointing = checkpoints;
    options.callbacks = {stopper};
    fulgur::Trainer trainer(options);
    return trainer.fit(model, regression_loader(2), nullptr, {.ckpt_path = ckpt_path});
  }
};

std::shared_ptr<EarlyStopping> stopper(EarlyStoppingOptions options) {
  if (options.monitor.empty()) options.monitor = "score";
  return std::make_shared<EarlyStopping>(options);
}

TEST(EarlyStopping, StopsAfterPatienceChecksWithoutImprovement) {
  TempDir dir;
  ScriptedRun script{{5, 4, 4.5, 4.2, 4.1, 3}};
  auto es = stopper({.patience = 2});
  auto result = script.run(dir, es);
  // Epoch 1 is the best (4); epochs 2 and 3 do not beat it.
  EXPECT_EQ(es->stopped_epoch(), 3);
  EXPECT_EQ(result.epochs, 4);
  EXPECT_EQ(result.global_step, 8);
  EXPECT_EQ(es->wait_count(), 2);
  EXPECT_EQ(es->best_score(), 4);
  EXPECT_THAT(es->stop_reason(), HasSubstr("score did not improve by more than min_delta=0 in 2"));
}

// The same EarlyStopping in a second fit from the start counts afresh (it
// stopped the second fit at its first check, from the first fit's count
// and best).
TEST(EarlyStopping, ASecondFitFromTheStartCountsAfresh) {
  TempDir dir;
  ScriptedRun script{{5, 4, 4.5, 4.2, 4.1, 3}};
  auto es = stopper({.patience = 2});
  script.run(dir, es);
  ASSERT_EQ(es->stopped_epoch(), 3);
  auto again = script.run(dir, es);
  EXPECT_EQ(es->stopped_epoch(), 3);
  EXPECT_EQ(again.epochs, 4);
  EXPECT_EQ(es->best_score(), 4);
}

TEST(EarlyStopping, MinDeltaInModeMax) {
  TempDir dir;
  ScriptedRun script{{1, 1.4, 1.8, 2.6, 2.7, 2.8, 9}};
  auto es = stopper({.min_delta = 0.5, .patience = 2, .mode = "max"});
  script.run(dir, es);
  // 1.4 is not 0.5 better than 1; 1.8 and 2.6 are; 2.7 and 2.8 are not.
  EXPECT_EQ(es->stopped_epoch(), 5);
  EXPECT_EQ(es->best_score(), 2.6);
}

TEST(EarlyStopping, ThresholdsStopAtOnce) {
  TempDir dir;
  ScriptedRun good{{5, 3, 1.5, 1, 0.5}};
  auto reached = stopper({.patience = 100, .stopping_threshold = 2.0});
  good.run(dir, reached);
  EXPECT_EQ(reached->stopped_epoch(), 2);
  EXPECT_THAT(reached->stop_reason(), HasSubstr("reached stopping_threshold=2"));

  ScriptedRun bad{{5, 4, 11, 3}};
  auto diverged = stopper({.patience = 100, .divergence_threshold = 10.0});
  bad.run(dir, diverged);
  EXPECT_EQ(diverged->stopped_epoch(), 2);
  EXPECT_THAT(diverged->stop_reason(), HasSubstr("worse than divergence_threshold=10"));
}

TEST(EarlyStopping, ANonFiniteMetricStopsUnlessCheckFiniteIsOff) {
  TempDir dir;
  ScriptedRun script{{5, kNaN, 4, 3, 2}};
  auto checked = stopper({.patience = 100});
  script.run(dir, checked);
  EXPECT_EQ(checked->stopped_epoch(), 1);
  EXPECT_THAT(checked->stop_reason(), HasSubstr("is not finite"));
  auto unchecked = stopper({.patience = 100, .check_finite = false});
  auto result = script.run(dir, unchecked, 5);
  EXPECT_EQ(unchecked->stopped_epoch(), -1);
  EXPECT_EQ(result.epochs, 5);
  // NaN is not worse than a divergence threshold either (Lightning's NaN >
  // threshold is false): check_finite alone decides on it.
  auto diverging = stopper({.patience = 100, .check_finite = false, .divergence_threshold = 10.0});
  result = script.run(dir, diverging, 5);
  EXPECT_EQ(diverging->stopped_epoch(), -1) << diverging->stop_reason();
  EXPECT_EQ(result.epochs, 5);
}

// Validation every other epoch: the check follows each validation (at
// every epoch's end it found no val_loss in epoch 0, or counted the last
// validation's value again and stopped two epochs early).
TEST(EarlyStopping, ChecksAfterEachValidationWhenValidationRunsEveryNthEpoch) {
  TempDir dir;
  LinearRegression model;
  model.val_hook = [](LinearRegression& m, fulgur::Batch&, int64_t) {
    if (!m.trainer().sanity_checking()) m.log("score", 1.0);
  };
  auto es =
      std::make_shared<EarlyStopping>(EarlyStoppingOptions{.monitor = "score", .patience = 2});
  auto options = test_options(dir);
  options.max_epochs = 10;
  options.check_val_every_n_epoch = 2;
  options.callbacks = {es};
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(2), regression_loader(1));
  // Validations after epochs 1, 3 and 5: the first sets the best, the next
  // two do not beat it.
  EXPECT_EQ(es->stopped_epoch(), 5);
  EXPECT_EQ(result.epochs, 6);
}

TEST(EarlyStopping, AMissingMetricIsAnErrorNamingTheLoggedOnesUnlessNotStrict) {
  TempDir dir;
  ScriptedRun script{{1}};
  try {
    script.run(dir, stopper({.monitor = "val_los"}));
    ADD_FAILURE() << "no error";
  } catch (const fulgur::ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("EarlyStopping(monitor=\"val_los\"): no metric"));
    EXPECT_THAT(e.what(), HasSubstr("score"));
    EXPECT_THAT(e.what(), HasSubstr("train_loss"));
  }
  auto lenient = stopper({.monitor = "val_los", .strict = false});
  auto result = script.run(dir, lenient, 3);
  EXPECT_EQ(result.epochs, 3);
}

TEST(EarlyStopping, BadOptionsAreNamedTogether) {
  try {
    EarlyStopping es({.monitor = "", .min_delta = -1, .patience = 0, .mode = "up"});
    ADD_FAILURE() << "no error";
  } catch (const fulgur::ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("monitor=\"\""));
    EXPECT_THAT(e.what(), HasSubstr("min_delta=-1"));
    EXPECT_THAT(e.what(), HasSubstr("patience=0"));
    EXPECT_THAT(e.what(), HasSubstr("mode=\"up\""));
  }
  // No improvement exceeds an infinite min_delta: the fit would stop after
  // patience checks whatever the metric did.
  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      EarlyStopping({.monitor = "val_loss", .min_delta = std::numeric_limits<double>::infinity()}),
      {"min_delta=inf", "finite"});
}

// Its wait count and best score are in the checkpoint: a run stopped by
// max_epochs and resumed stops where the uninterrupted run stopped.
TEST(EarlyStopping, AResumedRunStopsWhereTheUninterruptedOneDid) {
  TempDir whole, parts;
  ScriptedRun script{{5, 4, 4.5, 4.6, 4.7, 4.8, 4.9}};
  auto uninterrupted = stopper({.patience = 3});
  script.run(whole, uninterrupted, 10, "", /*checkpoints=*/true);
  ASSERT_EQ(uninterrupted->stopped_epoch(), 4);

  script.run(parts, stopper({.patience = 3}), 3, "", /*checkpoints=*/true);
  auto resumed = stopper({.patience = 3});
  auto result = script.run(parts, resumed, 10, "last", /*checkpoints=*/true);
  EXPECT_EQ(resumed->stopped_epoch(), 4);
  EXPECT_EQ(result.epochs, 5);
}

TEST(EarlyStopping, ChecksAfterEachValidationWhenValidationRunsWithinTheEpoch) {
  TempDir dir;
  LinearRegression model;
  // Validation i (every 2 training batches, 2 batches each) logs scores[i].
  const std::vector<double> scores = {3, 2, 2.5, 2.6, 1, 1};
  int validation_batches = 0;
  model.val_hook = [&](LinearRegression& m, fulgur::Batch&, int64_t) {
    if (m.trainer().sanity_checking()) return;
    m.log("score", scores[static_cast<size_t>(validation_batches++ / 2)]);
  };
  auto es =
      std::make_shared<EarlyStopping>(EarlyStoppingOptions{.monitor = "score", .patience = 2});
  auto options = test_options(dir);
  options.max_epochs = 5;
  options.val_check_interval = 2;
  options.num_sanity_val_steps = 0;
  options.callbacks = {es};
  fulgur::Trainer trainer(options);
  // The third and fourth validations (after steps 6 and 8) do not beat the
  // second: the run stops after the fourth, in the middle of the epoch.
  auto result = trainer.fit(model, regression_loader(12), regression_loader(2));
  EXPECT_EQ(validation_batches, 4 * 2);
  EXPECT_EQ(result.global_step, 8);
  EXPECT_EQ(es->stopped_epoch(), 0);
  EXPECT_EQ(es->best_score(), 2);
}

}  // namespace
