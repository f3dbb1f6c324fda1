// Lightning's hooks beyond the training loop's: each stage's setup and
// teardown, the evaluation and predict batch hooks, the callbacks' backward,
// zero_grad and sanity-check hooks, the batch transfer hooks, and the
// callbacks a Module brings (configure_callbacks).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::only;
using fulgur::test::RecordingDataModule;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using fulgur::test::with_prefix;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

/// LinearRegression recording the hooks it does not record itself.
class HookedRegression : public LinearRegression {
 public:
  void setup(fulgur::Stage stage) override { add("setup:", stage); }
  void teardown(fulgur::Stage stage) override { add("teardown:", stage); }
  void on_validation_start() override { events.emplace_back("on_validation_start"); }
  void on_validation_end() override { events.emplace_back("on_validation_end"); }
  void on_validation_batch_start(const fulgur::Batch&, int64_t idx) override {
    events.push_back("on_validation_batch_start " + std::to_string(idx));
  }
  void on_validation_batch_end(const fulgur::Batch&, int64_t idx) override {
    events.push_back("on_validation_batch_end " + std::to_string(idx));
  }
  void on_test_start() override { events.emplace_back("on_test_start"); }
  void on_test_end() override { events.emplace_back("on_test_end"); }
  void on_test_batch_start(const fulgur::Batch&, int64_t idx) override {
    events.push_back("on_test_batch_start " + std::to_string(idx));
  }
  void on_test_batch_end(const fulgur::Batch&, int64_t idx) override {
    events.push_back("on_test_batch_end " + std::to_string(idx));
  }
  void on_predict_start() override { events.emplace_back("on_predict_start"); }
  void on_predict_end() override { events.emplace_back("on_predict_end"); }
  void on_predict_batch_start(const fulgur::Batch&, int64_t idx) override {
    events.push_back("on_predict_batch_start " + std::to_string(idx));
  }
  void on_predict_batch_end(const fulgur::Batch& prediction, const fulgur::Batch& batch,
                            int64_t idx) override {
    events.push_back("on_predict_batch_end " + std::to_string(idx));
    predictions_seen.push_back(prediction.tensor());
    EXPECT_TRUE(batch.is_pair());
  }
  std::vector<std::shared_ptr<fulgur::Callback>> configure_callbacks() override { return brings; }

  std::vector<std::shared_ptr<fulgur::Callback>> brings;
  std::vector<at::Tensor> predictions_seen;

 private:
  void add(const char* what, fulgur::Stage stage) {
    events.push_back(std::string(what) + fulgur::to_string(stage));
  }
};

/// Records the callback hooks this file is about into `events`, as "cb:...".
class HookRecorder : public fulgur::Callback {
 public:
  explicit HookRecorder(std::vector<std::string>* events, std::string key = "HookRecorder")
      : events_(events), key_(std::move(key)) {}
  std::string state_key() const override { return key_; }
  void setup(fulgur::Trainer&, fulgur::Module&, fulgur::Stage s) override {
    add(std::string("setup:") + fulgur::to_string(s));
  }
  void teardown(fulgur::Trainer&, fulgur::Module&, fulgur::Stage s) override {
    add(std::string("teardown:") + fulgur::to_string(s));
  }
  void on_sanity_check_start(fulgur::Trainer& trainer, fulgur::Module&) override {
    EXPECT_TRUE(trainer.sanity_checking());
    add("on_sanity_check_start");
  }
  void on_sanity_check_end(fulgur::Trainer&, fulgur::Module&) override {
    add("on_sanity_check_end");
  }
  void on_before_backward(fulgur::Trainer&, fulgur::Module&, const at::Tensor& loss) override {
    EXPECT_TRUE(loss.requires_grad());
    losses.push_back(loss.detach().clone());
    add("on_before_backward");
  }
  void on_after_backward(fulgur::Trainer&, fulgur::Module& m) override {
    // The gradients are there, not yet stepped or zeroed.
    bool has_gradient = false;
    for (const auto& p : m.parameters()) has_gradient |= p.grad().defined();
    EXPECT_TRUE(has_gradient);
    add("on_after_backward");
  }
  void on_before_zero_grad(fulgur::Trainer&, fulgur::Module&, torch::optim::Optimizer&) override {
    add("on_before_zero_grad");
  }
  void on_validation_batch_start(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch&,
                                 int64_t idx) override {
    add("on_validation_batch_start " + std::to_string(idx));
  }
  void on_validation_batch_end(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch&,
                               int64_t idx) override {
    add("on_validation_batch_end " + std::to_string(idx));
  }
  void on_test_batch_start(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch&,
                           int64_t idx) override {
    add("on_test_batch_start " + std::to_string(idx));
  }
  void on_test_batch_end(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch&,
                         int64_t idx) override {
    add("on_test_batch_end " + std::to_string(idx));
  }
  void on_predict_epoch_start(fulgur::Trainer&, fulgur::Module&) override {
    add("on_predict_epoch_start");
  }
  void on_predict_epoch_end(fulgur::Trainer&, fulgur::Module&) override {
    add("on_predict_epoch_end");
  }
  void on_predict_batch_start(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch&,
                              int64_t idx) override {
    add("on_predict_batch_start " + std::to_string(idx));
  }
  void on_predict_batch_end(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch&,
                            const fulgur::Batch&, int64_t idx) override {
    add("on_predict_batch_end " + std::to_string(idx));
  }

