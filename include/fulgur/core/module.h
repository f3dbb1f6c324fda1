// File: fulgur/core/module.h
//
// fulgur::Module is what a user writes: a torch::nn::Module that also knows
// how to train itself (the LightningModule analogue). The Trainer calls its
// steps and hooks; the Module never touches devices, ranks or files.
//
//   struct Classifier : fulgur::Module {
//     torch::nn::Linear fc{nullptr};
//     Classifier() { fc = register_module("fc", torch::nn::Linear(784, 10)); }
//     torch::Tensor training_step(fulgur::Batch& batch, int64_t) override {
//       auto& [x, y] = batch.pair();
//       auto loss = torch::nn::functional::cross_entropy(fc(x), y);
//       log("train_loss", loss, {.prog_bar = true});
//       return loss;
//     }
//     fulgur::OptimizerConfig configure_optimizers() override {
//       return {std::make_shared<torch::optim::SGD>(parameters(), 0.1)};
//     }
//   };
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "fulgur/core/gradient_clipping.h"
#include "fulgur/core/interval.h"
#include "fulgur/core/reduce_op.h"
#include "fulgur/core/state_dict.h"
#include "fulgur/data/batch.h"

namespace torch::optim {
class Optimizer;
class LRScheduler;
}  // namespace torch::optim

namespace fulgur {

class ProcessGroup;
class Trainer;
class Callback;
enum class Stage;  // fulgur/data/data_module.h
namespace metrics {
class Metric;
class MetricCollection;
}  // namespace metrics
namespace detail {
class ModuleLogSink;
class TrainerLink;
}  // namespace detail

/// Options of Module::log. Unset on_step/on_epoch take the default of the
/// hook they are logged from: training steps log per step, evaluation steps
/// per epoch (as PyTorch Lightning does).
struct LogOptions {
  std::optional<bool> on_step = std::nullopt;
  std::optional<bool> on_epoch = std::nullopt;
  /// Show in the progress output.
  bool prog_bar = false;
  /// Send to the loggers (CSV, ...).
  bool logger = true;
  /// Reduce across ranks before logging (no-op on one process): a training
  /// step's value at the step's end (a collective each step: every rank
  /// logs the same names), the epoch's value at the epoch's end.
  bool sync_dist = false;
  /// How the value is reduced over an epoch (and, with sync_dist, across ranks).
  ReduceOp reduce = ReduceOp::kMean;
  /// Weight of this value in the epoch mean; defaults to the batch's size.
  std::optional<int64_t> batch_size = std::nullopt;
};

struct SchedulerConfig {
  std::shared_ptr<torch::optim::LRScheduler> scheduler;
  /// Step after every optimizer step, or after every training epoch.
  Interval interval = Interval::kEpoch;
  /// Step every `frequency` intervals.
  int64_t frequency = 1;
  /// The metric (a name in Trainer::callback_metrics(), e.g. "val_loss") a
  /// fulgur::MonitoredScheduler such as fulgur::ReduceLROnPlateau is
  /// stepped with; required by those, refused for any other scheduler.
  std::string monitor = {};
  /// With `monitor`: when the metric has not been logged at a step, stop
  /// with an error naming the metrics there are (true), or skip the step
  /// with a note (false).
  bool strict = true;
};

/// What configure_optimizers returns: one or more optimizers, and optional
/// LR schedulers. In automatic optimization every optimizer steps after the
/// one backward of a (accumulated) batch; use manual optimization to
/// alternate between optimizers (GANs).
struct OptimizerConfig {
  OptimizerConfig() = default;
  OptimizerConfig(
      std::shared_ptr<torch::optim::Optimizer> optimizer)  // NOLINT: implicit on purpose
      : optimizers{std::move(optimizer)} {}
  OptimizerConfig(std::vector<std::shared_ptr<torch::optim::Optimizer>> opts,
                  std::vector<SchedulerConfig> scheds = {})
      : optimizers(std::move(opts)), schedulers(std::move(scheds)) {}

