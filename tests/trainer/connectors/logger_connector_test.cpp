// Module::log inside the loops: names, step and epoch values, reductions,
// weighting by batch size, and where the values end up.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "fulgur/fulgur.h"
#include "support/test_support.h"
#include "trainer/connectors/logger_connector.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::regression_dataset;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using fulgur::test::uneven_loader;

TEST(Logging, TrainingStepLogsPerStepByDefault) {
  TempDir dir;
  LinearRegression model;
  double last_value = -1;
  model.train_hook = [&](LinearRegression& self, fulgur::Batch&, int64_t batch_idx) {
    last_value = static_cast<double>(batch_idx) * 10;
    self.log("plain", last_value);
  };
  fulgur::Trainer trainer(test_options(dir));
  auto result = trainer.fit(model, regression_loader(4));
  const auto& metrics = trainer.callback_metrics();
  ASSERT_EQ(metrics.count("plain"), 1u);
  EXPECT_DOUBLE_EQ(metrics.at("plain"), 30.0);  // the latest step's value
  EXPECT_EQ(metrics.count("plain_step"), 0u);
  EXPECT_EQ(metrics.count("plain_epoch"), 0u);
  EXPECT_EQ(result.metrics, metrics);
  EXPECT_EQ(metrics.count("train_loss"), 1u);
}

TEST(Logging, OnStepAndOnEpochGiveStepAndEpochNames) {
  TempDir dir;
  LinearRegression model;
  model.train_hook = [](LinearRegression& self, fulgur::Batch&, int64_t batch_idx) {
    self.log("idx", static_cast<double>(batch_idx), {.on_epoch = true});
  };
  fulgur::Trainer trainer(test_options(dir));
  trainer.fit(model, regression_loader(4));  // 4 batches of 2
  const auto& metrics = trainer.callback_metrics();
  ASSERT_EQ(metrics.count("idx_step"), 1u);
  ASSERT_EQ(metrics.count("idx_epoch"), 1u);
  EXPECT_DOUBLE_EQ(metrics.at("idx_step"), 3.0);
  EXPECT_DOUBLE_EQ(metrics.at("idx_epoch"), 1.5);  // (0 + 1 + 2 + 3) / 4
}

TEST(Logging, OnEpochOnlyKeepsTheName) {
  TempDir dir;
  LinearRegression model;
  model.train_hook = [](LinearRegression& self, fulgur::Batch&, int64_t batch_idx) {
    self.log("epoch_only", static_cast<double>(batch_idx), {.on_step = false, .on_epoch = true});
  };
  fulgur::Trainer trainer(test_options(dir));
  trainer.fit(model, regression_loader(4));
  const auto& metrics = trainer.callback_metrics();
  ASSERT_EQ(metrics.count("epoch_only"), 1u);
  EXPECT_DOUBLE_EQ(metrics.at("epoch_only"), 1.5);
  EXPECT_EQ(metrics.count("epoch_only_step"), 0u);
}

TEST(Logging, TrainingEpochMeanIsWeightedByBatchSize) {
  TempDir dir;
  LinearRegression model;
  model.train_hook = [](LinearRegression& self, fulgur::Batch&, int64_t batch_idx) {
    self.log("idx", static_cast<double>(batch_idx), {.on_step = false, .on_epoch = true});
  };
  fulgur::Trainer trainer(test_options(dir));
  trainer.fit(model, uneven_loader());
  // (0 * 4 + 1 * 4 + 2 * 2) / 10
  EXPECT_DOUBLE_EQ(trainer.callback_metrics().at("idx"), 0.8);
}

TEST(Logging, ValidationEpochMeanIsWeightedByBatchSize) {
  TempDir dir;
  LinearRegression model;
  model.val_hook = [](LinearRegression& self, fulgur::Batch&, int64_t batch_idx) {
    self.log("val_idx", static_cast<double>(batch_idx));
  };
  fulgur::Trainer trainer(test_options(dir));
  auto metrics = trainer.validate(model, uneven_loader());
  ASSERT_EQ(metrics.count("val_idx"), 1u);
  EXPECT_DOUBLE_EQ(metrics.at("val_idx"), 0.8);  // not the unweighted 1.0
  EXPECT_EQ(metrics.count("val_idx_step"), 0u) << "evaluation logs per epoch by default";
}

