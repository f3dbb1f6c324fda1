// The EMA callback: the average against the formula applied to the weights
// after each optimizer step (once per step under gradient accumulation, every
// n-th step), validation with the averaged weights and the training weights
// back after it, the module keeping the average at the end, a second fit
// from the start averaging afresh, a resumed run ending bit-identical, and
// bad options and a checkpoint's average of another model named.
#include "fulgur/callbacks/ema.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::EMA;
using fulgur::EMAOptions;
using fulgur::test::clone_parameters;
using fulgur::test::expect_tensors_equal;
using fulgur::test::LinearRegression;
using fulgur::test::parameters_equal;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using ::testing::HasSubstr;

// Records the module's parameters after every optimizer step (it runs after
// the EMA callback, which comes first in the list).
class StepRecorder : public fulgur::Callback {
 public:
  std::string state_key() const override { return "StepRecorder"; }
  void on_train_start(fulgur::Trainer&, fulgur::Module& m) override {
    if (steps.empty()) steps.push_back(clone_parameters(m));
  }
  void on_train_batch_end(fulgur::Trainer& t, fulgur::Module& m, const at::Tensor&,
                          const fulgur::Batch&, int64_t) override {
    if (t.global_step() == last) return;
    last = t.global_step();
    steps.push_back(clone_parameters(m));
  }
  std::vector<std::vector<at::Tensor>> steps;  // [0]: before the first step
  int64_t last = 0;
};

// The formula, with the callback's own operations.
std::vector<at::Tensor> expected_average(const std::vector<std::vector<at::Tensor>>& steps,
                                         double decay, int64_t every_n) {
  std::vector<at::Tensor> average;
  for (const auto& p : steps[0]) average.push_back(p.clone());
  for (size_t k = 1; k < steps.size(); ++k) {
    if (static_cast<int64_t>(k) % every_n != 0) continue;
    for (size_t i = 0; i < average.size(); ++i) average[i].mul_(decay).add_(steps[k][i], 1 - decay);
  }
  return average;
}

// `plain` (the trained model's initial weights), fitted for `epochs` of 4
// batches with a validation of 2 and no callbacks, ends with `trained`'s
// weights.
void expect_trained_as_without_callbacks(const TempDir& dir, int64_t epochs,
                                         LinearRegression& plain, LinearRegression& trained) {
  auto options = test_options(dir);
  options.max_epochs = epochs;
  options.num_sanity_val_steps = 0;
  options.default_root_dir = dir.file("plain");
  fulgur::Trainer(options).fit(plain, regression_loader(4), regression_loader(2));
  EXPECT_TRUE(parameters_equal(plain, trained));
}

TEST(EMA, TheAverageIsTheFormulaOverTheWeightsAfterEachStep) {
  TempDir dir;
  LinearRegression model;
  auto ema = std::make_shared<EMA>(EMAOptions{.decay = 0.75, .apply_at_end = false});
  auto recorder = std::make_shared<StepRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.callbacks = {ema, recorder};
  auto result = fulgur::Trainer(options).fit(model, regression_loader(4));
  ASSERT_EQ(result.global_step, 8);
  ASSERT_EQ(recorder->steps.size(), 9u);
  expect_tensors_equal(ema->average(), expected_average(recorder->steps, 0.75, 1));
  EXPECT_EQ(ema->last_update_step(), 8);
  // apply_at_end=false: the module keeps its last training weights.
  expect_tensors_equal(clone_parameters(model), recorder->steps.back());
}

TEST(EMA, EveryNthOptimizerStepNotEveryMicroBatch) {
  TempDir dir;
  LinearRegression model;
  auto ema = std::make_shared<EMA>(EMAOptions{.decay = 0.5, .every_n_steps = 2});
  auto recorder = std::make_shared<StepRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 3;
  options.accumulate_grad_batches = 2;
  options.callbacks = {ema, recorder};
  auto result = fulgur::Trainer(options).fit(model, regression_loader(4));
  ASSERT_EQ(result.global_step, 6);
  expect_tensors_equal(ema->average(), expected_average(recorder->steps, 0.5, 2));
  EXPECT_EQ(ema->last_update_step(), 6);
  // apply_at_end (the default): the module ends with the average.
  expect_tensors_equal(clone_parameters(model), ema->average());
}

