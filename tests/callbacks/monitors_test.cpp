#include "fulgur/callbacks/monitors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using ::testing::HasSubstr;

// Keeps every log_metrics call.
class RecordingLogger : public fulgur::Logger {
 public:
  std::string name() const override { return "recording"; }
  std::string log_dir() const override { return ""; }
  void log_hyperparams(const fulgur::HParams&) override {}
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) override {
    calls.emplace_back(step, metrics);
  }
  /// The values of `key` in logging order, with their steps.
  std::vector<std::pair<int64_t, double>> series(const std::string& key) const {
    std::vector<std::pair<int64_t, double>> out;
    for (const auto& [step, m] : calls) {
      if (auto it = m.find(key); it != m.end()) out.emplace_back(step, it->second);
    }
    return out;
  }
  std::vector<std::pair<int64_t, std::map<std::string, double>>> calls;
};

fulgur::TrainerOptions logged_options(const TempDir& dir, std::shared_ptr<RecordingLogger> logger,
                                      std::shared_ptr<fulgur::Callback> callback) {
  auto options = test_options(dir);
  options.logger = true;
  options.loggers = {logger};
  options.log_every_n_steps = 1;
  options.callbacks = {callback};
  return options;
}

TEST(LearningRateMonitor, LogsTheRateEachStepUsesAsTheSchedulerChangesIt) {
  TempDir dir;
  auto logger = std::make_shared<RecordingLogger>();
  auto monitor = std::make_shared<fulgur::LearningRateMonitor>(
      fulgur::LearningRateMonitorOptions{.log_momentum = true});
  LinearRegression model({.lr = 0.1, .momentum = 0.9});
  model.make_schedulers = [](torch::optim::Optimizer& o) {
    return std::vector<fulgur::SchedulerConfig>{
        {std::make_shared<torch::optim::StepLR>(o, 1, 0.5), fulgur::Interval::Step}};
  };
  fulgur::Trainer trainer(logged_options(dir, logger, monitor));
  trainer.fit(model, regression_loader(3));
  // The rate each step uses, at its index. LibTorch's StepLR applies its
  // first decay at its second step(): 0.1, 0.1, 0.05.
  auto lr = logger->series("lr-SGD");
  ASSERT_EQ(lr.size(), 3u);
  EXPECT_EQ(lr[0].first, 0);
  EXPECT_DOUBLE_EQ(lr[0].second, 0.1);
  EXPECT_DOUBLE_EQ(lr[1].second, 0.1);
  EXPECT_EQ(lr[2].first, 2);
  EXPECT_DOUBLE_EQ(lr[2].second, 0.05);
  EXPECT_DOUBLE_EQ(model.optimizer->param_groups()[0].options().get_lr(), 0.025);
  EXPECT_DOUBLE_EQ(monitor->last_logged().at("momentum-SGD"), 0.9);
}

TEST(LearningRateMonitor, NamesParamGroupsAndRepeatedOptimizersApart) {
  TempDir dir;
  auto logger = std::make_shared<RecordingLogger>();
  auto monitor = std::make_shared<fulgur::LearningRateMonitor>(
      fulgur::LearningRateMonitorOptions{.logging_interval = "epoch"});
  struct TwoOptimizers : LinearRegression {
    fulgur::OptimizerConfig configure_optimizers() override {
      std::vector<torch::optim::OptimizerParamGroup> groups = {
          torch::optim::OptimizerParamGroup({fc->weight}),
          torch::optim::OptimizerParamGroup({fc->bias},
                                            std::make_unique<torch::optim::AdamOptions>(0.5))};
      return fulgur::OptimizerConfig(std::vector<std::shared_ptr<torch::optim::Optimizer>>{
          std::make_shared<torch::optim::Adam>(groups, torch::optim::AdamOptions(0.1)),
          std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(0.2))});
    }
    at::Tensor training_step(fulgur::Batch& batch, int64_t idx) override {
      auto loss = LinearRegression::training_step(batch, idx);
      manual_backward(loss);
      for (auto& o : optimizers()) optimizer_step(*o);
      return loss;
    }
  } model;
  model.set_automatic_optimization(false);
  fulgur::Trainer trainer(logged_options(dir, logger, monitor));
  trainer.fit(model, regression_loader(2));
  const auto& last = monitor->last_logged();
  EXPECT_DOUBLE_EQ(last.at("lr-Adam/pg1"), 0.1);
  EXPECT_DOUBLE_EQ(last.at("lr-Adam/pg2"), 0.5);
  EXPECT_DOUBLE_EQ(last.at("lr-Adam-1"), 0.2);
  EXPECT_EQ(logger->series("lr-Adam-1").size(), 1u);  // once, at the epoch's end
}

TEST(ThroughputMonitor, LogsBatchAndSampleRates) {
  TempDir dir;
  auto logger = std::make_shared<RecordingLogger>();
  auto monitor =
      std::make_shared<fulgur::ThroughputMonitor>(fulgur::ThroughputMonitorOptions{.window = 4});
  LinearRegression model;
  fulgur::Trainer trainer(logged_options(dir, logger, monitor));
  trainer.fit(model, regression_loader(6, /*batch_size=*/5));
  auto batches = logger->series("throughput/batches_per_sec");
  auto samples = logger->series("throughput/samples_per_sec");
  ASSERT_EQ(batches.size(), 5u);  // from the second batch on
  EXPECT_GT(monitor->batches_per_sec(), 0);
  // Every batch holds 5 samples.
  EXPECT_NEAR(monitor->samples_per_sec(), 5 * monitor->batches_per_sec(),
              1e-9 * monitor->samples_per_sec());
  EXPECT_THROW(fulgur::ThroughputMonitor({.window = 1}), fulgur::ConfigError);
}

TEST(ModelSummary, ListsLayersParametersAndFrozenOnes) {
  struct Net : torch::nn::Module {
    torch::nn::Linear encoder{nullptr}, head{nullptr};
    Net() {
      encoder = register_module("encoder", torch::nn::Linear(100, 20));
      head = register_module("head", torch::nn::Linear(20, 3));
      for (auto& p : encoder->parameters()) p.requires_grad_(false);
    }
  } net;
  const std::string table = fulgur::ModelSummary::summarize(net);
  EXPECT_THAT(table, HasSubstr("encoder"));
  EXPECT_THAT(table, HasSubstr("Linear"));
  EXPECT_THAT(table, HasSubstr("2.0 K"));  // 100 * 20 + 20
  EXPECT_THAT(table, HasSubstr("frozen"));
  EXPECT_THAT(table, HasSubstr("trainable"));
  EXPECT_THAT(table, HasSubstr("63 trainable params, 2.0 K frozen params, 2.1 K total params"));
  EXPECT_THAT(fulgur::ModelSummary::summarize(net, 0), ::testing::Not(HasSubstr("encoder")));
}

TEST(ModelSummary, PrintsAtFitStart) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.callbacks = {std::make_shared<fulgur::ModelSummary>()};
  fulgur::Trainer trainer(options);
  testing::internal::CaptureStdout();
  trainer.fit(model, regression_loader(1));
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_THAT(out, HasSubstr("fc"));
  EXPECT_THAT(out, HasSubstr("4 trainable params"));
}

}  // namespace