TEST(Logging, ValidationMetricsDuringFitAreEpochMeans) {
  TempDir dir;
  LinearRegression model;
  model.val_hook = [](LinearRegression& self, fulgur::Batch&, int64_t batch_idx) {
    self.log("val_idx", static_cast<double>(batch_idx));
  };
  auto options = test_options(dir);
  options.num_sanity_val_steps = 0;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(2), uneven_loader());
  EXPECT_DOUBLE_EQ(result.metrics.at("val_idx"), 0.8);
}

// A fulgur::metrics object logged from the steps: its epoch value comes
// from its states (every sample once), it is reset after each epoch, and
// what cannot be logged that way is named.
class MetricModel : public LinearRegression {
 public:
  fulgur::metrics::MeanMetric sample_index;  // the batch index of every sample
  fulgur::metrics::MeanMetric epoch;         // the epoch of every training sample
  fulgur::metrics::ConfusionMatrix matrix{{.task = "binary"}};
};

TEST(Logging, AMetricLogsItsEpochValueFromItsStates) {
  TempDir dir;
  MetricModel model;
  model.val_hook = [&](LinearRegression&, fulgur::Batch& batch, int64_t batch_idx) {
    model.sample_index.update(
        torch::full({batch.batch_size()}, static_cast<double>(batch_idx), torch::kDouble));
    model.log("val_idx", model.sample_index);
  };
  model.train_hook = [&](LinearRegression&, fulgur::Batch& batch, int64_t) {
    model.epoch.update(torch::full({batch.batch_size()},
                                   static_cast<double>(model.current_epoch()), torch::kDouble));
    model.log("epoch_seen", model.epoch, {.prog_bar = true});
  };
  auto options = test_options(dir);
  options.num_sanity_val_steps = 1;
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(2), uneven_loader());
  // Batches of 4, 4 and 2 samples: (0*4 + 1*4 + 2*2) / 10, the sanity
  // check's batch not counted (the metric was reset after it).
  EXPECT_DOUBLE_EQ(result.metrics.at("val_idx"), 0.8);
  // Reset after each epoch: the second epoch's value is 1, not 0.5.
  EXPECT_DOUBLE_EQ(result.metrics.at("epoch_seen"), 1.0);
  EXPECT_EQ(trainer.progress_bar_metrics().count("epoch_seen"), 1u);
  EXPECT_EQ(result.metrics.count("epoch_seen_step"), 0u) << "a metric is logged per epoch only";
  EXPECT_EQ(model.sample_index.update_count(), 0);
}

TEST(Logging, WhatAMetricCannotBeLoggedAsIsNamed) {
  TempDir dir;
  for (int which = 0; which < 3; ++which) {
    MetricModel model;
    model.val_hook = [&](LinearRegression&, fulgur::Batch&, int64_t) {
      if (which == 0) model.log("v", model.sample_index, {.on_step = true});
      if (which == 1) model.log("cm", model.matrix);
      if (which == 2) {
        model.log("v", 1.0);
        model.log("v", model.sample_index);
      }
    };
    fulgur::Trainer trainer(test_options(dir));
    const std::vector<std::vector<std::string>> expected = {
        {"log(\"v\", MeanMetric, on_step=true)", "once per epoch"},
        {"log(\"cm\", ConfusionMatrix)", "not one number", "compute()"},
        {"log(\"v\")", "with values", "now with a metric object"}};
    EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.validate(model, uneven_loader()),
                       (expected[which]));
  }
}

TEST(Logging, ExplicitBatchSizeOverridesTheWeight) {
  TempDir dir;
  LinearRegression model;
  model.val_hook = [](LinearRegression& self, fulgur::Batch&, int64_t batch_idx) {
    self.log("unweighted", static_cast<double>(batch_idx), {.batch_size = 1});
  };
  fulgur::Trainer trainer(test_options(dir));
  auto metrics = trainer.validate(model, uneven_loader());
  EXPECT_DOUBLE_EQ(metrics.at("unweighted"), 1.0);  // (0 + 1 + 2) / 3
}

