#include "fulgur/callbacks/timer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

fulgur::Timer* timer_of(const fulgur::Trainer& trainer) {
  for (const auto& cb : trainer.callbacks()) {
    if (auto* t = dynamic_cast<fulgur::Timer*>(cb.get())) return t;
  }
  return nullptr;
}

// A model whose every step takes at least 20 ms.
struct SlowModel : LinearRegression {
  SlowModel() {
    train_hook = [](LinearRegression&, fulgur::Batch&, int64_t) {
      std::this_thread::sleep_for(20ms);
    };
  }
};

// Each step takes at least 20 ms; max_time is 50 ms: fit stops after the
// step that crosses it, far before its 100 steps, and saves its checkpoint.
TEST(Timer, MaxTimeStopsFitWithACheckpoint) {
  TempDir dir;
  SlowModel model;
  auto options = test_options(dir);
  options.max_time = 50ms;
  options.enable_checkpointing = true;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(100));
  auto* timer = timer_of(trainer);
  ASSERT_NE(timer, nullptr);
  EXPECT_TRUE(timer->stopped());
  EXPECT_GE(result.global_step, 1);
  EXPECT_LT(result.global_step, 100);
  EXPECT_GE(timer->time_elapsed(), 50ms);
  EXPECT_TRUE(std::filesystem::exists(dir.file("checkpoints/last.ckpt")));
}

// The checkpoint written at the end of the epoch that max_time cut short
// (in the callbacks' on_train_epoch_end, after the Timer's stop) resumes
// into that epoch's end; with more time the fit trains on: the stop was the
// Timer's, decided again from its elapsed time, not kept by the loop.
TEST(Timer, AStoppedRunResumedWithMoreTimeTrainsOn) {
  TempDir dir;
  auto options = test_options(dir);
  options.max_time = 50ms;
  options.max_epochs = 2;
  options.enable_checkpointing = true;
  int64_t stopped_at = 0;
  {
    SlowModel model;
    fulgur::Trainer trainer(options);
    stopped_at = trainer.fit(model, regression_loader(100)).global_step;
  }
  ASSERT_LT(stopped_at, 100);
  options.max_time = 1h;
  LinearRegression model;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(100), nullptr, {.ckpt_path = "last"});
  EXPECT_EQ(model.training_steps, 100);
  EXPECT_EQ(result.global_step, stopped_at + 100);
  EXPECT_EQ(result.stop_reason, "max_epochs");
}

// A run resumed from a checkpoint of a run its Timer stopped, with the same
// duration, trains no further (the time is checked as the fit starts, after
// the checkpoint's time is loaded, as Lightning's): under the step interval
// it trained one more step, under the epoch interval a whole epoch.
TEST(Timer, AResumeOfARunWhoseTimeIsSpentTrainsNoFurther) {
  for (const char* interval : {"step", "epoch"}) {
    SCOPED_TRACE(interval);
    TempDir dir;
    auto options = test_options(dir);
    options.max_epochs = 4;
    options.enable_checkpointing = true;
    options.callbacks = {std::make_shared<fulgur::Timer>(
        fulgur::TimerOptions{.duration = 50ms, .interval = interval})};
    int64_t stopped_at = 0;
    {
      SlowModel model;
      fulgur::Trainer trainer(options);
      stopped_at = trainer.fit(model, regression_loader(5)).global_step;
    }
    ASSERT_LT(stopped_at, 20);
    LinearRegression model;
    ::testing::internal::CaptureStderr();
    fulgur::Trainer trainer(options);
    auto result = trainer.fit(model, regression_loader(5), nullptr, {.ckpt_path = "last"});
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(model.training_steps, 0);
    EXPECT_EQ(result.global_step, stopped_at);
    EXPECT_EQ(result.stop_reason, "should_stop");
    EXPECT_THAT(err, HasSubstr("of training reached max_time=0.05 s")) << err;
  }
}

