#include "fulgur/callbacks/model_checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "fulgur/fulgur.h"
#include "support/process.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using fulgur::test::LinearRegression;
using fulgur::test::list_files;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using ::testing::ElementsAre;

/// Every file under `dir` (recursively), by path, with its bytes.
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file())
      files[entry.path().string()] = fulgur::test::read_text(entry.path());
  }
  return files;
}

/// Options with one ModelCheckpoint writing to `<dir>/ckpts`.
fulgur::TrainerOptions with_checkpoint(const TempDir& dir, fulgur::ModelCheckpointOptions o,
                                       std::shared_ptr<fulgur::ModelCheckpoint>* out = nullptr) {
  if (o.dirpath.empty()) o.dirpath = dir.file("ckpts");
  return fulgur::test::checkpointed_options(dir, std::move(o), out);
}

/// with_checkpoint for `epochs` epochs, each validated and no sanity check
/// first: one logged score an epoch (log_scores) to rank by.
fulgur::TrainerOptions scored_epochs(const TempDir& dir, fulgur::ModelCheckpointOptions o,
                                     int64_t epochs,
                                     std::shared_ptr<fulgur::ModelCheckpoint>* out = nullptr) {
  auto options = with_checkpoint(dir, std::move(o), out);
  options.max_epochs = epochs;
  options.num_sanity_val_steps = 0;
  return options;
}

TEST(ModelCheckpoint, RejectsInvalidOptions) {
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::ModelCheckpoint{fulgur::ModelCheckpointOptions{.mode = "avg"}},
                     {"mode", "avg"});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::ModelCheckpoint{fulgur::ModelCheckpointOptions{.save_top_k = -2}},
                     {"save_top_k=-2"});
  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      fulgur::ModelCheckpoint{fulgur::ModelCheckpointOptions{.every_n_train_steps = -1}},
      {"every_n_train_steps=-1"});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::ModelCheckpoint{fulgur::ModelCheckpointOptions{.every_n_epochs = -1}},
                     {"every_n_epochs=-1"});
  // A path in the template would write outside dirpath, where save_top_k
  // never removes a file.
  for (const char* name : {"sub/{epoch}", "../escape-{epoch}", "/tmp/abs-{epoch}",
                           "{epoch/x"}) {  // a '{' without its '}' is text
    EXPECT_THROWS_WITH(fulgur::ConfigError,
                       fulgur::ModelCheckpoint{fulgur::ModelCheckpointOptions{.filename = name}},
                       {name, "a file name, not a path", "dirpath"});
  }
  // A metric's name may hold one, where the name is not inserted as text
  // (it would make a directory).
  EXPECT_NO_THROW((fulgur::ModelCheckpoint{fulgur::ModelCheckpointOptions{
      .filename = "{epoch}-{val/loss:.2f}", .auto_insert_metric_name = false}}));
  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      fulgur::ModelCheckpoint{fulgur::ModelCheckpointOptions{.filename = "{epoch}-{val/loss:.2f}"}},
      {"with auto_insert_metric_name: {val/loss} would put \"val/loss=\" in the name",
       "auto_insert_metric_name=false"});
  for (const char* name : {"{epoch}-{val_loss:.2}", "{val_loss:x}", "{epoch:.2d}", "{a:999f}"}) {
    EXPECT_THROWS_WITH(fulgur::ConfigError,
                       fulgur::ModelCheckpoint{fulgur::ModelCheckpointOptions{.filename = name}},
                       {name, "is not one of [0][width][.precision]"});
  }
}

// A dirpath that cannot be a directory is named when the fit starts, not
// after its first epoch trained.
TEST(ModelCheckpoint, ADirpathUnderAFileIsNamedWhenTheFitStarts) {
  TempDir dir;
  fulgur::test::write_text(dir.file("afile"), "x");
  LinearRegression model;
  fulgur::Trainer trainer(with_checkpoint(dir, {.dirpath = dir.file("afile/ckpts")}));
  int batches = 0;
  model.train_hook = [&](LinearRegression&, fulgur::Batch&, int64_t) { ++batches; };
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, regression_loader(2)),
                     {"afile/ckpts", "cannot hold checkpoints", "afile\" is a file"});
  EXPECT_EQ(batches, 0);
}

