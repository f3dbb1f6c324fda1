// BaseFinetuning and BackboneFinetuning: the backbone frozen until its epoch
// and trained after it in a group of its own at the schedule's rates, frozen
// BatchNorm layers keeping their statistics, a BaseFinetuning of one's own
// unfreezing at group 0's rate / initial_denom_lr, a resumed fit (from
// before, at and after the unfreezing, mid-epoch too) ending bit-identical
// to the uninterrupted one, and what it cannot work with, named.
#include "fulgur/callbacks/finetuning.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::BackboneFinetuning;
using fulgur::BackboneFinetuningOptions;
using fulgur::test::clone_parameters;
using fulgur::test::expect_tensors_equal;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A backbone (linear, BatchNorm, tanh) and a linear head; SGD with momentum
// over the parameters that are trainable when the optimizer is made.
class Finetuned : public fulgur::Module {
 public:
  explicit Finetuned(bool only_trainable = true)
      : Finetuned(torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4),
                                        torch::nn::Functional(torch::tanh)),
                  4, only_trainable) {}
  // Another backbone, of `features` outputs.
  Finetuned(torch::nn::Sequential backbone_, int64_t features, bool only_trainable = true)
      : Module("Finetuned"), only_trainable_(only_trainable) {
    backbone = register_module("backbone", std::move(backbone_));
    head = register_module("head", torch::nn::Linear(features, 1));
  }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    const auto& [x, y] = batch.pair();
    return torch::nn::functional::mse_loss(head(backbone->forward(x)), y);
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    std::vector<at::Tensor> params;
    for (auto& p : parameters()) {
      if (p.requires_grad() || !only_trainable_) params.push_back(p);
    }
    optimizer =
        std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
    return fulgur::OptimizerConfig(optimizer);
  }
  torch::nn::BatchNorm1dImpl& norm() { return *backbone[1]->as<torch::nn::BatchNorm1d>(); }

  torch::nn::Sequential backbone{nullptr};
  torch::nn::Linear head{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer;

 private:
  bool only_trainable_;
};

std::vector<at::Tensor> backbone_weights(Finetuned& m) {
  auto* linear = m.backbone[0]->as<torch::nn::Linear>();
  return {linear->weight.detach().clone(), linear->bias.detach().clone()};
}

std::vector<at::Tensor> norm_state(Finetuned& m) {
  auto& bn = m.norm();
  return {bn.weight.detach().clone(), bn.bias.detach().clone(), bn.running_mean.clone(),
          bn.running_var.clone(), bn.num_batches_tracked.clone()};
}

// Every parameter and buffer bit-identical, by name.
void expect_state_equal(const torch::nn::Module& a, const torch::nn::Module& b) {
  EXPECT_TRUE(fulgur::test::parameters_equal(a, b));
  auto mine = a.named_buffers();
  auto theirs = b.named_buffers();
  ASSERT_EQ(mine.size(), theirs.size());
  for (const auto& item : mine) {
    SCOPED_TRACE(item.key());
    ASSERT_NE(theirs.find(item.key()), nullptr);
    EXPECT_TRUE(torch::equal(item.value(), theirs[item.key()]));
  }
}

// After the finetuning callback in the list: at each epoch's end, the
// optimizer's learning rates and the backbone's weights.
struct EpochRecorder : fulgur::Callback {
  std::string state_key() const override { return "EpochRecorder"; }
  void on_train_epoch_end(fulgur::Trainer&, fulgur::Module& m) override {
    auto& model = dynamic_cast<Finetuned&>(m);
    std::vector<double> rates;
    for (const auto& group : model.optimizer->param_groups())
      rates.push_back(group.options().get_lr());
    lrs.push_back(rates);
    backbone.push_back(backbone_weights(model));
    norms.push_back(norm_state(model));
    const auto& own = model.norm().options.momentum();  // a c10::optional
    momentum.push_back(own.has_value() ? std::optional<double>(*own) : std::nullopt);
  }
  std::vector<std::vector<double>> lrs;
  std::vector<std::vector<at::Tensor>> backbone;
  std::vector<std::vector<at::Tensor>> norms;
  std::vector<std::optional<double>> momentum;
};

