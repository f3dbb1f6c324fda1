// Learning-rate schedules: LambdaLR and ReduceLROnPlateau against values
// worked out by hand; a run resumed from any checkpoint (mid-epoch, the last
// batch of an epoch before its scheduler step, after an epoch boundary) ends
// bit-identical to the uninterrupted one under a per-epoch, a per-step, a
// metric-driven and a callback-driven schedule; and the errors of a
// SchedulerConfig that cannot work.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using fulgur::test::list_files;
using fulgur::test::parameters_equal;
using fulgur::test::regression_dataset;
using fulgur::test::TempDir;
using fulgur::test::test_options;

std::vector<double> lrs(const torch::optim::Optimizer& optimizer) {
  std::vector<double> out;
  for (const auto& group : optimizer.param_groups()) out.push_back(group.options().get_lr());
  return out;
}

std::shared_ptr<torch::optim::SGD> two_group_sgd(double lr0, double lr1) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{torch::zeros({2}, torch::requires_grad())},
                      std::make_unique<torch::optim::SGDOptions>(lr0));
  groups.emplace_back(std::vector<at::Tensor>{torch::zeros({3}, torch::requires_grad())},
                      std::make_unique<torch::optim::SGDOptions>(lr1));
  return std::make_shared<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(lr0));
}

// ---- The schedules' values.

TEST(LambdaLR, AppliesFactorZeroAtOnceAndFactorNAfterNSteps) {
  auto sgd = two_group_sgd(0.5, 2.0);
  fulgur::LambdaLR schedule(*sgd, [](int64_t step) { return 1.0 / (step + 2.0); });
  EXPECT_THAT(lrs(*sgd), ::testing::ElementsAre(0.25, 1.0));
  schedule.step();
  EXPECT_THAT(lrs(*sgd), ::testing::ElementsAre(0.5 / 3.0, 2.0 / 3.0));
  schedule.step();
  schedule.step();
  EXPECT_THAT(lrs(*sgd), ::testing::ElementsAre(0.5 / 5.0, 2.0 / 5.0));
  EXPECT_THAT(schedule.base_lrs(), ::testing::ElementsAre(0.5, 2.0));
}

// A group added after the scheduler was made (BaseFinetuning's) keeps the
// rate it is given, as under PyTorch's LambdaLR; the first ones follow the
// schedule.
TEST(LambdaLR, AGroupAddedLaterKeepsItsOwnRate) {
  auto sgd = two_group_sgd(0.5, 2.0);
  fulgur::LambdaLR schedule(*sgd, [](int64_t step) { return 1.0 / (step + 1.0); });
  sgd->add_param_group(torch::optim::OptimizerParamGroup(
      std::vector<at::Tensor>{torch::zeros({4}, torch::requires_grad())},
      std::make_unique<torch::optim::SGDOptions>(0.125)));
  schedule.step();
  EXPECT_THAT(lrs(*sgd), ::testing::ElementsAre(0.25, 1.0, 0.125));
  sgd->param_groups()[2].options().set_lr(0.0625);
  schedule.step();
  EXPECT_THAT(lrs(*sgd), ::testing::ElementsAre(0.5 / 3.0, 2.0 / 3.0, 0.0625));
}

TEST(LambdaLR, RefusesAnEmptyFunction) {
  auto sgd = two_group_sgd(0.5, 2.0);
  EXPECT_THROW(fulgur::LambdaLR(*sgd, nullptr), fulgur::ConfigError);
}