TEST(ModelCheckpoint, DefaultDirectoryIsUnderDefaultRootDir) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.enable_checkpointing = true;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2));
  ASSERT_NE(trainer.checkpoint_callback(), nullptr);
  EXPECT_TRUE(fs::equivalent(trainer.checkpoint_callback()->dirpath(), dir.file("checkpoints")));
  EXPECT_FALSE(trainer.checkpoint_callback()->state_key().empty());
}

TEST(ModelCheckpoint, WithoutMonitorKeepsTheLatestAndLast) {
  TempDir dir;
  LinearRegression model;
  std::shared_ptr<fulgur::ModelCheckpoint> callback;
  auto options = with_checkpoint(dir, {}, &callback);
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(3));
  EXPECT_THAT(list_files(dir.file("ckpts")), ElementsAre("epoch=1-step=6.ckpt", "last.ckpt"));
  EXPECT_EQ(fs::path(callback->last_model_path()).filename().string(), "last.ckpt");
  EXPECT_EQ(fs::path(callback->best_model_path()).filename().string(), "epoch=1-step=6.ckpt");
  EXPECT_EQ(result.best_model_path, callback->best_model_path());
  EXPECT_EQ(result.last_model_path, callback->last_model_path());
}

TEST(ModelCheckpoint, SaveTopKAllKeepsEveryEpoch) {
  TempDir dir;
  LinearRegression model;
  auto options = with_checkpoint(dir, {.save_top_k = -1});
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(3));
  EXPECT_THAT(list_files(dir.file("ckpts")),
              ElementsAre("epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"));
}

TEST(ModelCheckpoint, SaveTopKZeroKeepsOnlyLast) {
  TempDir dir;
  LinearRegression model;
  auto options = with_checkpoint(dir, {.save_top_k = 0});
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(3));
  EXPECT_THAT(list_files(dir.file("ckpts")), ElementsAre("last.ckpt"));
}

TEST(ModelCheckpoint, SaveLastFalseWritesNoLastCheckpoint) {
  TempDir dir;
  LinearRegression model;
  std::shared_ptr<fulgur::ModelCheckpoint> callback;
  auto options = with_checkpoint(dir, {.save_last = false}, &callback);
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(3));
  EXPECT_THAT(list_files(dir.file("ckpts")), ElementsAre("epoch=0-step=3.ckpt"));
  EXPECT_EQ(callback->last_model_path(), "");
  EXPECT_EQ(result.last_model_path, "");
}

TEST(ModelCheckpoint, EveryNTrainSteps) {
  TempDir dir;
  LinearRegression model;
  auto options = with_checkpoint(dir, {.save_top_k = -1, .every_n_train_steps = 3});
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(10));
  EXPECT_THAT(list_files(dir.file("ckpts")),
              ElementsAre("epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt", "epoch=0-step=9.ckpt",
                          "last.ckpt"));
}

TEST(ModelCheckpoint, EveryNEpochs) {
  TempDir dir;
  LinearRegression model;
  auto options = with_checkpoint(dir, {.save_top_k = -1, .every_n_epochs = 2});
  options.max_epochs = 4;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(1));
  EXPECT_THAT(list_files(dir.file("ckpts")),
              ElementsAre("epoch=1-step=2.ckpt", "epoch=3-step=4.ckpt", "last.ckpt"));
}

TEST(ModelCheckpoint, FilenameTemplate) {
  TempDir dir;
  LinearRegression model;
  auto options = with_checkpoint(
      dir, {.filename = "model_e{epoch}_s{step}", .auto_insert_metric_name = false});
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2));
  EXPECT_THAT(list_files(dir.file("ckpts")), ElementsAre("last.ckpt", "model_e0_s2.ckpt"));
}

// Lightning's auto_insert_metric_name (on by default): each field is
// preceded by its name, so a template written for Lightning names the
// same files ("epoch=0-score=0.12"; it named "0-0.12").
TEST(ModelCheckpoint, EachFieldIsNamedInTheFileNameAsLightnings) {
  TempDir dir;
  LinearRegression model;
  model.val_hook = [](LinearRegression& self, fulgur::Batch&, int64_t) {
    self.log("score", 0.123456, {.on_step = false, .on_epoch = true});
  };
  auto options = scored_epochs(dir, {.filename = "{epoch}-{score:.2f}-last{step}"}, 1);
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), regression_loader(1));
  EXPECT_THAT(list_files(dir.file("ckpts")),
              ElementsAre("epoch=0-score=0.12-laststep=2.ckpt", "last.ckpt"));
}

