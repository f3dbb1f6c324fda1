#include "fulgur/core/module.h"

#include <torch/torch.h>

#include <cmath>

#include "fulgur/core/errors.h"
#include "fulgur/core/monitored_scheduler.h"
#include "core/module_log_sink.h"
#include "core/trainer_link.h"

namespace fulgur {

std::string to_string(const HParam& value) {
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, bool>) {
          return v ? "true" : "false";
        } else if constexpr (std::is_same_v<T, std::string>) {
          return v;
        } else {
          return str(v);
        }
      },
      value);
}

Module::Module(std::string name) : torch::nn::Module(std::move(name)) {}
Module::~Module() = default;

at::Tensor Module::training_step(Batch&, int64_t) {
  throw ConfigError(str("Trainer.fit(", name(),
                        "): the Module does not override training_step(batch, batch_idx). "
                        "Override it to return the loss of one batch."));
}

void Module::validation_step(Batch&, int64_t) {
  throw ConfigError(str(name(),
                        ": a validation loader was given but the Module does not override "
                        "validation_step(batch, batch_idx). Override it, or pass no validation "
                        "loader (or limit_val_batches = 0)."));
}

void Module::test_step(Batch&, int64_t) {
  throw ConfigError(str("Trainer.test(", name(),
                        "): the Module does not override test_step(batch, batch_idx). "
                        "Override it to log test metrics."));
}

Batch Module::predict_step(Batch&, int64_t) {
  throw ConfigError(str("Trainer.predict(", name(),
                        "): the Module does not override predict_step(batch, batch_idx). "
                        "Override it to return the prediction of one batch."));
}

OptimizerConfig Module::configure_optimizers() {
  throw ConfigError(str("Trainer.fit(", name(),
                        "): the Module does not override configure_optimizers(). Override it "
                        "to return the optimizer(s), e.g. "
                        "`return {std::make_shared<torch::optim::SGD>(parameters(), 0.1)};`."));
}

namespace {

// The sink of the running loop; none outside a Trainer run.
detail::ModuleLogSink& attached_sink(detail::ModuleLogSink* sink, std::string_view name) {
  if (sink == nullptr) {
    throw ConfigError(str("log(\"", name,
                          "\"): called outside a Trainer run. Log from "
                          "training_step, validation_step, test_step or a hook the Trainer "
                          "calls."));
  }
  return *sink;
}

}  // namespace

void Module::log(std::string_view name, const at::Tensor& value, LogOptions options) {
  if (!value.defined() || value.numel() != 1) {
    throw ConfigError(str("log(\"", name, "\", tensor of shape ",
                          value.defined() ? c10::str(value.sizes()) : std::string("undefined"),
                          "): only scalars can be logged. Reduce it first, e.g. "
                          "value.mean()."));
  }
  if (value.is_complex()) {
    throw ConfigError(str("log(\"", name, "\", tensor of dtype ",
                          c10::toString(value.scalar_type()),
                          "): only real numbers can be logged. Log value.abs() or value.real()."));
  }
  // Kept on its device, read back only when a logger, the progress bar or
  // a callback needs the number.
  attached_sink(log_sink_, name).log(name, value, options);
}

void Module::log(std::string_view name, double value, LogOptions options) {
  attached_sink(log_sink_, name).log(name, value, options);
}

void Module::log(std::string_view name, metrics::Metric& metric, LogOptions options) {
  attached_sink(log_sink_, name).log(name, metric, options);
}

void Module::log_dict(metrics::MetricCollection& collection, LogOptions options) {
  attached_sink(log_sink_, "a MetricCollection").log_dict(collection, options);
}

void Module::save_hyperparameters(HParams hparams) {
  for (auto& [k, v] : hparams) hparams_.insert_or_assign(k, std::move(v));
}

Trainer& Module::trainer() const { return link().trainer(); }