TEST(ReduceLROnPlateau, ReducesAfterPatienceBadStepsThenRestsForTheCooldown) {
  auto sgd = two_group_sgd(1.0, 0.1);
  fulgur::ReduceLROnPlateau plateau(
      *sgd, {.factor = 0.5, .patience = 1, .threshold = 0.0, .cooldown = 1, .min_lr = 0.3});
  // value:      5    4    4    4    4    4    3    3    3
  // better:     y    y    n    n    n    n    y    n    n
  // bad count:  0    0    1    2->0 0(cd) 1    0    1    2->0
  // lr group 0: 1    1    1    .5   .5   .5   .5   .5   .3 (min_lr)
  // group 1 stays 0.1: below min_lr already, no reduction is applied.
  const std::vector<double> values = {5, 4, 4, 4, 4, 4, 3, 3, 3};
  const std::vector<double> expected = {1, 1, 1, 0.5, 0.5, 0.5, 0.5, 0.5, 0.3};
  for (size_t i = 0; i < values.size(); ++i) {
    plateau.step(values[i]);
    EXPECT_DOUBLE_EQ(lrs(*sgd)[0], expected[i]) << "after value " << i;
    EXPECT_DOUBLE_EQ(lrs(*sgd)[1], 0.1) << "after value " << i;
  }
  EXPECT_EQ(plateau.best(), 3.0);
}

TEST(ReduceLROnPlateau, MaxModeWithAnAbsoluteThreshold) {
  auto sgd = two_group_sgd(1.0, 1.0);
  fulgur::ReduceLROnPlateau plateau(
      *sgd,
      {.mode = "max", .factor = 0.1, .patience = 0, .threshold = 0.5, .threshold_mode = "abs"});
  plateau.step(1.0);  // better than -inf
  EXPECT_DOUBLE_EQ(lrs(*sgd)[0], 1.0);
  plateau.step(1.4);  // not above 1.0 + 0.5: bad, patience 0
  EXPECT_DOUBLE_EQ(lrs(*sgd)[0], 0.1);
  plateau.step(1.6);  // above 1.5
  EXPECT_DOUBLE_EQ(lrs(*sgd)[0], 0.1);
  EXPECT_EQ(plateau.best(), 1.6);
  plateau.step(std::nan(""));  // never better
  EXPECT_NEAR(lrs(*sgd)[0], 0.01, 1e-15);
}

TEST(ReduceLROnPlateau, RefusesEveryBadOptionInOneError) {
  auto sgd = two_group_sgd(1.0, 1.0);
  try {
    fulgur::ReduceLROnPlateau(
        *sgd, {.mode = "lowest", .factor = 1.5, .patience = -1, .threshold_mode = "relative"});
    FAIL() << "no error";
  } catch (const fulgur::ConfigError& e) {
    const std::string what = e.what();
    for (const char* part :
         {"mode=\"lowest\"", "factor=1.5", "patience=-1", "threshold_mode=\"relative\""}) {
      EXPECT_NE(what.find(part), std::string::npos) << what;
    }
  }
}

TEST(ReduceLROnPlateau, StateRoundTripsThroughAStateDictAndAnArchive) {
  auto sgd = two_group_sgd(1.0, 1.0);
  fulgur::ReduceLROnPlateau plateau(*sgd, {.patience = 3, .cooldown = 2});
  for (double v : {3.0, 2.0, 2.5, 2.5}) plateau.step(v);
  const fulgur::StateDict state = plateau.state_dict();
  EXPECT_EQ(state.keys(), (std::vector<std::string>{"best", "num_bad_steps", "cooldown_counter"}));
  for (const fulgur::StateDict& loaded : {state, fulgur::from_bytes(fulgur::to_bytes(state))}) {
    auto other_sgd = two_group_sgd(1.0, 1.0);
    fulgur::ReduceLROnPlateau other(*other_sgd, {.patience = 3, .cooldown = 2});
    other.load_state_dict(loaded);
    EXPECT_EQ(other.best(), 2.0);
    EXPECT_EQ(other.num_bad_steps(), 2);
    EXPECT_EQ(other.cooldown_counter(), 0);
  }
}

TEST(ReduceLROnPlateau, RefusesAStateWithoutItsCounters) {
  auto sgd = two_group_sgd(1.0, 1.0);
  fulgur::ReduceLROnPlateau plateau(*sgd, {.patience = 3});
  fulgur::StateDict state;
  state.set("best", 2.0);
  state.set("num_bad_steps", int64_t{1});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, plateau.load_state_dict(state),
                     {"ReduceLROnPlateau", "cooldown_counter", "holds best, num_bad_steps"});
  EXPECT_EQ(plateau.num_bad_steps(), 0);
}