/// A fit of `epochs` epochs of 2 batches with one ModelCheckpoint of `o`
/// (writing to <dir>/ckpts), resumed from `ckpt_path` when one is given.
void fit_epochs(const TempDir& dir, fulgur::ModelCheckpointOptions o, int64_t epochs,
                std::shared_ptr<fulgur::ModelCheckpoint>* out = nullptr,
                const std::string& ckpt_path = "") {
  LinearRegression model;
  auto options = with_checkpoint(dir, std::move(o), out);
  options.max_epochs = epochs;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), nullptr, {.ckpt_path = ckpt_path});
}

// Python's formats, as Lightning's templates use them.
TEST(ModelCheckpoint, FilenameTemplateFormatsItsFields) {
  TempDir dir;
  LinearRegression model;
  model.val_hook = [](LinearRegression& self, fulgur::Batch&, int64_t) {
    self.log("score", 0.123456, {.on_step = false, .on_epoch = true});
  };
  auto options =
      scored_epochs(dir,
                    {.filename = "e{epoch:03d}-s{step:2d}-{score:.2f}-{score:08.3f}-{score:.1e}",
                     .auto_insert_metric_name = false},
                    1);
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), regression_loader(1));
  EXPECT_THAT(list_files(dir.file("ckpts")),
              ElementsAre("e000-s 2-0.12-0000.123-1.2e-01.ckpt", "last.ckpt"));
}

// A name the template gives twice (no {epoch} or {step} in it, or a metric
// that repeats) never writes over a checkpoint that is kept: the next gets
// "-v1", "-v2", ... (before, the best was written over by a worse one, and
// "keep all" kept one). A metric not logged reads "nan", with a note.
TEST(ModelCheckpoint, ANameTheTemplateGivesTwiceIsVersionedNotWrittenOver) {
  {
    SCOPED_TRACE("the 2 best by a monitor");
    TempDir dir;
    LinearRegression model;
    model.val_hook = [](LinearRegression& self, fulgur::Batch&, int64_t) {
      const double scores[] = {0.5, 0.3, 0.4};
      self.log("score", scores[self.current_epoch()], {.on_step = false, .on_epoch = true});
    };
    std::shared_ptr<fulgur::ModelCheckpoint> callback;
    auto options = scored_epochs(
        dir, {.filename = "model", .monitor = "score", .mode = "max", .save_top_k = 2}, 3,
        &callback);
    fulgur::Trainer trainer(options);
    trainer.fit(model, regression_loader(2), regression_loader(1));
    // 0.5 as model, 0.3 as model-v1, then 0.4, which replaces 0.3: in its
    // place, model-v1 (model is taken).
    EXPECT_THAT(list_files(dir.file("ckpts")),
                ElementsAre("last.ckpt", "model-v1.ckpt", "model.ckpt"));
    EXPECT_DOUBLE_EQ(fulgur::TorchCheckpointIO()
                         .load_checkpoint(dir.file("ckpts/model-v1.ckpt"))
                         .section_at("callbacks")
                         .section_at(callback->state_key())
                         .reals("top_k_scores")
                         .back(),
                     0.4);
    EXPECT_EQ(fs::path(callback->best_model_path()).filename().string(), "model.ckpt");
    EXPECT_DOUBLE_EQ(*callback->best_model_score(), 0.5);
  }
  {
    SCOPED_TRACE("keep all, no monitor");
    TempDir dir;
    fit_epochs(dir, {.filename = "model", .save_top_k = -1}, 3);
    EXPECT_THAT(list_files(dir.file("ckpts")),
                ElementsAre("last.ckpt", "model-v1.ckpt", "model-v2.ckpt", "model.ckpt"));
  }
  {
    SCOPED_TRACE("save_top_k=1: the one it replaces, in place");
    TempDir dir;
    std::shared_ptr<fulgur::ModelCheckpoint> callback;
    fit_epochs(dir, {.filename = "best"}, 3, &callback);
    EXPECT_THAT(list_files(dir.file("ckpts")), ElementsAre("best.ckpt", "last.ckpt"));
    EXPECT_EQ(fs::path(callback->best_model_path()).filename().string(), "best.ckpt");
  }
  {
    SCOPED_TRACE("keep all, resumed: the names kept before go on being kept");
    TempDir dir;
    fit_epochs(dir, {.filename = "model", .save_top_k = -1}, 2);
    const auto before = snapshot(dir.file("ckpts"));
    fit_epochs(dir, {.filename = "model", .save_top_k = -1}, 4, nullptr, "last");
    EXPECT_THAT(
        list_files(dir.file("ckpts")),
        ElementsAre("last.ckpt", "model-v1.ckpt", "model-v2.ckpt", "model-v3.ckpt", "model.ckpt"));
    const auto after = snapshot(dir.file("ckpts"));
    for (const char* kept : {"model.ckpt", "model-v1.ckpt"}) {
      const std::string path = dir.file(std::string("ckpts/") + kept);
      EXPECT_EQ(after.at(path), before.at(path)) << kept << " was written over";
    }
  }
  {
    SCOPED_TRACE("a misspelt metric");
    TempDir dir;
    testing::internal::CaptureStderr();
    fit_epochs(dir, {.filename = "{epoch}-{vall_loss}", .save_top_k = -1}, 2);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_THAT(
        list_files(dir.file("ckpts")),
        ElementsAre("epoch=0-vall_loss=nan.ckpt", "epoch=1-vall_loss=nan.ckpt", "last.ckpt"));
    EXPECT_TRUE(fulgur::test::message_contains(
        err, {"{vall_loss} is not a logged metric", "\"nan\"", "Logged metrics: train_loss"}))
        << err;
  }
}

