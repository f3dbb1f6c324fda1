// The built-in strategies: each family's registered names (its variants,
// with their descriptions and options) and the global registry filled with
// them. strategy_registry() is defined here, so every program that asks for
// the registry links these registrations (no static registration objects
// for a static library's linker to drop).
#include "fulgur/core/errors.h"
#include "fulgur/strategies/ddp.h"
#include "fulgur/strategies/fsdp.h"
#include "fulgur/strategies/manual.h"
#include "fulgur/strategies/single_device.h"

namespace fulgur {

void SingleDeviceStrategy::register_strategies(StrategyRegistry& registry) {
  registry.add("single_device", "One process on one device",
               [] { return std::make_unique<SingleDeviceStrategy>(); });
}

void DDPStrategy::register_strategies(StrategyRegistry& registry) {
  register_variants<DDPStrategy>(registry, "ddp", "Distributed data parallel");
}

void FSDPStrategy::register_strategies(StrategyRegistry& registry) {
  struct Variant {
    const char* name;
    const char* description;
    ShardingStrategy sharding;
    StartMethod start_method;
  };
  static constexpr Variant variants[] = {
      {"fsdp",
       "Sharded data parallel, FULL_SHARD (ZeRO 3): the parameters of each declared "
       "fulgur::nn::FSDPUnit sharded between their uses, gradients and optimizer state sharded; "
       "one process per device, launched by re-executing the program",
       ShardingStrategy::kFullShard, StartMethod::kPopen},
      {"fsdp_fork", "Sharded data parallel, FULL_SHARD (ZeRO 3), ranks forked at fit()",
       ShardingStrategy::kFullShard, StartMethod::kFork},
      {"fsdp_shard_grad_op",
       "Sharded data parallel, SHARD_GRAD_OP (ZeRO 2): gradients and optimizer state sharded, "
       "parameters whole; one process per device, launched by re-executing the program",
       ShardingStrategy::kShardGradOp, StartMethod::kPopen},
      {"fsdp_shard_grad_op_fork",
       "Sharded data parallel, SHARD_GRAD_OP (ZeRO 2), ranks forked at fit()",
       ShardingStrategy::kShardGradOp, StartMethod::kFork},
  };
  for (const auto& v : variants) {
    FSDPOptions options;
    options.sharding_strategy = v.sharding;
    options.start_method = v.start_method;
    const std::string name = v.name;
    registry.add(
        name, v.description,
        [options, name] { return std::make_unique<FSDPStrategy>(options, name); },
        str("sharding_strategy=", options.sharding_strategy.text(), ", start_method=",
            options.start_method.text(), describe_parallel_options(options.parallel)));
  }
}

void ManualStrategy::register_strategies(StrategyRegistry& registry) {
  registry.add(
      "manual",
      "Parallelism in the Module: processes, ranks, process group and collectives "
      "from fulgur; placement, wrapping and gradients by the Module; per-rank checkpoints",
      [] { return std::make_unique<ManualStrategy>(); },
      "start_method=popen" + describe_parallel_options(ManualOptions{}));
}

StrategyRegistry& strategy_registry() {
  static StrategyRegistry registry = [] {
    StrategyRegistry r("strategy");
    SingleDeviceStrategy::register_strategies(r);
    DDPStrategy::register_strategies(r);
    FSDPStrategy::register_strategies(r);
    ManualStrategy::register_strategies(r);
    return r;
  }();
  return registry;
}

}  // namespace fulgur
