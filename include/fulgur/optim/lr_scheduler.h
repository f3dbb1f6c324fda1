// File: fulgur/optim/lr_scheduler.h
//
// Learning-rate schedules that LibTorch lacks, and what a scheduler of
// one's own implements to resume exactly.
//
// What a checkpoint keeps of a schedule: every scheduler's step count,
// every optimizer's parameter-group options as they were at the save point
// (learning rate, momentum, betas, weight decay: whatever a schedule or a
// callback changed), and the state of a scheduler that implements
// SchedulerState. A resumed run (a restart, ckpt_path="auto", a path) goes
// on with exactly those values.
//
//   fulgur::OptimizerConfig configure_optimizers() override {
//     auto adam = std::make_shared<torch::optim::Adam>(parameters(), 1e-3);
//     // Linear warm-up over 100 steps, then a cosine decay to 0 at step 1000.
//     auto warmup_cosine = std::make_shared<fulgur::LambdaLR>(*adam, [](int64_t step) {
//       if (step < 100) return (step + 1) / 100.0;
//       return 0.5 * (1 + std::cos(M_PI * std::min<int64_t>(step - 100, 900) / 900.0));
//     });
//     auto plateau = std::make_shared<fulgur::ReduceLROnPlateau>(*adam);
//     return {{adam},
//             {{.scheduler = warmup_cosine, .interval = fulgur::Interval::kStep},
//              {.scheduler = plateau, .monitor = "val_loss"}}};
//   }
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "fulgur/core/monitored_scheduler.h"
#include "fulgur/core/state_dict.h"

namespace fulgur {

/// Implemented by a scheduler whose state is more than LibTorch's step
/// count (which every checkpoint keeps): a checkpoint keeps what
/// state_dict() returns (under "lr_scheduler_states/<index>"), and a resume
/// hands it back to load_state_dict() before training goes on. A checkpoint
/// without it for such a scheduler is refused (the resume could not be
/// exact); load_state_dict throws CheckpointError when what it gets does not
/// fit.
class SchedulerState {
 public:
  virtual ~SchedulerState() = default;
  virtual StateDict state_dict() const = 0;
  virtual void load_state_dict(const StateDict& state) = 0;
};

/// lr = initial lr x factor(step) for each parameter group, as PyTorch's
/// LambdaLR: factor(0) applies from construction, factor(n) after n
/// scheduler steps. The initial learning rates are the optimizer's when
/// the scheduler is built (in configure_optimizers), so a resumed run
/// computes the same values. A group added later (BaseFinetuning's) keeps
/// the rate it is given, as in PyTorch.
class LambdaLR : public torch::optim::LRScheduler {
 public:
  LambdaLR(torch::optim::Optimizer& optimizer, std::function<double(int64_t)> factor);
  const std::vector<double>& base_lrs() const { return base_lrs_; }

 protected:
  std::vector<double> get_lrs() override;

 private:
  std::function<double(int64_t)> factor_;
  std::vector<double> base_lrs_;
};

struct ReduceLROnPlateauOptions {
  /// "min": the metric should fall (a loss); "max": rise (an accuracy).
  std::string mode = "min";
  /// New lr = lr x factor; in (0, 1).
  double factor = 0.1;
  /// Steps without improvement tolerated before the lr is reduced.
  int64_t patience = 10;
  /// What counts as an improvement: relative ("rel": better than
  /// best x (1 -/+ threshold)) or absolute ("abs": best -/+ threshold).
  double threshold = 1e-4;
  std::string threshold_mode = "rel";
  /// Steps after a reduction during which the count of bad steps rests.
  int64_t cooldown = 0;
  /// No group's lr goes below this.
  double min_lr = 0.0;
  /// A reduction smaller than this is not applied.
  double eps = 1e-8;
};

/// Reduces every parameter group's learning rate by `factor` when the
/// monitored metric has not improved for `patience` steps (PyTorch's
/// ReduceLROnPlateau). Give it a SchedulerConfig with `monitor`. Its
/// best value and counters are in checkpoints.
class ReduceLROnPlateau : public torch::optim::LRScheduler,
                          public SchedulerState,
                          public MonitoredScheduler {
 public:
  explicit ReduceLROnPlateau(torch::optim::Optimizer& optimizer,
                             ReduceLROnPlateauOptions options = {});

  void step(double value) override;
  /// "best" (double), "num_bad_steps" and "cooldown_counter" (ints).
  StateDict state_dict() const override;
  /// CheckpointError when one of them is missing or of another kind.
  void load_state_dict(const StateDict& state) override;

  const ReduceLROnPlateauOptions& options() const { return options_; }
  double best() const { return best_; }
  int64_t num_bad_steps() const { return num_bad_steps_; }
  int64_t cooldown_counter() const { return cooldown_counter_; }

 protected:
  std::vector<double> get_lrs() override;

 private:
  bool is_better(double value) const;

  ReduceLROnPlateauOptions options_;
  double best_;
  int64_t num_bad_steps_ = 0;
  int64_t cooldown_counter_ = 0;
  std::vector<double> next_lrs_;
};

}  // namespace fulgur