/// Logs "score" in validation: 3, 1, 2 in epochs 0, 1, 2.
void log_scores(LinearRegression& model) {
  model.val_hook = [](LinearRegression& self, fulgur::Batch&, int64_t) {
    const double scores[] = {3.0, 1.0, 2.0};
    // Explicitly per epoch: this test is about the checkpoints, not logging defaults.
    self.log("score", scores[self.current_epoch()], {.on_step = false, .on_epoch = true});
  };
}

// A second fit of the same Trainer from the start saves its own weights:
// its steps were skipped as "already saved" by the first fit's (last.ckpt
// kept the first fit's weights), and its scores competed with the first's.
TEST(ModelCheckpoint, ASecondFitFromTheStartSavesAndRanksItsOwn) {
  TempDir dir;
  std::shared_ptr<fulgur::ModelCheckpoint> callback;
  auto options =
      scored_epochs(dir, {.monitor = "score", .mode = "min", .save_top_k = 1}, 1, &callback);
  fulgur::Trainer trainer(options);
  auto weights_in = [&](const std::string& file) {
    LinearRegression fresh;
    trainer.test(fresh, regression_loader(1), dir.file("ckpts/" + file));
    return fresh;
  };
  LinearRegression first;
  log_scores(first);
  trainer.fit(first, regression_loader(3), regression_loader(1));
  LinearRegression second(fulgur::test::LinearRegressionOptions{.lr = 0.1});
  log_scores(second);
  trainer.fit(second, regression_loader(3), regression_loader(1));
  EXPECT_FALSE(fulgur::test::parameters_equal(first, second));
  EXPECT_TRUE(fulgur::test::parameters_equal(weights_in("last.ckpt"), second));
  EXPECT_TRUE(fulgur::test::parameters_equal(weights_in("epoch=0-step=3.ckpt"), second));
  EXPECT_EQ(fs::path(callback->best_model_path()).filename().string(), "epoch=0-step=3.ckpt");
}

