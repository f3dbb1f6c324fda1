// Trainer option cuda_graph: training steps captured into a CUDA graph and
// replayed. On the CPU: every refusal (named setting, what to do instead),
// the flag's spelling, and the no-read-back norm clipping against LibTorch's.
// The _CUDA tests (skipped without a GPU): replayed steps equal eager ones
// (SGD with momentum and a step schedule, AdamW with bf16-mixed and norm
// clipping), a scheduled learning rate taking effect under replay, a last
// partial batch run eagerly, logged values read from the graph, a number
// logged during the capture refused, and N steady-state steps (eager with
// prefetch, and replayed) under LibTorch's CUDA synchronisation debug mode
// set to error: any host synchronisation in them fails the test.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fulgur/fulgur.h"
#include "fulgur/optim/optimizers.h"
#include "support/test_support.h"
#include "trainer/loops/cuda_graph_step.h"

#ifdef FULGUR_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace cuda_graph_step_test {

using fulgur::test::TempDir;
using fulgur::test::test_options;

/// A two-layer MLP regression whose optimizer, schedule and logging each
/// test chooses.
class GraphNet : public fulgur::Module {
 public:
  struct Config {
    std::string optimizer = "sgd";  // sgd, adamw, torch_sgd
    double lr = 0.05;
    bool step_schedule = false;  // StepLR: halve the rate every 3 steps
    bool log_number = false;     // log a double in training_step
    bool manual = false;
    bool trainable_only = false;  // the optimizer gets what requires_grad
    std::optional<bool> one_cycle = std::nullopt;  // a OneCycleLR, cycling the momentum or not
  };

  explicit GraphNet(Config config) : fulgur::Module("GraphNet"), config(std::move(config)) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 1));
    set_automatic_optimization(!this->config.manual);
  }

  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    auto& [x, y] = batch.pair();
    auto loss = torch::mse_loss(fc2(torch::relu(fc1(x))).to(torch::kFloat), y);
    log("train_loss", loss, {.on_step = true, .on_epoch = true});
    if (config.log_number) log("a_number", 1.0);
    return loss;
  }

  fulgur::OptimizerConfig configure_optimizers() override {
    auto& opt = optimizer;
    std::vector<at::Tensor> params;
    for (auto& p : parameters()) {
      if (p.requires_grad() || !config.trainable_only) params.push_back(p);
    }
    if (config.optimizer == "sgd") {
      opt = std::make_shared<fulgur::optim::SGD>(
          params,
          torch::optim::SGDOptions(config.lr).momentum(0.9).nesterov(true).weight_decay(1e-3));
    } else if (config.optimizer == "adamw") {
      opt = std::make_shared<fulgur::optim::AdamW>(
          params, torch::optim::AdamWOptions(config.lr).weight_decay(0.01));
    } else {
      opt = std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(config.lr));
    }
    if (config.one_cycle) {
      auto cycle = std::make_shared<fulgur::OneCycleLR>(
          *opt,
          fulgur::OneCycleLROptions{
              .max_lr = {config.lr}, .total_steps = 100, .cycle_momentum = *config.one_cycle});
      return fulgur::OptimizerConfig(
          {opt},
          {fulgur::SchedulerConfig{.scheduler = cycle, .interval = fulgur::Interval::kStep}});
    }
    if (!config.step_schedule) return fulgur::OptimizerConfig(opt);
    auto schedule = std::make_shared<fulgur::LambdaLR>(
        *opt, [](int64_t step) { return std::pow(0.5, static_cast<double>(step / 3)); });
    return fulgur::OptimizerConfig(
        {opt}, {fulgur::SchedulerConfig{.scheduler = schedule, .interval = fulgur::Interval::kStep}});
  }

  double lr() const { return optimizer->param_groups()[0].options().get_lr(); }

  Config config;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  std::shared_ptr<torch::optim::Optimizer> optimizer;
};

