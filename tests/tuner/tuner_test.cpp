// The batch-size finder: the sizes tried in each search mode against a cap
// on the trial's CPU tensors, the module and generators put back, where
// the search ends without a cap, nothing fitting, another error rethrown,
// and the errors of options that cannot work.
//
// The learning-rate finder: the rate each step takes (as the optimizer saw
// it), the module and the random generators put back (a fit after the
// sweep is bit-identical to one without it), the early stop on a diverging
// loss, the steepest-descent rule on curves whose slopes are known, the
// picture, and the errors of options that cannot work.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <cmath>
#include <filesystem>
#include <set>

#include "fulgur/fulgur.h"
#include "support/process.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using fulgur::LRFinderOptions;
using fulgur::test::LinearRegression;
using fulgur::test::parameters_equal;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;

/// Records the rate of the first parameter group after every optimizer
/// step (the module's hook runs after the step, before the next sets it).
class RateRecorder : public LinearRegression {
 public:
  void on_train_batch_end(const at::Tensor& loss, const fulgur::Batch& batch,
                          int64_t batch_idx) override {
    LinearRegression::on_train_batch_end(loss, batch, batch_idx);
    seen_lrs.push_back(optimizer->param_groups()[0].options().get_lr());
  }
  std::vector<double> seen_lrs;
};

TEST(LRFinder, EveryStepTakesTheSweepsRateAndItsLossIsRecorded) {
  TempDir dir;
  RateRecorder model;
  fulgur::Tuner tuner(test_options(dir));
  const LRFinderOptions options{
      .min_lr = 1e-4, .max_lr = 1e-1, .num_training = 20, .early_stop_threshold = 0.0};
  auto found = tuner.lr_find(model, regression_loader(4), options);
  ASSERT_EQ(found.lrs.size(), 20u);
  ASSERT_EQ(found.losses.size(), 20u);
  EXPECT_FALSE(found.diverged);
  for (size_t k = 0; k < 20; ++k) {
    EXPECT_DOUBLE_EQ(found.lrs[k], 1e-4 * std::pow(1e3, static_cast<double>(k) / 19.0)) << k;
    EXPECT_TRUE(std::isfinite(found.losses[k])) << k;
  }
  // The optimizer stepped with exactly those rates, one step per batch,
  // over five epochs of four batches.
  EXPECT_EQ(model.seen_lrs, found.lrs);
  EXPECT_EQ(model.training_steps, 20);
  // The first loss is the first batch's own (bias-corrected average of one).
  EXPECT_GT(found.losses.front(), 0.0);

  RateRecorder linear;
  auto swept = tuner.lr_find(linear, regression_loader(4),
                             {.min_lr = 0.01, .max_lr = 0.2, .num_training = 5,
                              .mode = "linear", .early_stop_threshold = 0.0});
  EXPECT_THAT(swept.lrs, ::testing::ElementsAre(::testing::DoubleEq(0.01), ::testing::DoubleEq(0.0575),
                                                ::testing::DoubleEq(0.105), ::testing::DoubleEq(0.1525),
                                                ::testing::DoubleEq(0.2)));
}

// With overfit_batches the sweep steps through the fit's own first batches
// (its trials validate nothing: the flag's validation limit is not theirs).
TEST(LRFinder, OverfitBatchesSweepsTheFitsFirstBatches) {
  TempDir dir;
  RateRecorder model;
  std::set<int64_t> batches_seen;
  model.train_hook = [&](LinearRegression&, fulgur::Batch&, int64_t batch_idx) {
    batches_seen.insert(batch_idx);
  };
  auto options = test_options(dir);
  options.overfit_batches = 2;
  fulgur::Tuner tuner(options);
  auto found =
      tuner.lr_find(model, regression_loader(6), {.num_training = 6, .early_stop_threshold = 0.0});
  EXPECT_EQ(found.lrs.size(), 6u);
  EXPECT_EQ(model.training_steps, 6);
  EXPECT_EQ(batches_seen, (std::set<int64_t>{0, 1}));
  EXPECT_EQ(model.validation_steps, 0);
}

TEST(LRFinder, TheSweepRunsWithoutTheModulesCallbacksOrReloadedLoaders) {
  // Counts the training batches it sees.
  struct Counter : fulgur::Callback {
    std::string state_key() const override { return "Counter"; }
    void on_train_batch_start(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch&,
                              int64_t) override {
      ++batches;
    }
    int64_t batches = 0;
  };
  struct WithCallbacks : RateRecorder {
    std::vector<std::shared_ptr<fulgur::Callback>> configure_callbacks() override {
      return {counter};
    }
    std::shared_ptr<Counter> counter = std::make_shared<Counter>();
  };
  TempDir dir;
  WithCallbacks model;
  auto options = test_options(dir);
  options.reload_dataloaders_every_n_epochs = 1;
  fulgur::Tuner tuner(options);
  // The sweep's 6 steps span two epochs of its loader.
  auto found =
      tuner.lr_find(model, regression_loader(4), {.num_training = 6, .early_stop_threshold = 0.0});
  EXPECT_EQ(found.lrs.size(), 6u);
  EXPECT_EQ(model.training_steps, 6);
  EXPECT_EQ(model.counter->batches, 0);
  // A fit has them.
  fulgur::test::RecordingDataModule data(/*train_batches=*/2, /*val_batches=*/1);
  fulgur::Trainer(options).fit(model, data);
  EXPECT_EQ(model.counter->batches, 2);
}