  std::vector<at::Tensor> losses;

 private:
  void add(const std::string& hook) { events_->push_back("cb:" + hook); }
  std::vector<std::string>* events_;
  std::string key_;
};

TEST(Hooks, EveryStageSetsUpAndTearsDownTheModuleThenItsCallbacks) {
  TempDir dir;
  HookedRegression model;
  RecordingDataModule data(/*train_batches=*/2, /*val_batches=*/1);
  auto options = test_options(dir);
  options.callbacks = {std::make_shared<HookRecorder>(&model.events)};
  fulgur::Trainer trainer(options);
  trainer.fit(model, data);
  // The DataModule's setup first, the stage's hooks before configure_model
  // and after everything else.
  auto order = with_prefix(model.events, {"setup:", "cb:setup:", "configure_model", "on_fit_end",
                                          "teardown:", "cb:teardown:"});
  EXPECT_THAT(order, ElementsAre("setup:fit", "cb:setup:fit", "configure_model", "on_fit_end",
                                 "teardown:fit", "cb:teardown:fit"));
  EXPECT_EQ(data.events.front(), "prepare_data");
  for (auto [run, stage] : std::vector<std::pair<std::function<void()>, const char*>>{
           {[&] { trainer.validate(model, data); }, "validate"},
           {[&] { trainer.test(model, data); }, "test"},
           {[&] { trainer.predict(model, data); }, "predict"}}) {
    model.events.clear();
    run();
    EXPECT_THAT(with_prefix(model.events, {"setup:", "cb:setup:", "teardown:", "cb:teardown:"}),
                ElementsAre(std::string("setup:") + stage, std::string("cb:setup:") + stage,
                            std::string("teardown:") + stage, std::string("cb:teardown:") + stage));
  }
}

TEST(Hooks, AFailedStageStillTearsDownAndItsErrorIsTheOneThrown) {
  TempDir dir;
  HookedRegression model;
  model.train_hook = [](LinearRegression&, fulgur::Batch&, int64_t) {
    throw std::runtime_error("the step failed");
  };
  struct FailingTeardown : HookRecorder {
    using HookRecorder::HookRecorder;
    void teardown(fulgur::Trainer& t, fulgur::Module& m, fulgur::Stage s) override {
      HookRecorder::teardown(t, m, s);
      throw std::runtime_error("teardown failed too");
    }
    void on_exception(fulgur::Trainer&, fulgur::Module& m, const std::exception&) override {
      dynamic_cast<LinearRegression&>(m).events.emplace_back("cb:on_exception");
    }
  };
  auto options = test_options(dir);
  options.callbacks = {std::make_shared<FailingTeardown>(&model.events, "a"),
                       std::make_shared<HookRecorder>(&model.events, "b")};
  fulgur::Trainer trainer(options);
  ::testing::internal::CaptureStderr();
  ::testing::internal::CaptureStdout();
  EXPECT_THROWS_WITH(std::runtime_error, trainer.fit(model, regression_loader(2)),
                     {"the step failed"});
  const std::string out =
      ::testing::internal::GetCapturedStdout() + ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(out, HasSubstr("FailingTeardown's teardown(fit) failed after the stage failed: "
                             "teardown failed too"));
  // on_exception first (a checkpoint saved there sees the module before its
  // teardown), then every teardown.
  EXPECT_THAT(with_prefix(model.events, {"teardown:", "cb:teardown:", "cb:on_exception"}),
              ElementsAre("cb:on_exception", "teardown:fit", "cb:teardown:fit", "cb:teardown:fit"));
}

