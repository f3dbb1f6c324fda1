#include "fulgur/core/module.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;

/// Overrides nothing: every step falls back to fulgur::Module's default.
class BareModule : public fulgur::Module {
 public:
  BareModule() : fulgur::Module("BareModule") {}
};

TEST(Module, LogOutsideARunIsAConfigError) {
  LinearRegression model;
  EXPECT_THROWS_WITH(fulgur::ConfigError, model.log("loss", 1.0),
                     {"\"loss\"", "outside a Trainer run"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, model.log("loss", torch::tensor(1.0)),
                     {"\"loss\"", "outside a Trainer run"});
}

TEST(Module, LogRejectsNonScalarTensors) {
  LinearRegression model;
  EXPECT_THROWS_WITH(fulgur::ConfigError, model.log("vector", torch::ones({3})),
                     {"\"vector\"", "only scalars"});
}

TEST(Module, TrainerIsUnavailableWhenDetached) {
  LinearRegression model;
  EXPECT_FALSE(model.has_trainer());
  EXPECT_THROWS_WITH(fulgur::ConfigError, model.trainer(), {"LinearRegression", "not attached"});
  EXPECT_EQ(model.current_epoch(), 0);
  EXPECT_EQ(model.global_step(), 0);
  EXPECT_THROWS_WITH(fulgur::ConfigError, model.optimizers(), {"not attached"});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     model.manual_backward(torch::ones({1}, torch::requires_grad())),
                     {"not attached"});
}

TEST(Module, DefaultStepsExplainWhatToOverride) {
  BareModule module;
  fulgur::Batch batch(torch::ones({2, 3}));
  EXPECT_THROWS_WITH(fulgur::ConfigError, module.training_step(batch, 0),
                     {"BareModule", "training_step"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, module.validation_step(batch, 0),
                     {"BareModule", "validation_step"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, module.test_step(batch, 0), {"BareModule", "test_step"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, module.predict_step(batch, 0),
                     {"BareModule", "predict_step"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, module.configure_optimizers(),
                     {"BareModule", "configure_optimizers"});
}

TEST(Module, FitWithoutTrainingStepIsAConfigError) {
  TempDir dir;
  BareModule module;
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(module, regression_loader(2)),
                     {"BareModule"});
  EXPECT_FALSE(module.has_trainer());  // detached again after the failure
}

TEST(Module, SaveHyperparametersMerges) {
  LinearRegression model;
  model.save_hyperparameters({{"lr", 0.1}, {"layers", int64_t{2}}});
  model.save_hyperparameters({{"lr", 0.01}, {"optimizer", std::string("sgd")}, {"nesterov", true}});
  const auto& hp = model.hparams();
  ASSERT_EQ(hp.size(), 4u);
  EXPECT_EQ(std::get<double>(hp.at("lr")), 0.01);
  EXPECT_EQ(std::get<int64_t>(hp.at("layers")), 2);
  EXPECT_EQ(std::get<std::string>(hp.at("optimizer")), "sgd");
  EXPECT_EQ(std::get<bool>(hp.at("nesterov")), true);
}

TEST(Module, HParamToString) {
  EXPECT_EQ(fulgur::to_string(fulgur::HParam(true)), "true");
  EXPECT_EQ(fulgur::to_string(fulgur::HParam(false)), "false");
  EXPECT_EQ(fulgur::to_string(fulgur::HParam(int64_t{42})), "42");
  EXPECT_EQ(fulgur::to_string(fulgur::HParam(0.5)), "0.5");
  EXPECT_EQ(fulgur::to_string(fulgur::HParam(std::string("adam"))), "adam");
}

TEST(Module, ReduceToString) {
  EXPECT_STREQ(fulgur::to_string(fulgur::ReduceOp::kMean), "mean");
  EXPECT_STREQ(fulgur::to_string(fulgur::ReduceOp::kSum), "sum");
  EXPECT_STREQ(fulgur::to_string(fulgur::ReduceOp::kMax), "max");
  EXPECT_STREQ(fulgur::to_string(fulgur::ReduceOp::kMin), "min");
}

TEST(Module, AttachedDuringFitAndDetachedAfter) {
  TempDir dir;
  LinearRegression model;
  bool attached = false;
  fulgur::Stage stage = fulgur::Stage::kTest;
  model.train_hook = [&](LinearRegression& self, fulgur::Batch&, int64_t) {
    attached = self.has_trainer();
    stage = self.trainer().stage();
    EXPECT_EQ(self.optimizers().size(), 1u);
    EXPECT_EQ(self.optimizers()[0].get(), self.optimizer.get());
  };
  fulgur::Trainer trainer(test_options(dir));
  trainer.fit(model, regression_loader(2));
  EXPECT_TRUE(attached);
  EXPECT_EQ(stage, fulgur::Stage::kFit);
  EXPECT_FALSE(model.has_trainer());
}

TEST(Module, ProcessGroupUnderOneProcessIsAConfigErrorNamingTheStrategy) {
  TempDir dir;
  LinearRegression model;
  std::string message;
  model.train_hook = [&](LinearRegression& self, fulgur::Batch&, int64_t) {
    try {
      self.process_group();
    } catch (const fulgur::ConfigError& e) {
      message = e.what();
    }
  };
  fulgur::Trainer trainer(test_options(dir));
  trainer.fit(model, regression_loader(1));
  EXPECT_NE(message.find("process_group(): strategy \"single_device\" runs one process"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("strategy=\"ddp\""), std::string::npos) << message;
}

TEST(Module, CurrentEpochAndGlobalStepFollowTheTrainer) {
  TempDir dir;
  LinearRegression model;
  std::vector<std::pair<int64_t, int64_t>> seen;  // (epoch, global step) at each step
  model.train_hook = [&](LinearRegression& self, fulgur::Batch&, int64_t) {
    seen.emplace_back(self.current_epoch(), self.global_step());
  };
  auto options = test_options(dir);
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2));
  std::vector<std::pair<int64_t, int64_t>> expected{{0, 0}, {0, 1}, {1, 2}, {1, 3}};
  EXPECT_EQ(seen, expected);
}

TEST(Module, ConfigureOptimizersWithNoOptimizerIsAConfigError) {
  struct NoOptimizer : LinearRegression {
    fulgur::OptimizerConfig configure_optimizers() override { return {}; }
  };
  TempDir dir;
  NoOptimizer model;
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, regression_loader(2)),
                     {"configure_optimizers", "no optimizer"});
}