// Validation within epochs (val_check_interval) or every N-th epoch: each
// validation's end ranks the weights it scored, as Lightning's. Only the
// epoch's end was ranked: the weights validated within an epoch were never
// kept, and an epoch no validation ran was kept under the score of an
// earlier one (evicting a validated epoch).
TEST(ModelCheckpoint, EachValidationWithinOrEveryNthEpochRanksTheWeightsItScored) {
  TempDir dir;
  {
    LinearRegression model;
    model.val_hook = [](LinearRegression& self, fulgur::Batch&, int64_t) {
      self.log("score", 10.0 - static_cast<double>(self.trainer().global_step()),
               {.on_step = false, .on_epoch = true});
    };
    auto options = scored_epochs(
        dir, {.dirpath = dir.file("within"), .monitor = "score", .save_top_k = -1}, 2);
    options.val_check_interval = fulgur::BatchLimit(static_cast<long long>(2));
    fulgur::Trainer trainer(options);
    trainer.fit(model, regression_loader(4), regression_loader(1));
    EXPECT_THAT(list_files(dir.file("within")),
                ElementsAre("epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt",
                            "epoch=1-step=8.ckpt", "last.ckpt"));
  }
  LinearRegression model;
  model.val_hook = [](LinearRegression& self, fulgur::Batch&, int64_t) {
    self.log("score", self.current_epoch() == 1 ? 5.0 : 6.0, {.on_step = false, .on_epoch = true});
  };
  auto options = scored_epochs(
      dir, {.dirpath = dir.file("every_other"), .monitor = "score", .save_top_k = 2}, 4);
  options.check_val_every_n_epoch = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), regression_loader(1));
  EXPECT_THAT(list_files(dir.file("every_other")),
              ElementsAre("epoch=1-step=4.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"));
}

TEST(ModelCheckpoint, MonitorMinKeepsTheKBest) {
  TempDir dir;
  LinearRegression model;
  log_scores(model);
  std::shared_ptr<fulgur::ModelCheckpoint> callback;
  auto options =
      scored_epochs(dir, {.monitor = "score", .mode = "min", .save_top_k = 2}, 3, &callback);
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(2), regression_loader(1));
  EXPECT_THAT(list_files(dir.file("ckpts")),
              ElementsAre("epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"));
  EXPECT_EQ(fs::path(callback->best_model_path()).filename().string(), "epoch=1-step=4.ckpt");
  ASSERT_TRUE(callback->best_model_score().has_value());
  EXPECT_DOUBLE_EQ(*callback->best_model_score(), 1.0);
  EXPECT_EQ(result.best_model_path, callback->best_model_path());
}

// ckpt_path="best" (Lightning's keyword) loads the best checkpoint by the
// monitor: after a fit, this Trainer's ModelCheckpoint's; in a new Trainer
// (a new process), the one the run's newest checkpoint recorded, with a note.
// A best that no longer verifies, or no ModelCheckpoint, is an error saying
// what to pass instead.
TEST(ModelCheckpoint, BestLoadsTheBestCheckpointByTheMonitorInThisProcessAndTheNext) {
  TempDir dir;
  LinearRegression model;
  log_scores(model);
  std::shared_ptr<fulgur::ModelCheckpoint> callback;
  auto options =
      scored_epochs(dir, {.monitor = "score", .mode = "min", .save_top_k = 2}, 3, &callback);
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), regression_loader(1));
  const std::string best = dir.file("ckpts/epoch=1-step=4.ckpt");
  ASSERT_TRUE(fs::equivalent(callback->best_model_path(), best));
  // The weights a test() from `ckpt_path` runs with.
  auto weights = [](fulgur::Trainer& t, const std::string& ckpt_path) {
    LinearRegression fresh;
    t.test(fresh, regression_loader(1), ckpt_path);
    return fresh;
  };
  const LinearRegression from_best = weights(trainer, best);
  EXPECT_TRUE(fulgur::test::parameters_equal(weights(trainer, "best"), from_best));
  EXPECT_FALSE(
      fulgur::test::parameters_equal(weights(trainer, dir.file("ckpts/last.ckpt")), from_best));

  fulgur::Trainer next(with_checkpoint(dir, {.monitor = "score", .mode = "min", .save_top_k = 2}));
  ::testing::internal::CaptureStderr();
  const LinearRegression next_best = weights(next, "best");
  const std::string note = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(fulgur::test::parameters_equal(next_best, from_best));
  EXPECT_TRUE(
      fulgur::test::message_contains(note, {"ckpt_path=\"best\": \"" + callback->best_model_path() +
                                            "\", as the ModelCheckpoint "
                                            "state of \"" +
                                            dir.file("ckpts/last.ckpt") + "\" names it."}))
      << note;

  fs::remove(best);
  fulgur::Trainer after(with_checkpoint(dir, {.monitor = "score", .mode = "min", .save_top_k = 2}));
  EXPECT_THROWS_WITH(fulgur::CheckpointError, weights(after, "best"),
                     {"ckpt_path=\"best\": the best checkpoint the ModelCheckpoint state of",
                      callback->best_model_path(), "cannot be loaded",
                      "Pass ckpt_path=\"last\" or another checkpoint's path."});
  fulgur::Trainer without(test_options(dir));
  EXPECT_THROWS_WITH(fulgur::CheckpointError, weights(without, "best"),
                     {"ckpt_path=\"best\": this Trainer has no ModelCheckpoint"});
}