// ---- Resuming under a schedule.

enum class Schedule { PerEpoch, PerStep, Plateau, Callback };

std::string to_string(Schedule s) {
  switch (s) {
    case Schedule::PerEpoch: return "PerEpoch";
    case Schedule::PerStep: return "PerStep";
    case Schedule::Plateau: return "Plateau";
    case Schedule::Callback: return "Callback";
  }
  return "?";
}

/// Dropout (the RNG), SGD with momentum (optimizer state), shuffling (the
/// sampler), and one of the schedules.
class ScheduledNet : public fulgur::Module {
 public:
  explicit ScheduledNet(Schedule s) : fulgur::Module("ScheduledNet"), schedule(s) {
    fc1 = register_module("fc1", torch::nn::Linear(3, 16));
    dropout = register_module("dropout", torch::nn::Dropout(0.3));
    fc2 = register_module("fc2", torch::nn::Linear(16, 1));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(dropout(torch::relu(fc1(x)))); }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    const auto& [x, y] = batch.pair();
    return torch::nn::functional::mse_loss(forward(x), y);
  }
  void validation_step(fulgur::Batch& batch, int64_t) override {
    const auto& [x, y] = batch.pair();
    log("val_loss", torch::nn::functional::mse_loss(forward(x), y));
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    optimizer = std::make_shared<torch::optim::SGD>(parameters(),
                                                    torch::optim::SGDOptions(0.05).momentum(0.9));
    std::vector<fulgur::SchedulerConfig> schedulers;
    switch (schedule) {
      case Schedule::PerEpoch:
        schedulers.push_back(
            {.scheduler = std::make_shared<torch::optim::StepLR>(*optimizer, 1, 0.5),
             .interval = fulgur::Interval::kEpoch});
        break;
      case Schedule::PerStep:
        // Warm-up over 4 steps, then a cosine decay over the 36 others.
        schedulers.push_back(
            {.scheduler = std::make_shared<fulgur::LambdaLR>(
                 *optimizer,
                 [](int64_t step) {
                   if (step < 4) return (step + 1) / 4.0;
                   return 0.5 * (1 + std::cos(M_PI * static_cast<double>(step - 4) / 36.0));
                 }),
             .interval = fulgur::Interval::kStep});
        break;
      case Schedule::Plateau:
        // val_loss falls; in "max" mode that is no improvement, so with
        // patience 1 the rate halves every other epoch: a lost bad-step
        // count or best value shows.
        plateau = std::make_shared<fulgur::ReduceLROnPlateau>(
            *optimizer,
            fulgur::ReduceLROnPlateauOptions{.mode = "max", .factor = 0.5, .patience = 1});
        schedulers.push_back({.scheduler = plateau, .monitor = "val_loss"});
        break;
      case Schedule::Callback: break;
    }
    return {{optimizer}, std::move(schedulers)};
  }

  Schedule schedule;
  torch::nn::Linear fc1{nullptr};
  torch::nn::Dropout dropout{nullptr};
  torch::nn::Linear fc2{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer;
  std::shared_ptr<fulgur::ReduceLROnPlateau> plateau;
};

/// Multiplies every learning rate by 0.7 after every fourth step: the only
/// record of the schedule is the optimizer's learning rate.
class DecayingCallback : public fulgur::Callback {
 public:
  std::string state_key() const override { return "DecayingCallback"; }
  void on_train_batch_end(fulgur::Trainer& trainer, fulgur::Module& module, const at::Tensor&,
                          const fulgur::Batch&, int64_t) override {
    if (trainer.global_step() % 4 != 0) return;
    for (auto& group : static_cast<ScheduledNet&>(module).optimizer->param_groups()) {
      group.options().set_lr(group.options().get_lr() * 0.7);
    }
  }
};

constexpr int64_t kEpochs = 4;
constexpr int64_t kBatches = 10;