TEST(BackboneFinetuning, TheBackboneTrainsFromItsEpochInAGroupOfItsOwnAtTheScheduledRates) {
  TempDir dir;
  Finetuned model;
  const auto initial = backbone_weights(model);
  auto recorder = std::make_shared<EpochRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 7;
  options.callbacks = {std::make_shared<BackboneFinetuning>(
                           BackboneFinetuningOptions{.unfreeze_backbone_at_epoch = 2}),
                       recorder};
  ::testing::internal::CaptureStderr();
  fulgur::Trainer(options).fit(model, regression_loader(4));
  // The BatchNorm layer trained all along in group 0: no note about it.
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              ::testing::Not(HasSubstr("already in the optimizer")));
  ASSERT_EQ(recorder->lrs.size(), 7u);
  // Frozen for epochs 0 and 1; then the head's 0.05 x 0.1, doubled every
  // epoch up to the head's rate (should_align).
  const double first = 0.05 * 0.1;
  EXPECT_THAT(recorder->lrs[0], ElementsAre(0.05));
  EXPECT_THAT(recorder->lrs[1], ElementsAre(0.05));
  EXPECT_THAT(recorder->lrs[2], ElementsAre(0.05, first));
  EXPECT_THAT(recorder->lrs[3], ElementsAre(0.05, 2.0 * first));
  EXPECT_THAT(recorder->lrs[4], ElementsAre(0.05, 2.0 * (2.0 * first)));
  EXPECT_THAT(recorder->lrs[5], ElementsAre(0.05, 2.0 * (2.0 * (2.0 * first))));
  EXPECT_THAT(recorder->lrs[6], ElementsAre(0.05, 0.05));
  expect_tensors_equal(recorder->backbone[1], initial);
  EXPECT_FALSE(torch::equal(recorder->backbone[2][0], initial[0]));
  // train_bn (the default): the BatchNorm layer trained from the start, in
  // group 0, and its statistics moved.
  EXPECT_FALSE(torch::equal(recorder->norms[0][0], torch::ones({4})));
  EXPECT_EQ(recorder->norms[1][4].item<int64_t>(), 8);
  EXPECT_EQ(model.optimizer->param_groups()[0].params().size(), 4u);  // head, BatchNorm
  EXPECT_EQ(model.optimizer->param_groups()[1].params().size(), 2u);  // the linear layer
  for (const auto& p : model.parameters()) EXPECT_TRUE(p.requires_grad());
}

TEST(BackboneFinetuning, AFrozenBatchNormKeepsItsStatisticsAndGetsItsMomentumBack) {
  TempDir dir;
  Finetuned model;
  const auto initial = norm_state(model);
  auto recorder = std::make_shared<EpochRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 3;
  options.callbacks = {std::make_shared<BackboneFinetuning>(BackboneFinetuningOptions{
                           .unfreeze_backbone_at_epoch = 1, .train_bn = false}),
                       recorder};
  fulgur::Trainer(options).fit(model, regression_loader(4));
  // train_bn=false: the layer stays frozen after the unfreezing too, its
  // running statistics those it started with (momentum 0 meanwhile).
  for (size_t epoch = 0; epoch < 3; ++epoch) {
    SCOPED_TRACE(epoch);
    for (size_t k = 0; k < 4; ++k) EXPECT_TRUE(torch::equal(recorder->norms[epoch][k], initial[k]));
    EXPECT_EQ(recorder->momentum[epoch], 0.0);
  }
  EXPECT_EQ(model.optimizer->param_groups()[0].params().size(), 2u);  // the head
  EXPECT_EQ(model.optimizer->param_groups()[1].params().size(), 2u);  // the linear layer
  EXPECT_FALSE(model.norm().weight.requires_grad());
  // After the fit: its own momentum and count back.
  EXPECT_EQ(model.norm().options.momentum().value(), 0.1);
  EXPECT_EQ(model.norm().num_batches_tracked.item<int64_t>(), 0);
}