TEST(Hooks, EvaluationAndPredictBatchHooksSurroundEachStep) {
  TempDir dir;
  HookedRegression model;
  auto options = test_options(dir);
  options.callbacks = {std::make_shared<HookRecorder>(&model.events)};
  fulgur::Trainer trainer(options);
  trainer.validate(model, regression_loader(2));
  EXPECT_THAT(only(model.events, {"on_validation_start", "on_validation_batch_start 0",
                                  "cb:on_validation_batch_start 0", "validation_step",
                                  "on_validation_batch_end 0", "cb:on_validation_batch_end 0",
                                  "on_validation_batch_start 1", "on_validation_end"}),
              ElementsAre("on_validation_start", "on_validation_batch_start 0",
                          "cb:on_validation_batch_start 0", "validation_step",
                          "on_validation_batch_end 0", "cb:on_validation_batch_end 0",
                          "on_validation_batch_start 1", "validation_step", "on_validation_end"));
  model.events.clear();
  trainer.test(model, regression_loader(1));
  EXPECT_THAT(
      only(model.events,
           {"on_test_start", "on_test_batch_start 0", "cb:on_test_batch_start 0", "test_step",
            "on_test_batch_end 0", "cb:on_test_batch_end 0", "on_test_end"}),
      ElementsAre("on_test_start", "on_test_batch_start 0", "cb:on_test_batch_start 0", "test_step",
                  "on_test_batch_end 0", "cb:on_test_batch_end 0", "on_test_end"));
  model.events.clear();
  auto predictions = trainer.predict(model, regression_loader(2));
  EXPECT_THAT(
      only(model.events, {"on_predict_start", "on_predict_epoch_start", "cb:on_predict_epoch_start",
                          "on_predict_batch_start 1", "cb:on_predict_batch_start 1", "predict_step",
                          "on_predict_batch_end 1", "cb:on_predict_batch_end 1",
                          "on_predict_epoch_end", "cb:on_predict_epoch_end", "on_predict_end"}),
      ElementsAre("on_predict_start", "on_predict_epoch_start", "cb:on_predict_epoch_start",
                  "predict_step", "on_predict_batch_start 1", "cb:on_predict_batch_start 1",
                  "predict_step", "on_predict_batch_end 1", "cb:on_predict_batch_end 1",
                  "on_predict_epoch_end", "cb:on_predict_epoch_end", "on_predict_end"));
  // The Module's batch end hook gets each prediction.
  ASSERT_EQ(model.predictions_seen.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(model.predictions_seen[i].equal(predictions[i].tensor()));
  }
}

TEST(Hooks, CallbacksSeeTheSanityCheckBackwardAndZeroGrad) {
  TempDir dir;
  HookedRegression model;
  auto recorder = std::make_shared<HookRecorder>(&model.events);
  auto options = test_options(dir);
  options.num_sanity_val_steps = 1;
  options.accumulate_grad_batches = 2;
  options.callbacks = {recorder};
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(2), regression_loader(1));
  EXPECT_THAT(
      only(model.events,
           {"cb:on_sanity_check_start", "validation_step", "cb:on_sanity_check_end",
            "training_step", "on_before_backward", "cb:on_before_backward", "on_after_backward",
            "cb:on_after_backward", "on_before_zero_grad", "cb:on_before_zero_grad"}),
      ElementsAre("cb:on_sanity_check_start", "validation_step", "cb:on_sanity_check_end",
                  // batch 0 accumulates, batch 1 steps
                  "training_step", "on_before_backward", "cb:on_before_backward",
                  "on_after_backward", "cb:on_after_backward", "training_step",
                  "on_before_backward", "cb:on_before_backward", "on_after_backward",
                  "cb:on_after_backward", "on_before_zero_grad", "cb:on_before_zero_grad",
                  // the epoch's validation
                  "validation_step"));
  // The loss as training_step returned it (not divided for accumulation).
  ASSERT_EQ(recorder->losses.size(), 2u);
  EXPECT_GT(recorder->losses[0].item<double>(), 0.0);

  // No sanity check, no sanity hooks.
  model.events.clear();
  options.num_sanity_val_steps = 0;
  fulgur::Trainer(options).fit(model, regression_loader(1), regression_loader(1));
  EXPECT_THAT(with_prefix(model.events, {"cb:on_sanity_check"}), ::testing::IsEmpty());

  // Manual optimization's manual_backward calls the backward hooks too.
  struct Manual : LinearRegression {
    Manual() { set_automatic_optimization(false); }
    at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
      const auto& [x, y] = batch.pair();
      auto loss = torch::nn::functional::mse_loss(forward(x), y);
      manual_backward(loss);
      optimizer_step(*optimizer);
      return loss;
    }
  } manual;
  options.accumulate_grad_batches = 1;
  options.callbacks = {std::make_shared<HookRecorder>(&manual.events)};
  fulgur::Trainer(options).fit(manual, regression_loader(1));
  EXPECT_THAT(with_prefix(manual.events, {"cb:on_before_backward", "cb:on_after_backward"}),
              ElementsAre("cb:on_before_backward", "cb:on_after_backward"));
}