/// Checkpoints every 3 steps under `<ckpt_dir>/steps` and at every
/// epoch's end (after its scheduler step) under `<ckpt_dir>/epochs`.
fulgur::TrainerOptions options_for(const TempDir& root, const std::string& ckpt_dir, Schedule s) {
  auto options = test_options(root);
  options.max_epochs = kEpochs;
  options.seed = 42;
  options.enable_checkpointing = true;
  options.callbacks = {
      std::make_shared<fulgur::ModelCheckpoint>(fulgur::ModelCheckpointOptions{
          .dirpath = ckpt_dir + "/steps", .save_top_k = -1, .every_n_train_steps = 3}),
      std::make_shared<fulgur::ModelCheckpoint>(fulgur::ModelCheckpointOptions{
          .dirpath = ckpt_dir + "/epochs", .save_top_k = -1, .save_last = false})};
  if (s == Schedule::Callback) options.callbacks.push_back(std::make_shared<DecayingCallback>());
  return options;
}

std::shared_ptr<fulgur::DataLoader> train_loader() {
  return fulgur::make_data_loader(regression_dataset(4 * kBatches),
                                  {.batch_size = 4, .shuffle = true});
}
std::shared_ptr<fulgur::DataLoader> val_loader() {
  return fulgur::make_data_loader(regression_dataset(8), {.batch_size = 4});
}

::testing::AssertionResult same_training_state(const ScheduledNet& a, const ScheduledNet& b) {
  if (auto params = parameters_equal(a, b); !params) return params;
  if (lrs(*a.optimizer) != lrs(*b.optimizer)) {
    return ::testing::AssertionFailure()
           << "learning rates differ: " << ::testing::PrintToString(lrs(*a.optimizer)) << " vs "
           << ::testing::PrintToString(lrs(*b.optimizer));
  }
  // The same module type: parameters in the same order.
  const auto pa = a.parameters();
  const auto pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    auto& state_a = a.optimizer->state().at(fulgur::compat::optimizer_state_key(pa[i]));
    auto& state_b = b.optimizer->state().at(fulgur::compat::optimizer_state_key(pb[i]));
    if (!torch::equal(static_cast<torch::optim::SGDParamState&>(*state_a).momentum_buffer(),
                      static_cast<torch::optim::SGDParamState&>(*state_b).momentum_buffer())) {
      return ::testing::AssertionFailure()
             << "the momentum buffer of parameter " << i << " differs";
    }
  }
  if (a.plateau) {
    if (a.plateau->best() != b.plateau->best() ||
        a.plateau->num_bad_steps() != b.plateau->num_bad_steps() ||
        a.plateau->cooldown_counter() != b.plateau->cooldown_counter()) {
      return ::testing::AssertionFailure()
             << "ReduceLROnPlateau's state differs: best " << a.plateau->best() << " vs "
             << b.plateau->best() << ", bad steps " << a.plateau->num_bad_steps() << " vs "
             << b.plateau->num_bad_steps();
    }
  }
  return ::testing::AssertionSuccess();
}

class ResumeUnderASchedule : public ::testing::TestWithParam<Schedule> {};