// Averaging begins at epoch 1 and the backbone's group joins at epoch 2:
// StochasticWeightAveraging anneals it to swa_lr from the rate it joined
// with, as it anneals the head's from its own.
TEST(BackboneFinetuning, WeightAveragingAnnealsTheAddedGroupFromItsOwnRate) {
  TempDir dir;
  Finetuned model;
  auto recorder = std::make_shared<EpochRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 4;
  options.callbacks = {std::make_shared<BackboneFinetuning>(
                           BackboneFinetuningOptions{.unfreeze_backbone_at_epoch = 2}),
                       std::make_shared<fulgur::StochasticWeightAveraging>(
                           fulgur::SWAOptions{.swa_lr = 0.001,
                                              .swa_epoch_start = 2,  // index 1
                                              .annealing_epochs = 2,
                                              .annealing_strategy = "linear",
                                              .update_bn = false}),
                       recorder};
  fulgur::Trainer(options).fit(model, regression_loader(4));
  ASSERT_EQ(recorder->lrs.size(), 4u);
  using ::testing::DoubleEq;
  EXPECT_THAT(recorder->lrs[1], ElementsAre(DoubleEq(0.05)));
  // Halfway: each group between its own first rate and swa_lr.
  EXPECT_THAT(recorder->lrs[2], ElementsAre(DoubleEq(0.001 * 0.5 + 0.05 * 0.5),
                                            DoubleEq(0.001 * 0.5 + 0.05 * 0.1 * 0.5)));
  EXPECT_THAT(recorder->lrs[3], ElementsAre(DoubleEq(0.001), DoubleEq(0.001)));
}

// Freezes the whole backbone, BatchNorm included, and unfreezes it at epoch
// 1 without a learning rate: group 0's / initial_denom_lr.
class WholeBackbone : public fulgur::BaseFinetuning {
 protected:
  void freeze_before_training(fulgur::Module& m) override {
    freeze(*dynamic_cast<Finetuned&>(m).backbone, /*train_bn=*/false);
  }
  void finetune_function(fulgur::Module& m, int64_t epoch,
                         torch::optim::Optimizer& optimizer) override {
    if (epoch == 1) {
      added = unfreeze_and_add_param_group(*dynamic_cast<Finetuned&>(m).backbone, optimizer,
                                           std::nullopt, /*initial_denom_lr=*/5.0);
    }
  }

 public:
  size_t added = 0;
};

TEST(BaseFinetuning, AnUnfrozenBatchNormCountsOnFromWhereItWasFrozen) {
  TempDir dir;
  Finetuned model;
  auto finetuning = std::make_shared<WholeBackbone>();
  auto recorder = std::make_shared<EpochRecorder>();
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.callbacks = {finetuning, recorder};
  fulgur::Trainer(options).fit(model, regression_loader(4));
  EXPECT_EQ(finetuning->added, 4u);  // linear and BatchNorm, weight and bias each
  EXPECT_THAT(recorder->lrs[1], ElementsAre(0.05, 0.05 / 5.0));
  EXPECT_EQ(recorder->momentum[0], 0.0);
  EXPECT_EQ(recorder->momentum[1], 0.1);
  // Epoch 0's four frozen batches are not counted; epoch 1's are.
  EXPECT_EQ(recorder->norms[0][4].item<int64_t>(), 4);  // LibTorch counts while frozen
  EXPECT_EQ(recorder->norms[1][4].item<int64_t>(), 4);
  EXPECT_FALSE(torch::equal(recorder->norms[1][2], recorder->norms[0][2]));
  EXPECT_EQ(finetuning->state_key(), "WholeBackbone");
}