TEST(Logging, Reductions) {
  TempDir dir;
  LinearRegression model;
  model.val_hook = [](LinearRegression& self, fulgur::Batch&, int64_t batch_idx) {
    double v = static_cast<double>(batch_idx);
    self.log("v_max", v, {.reduce = fulgur::ReduceOp::kMax});
    self.log("v_min", v + 5, {.reduce = fulgur::ReduceOp::kMin});
    self.log("v_sum", v, {.reduce = fulgur::ReduceOp::kSum});
  };
  fulgur::Trainer trainer(test_options(dir));
  auto metrics = trainer.validate(model, uneven_loader());
  EXPECT_DOUBLE_EQ(metrics.at("v_max"), 2.0);
  EXPECT_DOUBLE_EQ(metrics.at("v_min"), 5.0);
  EXPECT_DOUBLE_EQ(metrics.at("v_sum"), 3.0);  // the plain sum of the logged values
}

TEST(Logging, TensorValuesAreLoggedAsScalars) {
  TempDir dir;
  LinearRegression model;
  model.val_hook = [](LinearRegression& self, fulgur::Batch&, int64_t) {
    self.log("t", torch::tensor(2.5));
    self.log("t1", torch::full({1}, 1.5));
  };
  fulgur::Trainer trainer(test_options(dir));
  auto metrics = trainer.validate(model, fulgur::test::regression_loader(2));
  EXPECT_DOUBLE_EQ(metrics.at("t"), 2.5);
  EXPECT_DOUBLE_EQ(metrics.at("t1"), 1.5);
}

TEST(Logging, EpochEndHookLogsPerEpoch) {
  TempDir dir;
  LinearRegression model;
  model.train_epoch_end_hook = [](LinearRegression& self) {
    self.log("finished_epoch", static_cast<double>(self.current_epoch()));
  };
  auto options = test_options(dir);
  options.max_epochs = 3;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(2));
  EXPECT_DOUBLE_EQ(result.metrics.at("finished_epoch"), 2.0);
}

TEST(Logging, ProgressBarMetricsAreTheOnesMarkedForIt) {
  TempDir dir;
  LinearRegression model;
  model.train_hook = [](LinearRegression& self, fulgur::Batch&, int64_t) {
    self.log("shown", 1.0, {.prog_bar = true});
    self.log("hidden", 2.0);
  };
  fulgur::Trainer trainer(test_options(dir));
  trainer.fit(model, regression_loader(2));
  EXPECT_EQ(trainer.progress_bar_metrics().count("shown"), 1u);
  EXPECT_EQ(trainer.progress_bar_metrics().count("hidden"), 0u);
  EXPECT_EQ(trainer.callback_metrics().count("shown"), 1u);
  EXPECT_EQ(trainer.callback_metrics().count("hidden"), 1u);
}

TEST(Logging, NonScalarInAStepIsAConfigError) {
  TempDir dir;
  LinearRegression model;
  model.train_hook = [](LinearRegression& self, fulgur::Batch& batch, int64_t) {
    self.log("batch", batch.pair().first);
  };
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, regression_loader(2)),
                     {"\"batch\"", "only scalars"});
}

