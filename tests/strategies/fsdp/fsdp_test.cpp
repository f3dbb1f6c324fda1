// The fsdp strategies in one process: what is registered and how, and what
// is refused before any rank starts. Training on real ranks:
// tests/distributed/fsdp_test.cpp.
#include "fulgur/strategies/fsdp.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/fulgur.h"
#include "support/test_support.h"
#include "strategies/strategy_driver.h"

namespace {

TEST(FSDPStrategy, RegisteredWithItsLaunchVariantsAndSharded) {
  auto& registry = fulgur::strategy_registry();
  for (const char* name : {"fsdp", "fsdp_fork"}) {
    auto full = registry.create(name);
    EXPECT_EQ(full->name(), name);
    EXPECT_EQ(dynamic_cast<fulgur::FSDPStrategy&>(*full).options().sharding_strategy.value(),
              fulgur::ShardingStrategy::kFullShard);
    EXPECT_TRUE(full->traits().forward_is_collective);
  }
  ASSERT_TRUE(registry.contains("fsdp_shard_grad_op"));
  ASSERT_TRUE(registry.contains("fsdp_shard_grad_op_fork"));
  auto popen = registry.create("fsdp_shard_grad_op");
  auto fork = registry.create("fsdp_shard_grad_op_fork");
  EXPECT_EQ(popen->name(), "fsdp_shard_grad_op");
  EXPECT_EQ(dynamic_cast<fulgur::FSDPStrategy&>(*popen).options().start_method.value(),
            fulgur::StartMethod::kPopen);
  EXPECT_EQ(dynamic_cast<fulgur::FSDPStrategy&>(*fork).options().start_method.value(),
            fulgur::StartMethod::kFork);
  // Each rank writes its own optimizer shard.
  EXPECT_EQ(dynamic_cast<fulgur::FSDPStrategy&>(*popen).options().sharding_strategy.value(),
            fulgur::ShardingStrategy::kShardGradOp);
  EXPECT_FALSE(popen->traits().forward_is_collective);
  EXPECT_EQ(popen->checkpoint_layout().name(), "sharded");
  EXPECT_TRUE(popen->traits().sync_batchnorm_unsupported_reason.empty());
}

TEST(FSDPStrategy, TheHalfPrecisionLossScalerIsRefusedNamingWhatToUse) {
  // A scaler judging each rank's shard alone could skip a step on one rank.
  struct Linear : fulgur::Module {
    torch::nn::Linear fc{nullptr};
    Linear() { fc = register_module("fc", torch::nn::Linear(3, 1)); }
    at::Tensor training_step(fulgur::Batch&, int64_t) override { return {}; }
    fulgur::OptimizerConfig configure_optimizers() override {
      return {std::make_shared<torch::optim::SGD>(parameters(), 0.1)};
    }
  } model;
  fulgur::FSDPStrategy strategy({.sharding_strategy = fulgur::ShardingStrategy::kShardGradOp,
                                 .start_method = fulgur::StartMethod::kPopen,
                                 .parallel = {}},
                                "fsdp_shard_grad_op");
  strategy.set_precision(std::make_shared<fulgur::MixedPrecision>(at::kHalf));
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::detail::drive(strategy).setup_optimizers(model),
                     {"strategy \"fsdp_shard_grad_op\" with precision=\"16-mixed\"", "loss scaler",
                      "precision=\"bf16-mixed\""});
}

TEST(FSDPStrategy, ABadStartMethodOrBackendIsNamed) {
  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      fulgur::FSDPStrategy(fulgur::FSDPOptions{.start_method = "spawn", .parallel = {}}),
      {"FSDPStrategy: start_method=\"spawn\"", "\"popen\"", "\"fork\""});
  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      fulgur::FSDPStrategy(fulgur::FSDPOptions{.parallel = {.process_group_backend = "glo"}}),
      {"FSDPStrategy: process_group_backend=\"glo\""});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::FSDPStrategy(fulgur::FSDPOptions{
                         .sharding_strategy = "ZERO3", .start_method = "popen", .parallel = {}}),
                     {"sharding_strategy=\"ZERO3\"", "\"FULL_SHARD\"", "\"SHARD_GRAD_OP\""});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::FSDPStrategy(fulgur::FSDPOptions{.auto_wrap_min_params = -1, .parallel = {}}),
                     {"auto_wrap_min_params=-1 is negative", "0 to turn auto-wrap off"});
}