// Under the epoch interval a run resumed from within an epoch whose time was
// already spent trains to the epoch's end, where the uninterrupted run
// checked and stopped (not at the resume: the time is checked at fit start
// only at an epoch's boundary).
TEST(Timer, UnderTheEpochIntervalAResumeWithinAnEpochStopsAtItsEnd) {
  TempDir dir;
  auto options = test_options(dir);
  options.max_epochs = 4;
  options.enable_checkpointing = true;
  auto timer_options = fulgur::TimerOptions{.duration = 50ms, .interval = "epoch"};
  auto every_second_step = [&] {
    return std::make_shared<fulgur::ModelCheckpoint>(fulgur::ModelCheckpointOptions{
        .dirpath = dir.file("steps"), .save_top_k = -1, .every_n_train_steps = 2});
  };
  options.callbacks = {std::make_shared<fulgur::Timer>(timer_options), every_second_step()};
  {
    SlowModel model;  // 4 steps of at least 20 ms: the time is spent at step 4
    auto result = fulgur::Trainer(options).fit(model, regression_loader(5));
    ASSERT_EQ(result.global_step, 5);  // stopped at the epoch's end
  }
  options.callbacks = {std::make_shared<fulgur::Timer>(timer_options), every_second_step()};
  LinearRegression model;
  auto result = fulgur::Trainer(options).fit(model, regression_loader(5), nullptr,
                                             {.ckpt_path = dir.file("steps/epoch=0-step=4.ckpt")});
  EXPECT_EQ(model.training_steps, 1);
  EXPECT_EQ(result.global_step, 5);
  EXPECT_EQ(result.stop_reason, "should_stop");
}

// A stop in the middle of an epoch validates where it stops (as
// Lightning's): the monitored ModelCheckpoint ranks the weights the run
// stopped with (before, it kept last.ckpt and ranked nothing), once.
TEST(Timer, AStopMidEpochValidatesAndTheMonitoredCheckpointRanksIt) {
  TempDir dir;
  SlowModel model;
  auto options = fulgur::test::checkpointed_options(dir, {.monitor = "val_loss"});
  options.max_time = 50ms;
  options.num_sanity_val_steps = 0;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(100), regression_loader(2));
  EXPECT_LT(result.global_step, 100);
  EXPECT_EQ(model.count("on_validation_epoch_start"), 1);
  EXPECT_TRUE(std::filesystem::exists(dir.file("checkpoints/last.ckpt")));
  EXPECT_EQ(trainer.checkpoint_callback()->best_model_path(),
            dir.file("checkpoints/epoch=0-step=" + std::to_string(result.global_step) + ".ckpt"));
  EXPECT_EQ(trainer.checkpoint_callback()->best_model_score(),
            trainer.callback_metrics().at("val_loss"));
}

// The time trained is in the checkpoint: a resumed run counts on from it.
TEST(Timer, AResumedRunCountsOnFromTheCheckpoint) {
  TempDir dir;
  auto options = test_options(dir);
  options.enable_checkpointing = true;
  options.max_time = 1h;
  {
    LinearRegression model;
    model.train_hook = [](LinearRegression&, fulgur::Batch&, int64_t) {
      std::this_thread::sleep_for(30ms);
    };
    fulgur::Trainer trainer(options);
    trainer.fit(model, regression_loader(3));
  }
  LinearRegression model;
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(3), nullptr, {.ckpt_path = "last"});
  EXPECT_GE(timer_of(trainer)->time_elapsed(), 90ms);
}

// A fit from the start has the whole duration again: the Trainer's Timer
// of a second fit had stopped once and latched, and the second fit ran all
// its epochs (or, with the first fit's time kept, stopped after one).
TEST(Timer, ASecondFitHasTheWholeDurationAgain) {
  TempDir dir;
  auto options = test_options(dir);
  options.max_time = 300ms;  // each epoch sleeps 20 ms: several epochs
  options.max_epochs = 1000;
  fulgur::Trainer trainer(options);
  for (int fit = 0; fit < 2; ++fit) {
    SCOPED_TRACE(fit);
    SlowModel model;
    auto result = trainer.fit(model, regression_loader(1));
    EXPECT_EQ(result.stop_reason, "should_stop");
    EXPECT_GT(result.epochs, 1);
    EXPECT_LT(result.epochs, 1000);
    EXPECT_TRUE(timer_of(trainer)->stopped());
    EXPECT_GE(timer_of(trainer)->time_elapsed(), 300ms);
  }
}

TEST(Timer, BadDurationsAreErrors) {
  TempDir dir;
  auto options = test_options(dir);
  options.max_time = 0ms;
  EXPECT_THROW(fulgur::Trainer{options}, fulgur::ConfigError);
  options.max_time = 1s;
  options.callbacks = {std::make_shared<fulgur::Timer>(fulgur::TimerOptions{.duration = 2s})};
  try {
    fulgur::Trainer trainer(options);
    ADD_FAILURE() << "no error";
  } catch (const fulgur::ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("max_time is set and callbacks[0] is a Timer too"));
  }
  EXPECT_THROW(fulgur::Timer({.duration = -1s}), fulgur::ConfigError);
}

}  // namespace