// Checkpoints every 3 steps and at every epoch's end, 4 steps per epoch,
// unfreezing at epoch 2: resumes from epoch 0 (frozen), from the end of
// epoch 1 (the unfreezing comes next), from step 9 (mid-epoch 2, just
// unfrozen: not unfrozen twice) and from step 15 (epoch 3, a raised rate).
TEST(BaseFinetuning, AResumedFitEndsBitIdenticalToTheUninterruptedOne) {
  for (bool train_bn : {true, false}) {
    SCOPED_TRACE(train_bn ? "train_bn" : "frozen BatchNorm");
    auto options_in = [train_bn](const TempDir& root) {
      auto options = test_options(root);
      options.max_epochs = 5;
      options.enable_checkpointing = true;
      options.callbacks = {
          std::make_shared<BackboneFinetuning>(
              BackboneFinetuningOptions{.unfreeze_backbone_at_epoch = 2, .train_bn = train_bn}),
          std::make_shared<fulgur::ModelCheckpoint>(fulgur::ModelCheckpointOptions{
              .dirpath = root.file("steps"), .save_top_k = -1, .every_n_train_steps = 3}),
          std::make_shared<fulgur::ModelCheckpoint>(fulgur::ModelCheckpointOptions{
              .dirpath = root.file("epochs"), .save_top_k = -1, .every_n_epochs = 1})};
      return options;
    };
    TempDir whole;
    Finetuned uninterrupted;
    fulgur::Trainer(options_in(whole)).fit(uninterrupted, regression_loader(4));
    for (const char* name : {"steps/epoch=0-step=3.ckpt", "epochs/epoch=1-step=8.ckpt",
                             "steps/epoch=2-step=9.ckpt", "steps/epoch=3-step=15.ckpt"}) {
      SCOPED_TRACE(name);
      TempDir other;
      Finetuned resumed;
      fulgur::test::copy_parameters(uninterrupted, resumed);  // overwritten by the checkpoint
      auto result =
          fulgur::Trainer(options_in(other))
              .fit(resumed, regression_loader(4), nullptr, {.ckpt_path = whole.file(name)});
      EXPECT_EQ(result.global_step, 20);
      expect_state_equal(uninterrupted, resumed);
      ASSERT_EQ(resumed.optimizer->param_groups().size(), 2u);
      EXPECT_EQ(resumed.optimizer->param_groups()[1].options().get_lr(),
                uninterrupted.optimizer->param_groups()[1].options().get_lr());
      EXPECT_EQ(resumed.norm().options.momentum().value(), 0.1);
    }
  }
}