TEST(Module, TrainingStepMustReturnAScalarThatRequiresGrad) {
  TempDir dir;
  {
    struct VectorLoss : LinearRegression {
      at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
        return forward(batch.pair().first);  // shape [2, 1]
      }
    } vector_loss;
    fulgur::Trainer trainer(test_options(dir));
    EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(vector_loss, regression_loader(2)),
                       {"training_step", "scalar"});
  }
  {
    struct DetachedLoss : LinearRegression {
      at::Tensor training_step(fulgur::Batch&, int64_t) override { return torch::tensor(1.0); }
    } detached;
    fulgur::Trainer trainer(test_options(dir));
    EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(detached, regression_loader(2)),
                       {"training_step", "does not require grad"});
  }
}

TEST(Module, UndefinedLossSkipsTheBatch) {
  struct Skipping : LinearRegression {
    at::Tensor training_step(fulgur::Batch& batch, int64_t idx) override {
      auto loss = LinearRegression::training_step(batch, idx);
      return idx == 0 ? at::Tensor() : loss;  // skip the first batch
    }
  };
  TempDir dir;
  Skipping model;
  fulgur::Trainer trainer(test_options(dir));
  auto result = trainer.fit(model, regression_loader(3));
  EXPECT_EQ(model.training_steps, 3);
  EXPECT_EQ(model.count("on_before_backward"), 2);
  EXPECT_EQ(result.global_step, 2);
}

TEST(Module, UndefinedLossAtAnAccumulationStepStepsWithWhatWasAccumulated) {
  // accumulate_grad_batches=2 over 6 batches: windows {0,1} {2,3} {4,5}.
  // Batch 1 has no loss: the window still steps with batch 0's gradient.
  // Batches 2 and 3 have none: that window has nothing to step with.
  struct Skipping : LinearRegression {
    at::Tensor training_step(fulgur::Batch& batch, int64_t idx) override {
      auto loss = LinearRegression::training_step(batch, idx);
      return idx == 1 || idx == 2 || idx == 3 ? at::Tensor() : loss;
    }
  };
  TempDir dir;
  auto options = test_options(dir);
  options.accumulate_grad_batches = 2;
  Skipping model;
  fulgur::Trainer trainer(options);
  auto result = trainer.fit(model, regression_loader(6));
  EXPECT_EQ(model.count("on_before_backward"), 3);
  EXPECT_EQ(result.global_step, 2);

  // That first step is the one batch 0 alone gives with its loss halved.
  struct Halved : LinearRegression {
    at::Tensor training_step(fulgur::Batch& batch, int64_t idx) override {
      return LinearRegression::training_step(batch, idx) / 2;
    }
  };
  torch::manual_seed(0);
  Skipping accumulated;
  torch::manual_seed(0);
  Halved reference;
  auto two = test_options(dir);
  two.accumulate_grad_batches = 2;
  fulgur::Trainer(two).fit(accumulated, regression_loader(2));
  fulgur::Trainer(test_options(dir)).fit(reference, regression_loader(1));
  auto a = accumulated.parameters();
  auto b = reference.parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(torch::allclose(a[k], b[k])) << k;
  torch::manual_seed(0);
  LinearRegression initial;
  EXPECT_FALSE(torch::allclose(a[0], initial.parameters()[0])) << "no step was taken";
}

}  // namespace
