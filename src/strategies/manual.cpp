#include "fulgur/strategies/manual.h"

#include "fulgur/strategies/checkpoint_layout.h"

namespace fulgur {

ManualStrategy::ManualStrategy(ManualOptions options, std::string name)
    : ParallelStrategy(std::move(options), "ManualStrategy"), name_(std::move(name)) {
  set_checkpoint_layout(std::make_shared<ShardedCheckpoint>());
}

void ManualStrategy::configure_launcher() { configure_launcher_for(StartMethod::kPopen); }

}  // namespace fulgur