// Each checkpoint records the best as it is with itself in the list: a
// run without last.ckpt whose newest save is a new best gives that one as
// "best" in a new process (it recorded the best before it). A checkpoint
// directory moved since is read where it is now.
TEST(ModelCheckpoint, BestInANewProcessIsTheNewestSaveWhenItIsTheBestAndFollowsAMovedDirectory) {
  TempDir dir, moved;
  LinearRegression model;
  model.val_hook = [](LinearRegression& self, fulgur::Batch&, int64_t) {
    const double scores[] = {3.0, 2.0, 1.0};
    self.log("score", scores[self.current_epoch()], {.on_step = false, .on_epoch = true});
  };
  const fulgur::ModelCheckpointOptions keep_two{
      .monitor = "score", .mode = "min", .save_top_k = 2, .save_last = false};
  std::shared_ptr<fulgur::ModelCheckpoint> callback;
  auto options = scored_epochs(dir, keep_two, 3, &callback);
  fulgur::Trainer(options).fit(model, regression_loader(2), regression_loader(1));
  EXPECT_THAT(list_files(dir.file("ckpts")),
              ElementsAre("epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"));
  fs::rename(dir.file("ckpts"), moved.file("ckpts"));
  auto moved_options = keep_two;
  moved_options.dirpath = moved.file("ckpts");
  fulgur::Trainer next(with_checkpoint(moved, moved_options));
  LinearRegression fresh, expected;
  ::testing::internal::CaptureStderr();
  next.test(fresh, regression_loader(1), "best");
  const std::string note = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(fulgur::test::message_contains(
      note, {"ckpt_path=\"best\": \"" + moved.file("ckpts/epoch=2-step=6.ckpt") + "\""}))
      << note;
  next.test(expected, regression_loader(1), moved.file("ckpts/epoch=2-step=6.ckpt"));
  EXPECT_TRUE(fulgur::test::parameters_equal(fresh, expected));
}

TEST(ModelCheckpoint, MonitorMaxKeepsTheBest) {
  TempDir dir;
  LinearRegression model;
  log_scores(model);
  std::shared_ptr<fulgur::ModelCheckpoint> callback;
  auto options =
      scored_epochs(dir, {.monitor = "score", .mode = "max", .save_top_k = 1}, 3, &callback);
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), regression_loader(1));
  EXPECT_THAT(list_files(dir.file("ckpts")), ElementsAre("epoch=0-step=2.ckpt", "last.ckpt"));
  EXPECT_DOUBLE_EQ(callback->best_model_score().value_or(-1.0), 3.0);
}