detail::TrainerLink& Module::link() const {
  if (link_ == nullptr) {
    throw ConfigError(str(name(),
                          ".trainer(): this Module is not attached to a Trainer. "
                          "trainer() is available inside fit/validate/test/predict."));
  }
  return *link_;
}

int64_t Module::current_epoch() const { return link_ ? link_->current_epoch() : 0; }
int64_t Module::global_step() const { return link_ ? link_->global_step() : 0; }

const std::vector<std::shared_ptr<torch::optim::Optimizer>>& Module::optimizers() const {
  return link().configured_optimizers().optimizers;
}

const std::vector<SchedulerConfig>& Module::lr_schedulers() const {
  return link().configured_optimizers().schedulers;
}

std::shared_ptr<ProcessGroup> Module::process_group() const {
  const detail::TrainerLink& run = link();
  // DistributedError, naming the strategy, before the group exists.
  std::shared_ptr<ProcessGroup> group = run.process_group();
  if (group == nullptr) {
    throw ConfigError(str(name(), ".process_group(): strategy \"", run.strategy_name(),
                          "\" runs one process and has no process group. Pass a parallel "
                          "strategy (e.g. strategy=\"ddp\" or \"manual\") for collectives of "
                          "the module's own."));
  }
  return group;
}

void Module::manual_backward(const at::Tensor& loss) { link().manual_backward(*this, loss); }

void Module::optimizer_step(torch::optim::Optimizer& optimizer) {
  link().manual_optimizer_step(*this, optimizer);
}

void Module::clip_gradients(torch::optim::Optimizer& optimizer, double gradient_clip_val,
                            GradientClipAlgorithm gradient_clip_algorithm) {
  if (!(std::isfinite(gradient_clip_val) && gradient_clip_val > 0.0)) {
    throw ConfigError(str("clip_gradients(gradient_clip_val=", gradient_clip_val,
                          "): pass a finite value > 0 (the largest norm, or element, allowed)."));
  }
  link().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm);
}

void Module::configure_gradient_clipping(torch::optim::Optimizer& optimizer,
                                         std::optional<double> gradient_clip_val,
                                         GradientClipAlgorithm gradient_clip_algorithm) {
  if (gradient_clip_val && *gradient_clip_val > 0.0) {
    clip_gradients(optimizer, *gradient_clip_val, gradient_clip_algorithm);
  }
}

void Module::lr_scheduler_step(torch::optim::LRScheduler& scheduler, std::optional<double> metric) {
  auto* monitored = dynamic_cast<MonitoredScheduler*>(&scheduler);
  if (!metric) {
    if (monitored != nullptr) {
      throw ConfigError(str(name(),
                            ".lr_scheduler_step: no metric for a scheduler stepped with "
                            "one (a fulgur::MonitoredScheduler, such as "
                            "ReduceLROnPlateau). Pass its metric's value (its "
                            "SchedulerConfig names it in monitor)."));
    }
    scheduler.step();
    return;
  }
  if (monitored == nullptr) {
    throw ConfigError(str(name(), ".lr_scheduler_step: a metric (", *metric,
                          ") for a scheduler that steps without one (not a "
                          "fulgur::MonitoredScheduler). Step it with step(), or give its "
                          "SchedulerConfig no monitor."));
  }
  monitored->step(*metric);
}

void Module::optimizer_zero_grad(int64_t /*epoch*/, int64_t /*batch_idx*/,
                                 torch::optim::Optimizer& optimizer) {
  optimizer.zero_grad();
}

void Module::optimizer_step(size_t optimizer_index) {
  const auto& opts = optimizers();
  if (optimizer_index >= opts.size()) {
    throw ConfigError(str("optimizer_step(", optimizer_index, "): configure_optimizers returned ",
                          opts.size(), " optimizer(s); pass an index below ", opts.size(), "."));
  }
  optimizer_step(*opts[optimizer_index]);
}

}  // namespace fulgur
