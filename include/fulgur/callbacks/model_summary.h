// File: fulgur/callbacks/model_summary.h
//
// Prints a table of the module's layers (name, type, parameters, trainable
// or frozen, size in MB) and the totals at fit start, on global rank 0.
#pragma once

#include <string>

#include "fulgur/callbacks/callback.h"

namespace torch::nn {
class Module;
}

namespace fulgur {

struct ModelSummaryOptions {
  /// Depth of the layers listed (1: the module's direct children; 0: only
  /// the totals).
  int max_depth = 1;
};

class ModelSummary : public Callback {
 public:
  explicit ModelSummary(ModelSummaryOptions options = {});
  std::string state_key() const override { return "ModelSummary"; }
  void on_fit_start(Trainer& trainer, Module& module) override;
  /// The table, as printed.
  static std::string summarize(const torch::nn::Module& module, int max_depth = 1);

 private:
  ModelSummaryOptions options_;
};

}  // namespace fulgur
