// Every error path of the Trainer that a user can reach with a bad input:
// each test checks the exception type and that the message names the value
// and what to do.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <sstream>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::CheckpointError;
using fulgur::ConfigError;
using fulgur::test::LinearRegression;
using fulgur::test::TempDir;
using fulgur::test::test_options;

// Trains LinearRegression for one epoch and returns the path of last.ckpt.
std::string write_checkpoint(const TempDir& dir, int64_t in_features = 3) {
  auto options = test_options(dir);
  options.enable_checkpointing = true;
  LinearRegression model({.in_features = in_features});
  fulgur::Trainer trainer(std::move(options));
  auto result = trainer.fit(model, fulgur::test::regression_loader(4));
  return result.last_model_path;
}

void write_archive(const std::string& path,
                   const std::function<void(torch::serialize::OutputArchive&)>& fill) {
  torch::serialize::OutputArchive archive;
  fill(archive);
  archive.save_to(path);
}

TEST(CheckpointErrors, ACheckpointOfAnotherModelDoesNotFit) {
  TempDir dir;
  auto path = write_checkpoint(dir, 3);
  LinearRegression other({.in_features = 4});
  fulgur::Trainer trainer(test_options(dir));
  auto loader = fulgur::make_data_loader(fulgur::test::regression_dataset(8, 4), {.batch_size = 2});
  EXPECT_THROWS_WITH(CheckpointError, trainer.validate(other, loader, path),
                     {path, "does not fit module", "same model"});
}

TEST(CheckpointErrors, ANewerFormatVersionIsNamed) {
  TempDir dir;
  auto path = dir.path() + "/future.ckpt";
  write_archive(path, [](auto& a) { a.write("fulgur_format_version", c10::IValue(int64_t{99})); });
  LinearRegression model;
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(
      CheckpointError,
      trainer.fit(model, fulgur::test::regression_loader(2), nullptr, {.ckpt_path = path}),
      {path, "format version 99", "reads versions 1 to 1"});
}

TEST(CheckpointErrors, AMissingSectionIsNamed) {
  TempDir dir;
  auto path = dir.path() + "/partial.ckpt";
  write_archive(path, [](auto& a) { a.write("fulgur_format_version", c10::IValue(int64_t{1})); });
  LinearRegression model;
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(
      CheckpointError,
      trainer.fit(model, fulgur::test::regression_loader(2), nullptr, {.ckpt_path = path}),
      {path, "is incomplete", "section \"state_dict\" is missing"});
}

TEST(CheckpointErrors, ADirectoryIsNotACheckpoint) {
  TempDir dir;
  LinearRegression model;
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(
      CheckpointError,
      trainer.fit(model, fulgur::test::regression_loader(2), nullptr, {.ckpt_path = dir.path()}),
      {dir.path(), "is a directory"});
}

TEST(CheckpointErrors, ResumingOnLessDataSaysTheDataChanged) {
  TempDir dir;
  auto options = fulgur::test::checkpointed_options(
      dir, {.save_top_k = -1, .save_last = false, .every_n_train_steps = 3});
  LinearRegression model;
  fulgur::Trainer trainer(std::move(options));
  trainer.fit(model, fulgur::test::regression_loader(4));
  auto path = dir.path() + "/checkpoints/epoch=0-step=3.ckpt";
  ASSERT_TRUE(std::filesystem::exists(path));

  LinearRegression resumed;
  fulgur::Trainer again(test_options(dir));
  EXPECT_THROWS_WITH(
      CheckpointError,
      again.fit(resumed, fulgur::test::regression_loader(2), nullptr, {.ckpt_path = path}),
      {"batch 3", "only 2 batches", "data changed"});
}

struct TwoOptimizers : LinearRegression {
  fulgur::OptimizerConfig configure_optimizers() override {
    auto config = LinearRegression::configure_optimizers();
    config.optimizers.push_back(std::make_shared<torch::optim::SGD>(parameters(), 0.1));
    return config;
  }
};

