#include "fulgur/strategies/ddp.h"

#include <torch/torch.h>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/plugins/environments/cluster_environment.h"
#include "fulgur/strategies/gradient_reducer.h"
#include "fulgur/strategies/launchers/fork.h"
#include "fulgur/strategies/launchers/subprocess_script.h"
#include "fulgur/strategies/process_group.h"

namespace fulgur {

DDPStrategy::DDPStrategy(DDPOptions options, std::string name)
    : options_(std::move(options)), name_(std::move(name)) {
  if (options_.start_method != "popen" && options_.start_method != "fork") {
    throw ConfigError(str("DDPStrategy: start_method=\"", options_.start_method, "\" is not one "
                          "of \"popen\" (re-execute the program per rank) or \"fork\" (fork the "
                          "ranks at fit())."));
  }
  if (!(options_.bucket_cap_mb > 0)) {
    throw ConfigError(str("DDPStrategy: bucket_cap_mb=", options_.bucket_cap_mb,
                          " must be > 0 (default 25)."));
  }
  set_process_group_timeout(options_.process_group_timeout);
}

DDPStrategy::~DDPStrategy() = default;

void DDPStrategy::configure_launcher() {
  if (cluster_environment().creates_processes_externally()) return;  // torchrun, srun, ...
  Supervision supervision{options_.stop_grace, options_.process_group_timeout};
  if (options_.start_method == "fork") {
    set_launcher(std::make_unique<ForkLauncher>(*this, supervision));
  } else {
    set_launcher(std::make_unique<SubprocessScriptLauncher>(*this, supervision));
  }
}

void DDPStrategy::do_setup(Module& module) {
  module.to(root_device());
  // Every rank starts from rank 0's parameters and buffers.
  {
    torch::NoGradGuard no_grad;
    auto& group = process_group();
    for (auto& p : module.parameters()) {
      at::Tensor data = p.detach();
      group.broadcast_(data, 0);
    }
    for (auto& b : module.buffers()) {
      at::Tensor data = b.detach();
      group.broadcast_(data, 0);
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (auto& item : module.named_parameters()) named.emplace_back(item.key(), item.value());
  GradientReducerOptions reducer_options;
  reducer_options.bucket_cap_mb = options_.bucket_cap_mb;
  reducer_options.find_unused_parameters = options_.find_unused_parameters;
  reducer_ = std::make_unique<GradientReducer>(std::move(named), shared_process_group(),
                                               reducer_options);
  reducer_->set_require_sync(sync_);
}

void DDPStrategy::do_teardown() {
  reducer_.reset();
  ParallelStrategy::do_teardown();
}

void DDPStrategy::backward(const at::Tensor& loss, Module& module) {
  bool sync = reducer_ && sync_;
  if (sync) reducer_->prepare_for_backward();
  ParallelStrategy::backward(loss, module);
  if (sync) reducer_->finalize_backward();
}

void DDPStrategy::set_gradient_sync(bool enabled) {
  sync_ = enabled;
  if (reducer_) reducer_->set_require_sync(enabled);
}

void DDPStrategy::register_strategies(StrategyRegistry& registry) {
  register_variants<DDPStrategy>(registry, "ddp", "Distributed data parallel");
}

}  // namespace fulgur