TEST(LRFinder, AFitAfterTheSweepIsBitIdenticalToOneWithoutIt) {
  TempDir dir;
  auto fit_options = test_options(dir);
  fit_options.max_epochs = 2;
  struct Run {
    std::unique_ptr<LinearRegression> model;
    at::Tensor next_random;   // the global generator's next draw after the sweep
    int64_t fit_steps = 0;    // training_step calls of the fit
    std::vector<int64_t> first_epoch_batches;
    std::shared_ptr<int64_t> epoch = std::make_shared<int64_t>(-1);  // -1: the sweep
  };
  auto train = [&](bool sweep_first) {
    Run run;
    torch::manual_seed(21);
    run.model = std::make_unique<LinearRegression>(
        fulgur::test::LinearRegressionOptions{.momentum = 0.9});
    // Every step draws from the global generator, and records its batch.
    auto* batches = &run.first_epoch_batches;
    auto epoch = run.epoch;
    run.model->train_hook = [batches, epoch](LinearRegression&, fulgur::Batch&, int64_t idx) {
      (void)torch::rand({1});
      if (*epoch == 0) batches->push_back(idx);
    };
    // One loader for the sweep and the fit, as a program would pass it.
    auto loader = regression_loader(4, 2, /*shuffle=*/true);
    const auto before = fulgur::test::clone_parameters(*run.model);
    if (sweep_first) {
      fulgur::Tuner tuner(fit_options);
      auto found = tuner.lr_find(*run.model, loader, {.num_training = 6, .early_stop_threshold = 0.0});
      EXPECT_EQ(found.lrs.size(), 6u);
      // The weights are back where they were.
      const auto after = fulgur::test::clone_parameters(*run.model);
      for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i]));
    }
    run.next_random = torch::rand({4});
    const int64_t steps_before = run.model->training_steps;
    struct EpochOf : fulgur::Callback {
      std::shared_ptr<int64_t> epoch;
      std::string state_key() const override { return "EpochOf"; }
      void on_train_epoch_start(fulgur::Trainer& t, fulgur::Module&) override {
        *epoch = t.current_epoch();
      }
    };
    auto epoch_of = std::make_shared<EpochOf>();
    epoch_of->epoch = run.epoch;
    auto options = fit_options;
    options.callbacks = {epoch_of};
    fulgur::Trainer trainer(options);
    trainer.fit(*run.model, loader);
    run.fit_steps = run.model->training_steps - steps_before;
    return run;
  };
  Run with_sweep = train(true);
  Run without = train(false);
  // The generator is where it was (the sweep drew from it at every step).
  EXPECT_TRUE(torch::equal(with_sweep.next_random, without.next_random));
  // The loader starts the fit's first epoch at its first batch, though the
  // sweep stopped in the middle of an epoch of it.
  EXPECT_EQ(with_sweep.first_epoch_batches, (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(with_sweep.fit_steps, 8);
  EXPECT_EQ(without.fit_steps, 8);
  EXPECT_TRUE(parameters_equal(*with_sweep.model, *without.model));
}

TEST(LRFinder, ADivergingLossStopsTheSweepAndTheWeightsAreStillPutBack) {
  TempDir dir;
  torch::manual_seed(3);
  LinearRegression model;
  const auto before = fulgur::test::clone_parameters(model);
  fulgur::Tuner tuner(test_options(dir));
  auto found = tuner.lr_find(model, regression_loader(4),
                             {.min_lr = 1e-3, .max_lr = 1e4, .num_training = 60});
  EXPECT_TRUE(found.diverged);
  EXPECT_LT(found.lrs.size(), 60u);
  EXPECT_GT(found.lrs.size(), 1u);
  // The last loss is past the threshold (or not finite).
  const double best = *std::min_element(found.losses.begin(), found.losses.end() - 1);
  EXPECT_TRUE(!std::isfinite(found.losses.back()) || found.losses.back() > 4.0 * best);
  const auto after = fulgur::test::clone_parameters(model);
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i]));
}