TEST(CheckpointErrors, AnotherNumberOfOptimizersIsNamed) {
  TempDir dir;
  auto path = write_checkpoint(dir);
  TwoOptimizers model;
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(
      CheckpointError,
      trainer.fit(model, fulgur::test::regression_loader(2), nullptr, {.ckpt_path = path}),
      {path, "holds 1 optimizer state(s)", "returned 2"});
}

// The same parameters, listed in reverse: the momentum of the weight would
// land on the bias (the step failed on the sizes, naming neither).
struct ReversedParameters : LinearRegression {
  using LinearRegression::LinearRegression;
  fulgur::OptimizerConfig configure_optimizers() override {
    auto params = parameters();
    std::reverse(params.begin(), params.end());
    return fulgur::OptimizerConfig(
        std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9)));
  }
};

TEST(CheckpointErrors, AnOptimizerStateOfParametersInAnotherOrderIsNamed) {
  TempDir dir;
  auto options = test_options(dir);
  options.enable_checkpointing = true;
  LinearRegression model({.momentum = 0.9});
  const auto path = fulgur::Trainer(std::move(options))
                        .fit(model, fulgur::test::regression_loader(4))
                        .last_model_path;
  ReversedParameters reversed({.momentum = 0.9});
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(
      CheckpointError,
      trainer.fit(reversed, fulgur::test::regression_loader(4), nullptr, {.ckpt_path = path}),
      {path, "optimizer 0 state does not fit",
       "the state of parameter 0 (fc.bias) of parameter group 0 has \"momentum_buffer\" of shape "
       "[1, 3] where the parameter has [1]",
       "in another order", "same optimizer type and parameters"});
}

TEST(CheckpointErrors, AnotherNumberOfSchedulersIsNamed) {
  TempDir dir;
  auto path = write_checkpoint(dir);
  LinearRegression model;
  model.make_schedulers = [](torch::optim::Optimizer& opt) {
    return std::vector<fulgur::SchedulerConfig>{
        {.scheduler = std::make_shared<torch::optim::StepLR>(opt, 1, 0.5)}};
  };
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(
      CheckpointError,
      trainer.fit(model, fulgur::test::regression_loader(2), nullptr, {.ckpt_path = path}),
      {path, "holds 0 scheduler state(s)", "returned 1"});
}

TEST(ModelCheckpointErrors, AMonitorThatWasNeverLoggedListsTheLoggedMetrics) {
  TempDir dir;
  auto options = fulgur::test::checkpointed_options(dir, {.monitor = "val_accuracy"});
  LinearRegression model;
  fulgur::Trainer trainer(std::move(options));
  EXPECT_THROWS_WITH(ConfigError, trainer.fit(model, fulgur::test::regression_loader(2)),
                     {"monitor=\"val_accuracy\"", "no metric of that name", "train_loss"});
}

// A save before the fit's first validation (here every training step, the
// validation at the epoch's end) has nothing to rank: last.ckpt keeps the
// state and a note says so once, where it failed the fit before. Without
// validation, a monitor nothing logs stays an error (above). With
// validation every second epoch the first epoch's end ranks nothing (no
// validation scored its weights) and keeps last.ckpt, without a note.
TEST(ModelCheckpointErrors, ASaveBeforeTheFitsFirstValidationKeepsLastAndSaysSo) {
  TempDir dir;
  {
    std::shared_ptr<fulgur::ModelCheckpoint> every_other;
    auto options = fulgur::test::checkpointed_options(dir, {.monitor = "val_loss"}, &every_other);
    options.max_epochs = 1;
    options.check_val_every_n_epoch = 2;
    LinearRegression model;
    fulgur::Trainer trainer(std::move(options));
    testing::internal::CaptureStderr();
    trainer.fit(model, fulgur::test::regression_loader(2), fulgur::test::regression_loader(1));
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(err.find("before any validation"), std::string::npos) << err;
    EXPECT_TRUE(std::filesystem::exists(every_other->last_model_path()));
    EXPECT_TRUE(every_other->best_model_path().empty());
  }
  std::shared_ptr<fulgur::ModelCheckpoint> callback;
  auto options = fulgur::test::checkpointed_options(
      dir, {.monitor = "val_loss", .every_n_train_steps = 1}, &callback);
  options.max_epochs = 1;
  LinearRegression model;
  fulgur::Trainer trainer(std::move(options));
  testing::internal::CaptureStderr();
  trainer.fit(model, fulgur::test::regression_loader(2), fulgur::test::regression_loader(1));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(fulgur::test::message_contains(
      err, {"ModelCheckpoint(monitor=\"val_loss\"): saving at step",
            "before any validation of this fit has run", "last.ckpt keeps the state"}))
      << err;
  EXPECT_EQ(fulgur::test::count_occurrences(err, "before any validation"), 1) << err;
  EXPECT_FALSE(callback->last_model_path().empty());
  EXPECT_TRUE(std::filesystem::exists(callback->last_model_path()));
}