/// Doubles the inputs on the host and adds 1 on the device; checks where
/// each hook gets its batch.
class TransferHooks : public LinearRegression {
 public:
  explicit TransferHooks(c10::Device device) : device_(device) {}
  fulgur::Batch on_before_batch_transfer(fulgur::Batch batch) override {
    ++before;
    auto& [x, y] = batch.pair();
    EXPECT_TRUE(x.device().is_cpu());
    return fulgur::Batch(x * 2, y);
  }
  fulgur::Batch on_after_batch_transfer(fulgur::Batch batch) override {
    ++after;
    auto& [x, y] = batch.pair();
    EXPECT_EQ(x.device(), device_);
    return fulgur::Batch(x + 1, y);
  }
  int before = 0, after = 0;

 private:
  c10::Device device_;
};

// Training, validation and predict steps get the batch as the two hooks
// made it, with the batches moved at the step or prefetched.
void expect_transfer_hooks_shape_every_step(const std::string& accelerator) {
  const c10::Device device = accelerator == "cuda" ? c10::Device("cuda:0") : c10::Device("cpu");
  for (bool prefetch : {false, true}) {
    SCOPED_TRACE(prefetch ? "prefetch_to_device" : "moved at the step");
    TempDir dir;
    TransferHooks model(device);
    const auto loader = regression_loader(3);
    loader->start_epoch(0);
    std::vector<at::Tensor> loaded;
    while (auto batch = loader->next()) loaded.push_back(batch->pair().first.clone());
    std::vector<at::Tensor> stepped;
    model.train_hook = [&](LinearRegression&, fulgur::Batch& batch, int64_t) {
      stepped.push_back(batch.pair().first.cpu());
    };
    model.val_hook = model.train_hook;
    auto options = test_options(dir);
    options.accelerator = accelerator;
    options.devices = 1;  // one device, also on a machine with several GPUs
    options.prefetch_to_device = prefetch;
    options.num_sanity_val_steps = 0;
    fulgur::Trainer trainer(options);
    trainer.fit(model, regression_loader(3), regression_loader(3));
    ASSERT_EQ(stepped.size(), 6u);  // 3 training steps, then 3 validation steps
    for (size_t i = 0; i < stepped.size(); ++i) {
      EXPECT_TRUE(stepped[i].equal(loaded[i % 3] * 2 + 1)) << i;
    }
    EXPECT_EQ(model.before, 6);
    EXPECT_EQ(model.after, 6);
    auto predictions = trainer.predict(model, regression_loader(1));
    EXPECT_EQ(model.after, 7);
    const at::Tensor expected =
        model.forward((loaded[0] * 2 + 1).to(model.parameters()[0].device())).cpu();
    EXPECT_TRUE(torch::allclose(predictions[0].tensor().cpu(), expected, 1e-6, 1e-6));
  }
}

TEST(Hooks, BatchTransferHooksShapeWhatEveryStepGets) {
  expect_transfer_hooks_shape_every_step("cpu");
}

// On a GPU the second hook runs on the step's stream after the prefetch
// copy's event: it reads the copied batch, never one still in flight.
TEST(Hooks, BatchTransferHooksShapeWhatEveryStepGets_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  expect_transfer_hooks_shape_every_step("cuda");
}

TEST(Hooks, AModulesCallbacksReplaceTheTrainersOfTheirTypeForTheStage) {
  TempDir dir;
  HookedRegression model;
  auto own_checkpoint = std::make_shared<fulgur::ModelCheckpoint>(
      fulgur::ModelCheckpointOptions{.dirpath = dir.file("module_checkpoints")});
  auto recorder = std::make_shared<HookRecorder>(&model.events);
  model.brings = {own_checkpoint, recorder};
  auto options = test_options(dir);
  options.enable_checkpointing = true;  // the Trainer adds a ModelCheckpoint
  options.callbacks = {std::make_shared<HookRecorder>(&model.events, "trainer's")};
  fulgur::Trainer trainer(options);
  const auto before = trainer.callbacks();
  std::vector<std::shared_ptr<fulgur::Callback>> during;
  model.train_hook = [&](LinearRegression& m, fulgur::Batch&, int64_t) {
    during = m.trainer().callbacks();
  };
  ::testing::internal::CaptureStderr();
  ::testing::internal::CaptureStdout();
  auto result = trainer.fit(model, regression_loader(2));
  const std::string out =
      ::testing::internal::GetCapturedStdout() + ::testing::internal::GetCapturedStderr();
  // The Trainer's HookRecorder and ModelCheckpoint made way for the
  // Module's, the checkpoint callback last; the fit's checkpoints are its.
  EXPECT_THAT(out, HasSubstr("replaces the Trainer's"));
  ASSERT_FALSE(during.empty());
  EXPECT_EQ(during.back(), own_checkpoint);
  EXPECT_EQ(std::count(during.begin(), during.end(), recorder), 1);
  for (const auto& cb : before) EXPECT_EQ(std::count(during.begin(), during.end(), cb), 0);
  EXPECT_THAT(result.last_model_path, HasSubstr("module_checkpoints"));
  EXPECT_EQ(with_prefix(model.events, {"cb:setup"}).size(), 1u);
  // After the stage the Trainer has its own again.
  EXPECT_EQ(trainer.callbacks(), before);

  // A null callback, and two whose states would share a checkpoint section.
  model.brings = {nullptr};
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, regression_loader(1)),
                     {"configure_callbacks() returned a null callback at [0]"});
  model.brings = {std::make_shared<HookRecorder>(&model.events, "same"),
                  std::make_shared<HookRecorder>(&model.events, "same")};
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.validate(model, regression_loader(1)),
                     {"same state_key() \"same\""});
  EXPECT_EQ(trainer.callbacks(), before);
}