TEST(EMA, ValidationRunsWithTheAverageAndTrainingGoesOnWithItsOwnWeights) {
  TempDir dir;
  LinearRegression model;
  std::vector<std::vector<at::Tensor>> seen_in_validation;
  model.val_hook = [&](LinearRegression& m, fulgur::Batch&, int64_t batch_idx) {
    if (batch_idx == 0) seen_in_validation.push_back(clone_parameters(m));
  };
  auto ema = std::make_shared<EMA>(EMAOptions{.decay = 0.9, .apply_at_end = false});
  auto recorder = std::make_shared<StepRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.num_sanity_val_steps = 0;
  options.callbacks = {ema, recorder};
  fulgur::Trainer(options).fit(model, regression_loader(4), regression_loader(2));
  ASSERT_EQ(seen_in_validation.size(), 2u);
  // After epoch 1's 4 steps, validation saw the average of those.
  std::vector<std::vector<at::Tensor>> first_epoch(recorder->steps.begin(),
                                                   recorder->steps.begin() + 5);
  expect_tensors_equal(seen_in_validation[0], expected_average(first_epoch, 0.9, 1));
  // ...and epoch 2 trained on from the weights of step 4, not the average:
  // the run ends as the formula over the recorded steps says.
  expect_tensors_equal(ema->average(), expected_average(recorder->steps, 0.9, 1));
  expect_tensors_equal(clone_parameters(model), recorder->steps.back());
  EXPECT_FALSE(torch::equal(seen_in_validation[0][0], recorder->steps[4][0]));
}

// A second fit from the start (no checkpoint) with the same callback
// averages afresh from its own first weights, as Lightning's weight
// averaging does: nothing of the first fit's average carries over, and the
// step of its last update does not hide the new fit's step of that number.
TEST(EMA, ASecondFitFromTheStartAveragesAfresh) {
  TempDir dir;
  LinearRegression model;
  auto ema = std::make_shared<EMA>(EMAOptions{.decay = 0.5, .apply_at_end = false});
  auto recorder = std::make_shared<StepRecorder>();
  auto options = test_options(dir);
  options.callbacks = {ema, recorder};
  fulgur::Trainer(options).fit(model, regression_loader(4));
  expect_tensors_equal(ema->average(), expected_average(recorder->steps, 0.5, 1));

  options.max_epochs = 2;
  recorder->last = 0;
  fulgur::Trainer(options).fit(model, regression_loader(4));
  ASSERT_EQ(recorder->steps.size(), 13u);  // 4 steps, then 8 from the end of those
  const std::vector<std::vector<at::Tensor>> second(recorder->steps.begin() + 4,
                                                    recorder->steps.end());
  expect_tensors_equal(ema->average(), expected_average(second, 0.5, 1));
  EXPECT_EQ(ema->last_update_step(), 8);
}

TEST(EMA, AResumedRunEndsBitIdenticalToTheUninterruptedOne) {
  TempDir whole, parts;
  LinearRegression uninterrupted, first, resumed;
  fulgur::test::copy_parameters(uninterrupted, first);
  fulgur::test::copy_parameters(uninterrupted, resumed);
  auto options = test_options(whole);
  options.enable_checkpointing = true;
  options.max_epochs = 3;
  auto full_ema = std::make_shared<EMA>(EMAOptions{.decay = 0.8});
  options.callbacks = {full_ema};
  fulgur::Trainer(options).fit(uninterrupted, regression_loader(4));

  options.default_root_dir = parts.path();
  options.max_epochs = 2;
  options.callbacks = {std::make_shared<EMA>(EMAOptions{.decay = 0.8})};
  fulgur::Trainer(options).fit(first, regression_loader(4));
  options.max_epochs = 3;
  auto resumed_ema = std::make_shared<EMA>(EMAOptions{.decay = 0.8});
  options.callbacks = {resumed_ema};
  fulgur::Trainer(options).fit(resumed, regression_loader(4), nullptr, {.ckpt_path = "last"});
  EXPECT_EQ(resumed_ema->last_update_step(), 12);
  expect_tensors_equal(resumed_ema->average(), full_ema->average());
  EXPECT_TRUE(parameters_equal(uninterrupted, resumed));
}