  std::vector<std::shared_ptr<torch::optim::Optimizer>> optimizers;
  std::vector<SchedulerConfig> schedulers;
};

/// A hyper-parameter value as saved in checkpoints and hparams.yaml.
using HParam = std::variant<bool, int64_t, double, std::string>;
using HParams = std::map<std::string, HParam>;
std::string to_string(const HParam& value);

class Module : public torch::nn::Module {
 public:
  explicit Module(std::string name = "Module");
  ~Module() override;

  // ---- Steps. The Trainer calls these with batches already on the device.
  /// One training step: returns the loss to minimise (automatic
  /// optimization), or an undefined tensor to skip this batch. Under ddp a
  /// rank may skip while others do not: the step then averages the
  /// gradients of the ranks that had a loss, and every rank takes it (when
  /// no rank had a loss, nobody steps); collectives of your own in backward
  /// hooks then run only on the ranks with a loss, and sync_batchnorm
  /// forbids it. With manual optimization it calls
  /// manual_backward/optimizer_step itself.
  virtual at::Tensor training_step(Batch& batch, int64_t batch_idx);
  /// Called when a validation loader is given; log metrics with log().
  virtual void validation_step(Batch& batch, int64_t batch_idx);
  virtual void test_step(Batch& batch, int64_t batch_idx);
  /// Returns the prediction for the batch; predict() collects them.
  virtual Batch predict_step(Batch& batch, int64_t batch_idx);
  /// The optimizers (and schedulers) of this module. Called once per fit,
  /// after configure_model() and after the module is on its device.
  virtual OptimizerConfig configure_optimizers();

  // ---- Hooks, in the order the Trainer calls them.
  /// Every stage (fit, validate, test, predict) starts with setup(stage) on
  /// every rank, after the DataModule's setup and before configure_model(),
  /// and ends with teardown(stage), also when it failed (Lightning's
  /// setup/teardown hooks): build what the stage needs, let go of it.
  virtual void setup(Stage /*stage*/) {}
  virtual void teardown(Stage /*stage*/) {}
  /// Callbacks the Module brings to every stage it runs in, after the
  /// Trainer's: one of the same type as a Trainer's callback replaces it
  /// (with a note), so a Module can bring its own ModelCheckpoint or
  /// EarlyStopping. The Trainer's list is back as it was after the stage.
  virtual std::vector<std::shared_ptr<Callback>> configure_callbacks() { return {}; }
  /// Each batch on its way to its step: on_before_batch_transfer gets the
  /// loader's batch (on the host) and returns what is moved to the device,
  /// and on_after_batch_transfer gets that on the device, on the step's
  /// stream (e.g. augmentation on the GPU), and returns what the step gets.
  /// The batch hooks keep getting the loader's batch. With
  /// prefetch_to_device the first runs one batch ahead, when the batch is
  /// put on its way; the second when its step takes it.
  virtual Batch on_before_batch_transfer(Batch batch) { return batch; }
  virtual Batch on_after_batch_transfer(Batch batch) { return batch; }
  /// Builds parts of the model that need the device or process group.
  virtual void configure_model() {}
  virtual void on_fit_start() {}
  virtual void on_fit_end() {}
  virtual void on_train_start() {}
  virtual void on_train_end() {}
  virtual void on_train_epoch_start() {}
  virtual void on_train_epoch_end() {}
  virtual void on_train_batch_start(const Batch& /*batch*/, int64_t /*batch_idx*/) {}
  /// `loss` is training_step's loss after backward, detached from its graph
  /// (in place: the tensor training_step returned is detached too).
  virtual void on_train_batch_end(const at::Tensor& /*loss*/, const Batch& /*batch*/,
                                  int64_t /*batch_idx*/) {}
  /// The evaluation hooks; `batch` is the loader's batch, as in the train
  /// batch hooks, and the batch end hooks run after the step.
  virtual void on_validation_start() {}
  virtual void on_validation_end() {}
  virtual void on_validation_epoch_start() {}
  virtual void on_validation_epoch_end() {}
  virtual void on_validation_batch_start(const Batch& /*batch*/, int64_t /*batch_idx*/) {}
  virtual void on_validation_batch_end(const Batch& /*batch*/, int64_t /*batch_idx*/) {}
  virtual void on_test_start() {}
  virtual void on_test_end() {}
  virtual void on_test_epoch_start() {}
  virtual void on_test_epoch_end() {}
  virtual void on_test_batch_start(const Batch& /*batch*/, int64_t /*batch_idx*/) {}
  virtual void on_test_batch_end(const Batch& /*batch*/, int64_t /*batch_idx*/) {}
  virtual void on_predict_start() {}
  virtual void on_predict_end() {}
  virtual void on_predict_epoch_start() {}
  virtual void on_predict_epoch_end() {}
  virtual void on_predict_batch_start(const Batch& /*batch*/, int64_t /*batch_idx*/) {}
  /// `prediction`: what predict_step returned for `batch`.
  virtual void on_predict_batch_end(const Batch& /*prediction*/, const Batch& /*batch*/,
                                    int64_t /*batch_idx*/) {}
  virtual void on_before_backward(const at::Tensor& /*loss*/) {}
  virtual void on_after_backward() {}
  virtual void on_before_optimizer_step(torch::optim::Optimizer& /*optimizer*/) {}
  virtual void on_before_zero_grad(torch::optim::Optimizer& /*optimizer*/) {}