TEST(BackboneFinetuning, NamesWhatItCannotWorkWith) {
  TempDir dir;
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     BackboneFinetuning(BackboneFinetuningOptions{.unfreeze_backbone_at_epoch = -1,
                                                                  .backbone_initial_ratio_lr = 0}),
                     {"unfreeze_backbone_at_epoch=-1", "backbone_initial_ratio_lr=0"});

  // No submodule of that name: the children are listed.
  {
    Finetuned model;
    auto options = test_options(dir);
    options.callbacks = {
        std::make_shared<BackboneFinetuning>(BackboneFinetuningOptions{.backbone = "encoder"})};
    EXPECT_THROWS_WITH(fulgur::ConfigError,
                       fulgur::Trainer(options).fit(model, regression_loader(2)),
                       {"no submodule \"encoder\"", "its children: backbone, head"});
  }
  // The optimizer holds the frozen backbone already: named when the fit
  // starts.
  {
    Finetuned model(/*only_trainable=*/false);
    auto options = test_options(dir);
    options.callbacks = {std::make_shared<BackboneFinetuning>(
        BackboneFinetuningOptions{.unfreeze_backbone_at_epoch = 1})};
    options.max_epochs = 2;
    EXPECT_THROWS_WITH(
        fulgur::ConfigError, fulgur::Trainer(options).fit(model, regression_loader(2)),
        {"the optimizer holds 2 of the frozen backbone's parameters", "requires_grad() only"});
    EXPECT_EQ(model.optimizer->param_groups().size(), 1u);
  }
  // A BaseFinetuning of one's own that unfreezes what the optimizer holds:
  // noted, and nothing is added.
  {
    Finetuned model(/*only_trainable=*/false);
    auto finetuning = std::make_shared<WholeBackbone>();
    auto options = test_options(dir);
    options.callbacks = {finetuning};
    options.max_epochs = 2;
    ::testing::internal::CaptureStderr();
    fulgur::Trainer(options).fit(model, regression_loader(2));
    EXPECT_THAT(::testing::internal::GetCapturedStderr(),
                HasSubstr("WholeBackbone: 4 of the frozen parameters it unfreezes are "
                          "already in the optimizer's parameter groups"));
    EXPECT_EQ(finetuning->added, 0u);
    EXPECT_EQ(model.optimizer->param_groups().size(), 1u);
  }
  // A backbone with nothing to unfreeze (no parameters; BatchNorm alone,
  // which train_bn keeps training): named when the fit starts, not at the
  // unfreezing epoch (where it blamed configure_optimizers).
  for (const bool with_norm : {false, true}) {
    torch::nn::Sequential backbone;
    if (with_norm) backbone->push_back(torch::nn::BatchNorm1d(3));
    backbone->push_back(torch::nn::Functional(torch::tanh));
    Finetuned model(backbone, 3);
    auto options = test_options(dir);
    options.callbacks = {std::make_shared<BackboneFinetuning>(
        BackboneFinetuningOptions{.unfreeze_backbone_at_epoch = 3})};
    options.max_epochs = 4;
    EXPECT_THROWS_WITH(
        fulgur::ConfigError, fulgur::Trainer(options).fit(model, regression_loader(2)),
        {"the backbone \"backbone\" has",
         with_norm ? "2 parameter(s), none of them frozen (train_bn=true keeps its BatchNorm"
                   : "no parameters",
         "unfreeze_backbone_at_epoch=3 would have nothing to add"});
  }
  // A schedule that returns no usable factor.
  {
    Finetuned model;
    auto options = test_options(dir);
    options.callbacks = {std::make_shared<BackboneFinetuning>(BackboneFinetuningOptions{
        .unfreeze_backbone_at_epoch = 0, .lambda_func = [](int64_t) { return -1.0; }})};
    options.max_epochs = 2;
    EXPECT_THROWS_WITH(fulgur::ConfigError,
                       fulgur::Trainer(options).fit(model, regression_loader(2)),
                       {"lambda_func(2) returned -1", "Return a finite factor >= 0"});
  }
  // Two optimizers.
  {
    struct TwoOptimizers : Finetuned {
      fulgur::OptimizerConfig configure_optimizers() override {
        auto a = std::make_shared<torch::optim::SGD>(head->parameters(), 0.1);
        auto b = std::make_shared<torch::optim::SGD>(head->parameters(), 0.1);
        return fulgur::OptimizerConfig({a, b}, {});
      }
    } model;
    auto options = test_options(dir);
    options.callbacks = {std::make_shared<BackboneFinetuning>()};
    EXPECT_THROWS_WITH(fulgur::ConfigError,
                       fulgur::Trainer(options).fit(model, regression_loader(2)),
                       {"returned 2 optimizers", "Return one optimizer"});
  }
  // A strategy that cannot follow a change of the trainable parameters.
  {
    struct Fixed : fulgur::SingleDeviceStrategy {
      Fixed() {
        set_traits({.max_processes = 1,
                    .trainable_change_unsupported_reason = "it compiled the step once"});
      }
    };
    Finetuned model;
    auto options = test_options(dir);
    options.strategy = std::make_shared<Fixed>();
    options.callbacks = {std::make_shared<BackboneFinetuning>()};
    EXPECT_THROWS_WITH(fulgur::ConfigError,
                       fulgur::Trainer(options).fit(model, regression_loader(2)),
                       {"BackboneFinetuning makes parameters trainable during the fit",
                        "strategy \"single_device\"", "it compiled the step once", "\"ddp\""});
  }
  // The helpers outside a fit.
  WholeBackbone alone;
  Finetuned model;
  EXPECT_THROWS_WITH(fulgur::ConfigError, alone.freeze(*model.backbone),
                     {"WholeBackbone: freeze() works on the Module of a fit"});
}

// fsdp and manual cannot follow; single_device and ddp can.
TEST(BaseFinetuning, StrategiesSayWhetherTheyFollowAChangeOfTheTrainableParameters) {
  EXPECT_EQ(fulgur::SingleDeviceStrategy().traits().trainable_change_unsupported_reason, "");
  EXPECT_EQ(fulgur::DDPStrategy().traits().trainable_change_unsupported_reason, "");
  EXPECT_THAT(fulgur::FSDPStrategy().traits().trainable_change_unsupported_reason,
              HasSubstr("shards the parameters that are trainable when the fit starts"));
  EXPECT_THAT(fulgur::ManualStrategy().traits().trainable_change_unsupported_reason,
              HasSubstr("the Module reduces the gradients itself"));
}

}  // namespace