// What would corrupt metrics.csv, weigh an epoch's mean wrongly, or lose
// values under another metric's name is refused, naming the metric: a name
// with a comma, quote or line break; a negative batch_size; a complex
// value; on_step/on_epoch changed within an epoch (its values went under
// two names and the epoch mean was lost); a name that another metric logged
// per step and per epoch is published as (<name>_step, <name>_epoch).
TEST(Logging, ValuesThatWouldLandWrongAreRefusedWithTheirName) {
  struct Case {
    const char* what;
    std::function<void(LinearRegression&, int64_t)> log;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      {"comma", [](LinearRegression& m, int64_t) { m.log("a,b", 1.0); }, {"\"a,b\"", "a comma"}},
      {"line break", [](LinearRegression& m, int64_t) { m.log("a\nb", 1.0); }, {"a line break"}},
      {"quote", [](LinearRegression& m, int64_t) { m.log("q\"", 1.0); }, {"a double quote"}},
      {"step",
       [](LinearRegression& m, int64_t) { m.log("step", 1.0); },
       {"log(\"step\")", "each row's optimizer step", "e.g. \"my_step\""}},
      {"negative batch_size",
       [](LinearRegression& m, int64_t) { m.log("w", 1.0, {.on_epoch = true, .batch_size = -1}); },
       {"\"w\", batch_size=-1", ">= 0"}},
      {"complex",
       [](LinearRegression& m, int64_t) {
         m.log("c", torch::complex(torch::ones({}), torch::ones({})));
       },
       {"\"c\", tensor of dtype ComplexFloat", "value.abs()"}},
      {"on_epoch changed",
       [](LinearRegression& m, int64_t i) {
         m.log("chg", 1.0, {.on_step = true, .on_epoch = i % 2 == 0});
       },
       {"\"chg\", on_step=true, on_epoch=false", "logged with on_step=true, on_epoch=true"}},
      {"a derived name",
       [](LinearRegression& m, int64_t) {
         m.log("loss2", 1.0, {.on_step = true, .on_epoch = true});
         m.log("loss2_step", 2.0);
       },
       {"log(\"loss2_step\")", "\"loss2\" is logged per step and per epoch", "Rename one"}},
      {"a derived name, the other way round",
       [](LinearRegression& m, int64_t) {
         m.log("loss3_epoch", 2.0, {.on_epoch = true});
         m.log("loss3", 1.0, {.on_step = true, .on_epoch = true});
       },
       {"\"loss3\", on_step=true, on_epoch=true", "\"loss3_epoch\" is logged"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    TempDir dir;
    LinearRegression model;
    model.train_hook = [&](LinearRegression& self, fulgur::Batch&, int64_t i) { c.log(self, i); };
    fulgur::Trainer trainer(test_options(dir));
    EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, regression_loader(3)), (c.message));
  }
}

// The start of an epoch logs per epoch and the start of a batch per step
// by default (Lightning's), in every epoch alike: before, a batch's start
// took the last epoch end's context from the second epoch on, mixing the
// two within an epoch.
TEST(Logging, EpochAndBatchStartsLogByTheirDefaultsInEveryEpoch) {
  struct Starts : LinearRegression {
    void on_train_epoch_start() override { log("at_epoch_start", 1.0); }
    void on_train_batch_start(const fulgur::Batch&, int64_t batch_idx) override {
      log("at_batch_start", static_cast<double>(batch_idx));
    }
  };
  TempDir dir;
  auto logger = std::make_shared<fulgur::test::RecordingLogger>();
  auto options = test_options(dir);
  options.max_epochs = 3;
  options.logger = true;
  options.loggers = {logger};
  options.log_every_n_steps = 1;
  Starts model;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2));
  EXPECT_EQ(logger->series("at_batch_start").size(), 6u);
  EXPECT_EQ(logger->series("at_epoch_start").size(), 3u);
}