// A loss that is negative (a log-likelihood, an ELBO): Lightning's
// smoothed > 4 * best read every loss above 4x a negative best as diverged
// and stopped the sweep at its second step, without a suggestion.
TEST(LRFinder, ANegativeLossSweepsOnAndDivergesByTheSameDistance) {
  TempDir dir;
  struct Shifted : LinearRegression {
    at::Tensor training_step(fulgur::Batch& batch, int64_t batch_idx) override {
      return LinearRegression::training_step(batch, batch_idx) - 100.0;
    }
  };
  Shifted model;
  fulgur::Tuner tuner(test_options(dir));
  auto found = tuner.lr_find(model, regression_loader(4),
                             {.min_lr = 1e-4, .max_lr = 1e-2, .num_training = 30});
  EXPECT_FALSE(found.diverged);
  EXPECT_EQ(found.lrs.size(), 30u);
  EXPECT_TRUE(found.suggestion.has_value());
  // Diverging: it stops once the loss is 3 |best| above the best.
  Shifted wild;
  auto diverged = tuner.lr_find(wild, regression_loader(4),
                                {.min_lr = 1e-3, .max_lr = 1e4, .num_training = 60});
  EXPECT_TRUE(diverged.diverged);
  EXPECT_GT(diverged.lrs.size(), 2u);
  const double best = *std::min_element(diverged.losses.begin(), diverged.losses.end() - 1);
  EXPECT_TRUE(!std::isfinite(diverged.losses.back()) ||
              diverged.losses.back() > best + 3.0 * std::abs(best));
}

TEST(LRFinder, TheSuggestionIsWhereTheLossFallsFastest) {
  // loss = 10 - lr^2 on uneven rates: the slope is -2 lr, exactly, at every
  // inner point (second-order differences are exact on a parabola); the
  // ends take one-sided slopes.
  const std::vector<double> lrs{0.1, 0.3, 0.4, 0.9, 1.0};
  std::vector<double> losses;
  for (double x : lrs) losses.push_back(10.0 - x * x);
  // Slopes: -0.4 (one-sided), -0.6, -0.8, -1.8 (exact), -1.9 (one-sided).
  EXPECT_EQ(fulgur::steepest_descent(lrs, losses, 0, 0), 4);
  // Without the last point, 0.9 is an end: (9.19 - 9.84) / 0.5 = -1.3, still
  // the steepest.
  EXPECT_EQ(fulgur::steepest_descent(lrs, losses, 0, 1), 3);
  // Without the first three, two points remain: 0.9 and 1.0.
  EXPECT_EQ(fulgur::steepest_descent(lrs, losses, 3, 0), 3);
  // A loss that rises then falls steeply in the middle.
  const std::vector<double> uniform{1, 2, 3, 4, 5, 6, 7};
  const std::vector<double> curve{5.0, 5.1, 5.0, 3.0, 1.0, 0.9, 0.9};
  // Central slopes: 0, -1.05, -2, -1.05, -0.05; one-sided ends 0.1 and 0.
  EXPECT_EQ(fulgur::steepest_descent(uniform, curve, 0, 0), 3);
  // Non-finite losses are left out (two points remain, one slope: the
  // first wins); fewer than two points: none.
  const std::vector<double> broken{5.0, NAN, INFINITY, 3.0, NAN, NAN, NAN};
  EXPECT_EQ(fulgur::steepest_descent(uniform, broken, 0, 0), 0);
  EXPECT_EQ(fulgur::steepest_descent(uniform, broken, 1, 0), -1);
  EXPECT_EQ(fulgur::steepest_descent({}, {}, 0, 0), -1);
}

TEST(LRFinder, ASuggestionComesWithTheSweepAndItsPicture) {
  TempDir dir;
  LinearRegression model;
  fulgur::Tuner tuner(test_options(dir));
  const std::string png = dir.file("lr_find.png");
  auto found = tuner.lr_find(model, regression_loader(8),
                             {.min_lr = 1e-4, .max_lr = 0.5, .num_training = 30,
                              .early_stop_threshold = 0.0, .plot_path = png});
  ASSERT_TRUE(found.suggestion.has_value()) << found.note;
  ASSERT_GE(found.suggestion_index, 10);
  EXPECT_DOUBLE_EQ(*found.suggestion, found.lrs[static_cast<size_t>(found.suggestion_index)]);
  EXPECT_EQ(found.suggestion_index,
            fulgur::steepest_descent(found.lrs, found.losses, /*skip_begin=*/10, /*skip_end=*/1));
  EXPECT_EQ(found.note, "");
  ASSERT_TRUE(fs::exists(png));
  EXPECT_GT(fs::file_size(png), 1000u);
  // Too few steps for a suggestion: said, not thrown.
  auto few = tuner.lr_find(model, regression_loader(8), {.num_training = 5});
  EXPECT_FALSE(few.suggestion.has_value());
  EXPECT_EQ(few.suggestion_index, -1);
  EXPECT_THAT(few.note, ::testing::HasSubstr("Raise num_training"));
}