std::shared_ptr<fulgur::DataLoader> loader(int64_t samples, int64_t batch_size) {
  torch::manual_seed(7);
  auto x = torch::randn({samples, 8});
  auto y = x.sum(1, /*keepdim=*/true).sin();
  return fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(x, y),
                                  {.batch_size = batch_size});
}

fulgur::TrainerOptions graph_options(const TempDir& dir, bool cuda_graph) {
  auto options = test_options(dir);
  options.cuda_graph = cuda_graph;
  options.seed = 5;
  return options;
}

// ---- Refusals (the CPU reaches every one that does not need a GPU).

TEST(CudaGraph, ManualOptimizationIsRefused) {
  TempDir dir;
  GraphNet net({.manual = true});
  fulgur::Trainer trainer(graph_options(dir, true));
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(net, loader(32, 8)),
                           {"cuda_graph=true with manual optimization", "cuda_graph=false"});
}

TEST(CudaGraph, AccumulationIsRefused) {
  TempDir dir;
  GraphNet net({});
  auto options = graph_options(dir, true);
  options.accumulate_grad_batches = 2;
  fulgur::Trainer trainer(options);
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(net, loader(32, 8)),
                           {"cuda_graph=true with accumulate_grad_batches=2",
                            "accumulate_grad_batches=1"});
}

TEST(CudaGraph, AnAccumulationSchedulerIsRefusedWhenItChangesTheCount) {
  TempDir dir;
  GraphNet net({});
  auto options = graph_options(dir, true);
  options.max_epochs = 2;
  options.callbacks = {std::make_shared<fulgur::GradientAccumulationScheduler>(
      std::map<int64_t, int64_t>{{0, 1}, {1, 2}})};
  fulgur::Trainer trainer(options);
  // On the CPU the device check comes first; the scheduler's refusal is
  // checked where the step can run (the _CUDA twin below).
  EXPECT_THROW(trainer.fit(net, loader(32, 8)), fulgur::ConfigError);
}

TEST(CudaGraph, TorchOptimOptimizersAreRefusedByTypeName) {
  TempDir dir;
  GraphNet net({.optimizer = "torch_sgd"});
  fulgur::Trainer trainer(graph_options(dir, true));
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(net, loader(32, 8)),
                           {"optimizer 0 is a torch::optim::SGD", "fulgur::optim::SGD"});
}

// OneCycleLR's momentum changes every step; a captured step keeps it as a
// constant, so every step would have been captured again.
TEST(CudaGraph, AOneCycleThatMovesTheMomentumIsRefused) {
  TempDir dir;
  GraphNet cycling({.one_cycle = true});
  fulgur::Trainer trainer(graph_options(dir, true));
  EXPECT_THROWS_WITH(
      fulgur::ConfigError, trainer.fit(cycling, loader(32, 8)),
      {"scheduler 0 is a OneCycleLR with cycle_momentum=true", "cycle_momentum=false"});
  GraphNet steady({.one_cycle = false});
  try {
    trainer.fit(steady, loader(32, 8));  // on a GPU it trains; here the CPU is refused
  } catch (const fulgur::ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).find("OneCycleLR"), std::string::npos) << e.what();
  }
}

TEST(CudaGraph, TheCpuIsRefused) {
  TempDir dir;
  GraphNet net({});
  fulgur::Trainer trainer(graph_options(dir, true));
  if (fulgur::detail::CudaGraphStep::supported()) {
    EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(net, loader(32, 8)),
                             {"cuda_graph=true on device cpu", "accelerator=\"cuda\""});
  } else {
    EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(net, loader(32, 8)),
                             {"this LibTorch has no CUDA", "cuda_graph=false"});
  }
}

