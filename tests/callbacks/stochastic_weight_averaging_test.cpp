// StochasticWeightAveraging: the average against the weights at the end of
// each averaged epoch (with the callback's own operations, and close to
// their plain mean), the annealed rates the optimizer stepped with (over a
// scheduler's), the module taking the average, BatchNorm statistics
// recomputed for it (against a pass made here), a resumed run ending
// bit-identical, and options that cannot work named.
#include "fulgur/callbacks/stochastic_weight_averaging.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <tuple>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using fulgur::StochasticWeightAveraging;
using fulgur::SWAOptions;
using fulgur::test::clone_parameters;
using fulgur::test::expect_tensors_equal;
using fulgur::test::LinearRegression;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;

// The weights at the end of every epoch, and the rate of every step.
class SwaRecorder : public fulgur::Callback {
 public:
  std::string state_key() const override { return "Recorder"; }
  void on_train_epoch_end(fulgur::Trainer&, fulgur::Module& m) override {
    epochs.push_back(clone_parameters(m));
  }
  void on_train_batch_end(fulgur::Trainer&, fulgur::Module&, const at::Tensor&,
                          const fulgur::Batch&, int64_t) override {
    lrs.push_back(optimizer->param_groups()[0].options().get_lr());
  }
  torch::optim::Optimizer* optimizer = nullptr;
  std::vector<std::vector<at::Tensor>> epochs;
  std::vector<double> lrs;
};

class RecordedRegression : public LinearRegression {
 public:
  explicit RecordedRegression(SwaRecorder* recorder) : recorder_(recorder) {}
  fulgur::OptimizerConfig configure_optimizers() override {
    auto config = LinearRegression::configure_optimizers();
    recorder_->optimizer = config.optimizers.front().get();
    return config;
  }

 private:
  SwaRecorder* recorder_;
};

TEST(StochasticWeightAveraging, TheModuleEndsWithTheAverageOfTheAveragedEpochsEnds) {
  TempDir dir;
  auto recorder = std::make_shared<SwaRecorder>();
  RecordedRegression model(recorder.get());
  auto swa = std::make_shared<StochasticWeightAveraging>(
      SWAOptions{.swa_lr = 0.01, .swa_epoch_start = 0.6, .annealing_epochs = 2});
  auto options = test_options(dir);
  options.max_epochs = 5;
  options.callbacks = {recorder, swa};
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(4));

  EXPECT_EQ(swa->start_epoch(), 2);  // 0.6 of 5 epochs: the 3rd, as Lightning counts
  EXPECT_EQ(swa->count(), 3);
  ASSERT_EQ(recorder->epochs.size(), 5u);
  // The running average of epochs 2, 3 and 4's ends, as the callback
  // computes it: the first copied, then avg += (w - avg) / (n + 1).
  std::vector<at::Tensor> expected;
  for (const auto& w : recorder->epochs[2]) expected.push_back(w.clone());
  for (size_t e = 3; e < 5; ++e) {
    for (size_t i = 0; i < expected.size(); ++i) {
      expected[i].add_(recorder->epochs[e][i] - expected[i], 1.0 / static_cast<double>(e - 1));
    }
  }
  expect_tensors_equal(swa->average(), expected);
  expect_tensors_equal(clone_parameters(model), expected);
  // And that is their mean, within rounding; not the last epoch's weights.
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto mean =
        (recorder->epochs[2][i] + recorder->epochs[3][i] + recorder->epochs[4][i]) / 3.0;
    EXPECT_TRUE(torch::allclose(expected[i], mean, 1e-6, 1e-7)) << i;
    EXPECT_FALSE(torch::equal(expected[i], recorder->epochs[4][i])) << i;
  }
}