// A checkpoint whose weights in EMA's state do not fit the module (edited,
// or written by another program) is refused when training resumes, naming
// the parameter, both shapes and what to do: the training weights where
// the module's are the average (validate_with_average), the average where
// they are the training weights.
TEST(EMA, ACheckpointWhoseWeightsDoNotFitTheModuleAreRefusedNamingTheParameter) {
  for (const bool validate_with_average : {true, false}) {
    SCOPED_TRACE(validate_with_average);
    TempDir dir;
    LinearRegression model;  // fc: weight [1, 3], bias [1]
    const EMAOptions ema_options{.validate_with_average = validate_with_average};
    auto options = test_options(dir);
    options.enable_checkpointing = true;
    options.callbacks = {std::make_shared<EMA>(ema_options)};
    fulgur::Trainer(options).fit(model, regression_loader(4));
    fulgur::TorchCheckpointIO io;
    fulgur::StateDict checkpoint = io.load_checkpoint(dir.file("checkpoints/last.ckpt"));
    fulgur::StateDict* ema_state = checkpoint.section("callbacks").find_section("EMA");
    ASSERT_NE(ema_state, nullptr);
    const std::string key = validate_with_average ? "training_0" : "average_0";
    ASSERT_TRUE(ema_state->contains(key));
    EXPECT_EQ(ema_state->boolean("module_holds_average"), validate_with_average);
    ema_state->set_buffer(key, torch::zeros({3, 3}));
    io.save_checkpoint(checkpoint, dir.file("edited.ckpt"));

    LinearRegression resumed;
    options.max_epochs = 2;
    options.callbacks = {std::make_shared<EMA>(ema_options)};
    try {
      fulgur::Trainer(options).fit(resumed, regression_loader(4), nullptr,
                                   {.ckpt_path = dir.file("edited.ckpt")});
      ADD_FAILURE() << "no error";
    } catch (const fulgur::ConfigError& e) {
      EXPECT_THAT(e.what(), HasSubstr("EMA: the copy of the weights it holds"));
      EXPECT_THAT(e.what(), HasSubstr("weight\" is of shape [1, 3], its value of shape [3, 3]"));
      EXPECT_THAT(e.what(), HasSubstr("Resume from a checkpoint of this model"));
    }
  }
}

// An error in a validation, while the module holds the average: the
// exception's checkpoint has the training weights whatever the callbacks'
// order (OnExceptionCheckpoint runs after EMA put them back, as Lightning's
// checkpoint callbacks run last), so a resume trains on from them.
TEST(EMA, AnExceptionsCheckpointHoldsTheTrainingWeights) {
  TempDir dir;
  LinearRegression model;
  int validations = 0;
  model.val_hook = [&](LinearRegression&, fulgur::Batch&, int64_t) {
    if (++validations == 2) throw std::runtime_error("a bug in the second validation");
  };
  auto options = test_options(dir);
  options.max_epochs = 3;
  options.num_sanity_val_steps = 0;
  options.callbacks = {std::make_shared<fulgur::OnExceptionCheckpoint>(),
                       std::make_shared<EMA>(EMAOptions{.decay = 0.5})};
  fulgur::Trainer trainer(options);
  EXPECT_THROW(trainer.fit(model, regression_loader(2), regression_loader(1)), std::runtime_error);
  LinearRegression saved;
  fulgur::Trainer reader(test_options(dir));
  reader.validate(saved, regression_loader(1), dir.file("checkpoints/on_exception.ckpt"));
  EXPECT_TRUE(parameters_equal(saved, model));
}

