// Private: the training flag of a module and of each of its submodules,
// put back as they were (an evaluation switches the module to eval mode; a
// submodule the user keeps in eval mode, a frozen BatchNorm, stays so).
#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <utility>
#include <vector>

namespace fulgur::detail {

class ModuleModes {
 public:
  explicit ModuleModes(torch::nn::Module& module)
      : module_(module), training_(module.is_training()) {
    for (const auto& sub : module.modules(/*include_self=*/false)) {
      kept_.emplace_back(sub, sub->is_training());
    }
  }
  ~ModuleModes() { restore(); }
  ModuleModes(const ModuleModes&) = delete;
  ModuleModes& operator=(const ModuleModes&) = delete;

  /// train() sets a module's submodules too: the module first, then each
  /// submodule in pre-order, each ends with its own flag.
  void restore() {
    module_.train(training_);
    for (const auto& [sub, training] : kept_) sub->train(training);
  }

 private:
  torch::nn::Module& module_;
  bool training_;
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, bool>> kept_;
};

}  // namespace fulgur::detail