TEST(StochasticWeightAveraging, EveryStepOfAnAveragedEpochTakesTheAnnealedRate) {
  for (const char* strategy : {"cos", "linear"}) {
    TempDir dir;
    auto recorder = std::make_shared<SwaRecorder>();
    RecordedRegression model(recorder.get());
    // A schedule that halves the rate after every epoch from the second on
    // (LibTorch's StepLR leaves its first step's rate as it is): averaging
    // starts from the rate it reached (0.05 / 2 at epoch 2) and overrides it.
    model.make_schedulers = [](torch::optim::Optimizer& optimizer) {
      return std::vector<fulgur::SchedulerConfig>{
          {.scheduler = std::make_shared<torch::optim::StepLR>(optimizer, 1, 0.5)}};
    };
    auto options = test_options(dir);
    options.max_epochs = 6;
    options.callbacks = {recorder, std::make_shared<StochasticWeightAveraging>(
                                       SWAOptions{.swa_lr = 0.001,
                                                  .swa_epoch_start = 3,  // index 2
                                                  .annealing_epochs = 3,
                                                  .annealing_strategy = strategy})};
    fulgur::Trainer trainer(options);
    trainer.fit(model, regression_loader(4));
    ASSERT_EQ(recorder->lrs.size(), 24u) << strategy;
    const double lr0 = 0.05 / 2;
    // As torch's SWALR: the first averaged epoch at lr0, then a step of the
    // annealing per epoch.
    auto anneal = [&](double t) {
      const double a = std::string(strategy) == "cos" ? (1 - std::cos(std::acos(-1.0) * t)) / 2 : t;
      return 0.001 * a + lr0 * (1 - a);
    };
    for (int epoch = 0; epoch < 6; ++epoch) {
      const double expected = epoch < 2 ? 0.05 : anneal(std::min(1.0, (epoch - 2) / 3.0));
      for (int b = 0; b < 4; ++b) {
        EXPECT_DOUBLE_EQ(recorder->lrs[static_cast<size_t>(epoch * 4 + b)], expected)
            << strategy << " epoch " << epoch << " batch " << b;
      }
    }
  }
}

// Linear → BatchNorm → Linear; predict_step is the forward pass.
class BatchNormNet : public fulgur::Module {
 public:
  explicit BatchNormNet(bool with_predict = true) : with_predict_(with_predict) {
    net = register_module("net",
                          torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4),
                                                torch::nn::Linear(4, 1)));
  }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    const auto& [x, y] = batch.pair();
    return torch::mse_loss(net->forward(x), y);
  }
  fulgur::Batch predict_step(fulgur::Batch& batch, int64_t idx) override {
    if (!with_predict_) return fulgur::Module::predict_step(batch, idx);
    return net->forward(batch.pair().first);
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return fulgur::OptimizerConfig(
        std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.05)));
  }
  torch::nn::Sequential net{nullptr};

 private:
  bool with_predict_;
};

std::vector<at::Tensor> bn_stats(BatchNormNet& m) {
  auto* bn = m.net[1]->as<torch::nn::BatchNorm1d>();
  return {bn->running_mean.clone(), bn->running_var.clone(), bn->num_batches_tracked.clone()};
}

TEST(StochasticWeightAveraging, BatchNormStatisticsAreRecomputedForTheAveragedWeights) {
  TempDir dir;
  auto as_trained = std::make_shared<std::vector<at::Tensor>>();
  struct StatsAtLastEpoch : fulgur::Callback {
    std::shared_ptr<std::vector<at::Tensor>> out;
    std::string state_key() const override { return "StatsAtLastEpoch"; }
    void on_train_epoch_end(fulgur::Trainer&, fulgur::Module& m) override {
      *out = bn_stats(static_cast<BatchNormNet&>(m));
    }
  };
  auto stats_callback = std::make_shared<StatsAtLastEpoch>();
  stats_callback->out = as_trained;
  auto run = [&](bool update_bn) {
    torch::manual_seed(4);
    auto model = std::make_unique<BatchNormNet>();
    auto options = test_options(dir);
    options.max_epochs = 4;
    options.callbacks = {stats_callback,
                         std::make_shared<StochasticWeightAveraging>(SWAOptions{
                             .swa_lr = 0.01, .swa_epoch_start = 2, .update_bn = update_bn})};
    fulgur::Trainer trainer(options);
    trainer.fit(*model, regression_loader(4));
    return model;
  };
  auto updated = run(true);
  // What the pass should give: the averaged weights, fresh statistics, a
  // cumulative average over the training batches in training mode.
  BatchNormNet reference;
  fulgur::load_module_state_dict(reference, fulgur::module_state_dict(*updated));
  auto* bn = reference.net[1]->as<torch::nn::BatchNorm1d>();
  {
    torch::NoGradGuard no_grad;
    bn->running_mean.zero_();
    bn->running_var.fill_(1.0);
    bn->num_batches_tracked.zero_();
    using Momentum = std::decay_t<decltype(bn->options.momentum())>;  // c10:: or std::optional
    bn->options.momentum(Momentum());
    reference.train();
    auto loader = regression_loader(4);
    loader->start_epoch(0);
    while (auto batch = loader->next()) reference.net->forward(batch->pair().first);
  }
  expect_tensors_equal(bn_stats(*updated), bn_stats(reference));
  EXPECT_EQ(bn_stats(*updated)[2].item<int64_t>(), 4);
  // The layer's own momentum is back; the statistics differ from the
  // trained ones, which update_bn=false keeps.
  EXPECT_EQ(updated->net[1]->as<torch::nn::BatchNorm1d>()->options.momentum(), 0.1);
  EXPECT_FALSE(torch::equal(bn_stats(*updated)[0], (*as_trained)[0]));
  auto kept = run(false);
  expect_tensors_equal(bn_stats(*kept), *as_trained);
}