// The Trainer's own callbacks are checked the same way, when it is made
// (two EMAs restored each other's average from one "EMA" section).
TEST(Hooks, TheTrainersCallbacksWithOneStateKeyOrNullAreRefused) {
  TempDir dir;
  std::vector<std::string> events;
  auto options = test_options(dir);
  options.callbacks = {std::make_shared<fulgur::EMA>(fulgur::EMAOptions{.decay = 0.5}),
                       std::make_shared<fulgur::EMA>(fulgur::EMAOptions{.decay = 0.9})};
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer{options},
                     {"TrainerOptions::callbacks: a fulgur::EMA and a fulgur::EMA have the same "
                      "state_key() \"EMA\""});
  options.callbacks = {std::make_shared<HookRecorder>(&events, "one"), nullptr};
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer{options}, {"callbacks[1] is null"});
}

// ---- The steps a Module may take its own way (Lightning's
// configure_gradient_clipping, lr_scheduler_step, optimizer_zero_grad).

// The largest element of any parameter's gradient.
double largest_gradient(const torch::nn::Module& module) {
  double largest = 0;
  for (const auto& p : module.parameters()) {
    largest = std::max(largest, p.grad().abs().max().item<double>());
  }
  return largest;
}

// Clips by value, tighter than the Trainer's norm, through clip_gradients;
// records what the Trainer passed and the largest gradient left.
class ClippingRegression : public LinearRegression {
 public:
  void configure_gradient_clipping(torch::optim::Optimizer& optimizer, std::optional<double> value,
                                   fulgur::GradientClipAlgorithm algorithm) override {
    received.emplace_back(value, algorithm);
    clip_gradients(optimizer, 1e-3, fulgur::GradientClipAlgorithm::kValue);
    largest = std::max(largest, largest_gradient(*this));
  }
  std::vector<std::pair<std::optional<double>, fulgur::GradientClipAlgorithm>> received;
  double largest = 0;
};

// A callback's hooks around each save: what it puts into the module for
// the save is the checkpoint's module weights (as EMA saves its average),
// and what it puts back after is what trains on. A failed save ends the
// hooks with failed=true; a save from within a step runs neither.
TEST(Hooks, ACallbackSavesOtherWeightsAsTheModulesAroundEachCheckpoint) {
  TempDir dir;
  struct Saver : fulgur::Callback {
    std::string state_key() const override { return "Saver"; }
    void on_before_backward(fulgur::Trainer& trainer, fulgur::Module&, const at::Tensor&) override {
      if (trainer.global_step() == 2) trainer.save_checkpoint(path + "/within.ckpt");
    }
    void on_train_batch_end(fulgur::Trainer& trainer, fulgur::Module&, const at::Tensor&,
                            const fulgur::Batch&, int64_t) override {
      if (trainer.global_step() == 1) trainer.save_checkpoint(path + "/one.ckpt");
      if (trainer.global_step() == 2) {
        try {
          trainer.save_checkpoint(path + "/one.ckpt/not-a-directory/two.ckpt");
        } catch (const std::exception&) {
          events.emplace_back("the save threw");
        }
      }
    }
    void on_before_checkpoint_save(fulgur::Trainer& trainer, fulgur::Module& module) override {
      events.push_back("before " + std::to_string(trainer.global_step()));
      kept = fulgur::test::clone_parameters(module);
      torch::NoGradGuard no_grad;
      for (auto& p : module.parameters()) p.fill_(42);
    }
    void on_after_checkpoint_save(fulgur::Trainer& trainer, fulgur::Module& module,
                                  bool failed) override {
      events.push_back("after " + std::to_string(trainer.global_step()) +
                       (failed ? " failed" : ""));
      torch::NoGradGuard no_grad;
      auto params = module.parameters();
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(kept[i]);
    }
    std::string path;
    std::vector<std::string> events;
    std::vector<at::Tensor> kept;
  };
  auto saver = std::make_shared<Saver>();
  saver->path = dir.path();
  LinearRegression model, plain;
  fulgur::test::copy_parameters(model, plain);
  auto options = test_options(dir);
  options.max_epochs = 1;
  options.callbacks = {saver};
  fulgur::Trainer(options).fit(model, regression_loader(3));
  EXPECT_THAT(saver->events,
              ElementsAre("before 1", "after 1", "before 2", "after 2 failed", "the save threw"));
  // The module trained as without the callback.
  options.callbacks = {};
  fulgur::Trainer(options).fit(plain, regression_loader(3));
  fulgur::test::expect_tensors_equal(fulgur::test::clone_parameters(model),
                                     fulgur::test::clone_parameters(plain));
  // The checkpoint holds what the hook put in; the one from within a step
  // the training weights.
  LinearRegression loaded;
  fulgur::Trainer reader(test_options(dir));
  reader.validate(loaded, regression_loader(2), dir.file("one.ckpt"));
  for (const auto& p : loaded.parameters()) EXPECT_TRUE(p.eq(42).all().item<bool>());
  reader.validate(loaded, regression_loader(2), dir.file("within.ckpt"));
  for (const auto& p : loaded.parameters()) EXPECT_FALSE(p.eq(42).any().item<bool>());
}