TEST(LRFinder, OptionsThatCannotWorkAreNamedTogether) {
  TempDir dir;
  LinearRegression model;
  fulgur::Tuner tuner(test_options(dir));
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     tuner.lr_find(model, regression_loader(2),
                                   {.min_lr = 0.0, .max_lr = -1.0, .num_training = 1,
                                    .mode = "cubic", .smoothing = 1.0}),
                     {"min_lr=0", "max_lr=-1", "num_training=1", "mode=\"cubic\"",
                      "exponential", "linear", "smoothing=1"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, tuner.lr_find(model, nullptr),
                     {"no training data"});
  // No trial step would run (it printed "0 steps from 0 to 0").
  auto no_batches = test_options(dir);
  no_batches.limit_train_batches = 0;
  fulgur::Tuner none(no_batches);
  EXPECT_THROWS_WITH(fulgur::ConfigError, none.lr_find(model, regression_loader(2)),
                     {"Tuner.lr_find with limit_train_batches=0", "positive limit_train_batches"});
  EXPECT_EQ(model.training_steps, 0);
  // The fit's options are checked as its Trainer checks them, before a
  // sweep (a trial overrides min_epochs: the Trainer after a whole sweep
  // was the first to say so).
  auto bad = test_options(dir);
  bad.min_epochs = -3;
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Tuner{bad}, {"min_epochs=-3", ">= 0"});
  bad.min_epochs = 0;
  bad.strategy = std::make_shared<fulgur::SingleDeviceStrategy>();
  bad.max_epochs = -5;
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Tuner{bad}, {"max_epochs=-5"});
}

TEST(LRFinder, AStrategyThatStartsProcessesIsRefusedWithWhatToDo) {
  TempDir dir;
  LinearRegression model;
  const auto before = fulgur::test::clone_parameters(model);
  auto options = test_options(dir);
  options.accelerator = std::string("cpu");
  options.strategy = std::string("ddp");
  options.devices = 2;
  fulgur::Tuner tuner(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError, tuner.lr_find(model, regression_loader(4)),
                     {"strategy \"ddp\"", "devices=1", "torchrun"});
  EXPECT_EQ(model.training_steps, 0);
}

// ---- scale_batch_size.

/// y = fc2(relu(fc1(x))) with a wide hidden layer: a step's tensors grow
/// with the batch (about 16 KiB a sample), so a cap on them bounds it.
class WideRegression : public fulgur::Module {
 public:
  WideRegression()
      : fc1(register_module("fc1", torch::nn::Linear(3, 1024))),
        fc2(register_module("fc2", torch::nn::Linear(1024, 1))) {}
  at::Tensor training_step(fulgur::Batch& batch, int64_t /*batch_idx*/) override {
    ++steps;
    if (fail_with) throw std::runtime_error(*fail_with);
    const auto& [x, y] = batch.pair();
    return torch::mse_loss(fc2(torch::relu(fc1(x))), y);
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return fulgur::OptimizerConfig(
        std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.01)));
  }
  torch::nn::Linear fc1, fc2;
  int64_t steps = 0;
  std::optional<std::string> fail_with;
};

std::function<std::shared_ptr<fulgur::DataLoader>(int64_t)> loaders_of(int64_t samples) {
  auto data = fulgur::test::regression_dataset(samples);
  return [data](int64_t batch_size) {
    return fulgur::make_data_loader(data, {.batch_size = batch_size});
  };
}

constexpr int64_t kCap = 1 << 20;  // 1 MiB of the trial's CPU tensors

TEST(BatchSizeFinder, PowerDoublesUntilATrialRunsOutOfMemory) {
  TempDir dir;
  WideRegression model;
  fulgur::Tuner tuner(test_options(dir));
  const auto found = tuner.scale_batch_size(model, loaders_of(1024),
                                            {.init_val = 2, .steps_per_trial = 2,
                                             .host_memory_cap = kCap});
  ASSERT_GE(found.trials.size(), 2u) << found.note;
  // 2, 4, 8, ... until the first failure, which ends the search.
  for (size_t i = 0; i < found.trials.size(); ++i) {
    EXPECT_EQ(found.trials[i].batch_size, int64_t{2} << i) << i;
    EXPECT_EQ(found.trials[i].fits, i + 1 < found.trials.size()) << i;
  }
  const auto& failed = found.trials.back();
  EXPECT_THAT(failed.failure, testing::HasSubstr("host_memory_cap"));
  EXPECT_THAT(failed.failure, testing::HasSubstr("over the cap of 1048576 bytes"));
  EXPECT_EQ(found.batch_size, failed.batch_size / 2);
  EXPECT_TRUE(found.note.empty()) << found.note;
  // Each trial that fit stayed under the cap, and a larger batch took more.
  for (size_t i = 0; i + 1 < found.trials.size(); ++i) {
    EXPECT_GT(found.trials[i].peak_bytes, 0);
    EXPECT_LE(found.trials[i].peak_bytes, kCap);
    if (i > 0) {
      EXPECT_GT(found.trials[i].peak_bytes, found.trials[i - 1].peak_bytes);
    }
  }
}

