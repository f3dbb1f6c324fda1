#include "fulgur/strategies/single_device.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/fulgur.h"
#include "support/test_support.h"
#include "strategies/strategy_driver.h"

namespace {

using fulgur::test::LinearRegression;

TEST(SingleDeviceStrategy, RanksOfOneProcess) {
  fulgur::SingleDeviceStrategy strategy;
  EXPECT_EQ(strategy.name(), "single_device");
  EXPECT_EQ(strategy.global_rank(), 0);
  EXPECT_EQ(strategy.local_rank(), 0);
  EXPECT_EQ(strategy.node_rank(), 0);
  EXPECT_EQ(strategy.world_size(), 1);
  EXPECT_TRUE(strategy.is_global_zero());
  EXPECT_TRUE(fulgur::detail::drive(strategy).is_checkpoint_writer());
  EXPECT_EQ(strategy.launcher(), nullptr);
}

TEST(SingleDeviceStrategy, RootDeviceDefaultsToTheCpuThenTheParallelDevices) {
  fulgur::SingleDeviceStrategy strategy;
  EXPECT_EQ(strategy.root_device(), c10::Device(c10::kCPU));
  strategy.set_parallel_devices({c10::Device(c10::kCPU)});
  EXPECT_EQ(strategy.root_device(), c10::Device(c10::kCPU));
  fulgur::SingleDeviceStrategy explicit_device(c10::Device(c10::kCUDA, 1));
  EXPECT_EQ(explicit_device.root_device(), c10::Device(c10::kCUDA, 1));
}

TEST(SingleDeviceStrategy, CollectivesAreIdentities) {
  fulgur::SingleDeviceStrategy strategy;
  auto t = torch::arange(3.0);
  EXPECT_TRUE(torch::equal(strategy.all_reduce(t), t));
  EXPECT_TRUE(torch::equal(strategy.all_reduce(t, fulgur::ReduceOp::kSum), t));
  EXPECT_TRUE(torch::equal(strategy.broadcast(t), t));
  auto gathered = strategy.all_gather(t);
  EXPECT_EQ(gathered.sizes().vec(), (std::vector<int64_t>{1, 3}));
  EXPECT_TRUE(torch::equal(gathered[0], t));
  EXPECT_TRUE(strategy.reduce_boolean_decision(true));
  EXPECT_FALSE(strategy.reduce_boolean_decision(false));
  EXPECT_TRUE(strategy.reduce_boolean_decision(true, /*all=*/false));
  EXPECT_NO_THROW(strategy.barrier("test"));
}

TEST(SingleDeviceStrategy, HasNoProcessGroup) {
  fulgur::SingleDeviceStrategy strategy;
  EXPECT_EQ(strategy.shared_process_group(), nullptr);
  EXPECT_THROWS_WITH(fulgur::DistributedError, strategy.process_group(),
                     {"single_device", "one process", "\"ddp\""});
  EXPECT_EQ(strategy.traits().max_processes, 1);
  EXPECT_EQ(strategy.traits().sync_batchnorm_unsupported_reason, "one process has no peers");
}

// What trainer.strategy() offers a user's code: the components, the ranks
// and the collectives. The Trainer's protocol (setup, steps, stop votes,
// checkpoint files, the node count) is reached only through
// detail::StrategyDriver; a call from outside does not compile.
template <class S>
concept UserSurface = requires(S& s, const at::Tensor& t) {
  s.all_reduce(t);
  s.broadcast(t);
  s.barrier();
  s.world_size();
  s.global_rank();
  s.root_device();
  s.shared_process_group();
  s.precision();
  s.cluster_environment();
  s.traits();
};
template <class S>
concept SetsUp = requires(S& s, fulgur::Module& m) { s.setup(m); };
template <class S>
concept Steps = requires(S& s, fulgur::Module& m, const at::Tensor& t) { s.backward(t, m); };
template <class S>
concept VotesToStop = requires(S& s) { s.set_stop_vote(true); };
template <class S>
concept SetsNodes = requires(S& s) { s.set_num_nodes(2); };
template <class S>
concept RemovesCheckpoints = requires(S& s) { s.remove_checkpoint(std::string()); };
template <class S>
concept Reconfigures = requires(S& s, std::vector<std::string>& notes) { s.configure(notes); };
template <class S>
constexpr bool internals_hidden =
    !SetsUp<S> && !Steps<S> && !VotesToStop<S> && !SetsNodes<S> && !RemovesCheckpoints<S> &&
    !Reconfigures<S>;

TEST(Strategy, UsersSeeComponentsRanksAndCollectivesOnly) {
  static_assert(UserSurface<fulgur::Strategy> && UserSurface<fulgur::DDPStrategy> &&
                UserSurface<fulgur::FSDPStrategy>);
  static_assert(internals_hidden<fulgur::Strategy> && internals_hidden<fulgur::SingleDeviceStrategy> &&
                internals_hidden<fulgur::DDPStrategy> && internals_hidden<fulgur::FSDPStrategy> &&
                internals_hidden<fulgur::ManualStrategy>);
  static_assert(SetsUp<fulgur::detail::StrategyDriver> && Steps<fulgur::detail::StrategyDriver> &&
                VotesToStop<fulgur::detail::StrategyDriver>);
  // The driver reaches the same strategy.
  fulgur::SingleDeviceStrategy strategy;
  LinearRegression model;
  auto driver = fulgur::detail::drive(strategy);
  driver.setup_environment();
  driver.setup(model);
  EXPECT_TRUE(driver.is_checkpoint_writer());
  driver.teardown();
}

TEST(SingleDeviceStrategy, DefaultComponentsAreFilledLazily) {
  fulgur::SingleDeviceStrategy strategy;
  EXPECT_FALSE(strategy.has_precision());
  EXPECT_EQ(strategy.precision().name(), "32-true");
  EXPECT_TRUE(strategy.has_precision());
  EXPECT_EQ(strategy.checkpoint_io().name(), "torch");
  EXPECT_EQ(strategy.cluster_environment().name(), "lightning");
}

TEST(SingleDeviceStrategy, AcceleratorHasNoDefault) {
  fulgur::SingleDeviceStrategy strategy;
  EXPECT_FALSE(strategy.has_accelerator());
  EXPECT_THROWS_WITH(fulgur::ConfigError, strategy.accelerator(),
                     {"single_device", "no accelerator", "set_accelerator"});
  strategy.set_accelerator(std::make_unique<fulgur::CPUAccelerator>());
  EXPECT_EQ(strategy.accelerator().name(), "cpu");
}

TEST(SingleDeviceStrategy, SetupBeforeSetupEnvironmentIsABug) {
  fulgur::SingleDeviceStrategy strategy;
  LinearRegression model;
  EXPECT_THROWS_WITH(fulgur::InternalError, fulgur::detail::drive(strategy).setup(model), {"setup_environment"});
  fulgur::detail::drive(strategy).setup_environment();
  EXPECT_NO_THROW(fulgur::detail::drive(strategy).setup(model));
  fulgur::detail::drive(strategy).teardown();
  EXPECT_NO_THROW(fulgur::detail::drive(strategy).teardown());  // safe to call twice
}

TEST(SingleDeviceStrategy, BatchToDeviceKeepsTheShapeOfTheBatch) {
  fulgur::SingleDeviceStrategy strategy;
  fulgur::Batch batch(fulgur::Batch::Map{{"x", torch::ones({2, 3})}, {"y", torch::zeros({2})}});
  auto moved = fulgur::detail::drive(strategy).batch_to_device(batch);
  ASSERT_TRUE(moved.is_map());
  EXPECT_TRUE(torch::equal(moved["x"], torch::ones({2, 3})));
  EXPECT_EQ(moved["y"].device(), c10::Device(c10::kCPU));
}

TEST(SingleDeviceStrategy, BackwardAndOptimizerStepGoThroughThePrecision) {
  fulgur::SingleDeviceStrategy strategy;
  LinearRegression model({.lr = 1.0});
  fulgur::detail::drive(strategy).setup_environment();
  fulgur::detail::drive(strategy).setup(model);
  auto config = fulgur::detail::drive(strategy).setup_optimizers(model);
  ASSERT_EQ(config.optimizers.size(), 1u);
  auto before = model.fc->weight.detach().clone();
  auto x = torch::ones({1, 3});
  auto loss = model.forward(x).sum();
  fulgur::detail::drive(strategy).backward(loss, model);
  auto grad = model.fc->weight.grad().clone();
  EXPECT_TRUE(torch::equal(grad, torch::ones({1, 3})));
  EXPECT_TRUE(fulgur::detail::drive(strategy).optimizer_step(*config.optimizers[0], model));
  EXPECT_TRUE(torch::allclose(model.fc->weight, before - grad));
  fulgur::detail::drive(strategy).teardown();
}

// gradient_clip_val with the norm algorithm: the gradients LibTorch's
// clip_grad_norm_ leaves, bit for bit (clipped, left as they are, one
// parameter or several, one without a gradient), without its read-back of
// the norm (a host synchronisation per step on a GPU: the CUDA test
// CudaGraph.SteadyStateStepsNeverSynchronise_CUDA clips in its steps).
TEST(SingleDeviceStrategy, ClippingByNormGivesLibTorchsGradients) {
  fulgur::SingleDeviceStrategy strategy;
  for (const double max_norm : {0.5, 1e3}) {
    for (const size_t count : {1, 3}) {
      SCOPED_TRACE(testing::Message() << "max_norm " << max_norm << ", " << count << " tensors");
      torch::manual_seed(1);
      std::vector<at::Tensor> ours, theirs;
      for (size_t i = 0; i < count; ++i) {
        auto p = torch::randn({4, static_cast<int64_t>(5 + i)}, torch::requires_grad());
        if (i != 1) p.mutable_grad() = torch::randn_like(p) * 3;
        auto q = p.detach().clone().requires_grad_(true);
        if (p.grad().defined()) q.mutable_grad() = p.grad().clone();
        ours.push_back(p);
        theirs.push_back(q);
      }
      fulgur::detail::drive(strategy).clip_gradients_norm(ours, max_norm);
      torch::nn::utils::clip_grad_norm_(theirs, max_norm);
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(ours[i].grad().defined(), theirs[i].grad().defined()) << i;
        if (ours[i].grad().defined()) {
          EXPECT_TRUE(torch::equal(ours[i].grad(), theirs[i].grad())) << i;
        }
      }
    }
  }
}

