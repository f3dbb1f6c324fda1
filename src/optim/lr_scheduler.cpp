#include "fulgur/optim/lr_scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "fulgur/core/errors.h"

namespace fulgur {

LambdaLR::LambdaLR(torch::optim::Optimizer& optimizer, std::function<double(int64_t)> factor)
    : LRScheduler(optimizer), factor_(std::move(factor)) {
  if (!factor_) {
    throw ConfigError("LambdaLR: the factor function is empty. Pass a function of the step count.");
  }
  base_lrs_ = get_current_lrs();
  const double f0 = factor_(0);
  for (size_t i = 0; i < optimizer.param_groups().size(); ++i) {
    optimizer.param_groups()[i].options().set_lr(base_lrs_[i] * f0);
  }
}

std::vector<double> LambdaLR::get_lrs() {
  // Called by step() before it counts the step: this is step step_count_ + 1.
  const double f = factor_(static_cast<int64_t>(step_count_) + 1);
  // A group added after construction (BaseFinetuning's) keeps the rate
  // it has, as PyTorch's LambdaLR leaves it.
  std::vector<double> lrs = get_current_lrs();
  for (size_t i = 0; i < lrs.size() && i < base_lrs_.size(); ++i) lrs[i] = base_lrs_[i] * f;
  return lrs;
}

ReduceLROnPlateau::ReduceLROnPlateau(torch::optim::Optimizer& optimizer,
                                     ReduceLROnPlateauOptions options)
    : LRScheduler(optimizer), options_(std::move(options)) {
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
