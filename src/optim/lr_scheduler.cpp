#include "fulgur/optim/lr_scheduler.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

#include "fulgur/core/errors.h"

namespace fulgur {

namespace {

bool finite_at_least(double value, double low) { return std::isfinite(value) && value >= low; }

void refuse_if(const char* scheduler, const std::vector<std::string>& problems) {
  if (!problems.empty()) throw ConfigError(str(scheduler, ": ", join(problems, "; ")));
}

// PyTorch's multiplicative schedules, chained: they scale every group's
// rate, one added after construction too.
constexpr ClosedFormLR::Chaining kScalesEveryGroup{.chained = true, .added_groups = true};

// Milestones must be steps of 1 or more, each after the one before.
void check_milestones(const std::vector<int64_t>& milestones, std::vector<std::string>& problems) {
  for (size_t i = 0; i < milestones.size(); ++i) {
    if (milestones[i] < 1 || (i > 0 && milestones[i] <= milestones[i - 1])) {
      std::vector<std::string> all;
      for (int64_t m : milestones) all.push_back(std::to_string(m));
      problems.push_back(str("milestones={", join(all, ", "),
                             "}: pass steps of 1 or more, each after the one before"));
      return;
    }
  }
}

}  // namespace

Scheduler::Scheduler(torch::optim::Optimizer& optimizer)
    : LRScheduler(optimizer), optimizer_(optimizer) {}

ClosedFormLR::ClosedFormLR(torch::optim::Optimizer& optimizer, Chaining chaining,
                           std::optional<std::vector<double>> base_lrs)
    : Scheduler(optimizer),
      base_lrs_(base_lrs ? std::move(*base_lrs) : get_current_lrs()),
      chaining_(chaining) {
  static std::atomic<uint64_t> built{0};
  built_ = ++built;
}

void ClosedFormLR::set_other_options(int64_t /*step*/) {}

void ClosedFormLR::start() {
  set_other_options(0);
  auto& groups = scheduled_optimizer().param_groups();
  for (size_t i = 0; i < groups.size() && i < base_lrs_.size(); ++i) {
    groups[i].options().set_lr(lr_at(i, base_lrs_[i], 0));
  }
}

std::vector<double> ClosedFormLR::get_lrs() {
  // Called by step() before it counts the step: this is step step_count_ + 1.
  const auto step = static_cast<int64_t>(step_count_) + 1;
  std::vector<double> next = get_current_lrs();
  const Chaining chaining = chaining_at(step);
  for (size_t i = 0; i < next.size(); ++i) {
    if (i < base_lrs_.size()) {
      const double to = lr_at(i, base_lrs_[i], step);
      if (!chaining.chained) {
        next[i] = to;
        continue;
      }
      // The rate it has, scaled by the schedule's change above the floor;
      // from the floor (a decay that reached 0, a cosine's trough) there
      // is no change to scale by, and the closed form applies.
      const double from = lr_at(i, base_lrs_[i], step - 1);
      const double floor = chaining.floor;
      next[i] = from != floor ? floor + (next[i] - floor) * ((to - floor) / (from - floor)) : to;
    } else if (chaining.chained && chaining.added_groups) {
      const double from = lr_at(i, 1.0, step - 1);
      if (from != 0.0) next[i] *= lr_at(i, 1.0, step) / from;
    }
  }
  // After every rate is computed: a step refused (OneCycleLR's beyond its
  // total) changes nothing.
  set_other_options(step);
  return next;
}

LambdaLR::LambdaLR(torch::optim::Optimizer& optimizer, std::function<double(int64_t)> factor)
    : ClosedFormLR(optimizer), factor_(std::move(factor)) {
  if (!factor_) {
    throw ConfigError("LambdaLR: the factor function is empty. Pass a function of the step count.");
  }
  start();
}

double LambdaLR::lr_at(size_t /*group*/, double base_lr, int64_t step) const {
  return base_lr * factor_(step);
}

StepLR::StepLR(torch::optim::Optimizer& optimizer, int64_t step_size, double gamma)
    : ClosedFormLR(optimizer, kScalesEveryGroup), step_size_(step_size), gamma_(gamma) {
  std::vector<std::string> problems;
  if (step_size_ < 1) {
    problems.push_back(str("step_size=", step_size_, ": pass the steps between decays, 1 or more"));
  }
  if (!finite_at_least(gamma_, 0.0)) {
    problems.push_back(str("gamma=", gamma_, ": pass a finite factor, 0 or more (0.1: a tenth)"));
  }
  refuse_if("StepLR", problems);
  start();
}

double StepLR::lr_at(size_t /*group*/, double base_lr, int64_t step) const {
  return base_lr * std::pow(gamma_, static_cast<double>(step / step_size_));
}

MultiStepLR::MultiStepLR(torch::optim::Optimizer& optimizer, std::vector<int64_t> milestones,
                         double gamma)
    : ClosedFormLR(optimizer, kScalesEveryGroup),
      milestones_(std::move(milestones)),
      gamma_(gamma) {
  std::vector<std::string> problems;
  if (milestones_.empty()) {
    problems.push_back("no milestones: pass the steps at which the rate decays");
  }
  check_milestones(milestones_, problems);
  if (!finite_at_least(gamma_, 0.0)) {
    problems.push_back(str("gamma=", gamma_, ": pass a finite factor, 0 or more"));
  }
  refuse_if("MultiStepLR", problems);
  start();
}

double MultiStepLR::lr_at(size_t /*group*/, double base_lr, int64_t step) const {
  const auto reached =
      std::upper_bound(milestones_.begin(), milestones_.end(), step) - milestones_.begin();
  return base_lr * std::pow(gamma_, static_cast<double>(reached));
}

ExponentialLR::ExponentialLR(torch::optim::Optimizer& optimizer, double gamma)
    : ClosedFormLR(optimizer, kScalesEveryGroup), gamma_(gamma) {
  if (!finite_at_least(gamma_, 0.0)) {
    refuse_if("ExponentialLR", {str("gamma=", gamma_, ": pass a finite factor, 0 or more")});
  }
  start();
}

double ExponentialLR::lr_at(size_t /*group*/, double base_lr, int64_t step) const {
  return base_lr * std::pow(gamma_, static_cast<double>(step));
}

namespace {

double cosine_between(double base_lr, double eta_min, double pct) {
  return eta_min + (base_lr - eta_min) * (1.0 + std::cos(M_PI * pct)) / 2.0;
}

}  // namespace

CosineAnnealingLR::CosineAnnealingLR(torch::optim::Optimizer& optimizer, int64_t t_max,
                                     double eta_min)
    : ClosedFormLR(optimizer, {.chained = true, .floor = eta_min}),
      t_max_(t_max),
      eta_min_(eta_min) {
  std::vector<std::string> problems;
  if (t_max_ < 1) {
    problems.push_back(str("t_max=", t_max_, ": pass the steps of the decay, 1 or more"));
  }
  if (!finite_at_least(eta_min_, 0.0)) {
    problems.push_back(str("eta_min=", eta_min_, ": pass the lowest rate, finite, 0 or more"));
  }
  refuse_if("CosineAnnealingLR", problems);
  start();
}

double CosineAnnealingLR::lr_at(size_t /*group*/, double base_lr, int64_t step) const {
  return cosine_between(base_lr, eta_min_, static_cast<double>(step) / static_cast<double>(t_max_));
}

CosineAnnealingWarmRestarts::CosineAnnealingWarmRestarts(torch::optim::Optimizer& optimizer,
                                                         int64_t t_0, int64_t t_mult,
                                                         double eta_min)
    : ClosedFormLR(optimizer), t_0_(t_0), t_mult_(t_mult), eta_min_(eta_min) {
  std::vector<std::string> problems;
  if (t_0_ < 1) {
    problems.push_back(str("t_0=", t_0_, ": pass the steps of the first period, 1 or more"));
  }
  if (t_mult_ < 1) {
    problems.push_back(str("t_mult=", t_mult_,
                           ": pass how many times longer each period is than the one before, "
                           "1 or more"));
  }
  if (!finite_at_least(eta_min_, 0.0)) {
    problems.push_back(str("eta_min=", eta_min_, ": pass the lowest rate, finite, 0 or more"));
  }
  refuse_if("CosineAnnealingWarmRestarts", problems);
  start();
}

double CosineAnnealingWarmRestarts::lr_at(size_t /*group*/, double base_lr, int64_t step) const {
  // The period `step` is in, counted in integers (no logarithm to round).
  int64_t t_cur = step;
  int64_t t_i = t_0_;
  if (t_mult_ == 1) {
    t_cur = step % t_0_;
  } else {
    while (t_cur >= t_i) {
      t_cur -= t_i;
      if (t_i > std::numeric_limits<int64_t>::max() / t_mult_) break;  // the last period
      t_i *= t_mult_;
    }
  }
  return cosine_between(base_lr, eta_min_, static_cast<double>(t_cur) / static_cast<double>(t_i));
}

LinearLR::LinearLR(torch::optim::Optimizer& optimizer, double start_factor, double end_factor,
                   int64_t total_iters)
    : ClosedFormLR(optimizer, kScalesEveryGroup),
      start_factor_(start_factor),
      end_factor_(end_factor),
      total_iters_(total_iters) {
  std::vector<std::string> problems;
  if (!(start_factor_ > 0.0 && start_factor_ <= 1.0)) {
    problems.push_back(str("start_factor=", start_factor_,
                           ": pass a value in (0, 1] (a rate of 0 would never train)"));
  }
  if (!(end_factor_ >= 0.0 && end_factor_ <= 1.0)) {
    problems.push_back(str("end_factor=", end_factor_, ": pass a value in [0, 1]"));
  }
  if (total_iters_ < 1) {
    problems.push_back(
        str("total_iters=", total_iters_, ": pass the steps of the ramp, 1 or more"));
  }
  refuse_if("LinearLR", problems);
  start();
}

double LinearLR::lr_at(size_t /*group*/, double base_lr, int64_t step) const {
  const double pct =
      static_cast<double>(std::min(step, total_iters_)) / static_cast<double>(total_iters_);
  return base_lr * (start_factor_ + (end_factor_ - start_factor_) * pct);
}

ConstantLR::ConstantLR(torch::optim::Optimizer& optimizer, double factor, int64_t total_iters)
    : ClosedFormLR(optimizer, kScalesEveryGroup), factor_(factor), total_iters_(total_iters) {
  std::vector<std::string> problems;
  if (!(factor_ >= 0.0 && factor_ <= 1.0)) {
    problems.push_back(str("factor=", factor_, ": pass a value in [0, 1]"));
  }
  if (total_iters_ < 0) {
    problems.push_back(
        str("total_iters=", total_iters_, ": pass the steps at the lower rate, 0 or more"));
  }
  refuse_if("ConstantLR", problems);
  start();
}

double ConstantLR::lr_at(size_t /*group*/, double base_lr, int64_t step) const {
  return step < total_iters_ ? base_lr * factor_ : base_lr;
}

PolynomialLR::PolynomialLR(torch::optim::Optimizer& optimizer, int64_t total_iters, double power)
    : ClosedFormLR(optimizer, kScalesEveryGroup), total_iters_(total_iters), power_(power) {
  std::vector<std::string> problems;
  if (total_iters_ < 1) {
    problems.push_back(
        str("total_iters=", total_iters_, ": pass the steps of the decay, 1 or more"));
  }
  if (!finite_at_least(power_, 0.0)) {
    problems.push_back(str("power=", power_, ": pass a finite power, 0 or more (1: linear)"));
  }
  refuse_if("PolynomialLR", problems);
  start();
}

double PolynomialLR::lr_at(size_t /*group*/, double base_lr, int64_t step) const {
  const double left =
      1.0 - static_cast<double>(std::min(step, total_iters_)) / static_cast<double>(total_iters_);
  return base_lr * std::pow(left, power_);
}

namespace {

/// OneCycleLR's initial rates (max_lr / div_factor of each group), for
/// ClosedFormLR's base_lrs; the options are checked afterwards.
std::vector<double> one_cycle_initial_lrs(const torch::optim::Optimizer& optimizer,
                                          const OneCycleLROptions& options) {
  std::vector<double> out;
  const size_t groups = optimizer.param_groups().size();
  for (size_t i = 0; i < groups; ++i) {
    const double max_lr = options.max_lr.size() == 1  ? options.max_lr[0]
                          : i < options.max_lr.size() ? options.max_lr[i]
                                                      : 0.0;
    out.push_back(max_lr / options.div_factor);
  }
  return out;
}

}  // namespace

OneCycleLR::OneCycleLR(torch::optim::Optimizer& optimizer, OneCycleLROptions options)
    : ClosedFormLR(optimizer, {}, one_cycle_initial_lrs(optimizer, options)),
      options_(std::move(options)) {
  const size_t groups = optimizer.param_groups().size();
  std::vector<std::string> problems;
  if (options_.max_lr.size() != 1 && options_.max_lr.size() != groups) {
    problems.push_back(str("max_lr has ", options_.max_lr.size(), " value(s) for ", groups,
                           " parameter group(s): pass one for all, or one per group"));
  }
  for (double lr : options_.max_lr) {
    if (!(std::isfinite(lr) && lr > 0.0)) {
      problems.push_back(str("max_lr=", lr, ": pass a finite peak rate above 0"));
      break;
    }
  }
  if (options_.total_steps < 1) {
    problems.push_back(str("total_steps=", options_.total_steps,
                           ": pass the optimizer steps of the run (Trainer::"
                           "estimated_stepping_batches() in configure_optimizers)"));
  }
  if (!(options_.pct_start >= 0.0 && options_.pct_start <= 1.0)) {
    problems.push_back(str("pct_start=", options_.pct_start, ": pass a share in [0, 1]"));
  }
  if (options_.anneal_strategy != "cos" && options_.anneal_strategy != "linear") {
    problems.push_back(
        str("anneal_strategy=\"", options_.anneal_strategy, "\": pass \"cos\" or \"linear\""));
  }
  if (!(std::isfinite(options_.div_factor) && options_.div_factor > 0.0)) {
    problems.push_back(str("div_factor=", options_.div_factor, ": pass a finite value above 0"));
  }
  if (!(std::isfinite(options_.final_div_factor) && options_.final_div_factor > 0.0)) {
    problems.push_back(
        str("final_div_factor=", options_.final_div_factor, ": pass a finite value above 0"));
  }
  if (options_.cycle_momentum) {
    if (!(options_.base_momentum >= 0.0 && options_.base_momentum <= options_.max_momentum &&
          options_.max_momentum < 1.0)) {
      problems.push_back(str("base_momentum=", options_.base_momentum,
                             ", max_momentum=", options_.max_momentum,
                             ": pass 0 <= base_momentum <= max_momentum < 1"));
    }
    for (size_t i = 0; i < groups; ++i) {
      const auto& group_options = optimizer.param_groups()[i].options();
      if (dynamic_cast<const torch::optim::SGDOptions*>(&group_options) == nullptr &&
          dynamic_cast<const torch::optim::RMSpropOptions*>(&group_options) == nullptr &&
          dynamic_cast<const torch::optim::AdamOptions*>(&group_options) == nullptr &&
          dynamic_cast<const torch::optim::AdamWOptions*>(&group_options) == nullptr) {
        problems.push_back(str("cycle_momentum=true, but parameter group ", i,
                               "'s optimizer has no momentum or first beta (SGD, RMSprop, Adam "
                               "and AdamW have): pass cycle_momentum=false"));
        break;
      }
    }
  }
  refuse_if("OneCycleLR", problems);

  for (size_t i = 0; i < groups; ++i) {
    max_lrs_.push_back(options_.max_lr.size() == 1 ? options_.max_lr[0] : options_.max_lr[i]);
  }
  const double total = static_cast<double>(options_.total_steps);
  const double rise_end = options_.pct_start * total - 1.0;
  const double low = options_.base_momentum;
  const double high = options_.max_momentum;
  if (options_.three_phase) {
    phases_ = {{rise_end, Level::kInitial, Level::kMax, high, low},
               {2.0 * options_.pct_start * total - 2.0, Level::kMax, Level::kInitial, low, high},
               {total - 1.0, Level::kInitial, Level::kMin, high, high}};
  } else {
    phases_ = {{rise_end, Level::kInitial, Level::kMax, high, low},
               {total - 1.0, Level::kMax, Level::kMin, low, high}};
  }
  start();
}

double OneCycleLR::level(size_t group, Level which) const {
  const double initial = base_lrs()[group];
  switch (which) {
    case Level::kInitial: return initial;
    case Level::kMax: return max_lrs_[group];
    case Level::kMin: return initial / options_.final_div_factor;
  }
  return initial;
}

double OneCycleLR::anneal(double start, double end, double pct) const {
  if (options_.anneal_strategy == "linear") return (end - start) * pct + start;
  return end + (start - end) / 2.0 * (std::cos(M_PI * pct) + 1.0);
}

std::pair<const OneCycleLR::Phase*, double> OneCycleLR::locate(int64_t step) const {
  if (step > options_.total_steps) {
    throw ConfigError(str("OneCycleLR: scheduler step ", step,
                          " is beyond total_steps=", options_.total_steps,
                          ": the cycle is over. Pass total_steps of at least the optimizer "
                          "steps of the run (Trainer::estimated_stepping_batches()), or step "
                          "the scheduler once per optimizer step (Interval::kStep, "
                          "frequency 1)."));
  }
  const auto s = static_cast<double>(step);
  double start_step = 0.0;
  for (size_t i = 0; i < phases_.size(); ++i) {
    const Phase& phase = phases_[i];
    if (s <= phase.end_step || i + 1 == phases_.size()) {
      const double length = phase.end_step - start_step;
      // A phase of no length (pct_start x total_steps = 1) is its end.
      return {&phase, length > 0.0 ? (s - start_step) / length : 1.0};
    }
    start_step = phase.end_step;
  }
  return {&phases_.back(), 1.0};
}

double OneCycleLR::lr_at(size_t group, double /*base_lr*/, int64_t step) const {
  const auto [phase, pct] = locate(step);
  return anneal(level(group, phase->start_lr), level(group, phase->end_lr), pct);
}

void OneCycleLR::set_other_options(int64_t step) {
  if (!options_.cycle_momentum) return;
  const auto [phase, pct] = locate(step);
  const double momentum = anneal(phase->start_momentum, phase->end_momentum, pct);
  auto& groups = scheduled_optimizer().param_groups();
  for (size_t i = 0; i < groups.size() && i < max_lrs_.size(); ++i) {
    auto& options = groups[i].options();
    if (auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
      sgd->momentum(momentum);
    } else if (auto* rmsprop = dynamic_cast<torch::optim::RMSpropOptions*>(&options)) {
      rmsprop->momentum(momentum);
    } else if (auto* adam = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
      adam->betas({momentum, std::get<1>(adam->betas())});
    } else if (auto* adamw = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
      adamw->betas({momentum, std::get<1>(adamw->betas())});
    }
  }
}

SequentialLR::SequentialLR(torch::optim::Optimizer& optimizer,
                           std::vector<std::shared_ptr<ClosedFormLR>> schedulers,
                           std::vector<int64_t> milestones)
    : ClosedFormLR(optimizer, {}, initial_rates(schedulers)),
      schedulers_(std::move(schedulers)),
      milestones_(std::move(milestones)) {
  std::vector<std::string> problems;
  if (schedulers_.empty()) problems.push_back("no schedulers: pass the schedules to run in turn");
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    const auto& scheduler = schedulers_[i];
    if (!scheduler) {
      problems.push_back(str("scheduler ", i, " is null"));
    } else if (&scheduler->optimizer() != &optimizer) {
      problems.push_back(
          str("scheduler ", i, " schedules another optimizer: build every one on this one"));
    } else if (scheduler->sequence_ != nullptr) {
      problems.push_back(str("scheduler ", i, " is already in another SequentialLR"));
    } else if (dynamic_cast<const SequentialLR*>(scheduler.get()) != nullptr) {
      problems.push_back(str("scheduler ", i, " is a SequentialLR: list its schedulers instead"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (scheduler && schedulers_[j] == scheduler) {
        problems.push_back(str("schedulers ", j, " and ", i, " are the same object"));
      }
    }
  }
  if (!schedulers_.empty() && milestones_.size() + 1 != schedulers_.size()) {
    problems.push_back(str(milestones_.size(), " milestone(s) for ", schedulers_.size(),
                           " schedulers: pass one fewer milestone than schedulers (the step "
                           "each one after the first takes over)"));
  }
  check_milestones(milestones_, problems);
  refuse_if("SequentialLR", problems);
  for (auto& scheduler : schedulers_) scheduler->sequence_ = this;
  start();
}

SequentialLR::~SequentialLR() {
  for (auto& scheduler : schedulers_) {
    if (scheduler && scheduler->sequence_ == this) scheduler->sequence_ = nullptr;
  }
}

bool SequentialLR::sets_rates_outright() const {
  return std::any_of(schedulers_.begin(), schedulers_.end(),
                     [](const auto& scheduler) { return scheduler->sets_rates_outright(); });
}

ClosedFormLR::Chaining SequentialLR::chaining_at(int64_t step) const {
  // Each scheduler starts from its own step 0 at its milestone, set
  // outright on the first one's initial rates (PyTorch's step(0)).
  const auto [scheduler, local] = locate(step);
  return local == 0 ? Chaining{} : scheduler->chaining_at(local);
}

std::optional<std::vector<double>> SequentialLR::initial_rates(
    const std::vector<std::shared_ptr<ClosedFormLR>>& schedulers) {
  const ClosedFormLR* first = nullptr;
  for (const auto& scheduler : schedulers) {
    if (scheduler && (first == nullptr || scheduler->built_ < first->built_)) {
      first = scheduler.get();
    }
  }
  if (first == nullptr) return std::nullopt;
  return first->base_lrs();
}

bool SequentialLR::in_sequence(const torch::optim::LRScheduler& scheduler) {
  const auto* closed = dynamic_cast<const ClosedFormLR*>(&scheduler);
  return closed != nullptr && closed->sequence_ != nullptr;
}

std::pair<ClosedFormLR*, int64_t> SequentialLR::locate(int64_t step) const {
  const auto index = static_cast<size_t>(
      std::upper_bound(milestones_.begin(), milestones_.end(), step) - milestones_.begin());
  const int64_t local = index == 0 ? step : step - milestones_[index - 1];
  return {schedulers_[index].get(), local};
}

double SequentialLR::lr_at(size_t group, double base_lr, int64_t step) const {
  const auto [scheduler, local] = locate(step);
  return scheduler->lr_at(group, base_lr, local);
}

void SequentialLR::set_other_options(int64_t step) {
  const auto [scheduler, local] = locate(step);
  scheduler->set_other_options(local);
}

ReduceLROnPlateau::ReduceLROnPlateau(torch::optim::Optimizer& optimizer,
                                     ReduceLROnPlateauOptions options)
    : Scheduler(optimizer), options_(std::move(options)) {
  std::vector<std::string> problems;
  if (options_.mode != "min" && options_.mode != "max") {
    problems.push_back(str("mode=\"", options_.mode, "\": pass \"min\" or \"max\""));
  }
  if (options_.threshold_mode != "rel" && options_.threshold_mode != "abs") {
    problems.push_back(
        str("threshold_mode=\"", options_.threshold_mode, "\": pass \"rel\" or \"abs\""));
  }
  if (!(options_.factor > 0.0 && options_.factor < 1.0)) {
    problems.push_back(str("factor=", options_.factor, ": pass a value in (0, 1)"));
  }
  if (options_.patience < 0) {
    problems.push_back(str("patience=", options_.patience, ": pass 0 or more"));
  }
  if (options_.cooldown < 0) {
    problems.push_back(str("cooldown=", options_.cooldown, ": pass 0 or more"));
  }
  if (!(options_.min_lr >= 0.0)) {
    problems.push_back(str("min_lr=", options_.min_lr, ": pass 0 or more"));
  }
  if (!problems.empty()) throw ConfigError(str("ReduceLROnPlateau: ", join(problems, "; ")));
  best_ = options_.mode == "min" ? std::numeric_limits<double>::infinity()
                                 : -std::numeric_limits<double>::infinity();
}

bool ReduceLROnPlateau::is_better(double value) const {
  const bool rel = options_.threshold_mode == "rel";
  if (options_.mode == "min") {
    return value < (rel ? best_ * (1.0 - options_.threshold) : best_ - options_.threshold);
  }
  return value > (rel ? best_ * (1.0 + options_.threshold) : best_ + options_.threshold);
}

void ReduceLROnPlateau::step(double value) {
  if (std::isnan(value)) {
    // NaN is never better; it counts as a step without improvement.
    ++num_bad_steps_;
  } else if (is_better(value)) {
    best_ = value;
    num_bad_steps_ = 0;
  } else {
    ++num_bad_steps_;
  }
  if (cooldown_counter_ > 0) {
    --cooldown_counter_;
    num_bad_steps_ = 0;
  }
  next_lrs_ = get_current_lrs();
  if (num_bad_steps_ > options_.patience) {
    for (double& lr : next_lrs_) {
      const double reduced = std::max(lr * options_.factor, options_.min_lr);
      if (lr - reduced > options_.eps) lr = reduced;
    }
    cooldown_counter_ = options_.cooldown;
    num_bad_steps_ = 0;
  }
  LRScheduler::step();
}

std::vector<double> ReduceLROnPlateau::get_lrs() {
  // Only step(value) decides; a plain LRScheduler::step() keeps the rates.
  if (next_lrs_.empty()) return get_current_lrs();
  auto lrs = std::move(next_lrs_);
  next_lrs_.clear();
  return lrs;
}

StateDict ReduceLROnPlateau::state_dict() const {
  StateDict state;
  state.set("best", best_);
  state.set("num_bad_steps", num_bad_steps_);
  state.set("cooldown_counter", cooldown_counter_);
  return state;
}

void ReduceLROnPlateau::load_state_dict(const StateDict& state) {
  const c10::IValue* best = state.find("best");
  const c10::IValue* bad = state.find("num_bad_steps");
  const c10::IValue* cooldown = state.find("cooldown_counter");
  if (best == nullptr || !best->isDouble() || bad == nullptr || !bad->isInt() ||
      cooldown == nullptr || !cooldown->isInt()) {
    throw CheckpointError(str(
        "ReduceLROnPlateau: the checkpoint's scheduler state",
        state.path().empty() ? "" : " (\"" + state.path() + "\")",
        " lacks best (a number), num_bad_steps or cooldown_counter (integers); it holds ",
        state.empty() ? std::string("nothing") : join(state.keys()),
        ". Resume from a checkpoint written with this scheduler."));
  }
  // Assigned together: a state that does not fit leaves the scheduler as it was.
  best_ = best->toDouble();
  num_bad_steps_ = bad->toInt();
  cooldown_counter_ = cooldown->toInt();
}

}  // namespace fulgur
