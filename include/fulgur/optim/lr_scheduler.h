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
#include <memory>
#include <optional>
#include <string>
#include <utility>
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

/// What fulgur's schedulers share: they keep the optimizer they schedule,
/// so that the Trainer can check that configure_optimizers returned it (a
/// schedule of another optimizer would move rates nothing trains with).
class Scheduler : public torch::optim::LRScheduler {
 public:
  const torch::optim::Optimizer& optimizer() const { return optimizer_; }

 protected:
  explicit Scheduler(torch::optim::Optimizer& optimizer);
  torch::optim::Optimizer& scheduled_optimizer() { return optimizer_; }

 private:
  torch::optim::Optimizer& optimizer_;
};

/// How a ClosedFormLR's step (1 or more) applies its rates: set outright
/// (the default), or chained (see ClosedFormLR).
struct ScheduleChaining {
  bool chained = false;
  /// The rate a chained step scales toward (CosineAnnealingLR's eta_min).
  double floor = 0.0;
  /// A chained step scales a group added after construction too.
  bool added_groups = false;
};

/// A schedule defined by its rate after n steps as a function of n and of
/// each group's initial rate (PyTorch's closed forms). The initial rates are
/// the optimizer's when the schedule is built (in configure_optimizers), and
/// the rates of step 0 apply from then on.
///
/// A step applies it as PyTorch's step() does: StepLR, MultiStepLR,
/// ExponentialLR, LinearLR, ConstantLR, PolynomialLR and CosineAnnealingLR
/// scale the rate each group has by the schedule's change (PyTorch's
/// chained forms: schedules on one optimizer multiply, a rate that
/// ReduceLROnPlateau or a callback changed is scaled, not replaced, and the
/// multiplicative ones scale a group added later, BaseFinetuning's, too);
/// LambdaLR, OneCycleLR and CosineAnnealingWarmRestarts set the rate
/// outright (a group added later keeps its own). Either way a step reads
/// only the step count and the rates a checkpoint keeps, so a resumed run
/// goes on exactly. Alone on an optimizer, a chained schedule follows the
/// closed form up to rounding in the last bits, as PyTorch's does.
class ClosedFormLR : public Scheduler {
 public:
  /// The rate of group `group`, whose initial rate is `base_lr`, after
  /// `step` scheduler steps.
  virtual double lr_at(size_t group, double base_lr, int64_t step) const = 0;
  /// What else the schedule sets after `step` steps (OneCycleLR's
  /// momentum); nothing by default.
  virtual void set_other_options(int64_t step);

  /// How a step applies lr_at: set outright (the default), or chained.
  using Chaining = ScheduleChaining;
  /// The chaining given to the constructor, at every step.
  virtual Chaining chaining_at(int64_t /*step*/) const { return chaining_; }
  /// Whether its steps set the rates outright (from the initial rates)
  /// rather than scale the rates they find: undoing, at its next step, what
  /// another schedule of the same optimizer did. A SequentialLR: whether
  /// one of its schedulers does.
  virtual bool sets_rates_outright() const { return !chaining_.chained; }

  const std::vector<double>& base_lrs() const { return base_lrs_; }
  /// Scheduler steps taken (restored from a checkpoint on resume).
  int64_t steps() const { return static_cast<int64_t>(step_count_); }

 protected:
  /// Keeps the optimizer's rates as the initial ones (`base_lrs`: one per
  /// group, instead of the optimizer's; OneCycleLR's). Its steps are
  /// applied as `chaining` says.
  explicit ClosedFormLR(torch::optim::Optimizer& optimizer, Chaining chaining = {},
                        std::optional<std::vector<double>> base_lrs = std::nullopt);
  /// Applies step 0's rates and options. A derived class calls it at the
  /// end of its constructor (lr_at is not virtual yet in this one's).
  void start();
  std::vector<double> get_lrs() override;

 private:
  friend class SequentialLR;
  std::vector<double> base_lrs_;
  Chaining chaining_;
  const ClosedFormLR* sequence_ = nullptr;  // the SequentialLR that steps this one
  uint64_t built_;                          // the order in which schedules were built
};

/// lr = initial lr x factor(step) for each parameter group, as PyTorch's
/// LambdaLR: factor(0) applies from construction, factor(n) after n
/// scheduler steps.
class LambdaLR : public ClosedFormLR {
 public:
  LambdaLR(torch::optim::Optimizer& optimizer, std::function<double(int64_t)> factor);
  double lr_at(size_t group, double base_lr, int64_t step) const override;