// What on_train_batch_end logs (the Module's or a callback's, through the
// Module) is published with its own step, as Lightning writes the step's
// row after those hooks: it went out with the next step's row, and the
// epoch's last batch's value went nowhere. A callback in
// on_train_batch_end reads the step's training_step values in the callback
// metrics (as ModelCheckpoint's every_n_train_steps does).
TEST(Logging, WhatOnTrainBatchEndLogsIsPublishedWithItsOwnStep) {
  struct EndsLogging : LinearRegression {
    void on_train_batch_end(const at::Tensor&, const fulgur::Batch&, int64_t batch_idx) override {
      log("at_batch_end", static_cast<double>(current_epoch() * 100 + batch_idx));
      log("batch_end_tensor", torch::tensor(static_cast<double>(batch_idx) + 0.5));
    }
  };
  struct Reader : fulgur::Callback {
    std::vector<double> seen;
    std::string state_key() const override { return "Reader"; }
    void on_train_batch_end(fulgur::Trainer& trainer, fulgur::Module& module, const at::Tensor&,
                            const fulgur::Batch&, int64_t batch_idx) override {
      seen.push_back(trainer.callback_metrics().at("in_step"));
      module.log("from_callback", static_cast<double>(batch_idx) * 2);
    }
  };
  TempDir dir;
  auto logger = std::make_shared<fulgur::test::RecordingLogger>();
  auto reader = std::make_shared<Reader>();
  auto options = fulgur::test::logged_options(dir, logger, reader);
  options.max_epochs = 2;
  EndsLogging model;
  model.train_hook = [](LinearRegression& self, fulgur::Batch&, int64_t batch_idx) {
    self.log("in_step", static_cast<double>(batch_idx));
  };
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(3));  // 3 batches an epoch, steps 1..6
  using Series = std::vector<std::pair<int64_t, double>>;
  EXPECT_EQ(logger->series("in_step"), (Series{{1, 0}, {2, 1}, {3, 2}, {4, 0}, {5, 1}, {6, 2}}));
  EXPECT_EQ(logger->series("at_batch_end"),
            (Series{{1, 0}, {2, 1}, {3, 2}, {4, 100}, {5, 101}, {6, 102}}));
  EXPECT_EQ(logger->series("batch_end_tensor"),
            (Series{{1, 0.5}, {2, 1.5}, {3, 2.5}, {4, 0.5}, {5, 1.5}, {6, 2.5}}));
  EXPECT_EQ(logger->series("from_callback"),
            (Series{{1, 0}, {2, 2}, {3, 4}, {4, 0}, {5, 2}, {6, 4}}));
  EXPECT_EQ(reader->seen, (std::vector<double>{0, 1, 2, 0, 1, 2}));
  EXPECT_DOUBLE_EQ(trainer.callback_metrics().at("at_batch_end"), 102.0);
  EXPECT_DOUBLE_EQ(trainer.callback_metrics().at("from_callback"), 4.0);
}

TEST(Logging, LogAfterTheRunIsAConfigError) {
  TempDir dir;
  LinearRegression model;
  fulgur::Trainer trainer(test_options(dir));
  trainer.fit(model, regression_loader(2));
  EXPECT_THROWS_WITH(fulgur::ConfigError, model.log("late", 1.0), {"outside a Trainer run"});
}

/// Collects what reaches a logger.
class MemoryLogger : public fulgur::Logger {
 public:
  std::string name() const override { return "memory"; }
  std::string log_dir() const override { return ""; }
  void log_hyperparams(const fulgur::HParams& params) override { hparams = params; }
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) override {
    rows.emplace_back(step, metrics);
  }
  void save() override {
    ++saved;
    if (disk_full) throw fulgur::ConfigError("memory: cannot write: No space left on device.");
  }
  void finalize() override { ++finalized; }
  fulgur::HParams hparams;
  std::vector<std::pair<int64_t, std::map<std::string, double>>> rows;
  int finalized = 0;
  int saved = 0;
  bool disk_full = false;
};

TEST(Logging, LoggersReceiveHyperparametersMetricsAndFinalize) {
  TempDir dir;
  LinearRegression model;
  model.save_hyperparameters({{"lr", 0.05}});
  auto memory = std::make_shared<MemoryLogger>();
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.logger = true;
  options.loggers = {memory};
  options.log_every_n_steps = 1;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(3), regression_loader(1));
  EXPECT_EQ(memory->hparams.count("lr"), 1u);
  EXPECT_EQ(memory->finalized, 1);
  bool saw_train_loss = false;
  bool saw_val_loss = false;
  for (const auto& [step, metrics] : memory->rows) {
    EXPECT_GE(step, 0);
    saw_train_loss = saw_train_loss || metrics.count("train_loss") > 0;
    saw_val_loss = saw_val_loss || metrics.count("val_loss") > 0;
  }
  EXPECT_TRUE(saw_train_loss);
  EXPECT_TRUE(saw_val_loss);
}