// A checkpoint's module weights are the weights its validation measured, as
// Lightning's weight averaging writes them: with validate_with_average the
// average (so the best checkpoint, evaluated again, gives exactly the score
// ModelCheckpoint ranked it by; it used to hold the training weights),
// without it the training weights. Training went on from the training
// weights either way (the last step's weights are not the average).
TEST(EMA, ACheckpointsModuleWeightsAreTheOnesItsValidationMeasured) {
  for (const bool validate_with_average : {true, false}) {
    SCOPED_TRACE(validate_with_average);
    TempDir dir;
    LinearRegression model, plain;
    fulgur::test::copy_parameters(model, plain);
    auto ema = std::make_shared<EMA>(EMAOptions{
        .decay = 0.7, .validate_with_average = validate_with_average, .apply_at_end = false});
    auto recorder = std::make_shared<StepRecorder>();
    auto checkpoint = std::make_shared<fulgur::ModelCheckpoint>(
        fulgur::ModelCheckpointOptions{.monitor = "val_loss", .save_last = false});
    auto options = test_options(dir);
    options.max_epochs = 3;
    options.num_sanity_val_steps = 0;
    options.enable_checkpointing = true;
    options.callbacks = {ema, recorder, checkpoint};
    auto result = fulgur::Trainer(options).fit(model, regression_loader(4), regression_loader(2));
    ASSERT_FALSE(result.best_model_path.empty());
    expect_tensors_equal(clone_parameters(model), recorder->steps.back());
    // The saves gave the training weights back exactly: the run trained as
    // one without EMA or checkpoints.
    expect_trained_as_without_callbacks(dir, 3, plain, model);

    LinearRegression loaded;
    fulgur::Trainer reader(test_options(dir));
    const auto metrics = reader.validate(loaded, regression_loader(2), result.best_model_path);
    ASSERT_TRUE(checkpoint->best_model_score().has_value());
    EXPECT_DOUBLE_EQ(metrics.at("val_loss"), *checkpoint->best_model_score());
    // The best checkpoint is one of the epochs' ends: its module weights are
    // that step's average or its training weights.
    const int64_t step = fulgur::TorchCheckpointIO()
                             .load_checkpoint(result.best_model_path)
                             .section_at("loops")
                             .integer("global_step");
    ASSERT_TRUE(step % 4 == 0 && step > 0) << step;
    const std::vector<std::vector<at::Tensor>> until(recorder->steps.begin(),
                                                     recorder->steps.begin() + step + 1);
    expect_tensors_equal(clone_parameters(loaded), validate_with_average
                                                       ? expected_average(until, 0.7, 1)
                                                       : recorder->steps[step]);
  }
}

// A checkpoint whose module weights are an EMA's average, resumed by a fit
// without an EMA: its training weights are in the EMA's state, which nothing
// loads, so training goes on from the average. A note says so, and names
// what to pass.
TEST(EMA, AResumeWithoutTheEmaSaysTrainingGoesOnFromTheAverage) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.enable_checkpointing = true;
  options.callbacks = {std::make_shared<EMA>(EMAOptions{.decay = 0.5})};
  fulgur::Trainer(options).fit(model, regression_loader(4));

  LinearRegression resumed;
  options.max_epochs = 2;
  auto recorder = std::make_shared<StepRecorder>();
  options.callbacks = {recorder};
  ::testing::internal::CaptureStderr();
  fulgur::Trainer(options).fit(resumed, regression_loader(4), nullptr,
                               {.ckpt_path = dir.file("checkpoints/last.ckpt")});
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr("holds the state of callback(s) \"EMA\", which this fit has none "
                             "of (no callback of that state_key()): not loaded. Its module "
                             "weights are an EMA's average"));
  EXPECT_THAT(err, HasSubstr("training goes on from the average. To go on with them, pass the "
                             "callbacks the run that wrote it had"));
  // The checkpoint was the epoch's end, after its last update: the first
  // run's average (which apply_at_end gave its module).
  ASSERT_FALSE(recorder->steps.empty());
  expect_tensors_equal(recorder->steps[0], clone_parameters(model));
}