 private:
  std::function<double(int64_t)> factor_;
};

/// lr = initial lr x gamma^(step / step_size) (integer division): PyTorch's
/// StepLR, decayed after step_size steps (LibTorch's torch::optim::StepLR
/// decays one step later and does not check step_size).
class StepLR : public ClosedFormLR {
 public:
  StepLR(torch::optim::Optimizer& optimizer, int64_t step_size, double gamma = 0.1);
  double lr_at(size_t group, double base_lr, int64_t step) const override;

 private:
  int64_t step_size_;
  double gamma_;
};

/// lr = initial lr x gamma^(milestones reached): PyTorch's MultiStepLR.
/// `milestones` rise strictly (a repeated one would decay twice, silently,
/// in PyTorch).
class MultiStepLR : public ClosedFormLR {
 public:
  MultiStepLR(torch::optim::Optimizer& optimizer, std::vector<int64_t> milestones,
              double gamma = 0.1);
  double lr_at(size_t group, double base_lr, int64_t step) const override;

 private:
  std::vector<int64_t> milestones_;
  double gamma_;
};

/// lr = initial lr x gamma^step: PyTorch's ExponentialLR.
class ExponentialLR : public ClosedFormLR {
 public:
  ExponentialLR(torch::optim::Optimizer& optimizer, double gamma);
  double lr_at(size_t group, double base_lr, int64_t step) const override;

 private:
  double gamma_;
};

/// lr = eta_min + (initial lr - eta_min) x (1 + cos(pi x step / t_max)) / 2:
/// PyTorch's CosineAnnealingLR (closed form). After t_max steps the rate
/// rises again along the cosine, as PyTorch's does; give t_max the number of
/// steps (or epochs) the schedule covers.
class CosineAnnealingLR : public ClosedFormLR {
 public:
  CosineAnnealingLR(torch::optim::Optimizer& optimizer, int64_t t_max, double eta_min = 0.0);
  double lr_at(size_t group, double base_lr, int64_t step) const override;

 private:
  int64_t t_max_;
  double eta_min_;
};

/// The cosine of CosineAnnealingLR over t_0 steps, restarted at the initial
/// rate, each period t_mult times the one before: PyTorch's
/// CosineAnnealingWarmRestarts stepped once per step (or epoch).
class CosineAnnealingWarmRestarts : public ClosedFormLR {
 public:
  CosineAnnealingWarmRestarts(torch::optim::Optimizer& optimizer, int64_t t_0, int64_t t_mult = 1,
                              double eta_min = 0.0);
  double lr_at(size_t group, double base_lr, int64_t step) const override;

 private:
  int64_t t_0_;
  int64_t t_mult_;
  double eta_min_;
};

/// lr = initial lr x a factor going linearly from start_factor to
/// end_factor over total_iters steps, then end_factor: PyTorch's LinearLR
/// (a warm-up with the defaults).
class LinearLR : public ClosedFormLR {
 public:
  LinearLR(torch::optim::Optimizer& optimizer, double start_factor = 1.0 / 3,
           double end_factor = 1.0, int64_t total_iters = 5);
  double lr_at(size_t group, double base_lr, int64_t step) const override;

 private:
  double start_factor_;
  double end_factor_;
  int64_t total_iters_;
};

/// lr = initial lr x factor for the first total_iters steps, then the
/// initial lr: PyTorch's ConstantLR.
class ConstantLR : public ClosedFormLR {
 public:
  ConstantLR(torch::optim::Optimizer& optimizer, double factor = 1.0 / 3, int64_t total_iters = 5);
  double lr_at(size_t group, double base_lr, int64_t step) const override;

 private:
  double factor_;
  int64_t total_iters_;
};

/// lr = initial lr x (1 - min(step, total_iters) / total_iters)^power:
/// PyTorch's PolynomialLR (0 from total_iters on).
class PolynomialLR : public ClosedFormLR {
 public:
  PolynomialLR(torch::optim::Optimizer& optimizer, int64_t total_iters = 5, double power = 1.0);
  double lr_at(size_t group, double base_lr, int64_t step) const override;

 private:
  int64_t total_iters_;
  double power_;
};