TEST(LogErrors, ANonScalarNamesItsShape) {
  TempDir dir;
  LinearRegression model;
  model.train_hook = [](LinearRegression& m, fulgur::Batch&, int64_t) {
    m.log("vector", torch::ones({2}));
  };
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(ConfigError, trainer.fit(model, fulgur::test::regression_loader(2)),
                     {"log(\"vector\"", "tensor of shape [2]", "value.mean()"});
}

TEST(LogErrors, TwoReductionsForOneNameConflict) {
  TempDir dir;
  LinearRegression model;
  model.train_hook = [](LinearRegression& m, fulgur::Batch&, int64_t idx) {
    m.log("m", 1.0, {.reduce = idx == 0 ? fulgur::ReduceOp::kMean : fulgur::ReduceOp::kMax});
  };
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(ConfigError, trainer.fit(model, fulgur::test::regression_loader(2)),
                     {"log(\"m\", reduce=max)", "reduce=mean", "one reduction per metric"});
}

TEST(LogErrors, NeitherStepNorEpochGoesNowhere) {
  TempDir dir;
  LinearRegression model;
  model.train_hook = [](LinearRegression& m, fulgur::Batch&, int64_t) {
    m.log("m", 1.0, {.on_step = false, .on_epoch = false});
  };
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(ConfigError, trainer.fit(model, fulgur::test::regression_loader(2)),
                     {"on_step=false, on_epoch=false", "Set on_step or on_epoch"});
}

TEST(LimitErrors, AFractionThatRoundsToNoBatchesIsRejected) {
  TempDir dir;
  auto options = test_options(dir);
  options.limit_train_batches = 0.05;
  LinearRegression model;
  fulgur::Trainer trainer(std::move(options));
  EXPECT_THROWS_WITH(ConfigError, trainer.fit(model, fulgur::test::regression_loader(10)),
                     {"limit_train_batches=0.05", "of 10 batches rounds down to 0"});
}

TEST(LimitErrors, AFractionalValCheckIntervalNeedsAKnownLength) {
  TempDir dir;
  auto options = test_options(dir);
  options.val_check_interval = 0.5;
  LinearRegression model;
  auto batches = std::make_shared<std::vector<fulgur::Batch>>();
  auto data = fulgur::test::regression_dataset(4);
  for (int64_t i = 0; i < 2; ++i) {
    batches->push_back(data->get_batch(torch::arange(2 * i, 2 * i + 2, torch::kLong)));
  }
  auto unknown = fulgur::make_iterable_loader([batches](int64_t) -> fulgur::BatchGenerator {
    auto i = std::make_shared<size_t>(0);
    return [batches, i]() -> std::optional<fulgur::Batch> {
      if (*i >= batches->size()) return std::nullopt;
      return (*batches)[(*i)++];
    };
  });
  fulgur::Trainer trainer(std::move(options));
  EXPECT_THROWS_WITH(ConfigError, trainer.fit(model, unknown, fulgur::test::regression_loader(1)),
                     {"val_check_interval=0.5", "known length", "Pass an int"});
}

TEST(EnvErrors, ANonIntegerVariableIsNamed) {
  fulgur::EnvView env(std::map<std::string, std::string>{{"WORLD_SIZE", "two"}});
  EXPECT_THROWS_WITH(ConfigError, env.get_int("WORLD_SIZE"),
                     {"WORLD_SIZE=\"two\"", "is not an integer"});
}

}  // namespace