// Saves from a callback's hooks: from within a step (on_before_backward,
// autograd holding the parameters) the module's weights are left as they
// are (a swap used to make backward fail: "modified by an inplace
// operation"), so the file holds the training weights as the module's and
// the average as EMA's state; from within a validation, where the average
// is swapped in, the average as the module's and the training weights as
// EMA's state. Either way the run trains as without the saves.
TEST(EMA, SavesFromWithinAStepAndFromWithinAValidationHoldBothWeights) {
  class Saver : public fulgur::Callback {
   public:
    explicit Saver(const TempDir& dir) : dir_(dir) {}
    std::string state_key() const override { return "Saver"; }
    void on_before_backward(fulgur::Trainer& t, fulgur::Module& m, const at::Tensor&) override {
      if (t.global_step() != 2 || !in_step.empty()) return;
      in_step = clone_parameters(m);
      t.save_checkpoint(dir_.file("in_step.ckpt"));
    }
    void on_validation_epoch_end(fulgur::Trainer& t, fulgur::Module& m) override {
      if (!in_validation.empty()) return;
      in_validation = clone_parameters(m);
      t.save_checkpoint(dir_.file("in_validation.ckpt"));
    }
    std::vector<at::Tensor> in_step, in_validation;

   private:
    const TempDir& dir_;
  };
  TempDir dir;
  LinearRegression model, plain;
  fulgur::test::copy_parameters(model, plain);
  auto ema = std::make_shared<EMA>(EMAOptions{.decay = 0.6, .apply_at_end = false});
  auto recorder = std::make_shared<StepRecorder>();
  auto saver = std::make_shared<Saver>(dir);
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.num_sanity_val_steps = 0;
  options.callbacks = {ema, recorder, saver};
  fulgur::Trainer(options).fit(model, regression_loader(4), regression_loader(2));
  ASSERT_FALSE(saver->in_step.empty());
  ASSERT_FALSE(saver->in_validation.empty());

  auto read = [&](const std::string& name, bool module_holds_average) {
    fulgur::TorchCheckpointIO io;
    const fulgur::StateDict checkpoint = io.load_checkpoint(dir.file(name));
    const fulgur::StateDict& state = checkpoint.section_at("callbacks").section_at("EMA");
    EXPECT_EQ(state.boolean("module_holds_average"), module_holds_average) << name;
    std::vector<at::Tensor> kept;
    for (int64_t i = 0; i < state.integer("count"); ++i) {
      kept.push_back(
          state.tensor((module_holds_average ? "training_" : "average_") + std::to_string(i)));
    }
    LinearRegression loaded;
    fulgur::Trainer(test_options(dir)).validate(loaded, regression_loader(2), dir.file(name));
    return std::make_pair(clone_parameters(loaded), kept);
  };
  // Step 2's backward: the weights after step 2, the average of steps 0-2.
  const std::vector<std::vector<at::Tensor>> two(recorder->steps.begin(),
                                                 recorder->steps.begin() + 3);
  const auto [step_module, step_kept] = read("in_step.ckpt", false);
  expect_tensors_equal(step_module, recorder->steps[2]);
  expect_tensors_equal(saver->in_step, recorder->steps[2]);
  expect_tensors_equal(step_kept, expected_average(two, 0.6, 1));
  // The first validation, after step 4: the module held the average.
  const std::vector<std::vector<at::Tensor>> four(recorder->steps.begin(),
                                                  recorder->steps.begin() + 5);
  const auto [validation_module, validation_kept] = read("in_validation.ckpt", true);
  expect_tensors_equal(saver->in_validation, expected_average(four, 0.6, 1));
  expect_tensors_equal(validation_module, saver->in_validation);
  expect_tensors_equal(validation_kept, recorder->steps[4]);

  expect_trained_as_without_callbacks(dir, 2, plain, model);
}

TEST(EMA, BadOptionsAreNamed) {
  try {
    EMA bad(EMAOptions{.decay = 1.0, .every_n_steps = 0});
    ADD_FAILURE() << "no error";
  } catch (const fulgur::ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("decay=1: must be in [0, 1)"));
    EXPECT_THAT(e.what(), HasSubstr("every_n_steps=0: must be >= 1"));
  }
}

}  // namespace