TEST_P(ResumeUnderASchedule, FromEveryKindOfCheckpointEndsBitIdentical) {
  const Schedule schedule = GetParam();
  TempDir root;
  const std::string ckpt_dir = root.file("ckpts");
  torch::manual_seed(1);
  ScheduledNet uninterrupted(schedule);
  const double initial_lr = 0.05;
  {
    fulgur::Trainer trainer(options_for(root, ckpt_dir, schedule));
    auto result = trainer.fit(uninterrupted, train_loader(), val_loader());
    ASSERT_EQ(result.global_step, kEpochs * kBatches);
  }
  // The schedule did move the rate (the test would prove nothing otherwise).
  ASSERT_NE(lrs(*uninterrupted.optimizer)[0], initial_lr);

  // Step 9: mid-epoch. Step 12: after the first epoch boundary. Step 21:
  // after the second (a plateau with one bad epoch counted). Step 30: the
  // last batch of the third epoch, written before that epoch's scheduler
  // step and validation. Then the checkpoints of two epochs' ends.
  for (const char* name :
       {"steps/epoch=0-step=9.ckpt", "steps/epoch=1-step=12.ckpt", "steps/epoch=2-step=21.ckpt",
        "steps/epoch=2-step=30.ckpt", "epochs/epoch=0-step=10.ckpt",
        "epochs/epoch=2-step=30.ckpt"}) {
    SCOPED_TRACE(name);
    const std::string path = (fs::path(ckpt_dir) / name).string();
    ASSERT_TRUE(fs::exists(path)) << ::testing::PrintToString(list_files(ckpt_dir + "/steps"))
                                  << ::testing::PrintToString(list_files(ckpt_dir + "/epochs"));
    torch::manual_seed(2);
    ScheduledNet resumed(schedule);
    TempDir root_b;
    fulgur::Trainer trainer(options_for(root_b, root_b.file("ckpts"), schedule));
    auto result = trainer.fit(resumed, train_loader(), val_loader(), {.ckpt_path = path});
    EXPECT_EQ(result.global_step, kEpochs * kBatches);
    EXPECT_TRUE(same_training_state(uninterrupted, resumed));
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, ResumeUnderASchedule,
                         ::testing::Values(Schedule::PerEpoch, Schedule::PerStep, Schedule::Plateau,
                                           Schedule::Callback),
                         [](const auto& info) { return to_string(info.param); });

// ---- SchedulerConfigs that cannot work.

/// A module whose configure_optimizers returns what the test sets.
class ConfiguredNet : public fulgur::Module {
 public:
  ConfiguredNet() : fulgur::Module("ConfiguredNet") {
    fc = register_module("fc", torch::nn::Linear(3, 1));
    optimizer = std::make_shared<torch::optim::SGD>(parameters(), 0.1);
  }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    const auto& [x, y] = batch.pair();
    auto loss = torch::nn::functional::mse_loss(fc(x), y);
    log("train_loss", loss);
    return loss;
  }
  fulgur::OptimizerConfig configure_optimizers() override { return {{optimizer}, {config}}; }
  torch::nn::Linear fc{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer;
  fulgur::SchedulerConfig config;
};

std::string fit_error(ConfiguredNet& model, const TempDir& root) {
  fulgur::Trainer trainer(test_options(root));
  try {
    trainer.fit(model, fulgur::test::regression_loader(4));
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(SchedulerConfig, AMonitorOnASchedulerThatReadsNoMetricIsRefused) {
  TempDir root;
  ConfiguredNet model;
  model.config = {.scheduler = std::make_shared<torch::optim::StepLR>(*model.optimizer, 1),
                  .monitor = "val_loss"};
  EXPECT_THAT(fit_error(model, root),
              ::testing::HasSubstr("scheduler 0 has monitor=\"val_loss\", but it is not stepped "
                                   "with a metric"));
}

TEST(SchedulerConfig, APlateauSchedulerWithoutAMonitorIsRefused) {
  TempDir root;
  ConfiguredNet model;
  model.config = {.scheduler = std::make_shared<fulgur::ReduceLROnPlateau>(*model.optimizer)};
  EXPECT_THAT(fit_error(model, root), ::testing::HasSubstr("has no monitor. Pass .monitor"));
}

TEST(SchedulerConfig, AMonitoredMetricNeverLoggedNamesTheMetricsThereAre) {
  TempDir root;
  ConfiguredNet model;
  model.config = {.scheduler = std::make_shared<fulgur::ReduceLROnPlateau>(*model.optimizer),
                  .monitor = "val_loss"};
  EXPECT_THAT(fit_error(model, root),
              ::testing::AllOf(::testing::HasSubstr("scheduler 0 monitors \"val_loss\""),
                               ::testing::HasSubstr("logged: train_loss"),
                               ::testing::HasSubstr("strict=false")));
}

TEST(SchedulerConfig, NotStrictSkipsTheStepsWithoutTheMetric) {
  TempDir root;
  ConfiguredNet model;
  model.config = {.scheduler = std::make_shared<fulgur::ReduceLROnPlateau>(
                      *model.optimizer, fulgur::ReduceLROnPlateauOptions{.patience = 0}),
                  .monitor = "val_loss",
                  .strict = false};
  EXPECT_EQ(fit_error(model, root), "");
  EXPECT_DOUBLE_EQ(lrs(*model.optimizer)[0], 0.1);
}

// A ReduceLROnPlateau on the step interval reads the value training_step
// logged in the same step (it stepped before the step's values were
// published: "not logged by step 1", or the previous step's value with
// strict=false). Every value after the first is no improvement here, so
// with patience 0 the rate halves at each of the 3 later steps.
TEST(SchedulerConfig, APlateauSchedulerOnTheStepIntervalReadsThatStepsValue) {
  for (const bool strict : {true, false}) {
    SCOPED_TRACE(strict);
    TempDir root;
    ConfiguredNet model;
    model.config = {
        .scheduler = std::make_shared<fulgur::ReduceLROnPlateau>(
            *model.optimizer, fulgur::ReduceLROnPlateauOptions{.mode = "max",
                                                               .factor = 0.5,
                                                               .patience = 0,
                                                               .threshold = 1e9,
                                                               .threshold_mode = "abs"}),
        .interval = fulgur::Interval::kStep,
        .monitor = "train_loss",
        .strict = strict};
    EXPECT_EQ(fit_error(model, root), "");
    EXPECT_DOUBLE_EQ(lrs(*model.optimizer)[0], 0.1 * 0.5 * 0.5 * 0.5);
  }
}

// A scheduler that makes a rate NaN (a NaN factor made every parameter NaN,
// silently) is named at the step it did so; one that makes it negative (the
// loss climbs) gets one note, and one that makes it 0 nothing.
TEST(SchedulerConfig, ASchedulerThatMakesARateNaNIsNamedAndANegativeOneNoted) {
  auto fit_with = [](double factor, std::string& err) {
    TempDir root;
    ConfiguredNet model;
    model.config = {
        .scheduler = std::make_shared<fulgur::LambdaLR>(
            *model.optimizer, [factor](int64_t step) { return step >= 2 ? factor : 1.0; }),
        .interval = fulgur::Interval::kStep};
    ::testing::internal::CaptureStderr();
    const std::string error = fit_error(model, root);
    err = ::testing::internal::GetCapturedStderr();
    return error;
  };
  std::string err;
  const std::string nan_error = fit_with(std::nan(""), err);
  EXPECT_TRUE(fulgur::test::message_contains(
      nan_error, {"scheduler 0 (interval step) set the learning rate of parameter group 0 of "
                  "optimizer 0 to nan at step 2",
                  "every parameter it steps NaN", "gamma"}))
      << nan_error;
  EXPECT_EQ(fit_with(-1.0, err), "");
  EXPECT_EQ(fulgur::test::count_occurrences(err, "a negative rate climbs the loss"), 1) << err;
  EXPECT_TRUE(fulgur::test::message_contains(err, {"to -0.1 at step 2"})) << err;
  EXPECT_EQ(fit_with(0.0, err), "");
  EXPECT_EQ(err.find("climbs"), std::string::npos) << err;
}

TEST(SchedulerConfig, ACheckpointWithoutAStatefulSchedulersStateIsRefused) {
  TempDir root;
  std::string last;
  {
    ConfiguredNet model;
    model.config = {.scheduler = std::make_shared<torch::optim::StepLR>(*model.optimizer, 1)};
    auto options = test_options(root);
    options.enable_checkpointing = true;
    fulgur::Trainer trainer(options);
    last = trainer.fit(model, fulgur::test::regression_loader(4)).last_model_path;
  }
  ConfiguredNet model;
  model.config = {.scheduler = std::make_shared<fulgur::ReduceLROnPlateau>(*model.optimizer),
                  .monitor = "train_loss"};
  auto options = test_options(root);
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  try {
    trainer.fit(model, fulgur::test::regression_loader(4), nullptr, {.ckpt_path = last});
    FAIL() << "resumed without the scheduler's state";
  } catch (const fulgur::CheckpointError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("holds no state for scheduler 0"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr(last));
  }
}

}  // namespace