TEST(CudaGraph, OffByDefaultAndSpelledAsAFlag) {
  EXPECT_FALSE(fulgur::TrainerOptions{}.cuda_graph);
  EXPECT_TRUE(fulgur::options_from_flags({{"cuda_graph", "true"}}).cuda_graph);
  EXPECT_TRUE(fulgur::options_from_flags({{"--cuda-graph", "true"}}).cuda_graph);
  EXPECT_THROWS_WITH(fulgur::FlagError, fulgur::options_from_flags({{"cuda_graph", "sometimes"}}),
                     {"cuda_graph", "sometimes"});
}

// ---- On a GPU.

struct FitResult {
  std::vector<at::Tensor> params;
  double last_lr = 0;
  double train_loss_epoch = 0;
  std::string notes;
};

FitResult fit_on_gpu(GraphNet::Config config, bool cuda_graph, int64_t samples, int64_t batch,
               const std::function<void(fulgur::TrainerOptions&)>& adjust = {}) {
  TempDir dir;
  auto options = graph_options(dir, cuda_graph);
  options.accelerator = "cuda";
  options.devices = 1;
  options.deterministic = true;
  options.max_epochs = 2;
  if (adjust) adjust(options);
  torch::manual_seed(3);
  GraphNet net(config);
  fulgur::Trainer trainer(options);
  testing::internal::CaptureStderr();
  FitResult run;
  try {
    trainer.fit(net, loader(samples, batch));
  } catch (...) {
    std::cerr << testing::internal::GetCapturedStderr();
    throw;
  }
  run.notes = testing::internal::GetCapturedStderr();
  for (const auto& p : net.parameters()) run.params.push_back(p.detach().cpu());
  run.last_lr = net.lr();
  run.train_loss_epoch = trainer.callback_metrics().at("train_loss_epoch");
  return run;
}

void expect_close(const FitResult& eager, const FitResult& graph, double rtol, double atol) {
  ASSERT_EQ(eager.params.size(), graph.params.size());
  for (size_t i = 0; i < eager.params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(eager.params[i], graph.params[i], rtol, atol))
        << "parameter " << i << ": max difference "
        << (eager.params[i] - graph.params[i]).abs().max().item<double>();
  }
}

TEST(CudaGraph, ReplayedStepsEqualEagerStepsWithAScheduledRate_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  // 64 samples in batches of 8: 8 steps an epoch, 16 in all; the rate
  // halves every 3 steps, so the replayed steps use five rates.
  const GraphNet::Config config{.optimizer = "sgd", .lr = 0.05, .step_schedule = true};
  const FitResult eager = fit_on_gpu(config, false, 64, 8);
  const FitResult graph = fit_on_gpu(config, true, 64, 8);
  EXPECT_DOUBLE_EQ(graph.last_lr, 0.05 * std::pow(0.5, 5));
  EXPECT_DOUBLE_EQ(eager.last_lr, graph.last_lr);
  expect_close(eager, graph, 1e-4, 1e-5);
  EXPECT_NEAR(eager.train_loss_epoch, graph.train_loss_epoch, 1e-4);
  EXPECT_THAT(graph.notes, testing::HasSubstr("captured after 3 warm-up steps"));
  EXPECT_THAT(graph.notes, testing::HasSubstr("13 steps replayed from 1 capture, 3 eager"));

  // A run whose rate never changes gives other weights: the schedule did
  // take effect under replay.
  const FitResult constant = fit_on_gpu({.optimizer = "sgd", .lr = 0.05}, true, 64, 8);
  EXPECT_FALSE(torch::allclose(constant.params[0], graph.params[0], 1e-4, 1e-5));
}

