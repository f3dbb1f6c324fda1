#include "fulgur/callbacks/monitors.h"

#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <vector>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/data/batch.h"
#include "fulgur/loggers/logger.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"

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

void to_loggers(Trainer& trainer, const std::map<std::string, double>& metrics) {
  if (!trainer.strategy().is_global_zero() || metrics.empty()) return;
  for (const auto& logger : trainer.loggers()) logger->log_metrics(metrics, trainer.global_step());
}

// Every log_every_n_steps optimizer steps, once per step.
bool step_due(Trainer& trainer, int64_t& logged_step) {
  const int64_t step = trainer.global_step();
  if (step == 0 || step == logged_step || step % trainer.options().log_every_n_steps != 0) {
    return false;
  }
  logged_step = step;
  return true;
}

std::string human_count(int64_t n) {
  char buf[32];
  if (n >= 1000000000) {
    std::snprintf(buf, sizeof buf, "%.1f B", static_cast<double>(n) / 1e9);
  } else if (n >= 1000000) {
    std::snprintf(buf, sizeof buf, "%.1f M", static_cast<double>(n) / 1e6);
  } else if (n >= 1000) {
    std::snprintf(buf, sizeof buf, "%.1f K", static_cast<double>(n) / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(n));
  }
  return buf;
}

// "torch::nn::Linear" -> "Linear"; a user's class keeps its own name.
std::string short_type(const torch::nn::Module& m) {
  std::string name = m.name();
  if (name.rfind("torch::nn::", 0) == 0) name = name.substr(11);
  return name;
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
  to_loggers(trainer, metrics);
}

void LearningRateMonitor::on_train_batch_start(Trainer& trainer, Module& module, const Batch&,
                                               int64_t) {
  // The rate the coming optimizer step uses, logged at that step's index
  // when it is the log_every_n_steps-th (as PyTorch Lightning does).
  const int64_t step = trainer.global_step();
  if (options_.logging_interval != LoggingInterval::kStep || step == logged_step_ ||
      (step + 1) % trainer.options().log_every_n_steps != 0) {
    return;
  }
  logged_step_ = step;
  log(trainer, module);
}

void LearningRateMonitor::on_train_epoch_end(Trainer& trainer, Module& module) {
  if (options_.logging_interval == LoggingInterval::kEpoch) log(trainer, module);
}

ThroughputMonitor::ThroughputMonitor(ThroughputMonitorOptions options) : options_(options) {
  if (options_.window < 2) {
    throw ConfigError(str("ThroughputMonitor(window=", options_.window,
                          "): must be >= 2 (a rate needs two batch ends)."));
  }
}

void ThroughputMonitor::on_train_epoch_start(Trainer&, Module&) {
  // The time between epochs (validation, checkpoints) is not training.
  window_.clear();
}

void ThroughputMonitor::on_train_batch_end(Trainer& trainer, Module&, const at::Tensor&,
                                           const Batch& batch, int64_t) {
  window_.emplace_back(std::chrono::steady_clock::now(), batch.batch_size());
  if (static_cast<int64_t>(window_.size()) > options_.window) window_.pop_front();
  if (window_.size() >= 2) {
    const double seconds =
        std::chrono::duration<double>(window_.back().first - window_.front().first).count();
    int64_t samples = 0;
    // The first entry marks the window's start; its samples came before it.
    for (size_t i = 1; i < window_.size(); ++i) samples += window_[i].second;
    if (seconds > 0) {
      batches_per_sec_ = static_cast<double>(window_.size() - 1) / seconds;
      samples_per_sec_ = static_cast<double>(samples) * trainer.strategy().world_size() / seconds;
    }
  }
  if (batches_per_sec_ > 0 && step_due(trainer, logged_step_)) {
    to_loggers(trainer, {{"throughput/batches_per_sec", batches_per_sec_},
                         {"throughput/samples_per_sec", samples_per_sec_}});
  }
}

ModelSummary::ModelSummary(ModelSummaryOptions options) : options_(options) {
  if (options_.max_depth < 0) {
    throw ConfigError(str("ModelSummary(max_depth=", options_.max_depth,
                          "): must be >= 0 (0: the totals only)."));
  }
}

void ModelSummary::on_fit_start(Trainer& trainer, Module& module) {
  if (trainer.strategy().is_global_zero()) {
    std::cout << summarize(module, options_.max_depth) << std::flush;
  }
}

std::string ModelSummary::summarize(const torch::nn::Module& module, int max_depth) {
  struct Row {
    std::string name, type;
    int64_t params = 0, trainable = 0, bytes = 0;
  };
  auto count = [](const torch::nn::Module& m, Row& row) {
    for (const auto& p : m.parameters(/*recurse=*/true)) {
      row.params += p.numel();
      if (p.requires_grad()) row.trainable += p.numel();
      row.bytes += p.numel() * static_cast<int64_t>(p.element_size());
    }
  };
  std::vector<Row> rows;
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    const std::string& name = item.key();
    const int depth = 1 + static_cast<int>(std::count(name.begin(), name.end(), '.'));
    if (depth > max_depth) continue;
    Row row{name, short_type(*item.value())};
    count(*item.value(), row);
    rows.push_back(row);
  }
  Row total;
  count(module, total);
  size_t name_w = 4, type_w = 4;
  for (const auto& r : rows) {
    name_w = std::max(name_w, r.name.size());
    type_w = std::max(type_w, r.type.size());
  }
  std::string out;
  char line[512];
  if (!rows.empty()) {
    std::snprintf(line, sizeof line, "   | %-*s | %-*s | %9s | %-9s | %9s\n",
                  static_cast<int>(name_w), "Name", static_cast<int>(type_w), "Type", "Params",
                  "Mode", "Size (MB)");
    out += line;
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      const char* mode = r.params == 0             ? "-"
                         : r.trainable == r.params ? "trainable"
                         : r.trainable == 0        ? "frozen"
                                                   : "partly";
      std::snprintf(line, sizeof line, "%2zu | %-*s | %-*s | %9s | %-9s | %9.3f\n", i,
                    static_cast<int>(name_w), r.name.c_str(), static_cast<int>(type_w),
                    r.type.c_str(), human_count(r.params).c_str(), mode,
                    static_cast<double>(r.bytes) / 1e6);
      out += line;
    }
  }
  std::snprintf(line, sizeof line,
                "%s trainable params, %s frozen params, %s total params, %.3f MB of parameters\n",
                human_count(total.trainable).c_str(),
                human_count(total.params - total.trainable).c_str(),
                human_count(total.params).c_str(), static_cast<double>(total.bytes) / 1e6);
  out += line;
  return out;
}

}  // namespace fulgur