TEST(ModelCheckpoint, ResumingACopiedCheckpointElsewhereNeverDeletesTheOriginalRunsFiles) {
  // Run A keeps its best (score 3, epoch 0). Its last.ckpt is copied and
  // resumed by run B in another directory, whose epoch 1 scores better (1):
  // the top-k list restored from A names A's best, which B must evict from
  // its list but never delete.
  TempDir a, b, copies;
  LinearRegression model_a;
  log_scores(model_a);
  auto options_a = scored_epochs(a, {.monitor = "score", .mode = "min", .save_top_k = 1}, 1);
  fulgur::Trainer(options_a).fit(model_a, regression_loader(2), regression_loader(1));
  ASSERT_THAT(list_files(a.file("ckpts")), ElementsAre("epoch=0-step=2.ckpt", "last.ckpt"));
  const std::string copy = copies.file("copy.ckpt");
  fs::copy_file(a.file("ckpts/last.ckpt"), copy);
  const auto original = snapshot(a.path());

  LinearRegression model_b;
  log_scores(model_b);
  std::shared_ptr<fulgur::ModelCheckpoint> callback;
  auto options_b =
      scored_epochs(b, {.monitor = "score", .mode = "min", .save_top_k = 1}, 2, &callback);
  fulgur::Trainer(options_b).fit(model_b, regression_loader(2), regression_loader(1),
                                 {.ckpt_path = copy});
  EXPECT_THAT(list_files(a.file("ckpts")), ElementsAre("epoch=0-step=2.ckpt", "last.ckpt"));
  EXPECT_TRUE(snapshot(a.path()) == original) << "run A's directory changed";
  EXPECT_THAT(list_files(b.file("ckpts")), ElementsAre("epoch=1-step=4.ckpt", "last.ckpt"));
  EXPECT_EQ(fs::path(callback->best_model_path()).parent_path(), fs::path(b.file("ckpts")));
}

TEST(ModelCheckpoint, SanityCheckWritesNothing) {
  TempDir dir;
  LinearRegression model;
  log_scores(model);
  auto options = with_checkpoint(dir, {.monitor = "score", .save_top_k = -1});
  options.limit_train_batches = 0;  // only the sanity check runs
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), regression_loader(1));
  EXPECT_EQ(model.sanity_steps, 1);
  EXPECT_THAT(list_files(dir.path()), ::testing::IsEmpty());
}

// At the start of fit, what a save killed mid-write left in the directory
// (a dead writer's temporary file) goes; a live writer's stays, and so does
// everything else, even when the run saves nothing.
TEST(ModelCheckpoint, FitStartRemovesDeadWritersTemporaryFiles) {
  TempDir dir;
  const pid_t dead = fulgur::test::dead_pid();
  const std::string host = fulgur::test::host_name();
  fs::create_directories(dir.file("ckpts"));
  const std::string stale = fulgur::str("last.ckpt.tmp.", dead, ".", host);
  const std::string live = fulgur::str("last.ckpt.tmp.", ::getpid(), ".", host);
  for (const auto& name : {stale, live, std::string("notes.txt")}) {
    fulgur::test::write_text(dir.file("ckpts/" + name), "partial\n");
  }
  LinearRegression model;
  auto options = with_checkpoint(dir, {.save_top_k = 0, .save_last = false});
  fulgur::Trainer(options).fit(model, regression_loader(2));
  EXPECT_THAT(list_files(dir.file("ckpts")), ::testing::UnorderedElementsAre(live, "notes.txt"));
}

// ---- Crash consistency: a writer killed at any point of a save.

using SaveStep = fulgur::TorchCheckpointIO::SaveStep;

// Three epochs of 4 steps under `root`, checkpointing each epoch
// (epoch=N-step=M.ckpt, then last.ckpt: two saves an epoch) into
// `<root>/ckpts` through `io` (the default IO when null).
fulgur::TrainerOptions crash_options(const std::string& root,
                                     std::shared_ptr<fulgur::TorchCheckpointIO> io) {
  fulgur::TrainerOptions options{.accelerator = "cpu",
                                 .max_epochs = 3,
                                 .default_root_dir = root,
                                 .enable_checkpointing = true,
                                 .enable_progress_bar = false,
                                 .logger = false};
  options.callbacks.push_back(std::make_shared<fulgur::ModelCheckpoint>(
      fulgur::ModelCheckpointOptions{.dirpath = root + "/ckpts", .save_top_k = 1}));
  if (io) options.plugins.push_back(std::shared_ptr<fulgur::CheckpointIO>(std::move(io)));
  return options;
}