// What validate() and test() logged is saved before they return, so that a
// logger that cannot write (a full disk) fails the stage with its reason, as
// at fit's end, instead of a note as the program exits with the values lost.
TEST(Logging, ValidateAndTestSaveTheirLoggersAndAFailedSaveFailsTheStage) {
  TempDir dir;
  LinearRegression model;
  auto memory = std::make_shared<MemoryLogger>();
  auto options = test_options(dir);
  options.logger = true;
  options.loggers = {memory};
  fulgur::Trainer trainer(options);
  trainer.test(model, regression_loader(2));
  EXPECT_EQ(memory->saved, 1);
  EXPECT_FALSE(memory->rows.empty());
  trainer.validate(model, regression_loader(2));
  EXPECT_EQ(memory->saved, 2);
  memory->disk_full = true;
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.test(model, regression_loader(2)),
                     {"No space left on device"});
}

TEST(Logging, LogEveryNStepsThinsStepMetrics) {
  TempDir dir;
  LinearRegression model;
  auto memory = std::make_shared<MemoryLogger>();
  auto options = test_options(dir);
  options.logger = true;
  options.loggers = {memory};
  options.log_every_n_steps = 5;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(10));
  int64_t rows_with_train_loss = 0;
  for (const auto& row : memory->rows) {
    if (row.second.count("train_loss") > 0) ++rows_with_train_loss;
  }
  EXPECT_EQ(rows_with_train_loss, 2);  // steps 5 and 10
}

// A loss that is no longer finite when it is read for a logger or an
// epoch's value gets one note per fit (the run goes on); a finite run gets
// none.
TEST(Logging, ADivergedLossIsNotedOnceWhenItIsRead) {
  TempDir dir;
  auto options = test_options(dir);
  options.max_epochs = 3;
  options.logger = true;
  options.loggers = {std::make_shared<MemoryLogger>()};
  options.log_every_n_steps = 2;
  auto stderr_of = [&](double lr) {
    LinearRegression model(fulgur::test::LinearRegressionOptions{.lr = lr});
    ::testing::internal::CaptureStderr();
    fulgur::Trainer(options).fit(model, regression_loader(8), regression_loader(2));
    return ::testing::internal::GetCapturedStderr();
  };
  const std::string diverged = stderr_of(1e30);
  EXPECT_EQ(fulgur::test::count_occurrences(diverged, "the training diverged"), 1) << diverged;
  EXPECT_TRUE(fulgur::test::message_contains(
      diverged, {"\"train_loss\" is ", " at step 2 (epoch 0)", "Lower the learning rate",
                 "gradient_clip_val", "check_finite"}));
  EXPECT_EQ(stderr_of(0.05).find("diverged"), std::string::npos);
  // Evaluating a diverged module outside a fit notes nothing: no training
  // diverged there.
  LinearRegression broken(fulgur::test::LinearRegressionOptions{.lr = 1e30});
  fulgur::Trainer trainer(options);
  ::testing::internal::CaptureStderr();
  trainer.fit(broken, regression_loader(8));
  ASSERT_NE(::testing::internal::GetCapturedStderr().find("diverged"), std::string::npos);
  ::testing::internal::CaptureStderr();
  const auto validated = trainer.validate(broken, regression_loader(2));
  const auto tested = trainer.test(broken, regression_loader(2));
  const std::string evaluated = ::testing::internal::GetCapturedStderr();
  ASSERT_FALSE(std::isfinite(validated.at("val_loss")));
  ASSERT_FALSE(std::isfinite(tested.at("test_loss")));
  EXPECT_EQ(evaluated.find("diverged"), std::string::npos) << evaluated;
}

// An epoch mean whose batch sizes add up to 0 is nan, with one note per
// metric that says why (not "the training diverged", whose name has "loss");
// a metric with one non-zero batch size in the epoch is its mean.
TEST(Logging, AnEpochMeanOfBatchSizesAddingUpToZeroIsNotedOnce) {
  TempDir dir;
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.logger = true;
  options.loggers = {std::make_shared<MemoryLogger>()};
  LinearRegression model;
  model.train_hook = [](LinearRegression& m, fulgur::Batch&, int64_t idx) {
    m.log("empty_loss", 1.0, {.on_epoch = true, .batch_size = 0});
    m.log("one_weighed", static_cast<double>(idx),
          {.on_epoch = true, .batch_size = idx == 2 ? 1 : 0});
  };
  ::testing::internal::CaptureStderr();
  const auto result = fulgur::Trainer(options).fit(model, regression_loader(4));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(std::isnan(result.metrics.at("empty_loss_epoch")));
  EXPECT_DOUBLE_EQ(result.metrics.at("one_weighed_epoch"), 2.0);
  EXPECT_EQ(fulgur::test::count_occurrences(err, "batch sizes this epoch add up to 0"), 1) << err;
  EXPECT_TRUE(fulgur::test::message_contains(
      err, {"\"empty_loss_epoch\" is nan for epoch 0", "batch_size", "reduce=sum"}));
  EXPECT_EQ(err.find("diverged"), std::string::npos) << err;
}

