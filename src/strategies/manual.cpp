#include "fulgur/strategies/manual.h"

#include "fulgur/strategies/checkpoint_layout.h"

namespace fulgur {

ManualStrategy::ManualStrategy(ManualOptions options, std::string name)
    : ParallelStrategy(std::move(options), "ManualStrategy"), name_(std::move(name)) {
  set_checkpoint_layout(std::make_shared<ShardedCheckpoint>());
  set_traits({.sync_batchnorm_unsupported_reason =
                  "under manual the Module connects its fulgur::nn::SyncBatchNorm layers itself, "
                  "with set_all_reduce",
              .trainable_change_unsupported_reason =
                  "under manual the Module reduces the gradients itself, over the parameters "
                  "it chose when the fit started"});
}

}  // namespace fulgur