// A callback whose on_after_checkpoint_save throws: the later callbacks'
// hooks still run (one that swapped weights in puts them back), then its
// error is the save's. A save from within a hook runs no hooks (it ran
// them again, without end).
TEST(Hooks, EveryAfterSaveHookRunsAndASaveFromAHookRunsNone) {
  TempDir dir;
  struct Throws : fulgur::Callback {
    std::string state_key() const override { return "Throws"; }
    void on_before_checkpoint_save(fulgur::Trainer& trainer, fulgur::Module&) override {
      events->push_back("throws: before");
      trainer.save_checkpoint(path);  // from a hook: no hooks
    }
    void on_after_checkpoint_save(fulgur::Trainer&, fulgur::Module&, bool) override {
      events->push_back("throws: after");
      throw std::runtime_error("after-save hook failed");
    }
    std::shared_ptr<std::vector<std::string>> events;
    std::string path;
  };
  struct Records : fulgur::Callback {
    std::string state_key() const override { return "Records"; }
    void on_before_checkpoint_save(fulgur::Trainer&, fulgur::Module&) override {
      events->push_back("records: before");
    }
    void on_after_checkpoint_save(fulgur::Trainer&, fulgur::Module&, bool failed) override {
      events->push_back(failed ? "records: after failed" : "records: after");
    }
    std::shared_ptr<std::vector<std::string>> events;
  };
  auto events = std::make_shared<std::vector<std::string>>();
  auto throws = std::make_shared<Throws>();
  throws->events = events;
  throws->path = dir.file("nested.ckpt");
  auto records = std::make_shared<Records>();
  records->events = events;
  struct SaveOnce : fulgur::Callback {
    std::string state_key() const override { return "SaveOnce"; }
    void on_train_batch_end(fulgur::Trainer& trainer, fulgur::Module&, const at::Tensor&,
                            const fulgur::Batch&, int64_t) override {
      if (trainer.global_step() != 1) return;
      try {
        trainer.save_checkpoint(path);
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    std::string path, error;
  };
  auto save = std::make_shared<SaveOnce>();
  save->path = dir.file("one.ckpt");
  auto options = test_options(dir);
  options.max_epochs = 1;
  options.callbacks = {throws, records, save};
  LinearRegression model;
  fulgur::Trainer(options).fit(model, regression_loader(2));
  EXPECT_THAT(*events,
              ElementsAre("throws: before", "records: before", "throws: after", "records: after"));
  EXPECT_EQ(save->error, "after-save hook failed");
  EXPECT_TRUE(std::filesystem::exists(dir.file("nested.ckpt")));
  EXPECT_TRUE(std::filesystem::exists(dir.file("one.ckpt")));
}

TEST(Hooks, AModuleClipsItsGradientsItsOwnWay) {
  TempDir dir;
  ClippingRegression model;
  const auto before = fulgur::test::clone_parameters(model);
  auto options = test_options(dir);
  options.gradient_clip_val = 0.5;
  fulgur::Trainer(options).fit(model, regression_loader(4));
  ASSERT_EQ(model.received.size(), 4u);
  EXPECT_EQ(model.received[0].first, 0.5);
  EXPECT_EQ(model.received[0].second, fulgur::GradientClipAlgorithm::kNorm);
  EXPECT_GT(model.largest, 0.0);
  EXPECT_LE(model.largest, static_cast<double>(1e-3f));  // the float bound
  // Four SGD steps at lr 0.05 of gradients within 1e-3: no weight moved
  // further than 4 x 0.05 x 1e-3, give or take float rounding (unclipped,
  // they move by about 0.01).
  const auto after = fulgur::test::clone_parameters(model);
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_LE((after[i] - before[i]).abs().max().item<double>(), 4 * 0.05 * 1e-3 * 1.001);
  }
  EXPECT_THROWS_WITH(fulgur::ConfigError, model.clip_gradients(*model.optimizer, 0.0),
                     {"clip_gradients(gradient_clip_val=0)", "a finite value > 0"});
}

// Under manual optimization clip_gradients clips before optimizer_step.
TEST(Hooks, ManualOptimizationClipsThroughClipGradients) {
  struct Manual : LinearRegression {
    Manual() { set_automatic_optimization(false); }
    at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
      const auto& [x, y] = batch.pair();
      auto loss = torch::nn::functional::mse_loss(forward(x), y);
      manual_backward(loss);
      clip_gradients(*optimizers()[0], 1e-3, fulgur::GradientClipAlgorithm::kValue);
      largest = std::max(largest, largest_gradient(*this));
      optimizer_step(0);
      optimizers()[0]->zero_grad();
      return loss.detach();
    }
    double largest = 0;
  } model;
  TempDir dir;
  fulgur::Trainer(test_options(dir)).fit(model, regression_loader(4));
  EXPECT_GT(model.largest, 0.0);
  EXPECT_LE(model.largest, static_cast<double>(1e-3f));  // the float bound
  // The Trainer's own clipping is refused there, naming the way to clip.
  auto options = test_options(dir);
  options.gradient_clip_val = 0.5;
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer(options).fit(model, regression_loader(2)),
                     {"gradient_clip_val=0.5", "clip_gradients(optimizer, value)"});
}