// state_dict_type "full": one file, rank 0's (the single-file layout).
TEST(FSDPStrategy, AFullStateDictIsWrittenAsOneFileAndABadTypeIsNamed) {
  fulgur::FSDPOptions options;
  options.state_dict_type = fulgur::StateDictType::kFull;
  fulgur::FSDPStrategy full(options);
  EXPECT_NE(full.checkpoint_layout().name(), "sharded");
  options.state_dict_type = "whole";
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::FSDPStrategy{options},
                     {"state_dict_type=\"whole\"", "\"sharded\"", "\"full\""});
}

// The optimizer-state bytes the fsdp bench and FSDPStrategy::memory()
// report: Adam's two moments per parameter once it stepped (none before),
// SGD's momentum buffer, and LBFGS's direction, gradient and history (its
// one state for all the parameters).
TEST(FSDPStrategy, OptimizerStateBytesCountTheStatesTensors) {
  torch::nn::Linear fc(3, 2);  // 8 parameters
  auto step = [&](torch::optim::Optimizer& optimizer) {
    optimizer.zero_grad();
    fc(torch::ones({1, 3})).sum().backward();
    optimizer.step();
  };
  torch::optim::Adam adam(fc->parameters(), 0.1);
  EXPECT_EQ(fulgur::optimizer_state_bytes(adam), 0);
  step(adam);
  EXPECT_EQ(fulgur::optimizer_state_bytes(adam), 2 * 8 * 4);
  torch::optim::SGD sgd(fc->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  step(sgd);
  EXPECT_EQ(fulgur::optimizer_state_bytes(sgd), 8 * 4);
  torch::optim::LBFGS lbfgs(fc->parameters());
  lbfgs.step([&] {
    lbfgs.zero_grad();
    auto loss = fc(torch::ones({1, 3})).sum();
    loss.backward();
    return loss;
  });
  // After its first step: d and prev_flat_grad (8 floats each) and H_diag
  // (a scalar, of LBFGS's own dtype); no history (y.s never passed its
  // threshold on this linear loss).
  ASSERT_EQ(lbfgs.state().size(), 1u);
  const auto& state =
      static_cast<const torch::optim::LBFGSParamState&>(*lbfgs.state().begin()->second);
  ASSERT_TRUE(state.old_dirs().empty());
  EXPECT_EQ(fulgur::optimizer_state_bytes(lbfgs),
            (8 + 8) * 4 + static_cast<int64_t>(state.H_diag().element_size()));
}

// A full state dict gathers per-element state; LBFGS's one state for all
// its parameters is not that, and the save says what to use instead.
TEST(FSDPStrategy, AFullStateDictRefusesAnOptimizerStateItCannotGather) {
  fulgur::test::on_ranks(1, [&](int, std::shared_ptr<fulgur::ProcessGroup> group) {
    struct Model : fulgur::Module {
      torch::nn::Linear fc{nullptr};
      Model() { fc = register_module("fc", torch::nn::Linear(3, 2)); }
      at::Tensor training_step(fulgur::Batch&, int64_t) override { return {}; }
      fulgur::OptimizerConfig configure_optimizers() override {
        return {std::make_shared<torch::optim::LBFGS>(parameters())};
      }
    } model;
    fulgur::FSDPOptions options;
    options.state_dict_type = fulgur::StateDictType::kFull;
    fulgur::FSDPStrategy strategy(options);
    strategy.set_process_group(group);
    auto config = fulgur::detail::drive(strategy).setup_optimizers(model);
    auto& lbfgs = static_cast<torch::optim::LBFGS&>(*config.optimizers.front());
    lbfgs.step([&] { return torch::zeros({}); });  // its state exists after a step
    EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::detail::drive(strategy).optimizer_state(lbfgs),
                       {"state_dict_type=\"full\"", "not one fulgur can gather",
                        "state_dict_type=\"sharded\""});
  });
}

}  // namespace