/// LogSink::tensor_reads() at the start of training and after each batch
/// (whose row is written after on_train_batch_end: read at the next batch's
/// start, or the epoch's end).
class TensorReadCounter : public fulgur::Callback {
 public:
  std::string state_key() const override { return "TensorReadCounter"; }
  void on_train_start(fulgur::Trainer&, fulgur::Module&) override {
    start = fulgur::detail::LogSink::tensor_reads();
  }
  void on_train_batch_start(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch&,
                            int64_t batch_idx) override {
    if (batch_idx > 0) after_batch.push_back(fulgur::detail::LogSink::tensor_reads());
  }
  void on_train_epoch_end(fulgur::Trainer&, fulgur::Module&) override {
    after_batch.push_back(fulgur::detail::LogSink::tensor_reads());
  }
  int64_t start = 0;
  std::vector<int64_t> after_batch;
};

// On a GPU a read-back is a host synchronisation: a logged tensor stays
// unread between log intervals (log_every_n_steps), and is read when a
// logger's row is written, when callback_metrics() is asked, and once at
// the epoch's end for its epoch value. What was logged is a copy.
TEST(Logging, LoggedTensorsAreReadOnlyAtLogIntervals) {
  TempDir dir;
  LinearRegression model;
  model.train_hook = [&](LinearRegression& self, fulgur::Batch&, int64_t batch_idx) {
    auto value = torch::full({}, 0.5 * static_cast<double>(batch_idx + 1));
    self.log("scaled", value, {.on_step = true, .on_epoch = true});
    self.log("peak", value, {.on_epoch = true, .reduce = fulgur::ReduceOp::kMax});
    value.add_(100.0);  // changes nothing logged
    // A tensor on the meta device has no value: reading it throws. Logged
    // at every step but the last (whose value is read when fit returns its
    // metrics), it shows that nothing reads a step value it does not need.
    self.log("unreadable",
             batch_idx < 9 ? torch::zeros({}, torch::Device("meta")) : torch::ones({}),
             {.logger = false});
  };
  auto memory = std::make_shared<MemoryLogger>();
  auto counter = std::make_shared<TensorReadCounter>();
  auto options = test_options(dir);
  options.logger = true;
  options.loggers = {memory};
  options.log_every_n_steps = 5;
  options.callbacks = {counter};
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(10));

  ASSERT_EQ(counter->after_batch.size(), 10u);
  int64_t before = counter->start;
  for (size_t k = 0; k < counter->after_batch.size(); ++k) {
    const int64_t reads = counter->after_batch[k] - before;
    before = counter->after_batch[k];
    if ((k + 1) % 5 == 0) {
      EXPECT_GT(reads, 0) << "step " << k + 1 << " writes a logger row";
    } else {
      EXPECT_EQ(reads, 0) << "step " << k + 1 << " read a logged tensor back";
    }
  }
  std::vector<double> rows;
  for (const auto& [step, row] : memory->rows) {
    if (row.count("scaled_step") > 0) rows.push_back(row.at("scaled_step"));
  }
  EXPECT_THAT(rows, ::testing::ElementsAre(2.5, 5.0));
  const auto& metrics = trainer.callback_metrics();
  EXPECT_DOUBLE_EQ(metrics.at("scaled_step"), 5.0);
  EXPECT_DOUBLE_EQ(metrics.at("scaled_epoch"), 2.75);  // the mean of 0.5, 1.0, ..., 5.0
  EXPECT_DOUBLE_EQ(metrics.at("peak"), 5.0);
  EXPECT_DOUBLE_EQ(metrics.at("unreadable"), 1.0);
}

}  // namespace