TEST(SingleDeviceStrategy, SchedulerWithBadFrequencyIsAConfigError) {
  fulgur::SingleDeviceStrategy strategy;
  LinearRegression model;
  model.make_schedulers = [](torch::optim::Optimizer& optimizer) {
    return std::vector<fulgur::SchedulerConfig>{
        {.scheduler = std::make_shared<torch::optim::StepLR>(optimizer, 1, 0.5),
         .interval = fulgur::Interval::kStep,
         .frequency = 0}};
  };
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::detail::drive(strategy).setup_optimizers(model),
                     {"scheduler 0", "frequency=0"});
}

TEST(SingleDeviceStrategy, SaveAndLoadModuleState) {
  fulgur::test::TempDir dir;
  fulgur::SingleDeviceStrategy strategy;
  torch::manual_seed(1);
  LinearRegression a;
  torch::manual_seed(2);
  LinearRegression b;
  ASSERT_FALSE(fulgur::test::parameters_equal(a, b));
  const auto* weight_impl = b.fc->weight.unsafeGetTensorImpl();
  {
    fulgur::StateDict state = fulgur::detail::drive(strategy).module_state(a);
    fulgur::detail::drive(strategy).save_checkpoint(state, dir.file("state.ckpt"));
  }
  const fulgur::StateDict state = fulgur::detail::drive(strategy).load_checkpoint(dir.file("state.ckpt"));
  fulgur::detail::drive(strategy).load_module_state(b, state);
  EXPECT_TRUE(fulgur::test::parameters_equal(a, b));
  // Loaded into the same tensors: an optimizer holding b's parameters stays valid.
  EXPECT_EQ(b.fc->weight.unsafeGetTensorImpl(), weight_impl);
}

TEST(SingleDeviceStrategy, DescribeListsEveryComponent) {
  fulgur::SingleDeviceStrategy strategy;
  strategy.set_accelerator(std::make_unique<fulgur::CPUAccelerator>());
  auto text = strategy.describe();
  EXPECT_TRUE(fulgur::test::message_contains(
      text,
      {"strategy: single_device", "accelerator: cpu", "precision: 32-true", "checkpoint_io: torch",
       "cluster_environment: lightning", "launcher: none", "world_size: 1", "root_device: cpu"}));
}

TEST(ReduceOp, Names) {
  EXPECT_STREQ(fulgur::to_string(fulgur::ReduceOp::kSum), "sum");
  EXPECT_STREQ(fulgur::to_string(fulgur::ReduceOp::kMean), "mean");
  EXPECT_STREQ(fulgur::to_string(fulgur::ReduceOp::kMax), "max");
  EXPECT_STREQ(fulgur::to_string(fulgur::ReduceOp::kMin), "min");
}

}  // namespace