// BackboneFinetuning makes fc1 trainable at epoch 1, in a group of its own:
// the captured step's constants change, so it warms up again (fc1's Adam
// state is made in an eager step) and is captured again, and the run equals
// the eager one.
TEST(CudaGraph, AFinetunedBackboneIsCapturedAgainAfterAWarmUp_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  const GraphNet::Config config{.optimizer = "adamw", .lr = 0.01, .trainable_only = true};
  auto finetuning = [](fulgur::TrainerOptions& options) {
    options.callbacks = {std::make_shared<fulgur::BackboneFinetuning>(
        fulgur::BackboneFinetuningOptions{.unfreeze_backbone_at_epoch = 1, .backbone = "fc1"})};
  };
  const FitResult eager = fit_on_gpu(config, false, 64, 8, finetuning);
  const FitResult graph = fit_on_gpu(config, true, 64, 8, finetuning);
  expect_close(eager, graph, 1e-4, 1e-5);
  EXPECT_THAT(graph.notes, testing::HasSubstr("warming up and capturing the step again"));
  // Epoch 0: 3 warm-up steps, 5 replayed; epoch 1: 3 again, 5 replayed.
  EXPECT_THAT(graph.notes, testing::HasSubstr("10 steps replayed from 2 captures, 6 eager"));
}

TEST(CudaGraph, AdamWWithBf16MixedAndNormClippingEqualsEager_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  auto adjust = [](fulgur::TrainerOptions& o) {
    o.precision = "bf16-mixed";
    o.gradient_clip_val = 0.5;
  };
  const GraphNet::Config config{.optimizer = "adamw", .lr = 1e-2, .step_schedule = true};
  const FitResult eager = fit_on_gpu(config, false, 64, 8, adjust);
  const FitResult graph = fit_on_gpu(config, true, 64, 8, adjust);
  expect_close(eager, graph, 1e-3, 1e-4);
}

TEST(CudaGraph, ALastPartialBatchRunsEagerly_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  // 60 samples in batches of 8: 7 full batches and one of 4 per epoch.
  const GraphNet::Config config{.optimizer = "adamw", .lr = 1e-2};
  const FitResult eager = fit_on_gpu(config, false, 60, 8);
  const FitResult graph = fit_on_gpu(config, true, 60, 8);
  expect_close(eager, graph, 1e-4, 1e-5);
  EXPECT_THAT(graph.notes, testing::HasSubstr("runs eagerly"));
  EXPECT_THAT(graph.notes, testing::HasSubstr("11 steps replayed from 1 capture, 5 eager"));
}

TEST(CudaGraph, AnEpochsLastBatchIsNeverTheOneCaptured_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  // 28 samples in batches of 8: 3 full batches and one of 4 per epoch. The
  // 4th step (the partial batch) would be the first captured: it warms up
  // instead, and the capture takes the next epoch's first, full batch.
  const GraphNet::Config config{.optimizer = "sgd", .lr = 0.05};
  const FitResult eager = fit_on_gpu(config, false, 28, 8);
  const FitResult graph = fit_on_gpu(config, true, 28, 8);
  expect_close(eager, graph, 1e-4, 1e-5);
  EXPECT_THAT(graph.notes, testing::HasSubstr("3 steps replayed from 1 capture, 5 eager"));
}

TEST(CudaGraph, ANumberLoggedInACapturedStepIsRefused_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  EXPECT_THROWS_WITH(fulgur::ConfigError, fit_on_gpu({.log_number = true}, true, 64, 8),
                     {"logged \"a_number\" as a number", "on_train_batch_end"});
}

TEST(CudaGraph, AnAccumulationSchedulerIsRefused_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  EXPECT_THROWS_WITH(fulgur::ConfigError, (fit_on_gpu({}, true, 64, 8, [](auto& o) {
                       o.callbacks = {std::make_shared<fulgur::GradientAccumulationScheduler>(
                           std::map<int64_t, int64_t>{{0, 1}, {1, 2}})};
                     })),
                     {"GradientAccumulationScheduler with cuda_graph=true: factor 2 from epoch 1"});
}