// lr_scheduler_step steps every configured scheduler when its interval
// comes, with the monitored value for a monitored one; the default steps
// them as the Trainer did before.
TEST(Hooks, AModuleStepsItsSchedulersThroughLrSchedulerStep) {
  struct Scheduling : LinearRegression {
    void lr_scheduler_step(torch::optim::LRScheduler& scheduler,
                           std::optional<double> metric) override {
      metrics.push_back(metric);
      LinearRegression::lr_scheduler_step(scheduler, metric);
    }
    std::vector<std::optional<double>> metrics;
  };
  auto schedules = [](torch::optim::Optimizer& optimizer) {
    return std::vector<fulgur::SchedulerConfig>{
        {.scheduler = std::make_shared<torch::optim::StepLR>(optimizer, 1, 0.5),
         .interval = fulgur::Interval::kStep},
        {.scheduler = std::make_shared<fulgur::ReduceLROnPlateau>(
             optimizer, fulgur::ReduceLROnPlateauOptions{.patience = 0}),
         .monitor = "val_loss"}};
  };
  TempDir dir;
  auto options = test_options(dir);
  options.max_epochs = 2;
  Scheduling model;
  model.make_schedulers = schedules;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(4), regression_loader(2));
  // Per epoch: four step-interval steps without a metric, then the
  // epoch's plateau step with val_loss.
  ASSERT_EQ(model.metrics.size(), 10u);
  EXPECT_FALSE(model.metrics[0].has_value());
  ASSERT_TRUE(model.metrics[4].has_value());
  ASSERT_TRUE(model.metrics[9].has_value());
  EXPECT_DOUBLE_EQ(*model.metrics[9], trainer.callback_metrics().at("val_loss"));
  // The default is what the Trainer did: the same rates and weights as a
  // module that does not override it.
  LinearRegression plain;
  Scheduling again;
  fulgur::test::copy_parameters(plain, again);
  plain.make_schedulers = schedules;
  again.make_schedulers = schedules;
  fulgur::Trainer(options).fit(plain, regression_loader(4), regression_loader(2));
  fulgur::Trainer(options).fit(again, regression_loader(4), regression_loader(2));
  EXPECT_TRUE(fulgur::test::parameters_equal(plain, again));
  EXPECT_EQ(plain.optimizer->param_groups()[0].options().get_lr(),
            again.optimizer->param_groups()[0].options().get_lr());
  // A metric for a scheduler that takes none is named.
  torch::optim::StepLR step_lr(*plain.optimizer, 1, 0.5);
  EXPECT_THROWS_WITH(fulgur::ConfigError, plain.lr_scheduler_step(step_lr, 1.0),
                     {"lr_scheduler_step: a metric (1)", "not a fulgur::MonitoredScheduler"});
}

