#include "fulgur/strategies/manual.h"

#include "fulgur/strategies/checkpoint_layout.h"

namespace fulgur {

ManualStrategy::ManualStrategy(ManualOptions options, std::string name)
    : ParallelStrategy(std::move(options), "ManualStrategy"), name_(std::move(name)) {
  set_checkpoint_layout(std::make_shared<ShardedCheckpoint>());
}

void ManualStrategy::configure_launcher() { configure_launcher_for(StartMethod::kPopen); }

void ManualStrategy::register_strategies(StrategyRegistry& registry) {
  registry.add(
      "manual",
      "Parallelism in the Module: processes, ranks, process group and collectives "
      "from fulgur; placement, wrapping and gradients by the Module; per-rank checkpoints",
      [] { return std::make_unique<ManualStrategy>(); },
      "start_method=popen" + describe_parallel_options(ManualOptions{}));
}

}  // namespace fulgur