#ifdef FULGUR_WITH_CUDA
/// Turns LibTorch's CUDA synchronisation debug mode to "error" for batches
/// `from` to `to` (the end of the epoch reads its values back, by design).
class NoSyncBetween : public fulgur::Callback {
 public:
  NoSyncBetween(int64_t from, int64_t to) : from_(from), to_(to) {}
  std::string state_key() const override { return "NoSyncBetween"; }
  void on_train_batch_start(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch&,
                            int64_t batch_idx) override {
    if (batch_idx == from_) {
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
    }
  }
  void on_train_batch_end(fulgur::Trainer&, fulgur::Module&, const at::Tensor&,
                          const fulgur::Batch&, int64_t batch_idx) override {
    if (batch_idx == to_) {
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    }
  }

 private:
  int64_t from_, to_;
};

TEST(CudaGraph, SteadyStateStepsNeverSynchronise_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  for (bool cuda_graph : {false, true}) {
    SCOPED_TRACE(cuda_graph ? "replayed steps" : "eager steps with prefetch");
    // 8 batches of 8, one epoch; logged every step but read back only every
    // 100 steps (never here), the gradients clipped by their norm. Batches
    // 4 to 7 are steady (replayed under cuda_graph); their steps, the loop
    // around them and the next batch's prefetch run with synchronisation
    // as an error.
    EXPECT_NO_THROW(fit_on_gpu({.optimizer = "adamw", .lr = 1e-3, .step_schedule = true},
                               cuda_graph, 64, 8, [](fulgur::TrainerOptions& o) {
                                 o.max_epochs = 1;
                                 o.log_every_n_steps = 100;
                                 o.gradient_clip_val = 0.5;
                                 o.deterministic = false;
                                 o.callbacks = {std::make_shared<NoSyncBetween>(4, 7)};
                               }));
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  }
}

TEST(CudaGraph, SteadyStateDdpStepsOnOneNcclRankNeverSynchronise_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  const auto backends = fulgur::available_process_group_backends();
  if (std::find(backends.begin(), backends.end(), "nccl") == backends.end()) {
    // Gloo's CUDA all-reduce synchronises the stream by design.
    GTEST_SKIP() << "this LibTorch has no NCCL process group (a pip wheel without the "
                    "nvidia-nccl wheel?): DDP on CUDA would fall back to Gloo";
  }
  // DDP's reducer on one NCCL rank: the buffers' broadcast, the gradient
  // all-reduce, the mean over the ranks with a loss and the stop vote's
  // copy to the host, all in batches 4 to 7 with synchronisation as an
  // error (one rank agrees to stop without reading the vote).
  EXPECT_NO_THROW(fit_on_gpu({.optimizer = "adamw", .lr = 1e-3}, false, 64, 8,
                             [](fulgur::TrainerOptions& o) {
                               o.strategy = "ddp";
                               o.max_epochs = 1;
                               o.log_every_n_steps = 100;
                               o.deterministic = false;
                               o.callbacks = {std::make_shared<NoSyncBetween>(4, 7)};
                             }));
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
}

TEST(CudaGraph, SteadyState16MixedStepsNeverSynchronise_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  if (!fulgur::optim::DeviceSkippedSteps::available()) {
    GTEST_SKIP() << "LibTorch " << fulgur::compat::torch_version()
                 << " has no fused optimizer kernels: the loss scaler reads its verdict";
  }
  // The loss scaler's unscale and inf check, its verdict handed to
  // fulgur::optim::AdamW's fused kernel, the scale's update, and the last
  // verdict's copy to the host, in batches 4 to 7 with synchronisation as
  // an error.
  EXPECT_NO_THROW(fit_on_gpu({.optimizer = "adamw", .lr = 1e-3}, false, 64, 8,
                             [](fulgur::TrainerOptions& o) {
                               o.precision = "16-mixed";
                               o.max_epochs = 1;
                               o.log_every_n_steps = 100;
                               o.deterministic = false;
                               o.callbacks = {std::make_shared<NoSyncBetween>(4, 7)};
                             }));
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
}
#endif

}  // namespace cuda_graph_step_test
