// File: fulgur/callbacks/gradient_accumulation_scheduler.h
//
// Changes gradient accumulation by epoch: {{0, 1}, {4, 2}, {8, 4}} steps
// after every batch in epochs 0-3, every 2 batches in epochs 4-7, every 4
// from epoch 8 on (epochs before the first key: 1). Set at each epoch's
// start, so a resumed run accumulates as the uninterrupted one did. Leave
// the Trainer's accumulate_grad_batches at 1; automatic optimization only.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "fulgur/callbacks/callback.h"

namespace fulgur {

class GradientAccumulationScheduler : public Callback {
 public:
  /// epoch → batches per optimizer step. ConfigError on an empty schedule,
  /// a negative epoch or a factor < 1.
  explicit GradientAccumulationScheduler(std::map<int64_t, int64_t> scheduling);
  std::string state_key() const override { return "GradientAccumulationScheduler"; }
  /// A fit with cuda_graph and a factor above 1 is refused.
  void setup(Trainer& trainer, Module& module, Stage stage) override;
  void on_fit_start(Trainer& trainer, Module& module) override;
  void on_train_epoch_start(Trainer& trainer, Module& module) override;
  /// The factor for `epoch`.
  int64_t factor(int64_t epoch) const;

 private:
  std::map<int64_t, int64_t> scheduling_;
};

}  // namespace fulgur