TEST(BatchSizeFinder, BinsearchEndsBetweenASizeThatFitsAndTheNextThatDoesNot) {
  TempDir dir;
  WideRegression model;
  fulgur::Tuner tuner(test_options(dir));
  const auto found = tuner.scale_batch_size(
      model, loaders_of(1024),
      {.mode = "binsearch", .init_val = 3, .steps_per_trial = 2, .host_memory_cap = kCap});
  ASSERT_GT(found.batch_size, 3);
  bool fit_at_answer = false;
  bool failed_above = false;
  for (const auto& t : found.trials) {
    if (t.batch_size == found.batch_size) fit_at_answer = t.fits;
    if (t.batch_size == found.batch_size + 1) failed_above = !t.fits;
    // Nothing larger than the answer fit, nothing smaller failed.
    if (t.batch_size > found.batch_size) {
      EXPECT_FALSE(t.fits) << t.batch_size;
    } else {
      EXPECT_TRUE(t.fits) << t.batch_size;
    }
  }
  EXPECT_TRUE(fit_at_answer);
  EXPECT_TRUE(failed_above) << "the search narrowed the gap to one";
}

TEST(BatchSizeFinder, TheModuleAndTheGeneratorsArePutBackAfterEveryTrial) {
  TempDir dir;
  torch::manual_seed(7);
  WideRegression model;
  std::vector<at::Tensor> before;
  for (const auto& p : model.parameters()) before.push_back(p.detach().clone());
  const auto rng = fulgur::rng_state_dict();
  const at::Tensor expected_draw = torch::rand({4});
  fulgur::load_rng_state_dict(rng);

  fulgur::Tuner tuner(test_options(dir));
  const auto found = tuner.scale_batch_size(model, loaders_of(256),
                                            {.steps_per_trial = 2, .host_memory_cap = kCap});
  EXPECT_GT(model.steps, 0);
  EXPECT_GT(found.batch_size, 0);
  const auto after = model.parameters();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(after[i], before[i])) << i;
    EXPECT_FALSE(after[i].grad().defined()) << "no gradient before, none after";
  }
  EXPECT_TRUE(torch::equal(torch::rand({4}), expected_draw));
}

/// A layer built in configure_model(), once (as the README recommends):
/// a trial's fit builds it, and the fit after the tuner finds it built.
class LateLayer : public fulgur::Module {
 public:
  void configure_model() override {
    if (fc) return;
    fc = register_module("fc", torch::nn::Linear(3, 1));
  }
  at::Tensor training_step(fulgur::Batch& batch, int64_t /*batch_idx*/) override {
    const auto& [x, y] = batch.pair();
    // Random numbers in every step: the fit after the tuner draws the same.
    return torch::mse_loss(fc(torch::dropout(x, 0.5, /*train=*/true)), y);
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return fulgur::OptimizerConfig(
        std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.05)));
  }
  torch::nn::Linear fc{nullptr};
};

// The layers a trial's configure_model() built are put back as that built
// them (they had trained with the sweep's rates up to 10, or with every
// trial's batches), and the generators as they were after it (the fit
// finds the layers built and draws nothing there): a fit after either
// finder is bit-identical to one without it, its dropout masks included.
TEST(Tuner, LayersBuiltInConfigureModelArePutBackAsTheyWereBuilt) {
  TempDir dir;
  auto options = test_options(dir);
  options.max_epochs = 2;
  auto fit = [&](LateLayer& model) {
    fulgur::Trainer trainer(options);
    trainer.fit(model, regression_loader(4));
  };
  torch::manual_seed(3);
  LateLayer plain;
  fit(plain);
  for (const char* finder : {"lr_find", "scale_batch_size"}) {
    SCOPED_TRACE(finder);
    torch::manual_seed(3);
    LateLayer tuned;
    fulgur::Tuner tuner(options);
    if (std::string(finder) == "lr_find") {
      const auto found =
          tuner.lr_find(tuned, regression_loader(4),
                        {.max_lr = 10.0, .num_training = 8, .early_stop_threshold = 0.0});
      EXPECT_EQ(found.lrs.size(), 8u);
    } else {
      const auto found = tuner.scale_batch_size(
          tuned, loaders_of(64),
          {.max_trials = 3, .steps_per_trial = 3, .host_memory_cap = int64_t{1} << 30});
      EXPECT_EQ(found.trials.size(), 3u);
    }
    ASSERT_TRUE(tuned.fc);
    fit(tuned);
    EXPECT_TRUE(parameters_equal(plain, tuned));
  }
}