// optimizer_zero_grad after every optimizer step (every second batch under
// accumulate_grad_batches=2), with its epoch and batch.
TEST(Hooks, AModuleZeroesItsGradientsThroughOptimizerZeroGrad) {
  struct Zeroing : LinearRegression {
    void optimizer_zero_grad(int64_t epoch, int64_t batch_idx,
                             torch::optim::Optimizer& optimizer) override {
      zeroed.emplace_back(epoch, batch_idx);
      LinearRegression::optimizer_zero_grad(epoch, batch_idx, optimizer);
    }
    std::vector<std::pair<int64_t, int64_t>> zeroed;
  } model;
  TempDir dir;
  auto options = test_options(dir);
  options.max_epochs = 2;
  options.accumulate_grad_batches = 2;
  fulgur::Trainer(options).fit(model, regression_loader(4));
  using Call = std::pair<int64_t, int64_t>;
  EXPECT_THAT(model.zeroed, ElementsAre(Call{0, 1}, Call{0, 3}, Call{1, 1}, Call{1, 3}));
}

// A loss scaler on the CPU (bf16 autocast with GradScaler, as 16-mixed
// scales on a GPU): clip_gradients unscales once per step, a backward after
// an unscale is refused, and so is a manual step that would make the scaler
// forget another optimizer's unscaled gradients.
class ScaledOnCpu : public fulgur::MixedPrecision {
 public:
  ScaledOnCpu() : MixedPrecision(at::kBFloat16, std::make_shared<fulgur::GradScaler>()) {}
};

TEST(Hooks, UnderALossScalerGradientsAreUnscaledOnceAndClippedTrueScale) {
  TempDir dir;
  ClippingRegression model;
  auto options = test_options(dir);
  options.plugins = {std::make_shared<ScaledOnCpu>()};
  fulgur::Trainer(options).fit(model, regression_loader(4));
  // Scaled by 65536, the gradients would have been clipped to 1e-3 and
  // stepped as 1e-3 / 65536 at most; true-scale, the bound is reached.
  EXPECT_GT(model.largest, 1e-4);
  EXPECT_LE(model.largest, static_cast<double>(1e-3f));

  // Clipping a micro-batch's gradients before the window's last backward.
  struct EarlyClip : LinearRegression {
    void on_after_backward() override { clip_gradients(*optimizer, 1.0); }
  } early;
  options.accumulate_grad_batches = 2;
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer(options).fit(early, regression_loader(4)),
                     {"a backward after gradients were unscaled",
                      "Clip after the step's last "
                      "backward"});
}

// Manual optimization: each optimizer's gradients clipped (unscaled) before
// the steps, as PyTorch's unscale_, unscale_, step, step, update. The
// scaler's iteration ends after training_step (it ended at each step, and
// the second optimizer's clipped gradients would have been unscaled again:
// refused then). Gradients clipped but not stepped by then are refused.
// Each step is checked as it is taken: over the fit, a parameter with one
// element clipped to +1 then -1 can end where it began.
TEST(Hooks, AManualStepThatWouldUnscaleAnotherOptimizersGradientsTwiceIsRefused) {
  struct TwoOptimizers : LinearRegression {
    bool step_second = true;
    // Per step of optimizer 0 and 1: its parameter moved, by at most
    // lr x 1 per element (clipped at true scale).
    std::vector<bool> moved[2];
    std::vector<double> largest_move[2];
    TwoOptimizers() { set_automatic_optimization(false); }
    void step_and_watch(int index, const at::Tensor& param) {
      const at::Tensor before = param.detach().clone();
      optimizer_step(index);
      moved[index].push_back(!torch::equal(before, param.detach()));
      largest_move[index].push_back((before - param.detach()).abs().max().item<double>());
    }
    fulgur::OptimizerConfig configure_optimizers() override {
      auto weight = std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{fc->weight},
                                                        torch::optim::SGDOptions(0.05));
      auto bias = std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{fc->bias},
                                                      torch::optim::SGDOptions(0.05));
      return fulgur::OptimizerConfig({weight, bias}, {});
    }
    at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
      const auto& [x, y] = batch.pair();
      auto loss = torch::nn::functional::mse_loss(forward(x), y);
      manual_backward(loss);
      clip_gradients(*optimizers()[0], 1.0);
      clip_gradients(*optimizers()[1], 1.0);
      step_and_watch(0, fc->weight);
      if (step_second) step_and_watch(1, fc->bias);
      for (auto& o : optimizers()) o->zero_grad();
      return loss.detach();
    }
  } model;
  TempDir dir;
  auto options = test_options(dir);
  options.plugins = {std::make_shared<ScaledOnCpu>()};
  fulgur::Trainer(options).fit(model, regression_loader(2));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(model.moved[i], (std::vector<bool>{true, true})) << "optimizer " << i;
    for (const double move : model.largest_move[i]) EXPECT_LE(move, 0.05 + 1e-6) << i;
  }
  TwoOptimizers unstepped;
  unstepped.step_second = false;
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::Trainer(options).fit(unstepped, regression_loader(2)),
                     {"optimizer 1's gradients were unscaled (clip_gradients) and it has not "
                      "stepped before the next backward or the end of training_step",
                      "right before its own optimizer_step"});
}

}  // namespace