TEST(StochasticWeightAveraging, WithoutAForwardPassTheBatchNormUpdateSaysWhatToDo) {
  TempDir dir;
  BatchNormNet model(/*with_predict=*/false);
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.callbacks = {std::make_shared<StochasticWeightAveraging>(
      SWAOptions{.swa_lr = 0.01, .swa_epoch_start = 1})};
  fulgur::Trainer trainer(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, regression_loader(4)),
                     {"StochasticWeightAveraging", "predict_step", "update_bn = false"});
  // Without BatchNorm layers no pass is needed: LinearRegression's
  // predict_step is never called.
  LinearRegression plain;
  options.callbacks = {std::make_shared<StochasticWeightAveraging>(
      SWAOptions{.swa_lr = 0.01, .swa_epoch_start = 1})};
  fulgur::Trainer again(options);
  again.fit(plain, regression_loader(4));
  EXPECT_EQ(plain.predict_steps, 0);
}

TEST(StochasticWeightAveraging, ARunResumedFromAnEpochsEndOrFromItsLastEndsBitIdentical) {
  TempDir dir;
  auto train = [&](const std::string& ckpt, int64_t max_epochs) {
    torch::manual_seed(8);
    auto model =
        std::make_unique<LinearRegression>(fulgur::test::LinearRegressionOptions{.momentum = 0.9});
    auto options =
        fulgur::test::checkpointed_options(dir, {.filename = "{epoch}", .save_top_k = -1});
    // ModelCheckpoint saves at an epoch's end, before that epoch is
    // averaged (the next epoch's start, or the end of training, takes it).
    options.callbacks.push_back(std::make_shared<StochasticWeightAveraging>(
        SWAOptions{.swa_lr = 0.02, .swa_epoch_start = 1, .annealing_epochs = 2}));
    options.max_epochs = max_epochs;
    fulgur::Trainer trainer(options);
    trainer.fit(*model, regression_loader(4, 2, /*shuffle=*/true), nullptr, {.ckpt_path = ckpt});
    return model;
  };
  auto whole = train("", 5);
  const auto files = fulgur::test::list_files(dir.file("checkpoints"));
  ASSERT_THAT(files, ::testing::Contains("epoch=2.ckpt")) << ::testing::PrintToString(files);
  auto resumed = train(dir.file("checkpoints/epoch=2.ckpt"), 5);
  EXPECT_TRUE(fulgur::test::parameters_equal(*whole, *resumed));
  // From the last epoch's checkpoint no epoch runs; its weights are still
  // averaged in when training ends.
  auto from_last = train(dir.file("checkpoints/epoch=4.ckpt"), 5);
  EXPECT_TRUE(fulgur::test::parameters_equal(*whole, *from_last));
}