// A restarted job (restart_count() > 0: torchrun, a requeued SLURM job,
// fulgur's launcher) resumes its fit from the newest checkpoint; a trial is
// not that fit and starts from the module as it is (it had resumed at that
// checkpoint's step, past its own max_steps, and recorded nothing).
TEST(Tuner, ATrialOfARestartedJobDoesNotResumeTheJobsCheckpoint) {
  TempDir dir;
  auto options = test_options(dir);
  options.enable_checkpointing = true;
  options.max_epochs = 3;
  {
    LinearRegression model;
    fulgur::Trainer trainer(options);
    trainer.fit(model, regression_loader(4));
  }
  ASSERT_TRUE(fs::exists(dir.file("checkpoints/last.ckpt")));
  struct RestartedJob {
    RestartedJob() { ::setenv("FULGUR_RESTART_COUNT", "1", 1); }
    ~RestartedJob() { ::unsetenv("FULGUR_RESTART_COUNT"); }
  };
  LinearRegression model;
  fulgur::LRFinderResult swept;
  fulgur::BatchSizeFinderResult sized;
  int64_t steps_in_sweep = 0;
  {
    const RestartedJob restarted;
    fulgur::Tuner tuner(options);
    swept = tuner.lr_find(model, regression_loader(4),
                          {.num_training = 6, .early_stop_threshold = 0.0});
    steps_in_sweep = model.training_steps;
    sized = tuner.scale_batch_size(
        model, loaders_of(64), {.max_trials = 2, .steps_per_trial = 2, .host_memory_cap = kCap});
  }
  EXPECT_EQ(swept.lrs.size(), 6u);
  EXPECT_EQ(steps_in_sweep, 6);
  ASSERT_EQ(sized.trials.size(), 2u);
  EXPECT_EQ(model.training_steps, 6 + 2 * 2);
}

// A preemption signal during a trial (a job's scheduler asks it to stop,
// then requeues it) ends the process as in a fit, but saves nothing: the
// trial's last.ckpt (the sweep's weights, rates and steps) was what the
// requeued job's fit resumed from.
//
// The trial (FULGUR_TEST_TRIAL: lr_find or scale_batch_size, under
// FULGUR_TEST_TRIAL_DIR) runs in a process of its own, run by the test
// through this program: the test's process may have trained, and LibTorch
// 2.x refuses autograd in a child forked from it.
TEST(Tuner, PreemptedTrialChild) {
  const char* finder = std::getenv("FULGUR_TEST_TRIAL");
  const char* dir = std::getenv("FULGUR_TEST_TRIAL_DIR");
  if (finder == nullptr || dir == nullptr) GTEST_SKIP() << "the trial of the test below";
  struct Preempted : fulgur::LightningEnvironment {
    std::vector<int> preemption_signals() const override { return {SIGUSR1}; }
  };
  TempDir unused;
  auto options = test_options(unused);
  options.default_root_dir = dir;
  options.plugins = {std::make_shared<Preempted>()};
  LinearRegression model;
  model.train_hook = [](LinearRegression& m, fulgur::Batch&, int64_t) {
    if (m.training_steps == 2) ::raise(SIGUSR1);
  };
  fulgur::Tuner tuner(options);
  if (std::string(finder) == "lr_find") {
    tuner.lr_find(model, regression_loader(4), {.num_training = 6});
  } else {
    tuner.scale_batch_size(model, loaders_of(64),
                           {.max_trials = 2, .steps_per_trial = 4, .host_memory_cap = kCap});
  }
  FAIL() << "the preemption signal did not end the " << finder;
}

TEST(Tuner, APreemptionDuringATrialSavesNoCheckpoint) {
  for (const char* finder : {"lr_find", "scale_batch_size"}) {
    SCOPED_TRACE(finder);
    TempDir dir;
    const auto child = fulgur::test::run_test_alone(
        "Tuner.PreemptedTrialChild",
        {{"FULGUR_TEST_TRIAL", finder}, {"FULGUR_TEST_TRIAL_DIR", dir.path()}},
        std::chrono::seconds(60));
    EXPECT_EQ(child.signal, SIGUSR1) << child.output;
    EXPECT_NE(child.output.find("during a tuner trial"), std::string::npos) << child.output;
    EXPECT_FALSE(fs::exists(dir.file("checkpoints"))) << child.output;
  }
}