// The writer, in a process of its own (started by the test below through
// this binary): it trains into FULGUR_TEST_CRASH_DIR and SIGKILLs itself at
// FULGUR_TEST_CRASH_AT = "<save>:<step>:<chunk>" (the how-many-th save, a
// SaveStep, and for kWrote the chunk after which). A process of its own,
// not a fork: LibTorch 2.x refuses autograd in a child forked from a
// process that has used it.
TEST(CheckpointCrash, WriterChild) {
  const char* at = std::getenv("FULGUR_TEST_CRASH_AT");
  const char* dir = std::getenv("FULGUR_TEST_CRASH_DIR");
  if (at == nullptr || dir == nullptr) GTEST_SKIP() << "the writer of the test below";
  int save = 0, step = 0;
  long long chunk = 0;
  ASSERT_EQ(std::sscanf(at, "%d:%d:%lld", &save, &step, &chunk), 3) << at;
  auto io = std::make_shared<fulgur::TorchCheckpointIO>();
  int saves = 0;
  io->set_save_observer([&](SaveStep s, int64_t c) {
    if (s == SaveStep::kCreated) ++saves;
    if (saves == save && static_cast<int>(s) == step && (s != SaveStep::kWrote || c == chunk)) {
      ::kill(::getpid(), SIGKILL);
    }
  });
  LinearRegression model;
  fulgur::Trainer(crash_options(dir, io)).fit(model, regression_loader(4));
  FAIL() << "the kill point " << at << " never came";
}

// A writer SIGKILLed at each step of a save — the temporary file just
// created, after its first and a middle chunk, once flushed, once renamed
// into place, once its directory is flushed — during the second epoch's
// top-k save and during its last.ckpt rewrite. After each: every checkpoint
// left in the directory verifies, ckpt_path="last" resumes and finishes the
// run, and that next run leaves no temporary file behind.
TEST(CheckpointCrash, AWriterKilledAtAnyPointOfASaveLosesNothing) {
  struct Point {
    int save;
    SaveStep step;
    int64_t chunk;
    const char* name;
  };
  std::vector<Point> points;
  for (int save : {3, 4}) {
    points.push_back({save, SaveStep::kCreated, 0, "the temporary file created"});
    points.push_back({save, SaveStep::kWrote, 0, "the first chunk written"});
    points.push_back({save, SaveStep::kWrote, 8, "mid-write"});
    points.push_back({save, SaveStep::kFlushed, 0, "flushed, not yet renamed"});
    points.push_back({save, SaveStep::kRenamed, 0, "renamed, directory not flushed"});
    points.push_back({save, SaveStep::kDirectoryFlushed, 0, "durable"});
  }
  for (const Point& point : points) {
    SCOPED_TRACE(fulgur::str("killed in save ", point.save, " at ", point.name));
    TempDir dir;
    const auto writer = fulgur::test::run_test_alone(
        "CheckpointCrash.WriterChild",
        {{"FULGUR_TEST_CRASH_DIR", dir.path()},
         {"FULGUR_TEST_CRASH_AT",
          fulgur::str(point.save, ":", static_cast<int>(point.step), ":", point.chunk)}},
        std::chrono::seconds(60));
    ASSERT_EQ(writer.signal, SIGKILL) << "the writer was not killed there:\n" << writer.output;

    // Every checkpoint left verifies (a temporary file may be left).
    const fs::path ckpts = dir.file("ckpts");
    int checkpoints = 0;
    for (const auto& name : list_files(ckpts.string())) {
      if (fs::path(name).extension() != ".ckpt") continue;
      ++checkpoints;
      EXPECT_EQ(fulgur::TorchCheckpointIO().verify((ckpts / name).string()), "") << name;
    }
    EXPECT_GE(checkpoints, 2);  // the first epoch's two saves at least

    // "last" resumes from the newest that verifies and finishes the run.
    LinearRegression resumed;
    fulgur::FitResult result;
    ASSERT_NO_THROW(result =
                        fulgur::Trainer(crash_options(dir.path(), nullptr))
                            .fit(resumed, regression_loader(4), nullptr, {.ckpt_path = "last"}));
    EXPECT_EQ(result.global_step, 12);
    EXPECT_GE(resumed.training_steps, 4);  // resumed, not restarted
    EXPECT_LE(resumed.training_steps, 8);
    for (const auto& name : list_files(ckpts.string())) {
      EXPECT_EQ(name.find(".tmp."), std::string::npos) << "left behind: " << name;
      EXPECT_EQ(fulgur::TorchCheckpointIO().verify((ckpts / name).string()), "") << name;
    }
  }
}

}  // namespace