// Two optimizers under manual optimization, the first stepping at even
// batches only. Each anneals from its own starting rate; a run resumed
// at an odd batch, where the second steps first, too (the rates were
// matched to the optimizers in the order they first stepped in the fit,
// so there the second annealed from the first's rate).
class TwoOptimizers : public fulgur::Module {
 public:
  TwoOptimizers() {
    set_automatic_optimization(false);
    a = register_module("a", torch::nn::Linear(3, 1));
    b = register_module("b", torch::nn::Linear(3, 1));
  }
  at::Tensor training_step(fulgur::Batch& batch, int64_t batch_idx) override {
    const auto& [x, y] = batch.pair();
    auto loss = torch::mse_loss(a(x) + b(x), y);
    for (auto& o : optimizers()) o->zero_grad();
    manual_backward(loss);
    if (batch_idx % 2 == 0) optimizer_step(0);
    optimizer_step(1);
    rates.push_back({current_epoch(), batch_idx,
                     optimizers()[0]->param_groups()[0].options().get_lr(),
                     optimizers()[1]->param_groups()[0].options().get_lr()});
    return loss.detach();
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return fulgur::OptimizerConfig(
        {std::make_shared<torch::optim::SGD>(a->parameters(), torch::optim::SGDOptions(0.05)),
         std::make_shared<torch::optim::SGD>(b->parameters(), torch::optim::SGDOptions(0.2))});
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  std::vector<std::tuple<int64_t, int64_t, double, double>> rates;
};

TEST(StochasticWeightAveraging, EachOptimizerAnnealsFromItsOwnRateAlsoAfterAResume) {
  TempDir dir;
  const std::string saved = dir.file("epoch2-batch0.ckpt");
  struct SaveAt : fulgur::Callback {
    std::string path;
    std::string state_key() const override { return "SaveAt"; }
    void on_train_batch_end(fulgur::Trainer& t, fulgur::Module&, const at::Tensor&,
                            const fulgur::Batch&, int64_t batch_idx) override {
      if (t.current_epoch() == 2 && batch_idx == 0) t.save_checkpoint(path);
    }
  };
  auto train = [&](const std::string& ckpt) {
    torch::manual_seed(5);
    auto model = std::make_unique<TwoOptimizers>();
    auto options = test_options(dir);
    options.max_epochs = 4;
    auto save = std::make_shared<SaveAt>();
    save->path = saved;
    options.callbacks = {std::make_shared<StochasticWeightAveraging>(SWAOptions{
                             .swa_lr = 0.001, .swa_epoch_start = 2, .annealing_epochs = 2}),
                         save};
    fulgur::Trainer trainer(options);
    trainer.fit(*model, regression_loader(4), nullptr, {.ckpt_path = ckpt});
    return model;
  };
  auto whole = train("");
  ASSERT_EQ(whole->rates.size(), 16u);
  // Epoch 2 (index), halfway through the annealing: each optimizer's own.
  const auto& [epoch, batch, lr_a, lr_b] = whole->rates[9];
  ASSERT_EQ(epoch, 2);
  ASSERT_EQ(batch, 1);
  EXPECT_DOUBLE_EQ(lr_a, 0.001 * 0.5 + 0.05 * 0.5);
  EXPECT_DOUBLE_EQ(lr_b, 0.001 * 0.5 + 0.2 * 0.5);
  auto resumed = train(saved);
  ASSERT_EQ(resumed->rates.size(), 7u);
  for (size_t i = 0; i < resumed->rates.size(); ++i) {
    EXPECT_EQ(resumed->rates[i], whole->rates[9 + i]) << i;
  }
  EXPECT_TRUE(fulgur::test::parameters_equal(*whole, *resumed));
}

TEST(StochasticWeightAveraging, OptionsThatCannotWorkAreNamed) {
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     StochasticWeightAveraging(SWAOptions{.swa_lr = 0.0,
                                                          .swa_epoch_start = 1.5,
                                                          .annealing_epochs = -1,
                                                          .annealing_strategy = "step"}),
                     {"swa_lr=0", "swa_epoch_start=1.5", "annealing_epochs=-1",
                      "annealing_strategy=\"step\"", "cos", "linear"});
  // An epoch past what an int64_t holds (it was converted regardless, and
  // named as epoch -9223372036854775808).
  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      StochasticWeightAveraging(SWAOptions{.swa_lr = 0.01, .swa_epoch_start = 1e300}),
      {"swa_epoch_start=1e+300", "from 1 to 2^62"});
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.max_epochs = 3;
  options.callbacks = {std::make_shared<StochasticWeightAveraging>(
      SWAOptions{.swa_lr = 0.01, .swa_epoch_start = 4})};
  fulgur::Trainer late(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError, late.fit(model, regression_loader(2)),
                     {"swa_epoch_start=4 is epoch 4 (counted from 1)", "trains 3 epoch(s)",
                      "nothing would be averaged"});
  options.callbacks = {std::make_shared<fulgur::EMA>(),
                       std::make_shared<StochasticWeightAveraging>(SWAOptions{.swa_lr = 0.01})};
  fulgur::Trainer with_ema(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError, with_ema.fit(model, regression_loader(2)),
                     {"EMA with apply_at_end=true", "apply_at_end = false"});
  options.max_epochs = -1;
  options.max_steps = 6;
  options.callbacks = {std::make_shared<StochasticWeightAveraging>(SWAOptions{.swa_lr = 0.01})};
  fulgur::Trainer unlimited(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError, unlimited.fit(model, regression_loader(2)),
                     {"swa_epoch_start=0.8", "no epoch limit", "swa_epoch_start=10"});
  EXPECT_EQ(model.training_steps, 0);
}

}  // namespace