struct OneCycleLROptions {
  /// The peak rate of every group (one value), or of each group (one per
  /// group). Required: the optimizer's own rates are not used.
  std::vector<double> max_lr;
  /// Steps of the whole cycle: give it the number of optimizer steps the
  /// run takes (a scheduler step after each, Interval::kStep). Required.
  int64_t total_steps = 0;
  /// The share of the cycle spent rising to max_lr, in [0, 1].
  double pct_start = 0.3;
  /// "cos" or "linear".
  std::string anneal_strategy = "cos";
  /// The rate starts at max_lr / div_factor ...
  double div_factor = 25.0;
  /// ... and ends at max_lr / div_factor / final_div_factor.
  double final_div_factor = 1e4;
  /// Rise, fall back to the start, then fall to the end (fast.ai's
  /// schedule) instead of rise then fall.
  bool three_phase = false;
  /// Move the momentum (SGD's and RMSprop's momentum, Adam's and AdamW's
  /// first beta) opposite to the rate, between base_momentum and
  /// max_momentum.
  bool cycle_momentum = true;
  double base_momentum = 0.85;
  double max_momentum = 0.95;
};

/// PyTorch's OneCycleLR (Smith's 1cycle policy): the rate rises from
/// max_lr / div_factor to max_lr over pct_start of total_steps, then
/// anneals to its minimum, and the momentum moves the other way. A
/// scheduler step beyond total_steps is a ConfigError naming both (PyTorch's
/// ValueError). A checkpoint keeps the momentum with the other options of
/// each group, so a resume is exact.
class OneCycleLR : public ClosedFormLR {
 public:
  OneCycleLR(torch::optim::Optimizer& optimizer, OneCycleLROptions options);
  double lr_at(size_t group, double base_lr, int64_t step) const override;
  void set_other_options(int64_t step) override;
  const OneCycleLROptions& options() const { return options_; }

 private:
  enum class Level { kInitial, kMax, kMin };
  struct Phase {
    double end_step;
    Level start_lr;
    Level end_lr;
    double start_momentum;
    double end_momentum;
  };
  double level(size_t group, Level which) const;
  double anneal(double start, double end, double pct) const;
  /// The phase `step` is in, and how far along it (0 to 1; 1 in a phase of
  /// no length).
  std::pair<const Phase*, double> locate(int64_t step) const;

  OneCycleLROptions options_;
  std::vector<double> max_lrs_;
  std::vector<Phase> phases_;
};

/// Runs `schedulers` one after the other: the first until milestones[0]
/// steps, the second (from its own step 0) until milestones[1], and so on,
/// each on the optimizer's rates from before the first of them was built
/// (in any order: PyTorch's initial_lr; a warm-up then a decay:
///   SequentialLR(adam, {make_shared<LinearLR>(adam, 0.01, 1.0, 100),
///                       make_shared<CosineAnnealingLR>(adam, 900)}, {100})).
/// Give configure_optimizers only the SequentialLR: it steps them (one
/// listed there too would be stepped twice, and is refused).
class SequentialLR : public ClosedFormLR {
 public:
  SequentialLR(torch::optim::Optimizer& optimizer,
               std::vector<std::shared_ptr<ClosedFormLR>> schedulers,
               std::vector<int64_t> milestones);
  ~SequentialLR() override;
  double lr_at(size_t group, double base_lr, int64_t step) const override;
  void set_other_options(int64_t step) override;
  /// The chaining of the scheduler in charge (none at its own step 0).
  Chaining chaining_at(int64_t step) const override;
  bool sets_rates_outright() const override;
  /// Whether `scheduler` is stepped by a SequentialLR.
  static bool in_sequence(const torch::optim::LRScheduler& scheduler);

 private:
  /// The scheduler in charge at `step`, and the step in its own count.
  std::pair<ClosedFormLR*, int64_t> locate(int64_t step) const;
  /// The initial rates of the one of `schedulers` built first (the others
  /// were built on the rates it set).
  static std::optional<std::vector<double>> initial_rates(
      const std::vector<std::shared_ptr<ClosedFormLR>>& schedulers);

  std::vector<std::shared_ptr<ClosedFormLR>> schedulers_;
  std::vector<int64_t> milestones_;
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
class ReduceLROnPlateau : public Scheduler, public SchedulerState, public MonitoredScheduler {
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