// An iterable loader's factory is asked only for the epochs the fits run:
// the sweep's loader put back where it was (never started) starts no
// epoch -1 (a factory indexing shards by epoch would read shard -1).
TEST(LRFinder, TheLoaderPutBackAsItWasStartsNoEpochOfItsOwn) {
  TempDir dir;
  auto epochs = std::make_shared<std::vector<int64_t>>();
  auto data = fulgur::test::regression_dataset(8);
  const at::Tensor x = data->tensors()[0];
  const at::Tensor y = data->tensors()[1];
  auto loader = fulgur::make_iterable_loader(
      [x, y, epochs](int64_t epoch) -> fulgur::BatchGenerator {
        epochs->push_back(epoch);
        return [x, y, i = int64_t{0}]() mutable -> std::optional<fulgur::Batch> {
          if (i >= 4) return std::nullopt;
          const int64_t k = i++;
          return fulgur::Batch(x.slice(0, 2 * k, 2 * k + 2), y.slice(0, 2 * k, 2 * k + 2));
        };
      },
      4);
  LinearRegression model;
  fulgur::Tuner tuner(test_options(dir));
  const auto found = tuner.lr_find(model, loader, {.num_training = 6, .early_stop_threshold = 0.0});
  EXPECT_EQ(found.lrs.size(), 6u);
  EXPECT_EQ(*epochs, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(loader->epoch(), -1);
  auto options = test_options(dir);
  options.max_epochs = 1;
  fulgur::Trainer trainer(options);
  trainer.fit(model, loader);
  EXPECT_EQ(*epochs, (std::vector<int64_t>{0, 1, 0}));
}

// Under fast_dev_run (a check that the program runs), the finders skip, as
// Lightning's do, and say so; the module is not touched.
TEST(Tuner, FastDevRunSkipsTheFinders) {
  TempDir dir;
  auto options = test_options(dir);
  options.fast_dev_run = 1;
  LinearRegression model;
  fulgur::Tuner tuner(options);
  const auto swept = tuner.lr_find(model, regression_loader(4));
  EXPECT_TRUE(swept.skipped);
  EXPECT_TRUE(swept.lrs.empty());
  EXPECT_THAT(swept.note, ::testing::HasSubstr("lr_find: skipped: fast_dev_run=1"));
  const auto sized = tuner.scale_batch_size(model, loaders_of(64), {.host_memory_cap = kCap});
  EXPECT_TRUE(sized.skipped);
  EXPECT_EQ(sized.batch_size, 0);
  EXPECT_TRUE(sized.trials.empty());
  EXPECT_THAT(sized.note, ::testing::HasSubstr("scale_batch_size: skipped: fast_dev_run=1"));
  EXPECT_EQ(model.training_steps, 0);
}

// A fraction of the training batches that rounds down to none at a size
// (its trial's fit would refuse the fraction): that size is not tried, as
// one the loader makes no batch of, and the note says why. It used to end
// the search with the fit's error, losing what it had found.
TEST(BatchSizeFinder, ASizeWhoseFractionOfBatchesRoundsDownToNoneIsNotTried) {
  TempDir dir;
  auto options = test_options(dir);
  // Of 64 samples: one batch of 16 (4 batches of it), none of 32 (2).
  options.limit_train_batches = 0.25;
  WideRegression model;
  fulgur::Tuner tuner(options);
  const auto found = tuner.scale_batch_size(
      model, loaders_of(64),
      {.init_val = 16, .steps_per_trial = 1, .host_memory_cap = int64_t{1} << 30});
  // 16 fits, 32 and then 24 are not tried, 20 fits (the power search ends
  // at the first size that fits below one it could not try).
  EXPECT_EQ(found.batch_size, 20);
  ASSERT_FALSE(found.trials.empty());
  EXPECT_EQ(found.trials.front().batch_size, 16);
  for (const auto& t : found.trials) EXPECT_TRUE(t.fits) << t.batch_size;
  EXPECT_THAT(found.note, ::testing::HasSubstr("scale_batch_size: batch_size=24 was not tried: "
                                               "limit_train_batches=0.25 of its 3 batches rounds "
                                               "down to none. Pass a larger fraction"));
}

TEST(BatchSizeFinder, TheSearchEndsAtTheWholeTrainingSetOrMaxTrialsAndTheCPUNeedsACap) {
  TempDir dir;
  WideRegression model;
  fulgur::Tuner tuner(test_options(dir));
  constexpr int64_t kRoomy = int64_t{1} << 30;
  const auto whole = tuner.scale_batch_size(model, loaders_of(40),
                                            {.steps_per_trial = 1, .host_memory_cap = kRoomy});
  // 2, 4, ..., 64: the first one batch holds all 40 samples.
  EXPECT_EQ(whole.batch_size, 64);
  EXPECT_EQ(whole.trials.size(), 6u);
  EXPECT_THAT(whole.note, testing::HasSubstr("batch_size=64 holds the whole training set"));

  const auto capped = tuner.scale_batch_size(
      model, loaders_of(4096), {.max_trials = 3, .steps_per_trial = 1, .host_memory_cap = kRoomy});
  EXPECT_EQ(capped.batch_size, 8);
  EXPECT_THAT(capped.note, testing::HasSubstr("stopped after max_trials=3 trials; batch_size=16 "
                                              "was not tried"));

  // With drop_last, a batch larger than the set yields none: the search
  // looks below it, between the last size that fit and it.
  auto data = fulgur::test::regression_dataset(40);
  const auto dropping = tuner.scale_batch_size(
      model,
      [data](int64_t b) {
        return fulgur::make_data_loader(data, {.batch_size = b, .drop_last = true});
      },
      {.mode = "binsearch", .steps_per_trial = 1, .host_memory_cap = kRoomy});
  EXPECT_EQ(dropping.batch_size, 40);
  EXPECT_THAT(dropping.note, testing::HasSubstr("the loader yields no batch of 41 samples"));
  for (const auto& t : dropping.trials) EXPECT_TRUE(t.fits) << t.batch_size;

  EXPECT_THROWS_WITH(fulgur::ConfigError, tuner.scale_batch_size(model, loaders_of(40)),
                     {"on the CPU with host_memory_cap=0", "Pass host_memory_cap"});
  EXPECT_EQ(model.steps, 6 + 3 + static_cast<int64_t>(dropping.trials.size()))
      << "the refusal ran no step";
}

TEST(BatchSizeFinder, NothingFitsSaysSoAndAnotherErrorIsRethrownWithTheModulePutBack) {
  TempDir dir;
  WideRegression model;
  fulgur::Tuner tuner(test_options(dir));
  const auto none = tuner.scale_batch_size(model, loaders_of(64),
                                           {.init_val = 4, .host_memory_cap = 1024});
  EXPECT_EQ(none.batch_size, 0);
  ASSERT_EQ(none.trials.size(), 3u) << "4, 2, 1";
  EXPECT_EQ(none.trials.back().batch_size, 1);
  EXPECT_THAT(none.note, testing::HasSubstr("no batch size fit; batch_size=1 ran out of memory"));

  const at::Tensor weight = model.fc1->weight.detach().clone();
  model.fail_with = "a bug in training_step";
  EXPECT_THROWS_WITH(std::runtime_error,
                     tuner.scale_batch_size(model, loaders_of(64), {.host_memory_cap = kCap}),
                     {"a bug in training_step"});
  EXPECT_TRUE(torch::equal(model.fc1->weight, weight));
}

// A DataModule whose setup() draws (a random split): set up for the trials
// as the fit sets it up. Unseeded, the generators after the tuner are as
// before it (its setup's draws were behind them: the fit's split and
// weights were not those of a fit without the tuner); seeded, the trials
// ran on the fit's split (their setup was not seeded).
TEST(BatchSizeFinder, ADataModuleIsSetUpAsTheFitSetsItUp) {
  struct SplitData : fulgur::DataModule {
    std::vector<double> drawn;  // each setup()'s draw
    int64_t batch = 2;
    void setup(fulgur::Stage) override { drawn.push_back(torch::rand({1}).item<double>()); }
    std::shared_ptr<fulgur::DataLoader> train_dataloader() override {
      return fulgur::make_data_loader(fulgur::test::regression_dataset(64), {.batch_size = batch});
    }
    std::optional<int64_t> batch_size() const override { return batch; }
    void set_batch_size(int64_t n) override { batch = n; }
  };
  const fulgur::BatchSizeFinderOptions search{
      .max_trials = 2, .steps_per_trial = 1, .host_memory_cap = kCap};
  {
    TempDir dir;
    LinearRegression model;
    SplitData data;
    torch::manual_seed(5);
    fulgur::Tuner(test_options(dir)).scale_batch_size(model, data, search);
    const double after = torch::rand({1}).item<double>();
    torch::manual_seed(5);
    EXPECT_EQ(after, torch::rand({1}).item<double>());
  }
  TempDir dir;
  auto options = test_options(dir);
  options.seed = 7;
  LinearRegression model;
  SplitData data;
  fulgur::Tuner(options).scale_batch_size(model, data, search);
  ASSERT_EQ(data.drawn.size(), 1u);
  fulgur::Trainer(options).fit(model, data);
  ASSERT_EQ(data.drawn.size(), 2u);
  EXPECT_EQ(data.drawn[0], data.drawn[1]);
}

TEST(BatchSizeFinder, OptionsThatCannotWorkAreNamedTogether) {
  TempDir dir;
  WideRegression model;
  fulgur::Tuner tuner(test_options(dir));
  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      tuner.scale_batch_size(model, loaders_of(8),
                             {.mode = "bisect", .init_val = 0, .max_trials = 0,
                              .steps_per_trial = 0, .host_memory_cap = -1}),
      {"Tuner.scale_batch_size(", "mode=\"bisect\"", "\"power\" or \"binsearch\"", "init_val=0",
       "max_trials=0", "steps_per_trial=0", "host_memory_cap=-1"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, tuner.scale_batch_size(model, nullptr),
                     {"make_loader is empty"});
  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      tuner.scale_batch_size(
          model, [](int64_t) { return std::shared_ptr<fulgur::DataLoader>(); },
          {.host_memory_cap = kCap}),
      {"make_loader(2) returned no loader"});
  // A loader of another size than asked for made every trial the same
  // (batch_size=4096 "fit", batches of 8 ran); no step ran every trial
  // "fit" too.
  auto data = fulgur::test::regression_dataset(64);
  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      tuner.scale_batch_size(
          model, [&](int64_t) { return fulgur::make_data_loader(data, {.batch_size = 8}); },
          {.host_memory_cap = kCap}),
      {"make_loader(2) returned a loader of batch_size=8", "the batch size asked for"});
  auto no_batches = test_options(dir);
  no_batches.limit_train_batches = 0;
  fulgur::Tuner none(no_batches);
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     none.scale_batch_size(model, loaders_of(8), {.host_memory_cap = kCap}),
                     {"Tuner.scale_batch_size with limit_train_batches=0", "no training step"});
  auto options = test_options(dir);
  options.strategy = "ddp";
  options.devices = 2;
  fulgur::Tuner ddp(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     ddp.scale_batch_size(model, loaders_of(8), {.host_memory_cap = kCap}),
                     {"strategy \"ddp\"", "devices=1"});
}

}  // namespace