  // ---- Steps the Trainer takes, which a Module may take its own way
  // (Lightning's). Under cuda_graph configure_gradient_clipping runs for
  // the capture only and its GPU work replays (a value it computes on the
  // host stays the captured one; it may not read a tensor back);
  // lr_scheduler_step runs on the host after every step; optimizer_zero_grad
  // does not run in captured steps (their backward writes the gradients
  // afresh).
  /// Before each optimizer step (after on_before_optimizer_step), with the
  /// Trainer's gradient_clip_val and gradient_clip_algorithm; the default
  /// clips with them (clip_gradients), and nothing when the value is unset.
  /// Override to clip otherwise: another value per optimizer, a part of the
  /// model, a schedule.
  virtual void configure_gradient_clipping(torch::optim::Optimizer& optimizer,
                                           std::optional<double> gradient_clip_val,
                                           GradientClipAlgorithm gradient_clip_algorithm);
  /// Steps a configured scheduler when its interval comes: `metric` is the
  /// monitored value of a MonitoredScheduler (SchedulerConfig::monitor),
  /// none otherwise. The default calls its step() (step(metric)).
  virtual void lr_scheduler_step(torch::optim::LRScheduler& scheduler,
                                 std::optional<double> metric);
  /// After each optimizer step (after on_before_zero_grad): the default
  /// calls optimizer.zero_grad(). `batch_idx`: the epoch's batch that
  /// stepped. (A fit's start clears what gradients a module had before it
  /// with zero_grad() itself: no step is behind that, so not this hook.)
  virtual void optimizer_zero_grad(int64_t epoch, int64_t batch_idx,
                                   torch::optim::Optimizer& optimizer);
  /// Adds user state to a checkpoint being written: `checkpoint` is the
  /// checkpoint's "module" section, empty when handed over (parameters and
  /// buffers are saved apart, under "state_dict").
  ///   void on_save_checkpoint(fulgur::StateDict& checkpoint) override {
  ///     checkpoint.set("vocabulary_size", vocabulary_size_);
  ///   }
  virtual void on_save_checkpoint(StateDict& /*checkpoint*/) {}
  /// Reads back what on_save_checkpoint added, after the parameters were
  /// loaded; called only when the checkpoint holds a "module" section. Its
  /// tensors are in host memory, whatever device saved them: move those
  /// the module keeps on a device.
  virtual void on_load_checkpoint(const StateDict& /*checkpoint*/) {}

