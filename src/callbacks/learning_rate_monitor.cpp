#include "fulgur/callbacks/learning_rate_monitor.h"

#include <torch/torch.h>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/data/batch.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"
#include "callbacks/log_support.h"

namespace fulgur {

namespace {

// "SGD", "Adam", ... for the metric names.
std::string optimizer_name(const torch::optim::Optimizer& o) {
  if (dynamic_cast<const torch::optim::SGD*>(&o)) return "SGD";
  if (dynamic_cast<const torch::optim::AdamW*>(&o)) return "AdamW";
  if (dynamic_cast<const torch::optim::Adam*>(&o)) return "Adam";
  if (dynamic_cast<const torch::optim::RMSprop*>(&o)) return "RMSprop";
  if (dynamic_cast<const torch::optim::Adagrad*>(&o)) return "Adagrad";
  if (dynamic_cast<const torch::optim::LBFGS*>(&o)) return "LBFGS";
  return "Optimizer";
}

std::optional<double> momentum_of(const torch::optim::OptimizerOptions& options) {
  if (auto* sgd = dynamic_cast<const torch::optim::SGDOptions*>(&options)) return sgd->momentum();
  if (auto* adamw = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    return std::get<0>(adamw->betas());
  }
  if (auto* adam = dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
    return std::get<0>(adam->betas());
  }
  if (auto* rms = dynamic_cast<const torch::optim::RMSpropOptions*>(&options)) {
    return rms->momentum();
  }
  return std::nullopt;
}

}  // namespace

LearningRateMonitor::LearningRateMonitor(LearningRateMonitorOptions options)
    : options_(std::move(options)) {
  if (!options_.logging_interval.is_valid()) {
    throw ConfigError(str("LearningRateMonitor(logging_interval=\"",
                          options_.logging_interval.text(), "\"): pass ",
                          options_.logging_interval.spellings(), "."));
  }
}

void LearningRateMonitor::log(Trainer& trainer, Module& module) {
  std::map<std::string, double> metrics;
  std::map<std::string, int> seen;
  for (const auto& optimizer : module.optimizers()) {
    std::string name = "lr-" + optimizer_name(*optimizer);
    if (int n = seen[name]++; n > 0) name += "-" + std::to_string(n);
    const auto& groups = optimizer->param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      const std::string key = groups.size() > 1 ? str(name, "/pg", g + 1) : name;
      metrics[key] = groups[g].options().get_lr();
      if (options_.log_momentum) {
        if (auto m = momentum_of(groups[g].options())) {
          metrics["momentum-" + key.substr(3)] = *m;
        }
      }
    }
  }
  last_ = metrics;
  detail::log_to_loggers(trainer, metrics);
}

void LearningRateMonitor::setup(Trainer& trainer, Module&, Stage stage) {
  detail::require_logger_to_fit(trainer, stage, "LearningRateMonitor", "the learning rates");
}

void LearningRateMonitor::on_train_start(Trainer&, Module&) { logged_ = -1; }

void LearningRateMonitor::on_train_batch_start(Trainer& trainer, Module& module, const Batch&,
                                               int64_t) {
  // The rate the coming optimizer step uses, logged at that step's index
  // at the loggers' cadence (as PyTorch Lightning does).
  if (options_.logging_interval == Interval::kStep &&
      detail::due_at_train_batch_start(trainer, logged_)) {
    log(trainer, module);
  }
}

void LearningRateMonitor::on_train_epoch_start(Trainer& trainer, Module& module) {
  // The rate the epoch's steps use (an epoch-interval scheduler stepped
  // after the last epoch's end), at its first step's index.
  if (options_.logging_interval == Interval::kEpoch) log(trainer, module);
}

}  // namespace fulgur