  // ---- Logging. Valid inside steps and hooks called by the Trainer.
  /// Logs a scalar. Throws ConfigError for a non-scalar tensor or when called
  /// outside a Trainer run. A tensor is not read back when logged: it stays
  /// on its device (a GPU's: no host synchronisation in the step), and is
  /// read when a logger writes (every log_every_n_steps), when a callback
  /// or the progress bar reads callback_metrics() / progress_bar_metrics(),
  /// and once at the epoch's end for its epoch value. It is copied when
  /// logged, so changing it afterwards does not change what was logged.
  void log(std::string_view name, const at::Tensor& value, LogOptions options = {});
  void log(std::string_view name, double value, LogOptions options = {});
  /// Logs a metric's epoch value (fulgur/metrics/metric.h): computed once at
  /// the end of the epoch from the states of every rank, exact where a mean
  /// of per-rank values is not (F1, macro averages, AUROC), then the metric
  /// is reset. update() it in the steps; log it as often as you like (the
  /// last call's options count). It must live until the epoch ends (make it
  /// a member of the module). ConfigError for on_step=true (a metric is
  /// logged per epoch; log a tensor for a step's value) and for a metric
  /// that is not one number (ConfusionMatrix: compute() it yourself).
  void log(std::string_view name, metrics::Metric& metric, LogOptions options = {});
  /// log() of every metric of `collection`, each under its prefix + key.
  void log_dict(metrics::MetricCollection& collection, LogOptions options = {});

  // ---- Hyper-parameters: saved in every checkpoint and by the loggers.
  void save_hyperparameters(HParams hparams);
  const HParams& hparams() const { return hparams_; }

  // ---- Manual optimization.
  /// false: training_step does its own backward and optimizer steps.
  void set_automatic_optimization(bool value) { automatic_optimization_ = value; }
  bool automatic_optimization() const { return automatic_optimization_; }
  /// The optimizers configure_optimizers returned (available during fit).
  const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers() const;
  const std::vector<SchedulerConfig>& lr_schedulers() const;
  /// Backward through the strategy (precision, gradient sync).
  void manual_backward(const at::Tensor& loss);
  /// Clips the gradients of `optimizer`'s parameters through the strategy,
  /// by their total norm or by value: under fsdp the norm is over every
  /// rank's shards of them, a collective (every rank clips the same
  /// optimizers by norm, in the same order); under 16-mixed the gradients
  /// are unscaled first, once per step. In configure_gradient_clipping, or
  /// in a training_step under manual optimization after the step's last
  /// backward, before optimizer_step. ConfigError for a value that is not
  /// finite and > 0.
  void clip_gradients(torch::optim::Optimizer& optimizer, double gradient_clip_val,
                      GradientClipAlgorithm gradient_clip_algorithm = GradientClipAlgorithm::kNorm);
  /// Steps `optimizer` through the strategy and counts a global step.
  void optimizer_step(torch::optim::Optimizer& optimizer);
  void optimizer_step(size_t optimizer_index = 0);

  // ---- Trainer state.
  /// The Trainer running this module; throws ConfigError when not attached.
  Trainer& trainer() const;
  bool has_trainer() const { return link_ != nullptr; }
  int64_t current_epoch() const;
  int64_t global_step() const;
  /// The process group of this run's ranks, for collectives of the module's
  /// own (sharded layers, a GradientReducer of its own): available from
  /// configure_model() on, in every rank. Throws ConfigError when the
  /// strategy runs one process without a group (single_device), naming it,
  /// and DistributedError before the group exists (e.g. in the constructor).
  std::shared_ptr<ProcessGroup> process_group() const;

 private:
  /// The Trainer attaches and detaches a module through its link.
  friend class detail::TrainerLink;
  /// The Trainer's link; throws ConfigError naming this module when not
  /// attached.
  detail::TrainerLink& link() const;

  detail::TrainerLink* link_ = nullptr;
  detail::ModuleLogSink* log_sink_ = nullptr;
  HParams hparams_;
  bool automatic_optimization_ = true;
};

}  // namespace fulgur
