// Private: the Trainer's state and loops, shared by the trainer/*.cpp files
// and Module (log, manual optimization). Not installed.
#pragma once

#include "fulgur/strategies/launchers/launcher.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fulgur/callbacks/callback.h"
#include "fulgur/core/module.h"
#include "fulgur/data/data_loader.h"
#include "fulgur/loggers/logger.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/connectors/accelerator_connector.h"
#include "fulgur/trainer/trainer.h"

namespace fulgur {
namespace detail {

/// Collects what a Module logs during one loop (training or evaluation):
/// step values, and epoch aggregates weighted by batch size.
class LogSink {
 public:
  struct Entry {
    LogOptions options;
    bool on_step = false;
    bool on_epoch = false;
    double step_value = 0.0;
    bool step_fresh = false;  // logged since the last collect_step()
    double epoch_sum = 0.0;   // mean: weighted sum; sum: sum; max/min: extreme
    double epoch_weight = 0.0;
    bool epoch_has_value = false;
  };

  /// Defaults for unset on_step/on_epoch: per step inside training_step,
  /// per epoch everywhere else (evaluation steps, epoch hooks).
  void set_context(bool training_step, int64_t batch_size) {
    in_step_ = training_step;
    batch_size_ = batch_size;
  }
  void log(std::string_view name, double value, const LogOptions& options);

  /// A value ready to publish, under its published name.
  struct Value {
    std::string name;
    double value;
    bool logger;
    bool prog_bar;
  };
  /// Values logged with on_step since clear_step_flags(): name, or
  /// name_step when the metric is also aggregated per epoch.
  /// The vector is the sink's own, reused from step to step (no allocation
  /// in steady state); valid until the next call.
  const std::vector<Value>& collect_step();
  void clear_step_flags();
  /// Epoch aggregates: name, or name_epoch when also logged per step.
  /// Reduces sync_dist metrics across ranks (a collective: every rank calls).
  std::vector<Value> collect_epoch(Strategy& strategy) const;
  void reset() { entries_.clear(); }
  bool empty() const { return entries_.empty(); }

 private:
  std::map<std::string, Entry, std::less<>> entries_;
  std::vector<Value> step_values_;
  bool in_step_ = true;
  int64_t batch_size_ = 1;
};

}  // namespace detail

struct Trainer::Impl {
  explicit Impl(Trainer& self, TrainerOptions options);

  Trainer& self;
  TrainerOptions options;
  std::shared_ptr<Strategy> strategy;
  Resolution resolution;  // the connector's choices, with the Trainer's notes added
  std::vector<std::shared_ptr<Callback>> callbacks;
  std::vector<std::shared_ptr<Logger>> loggers;
  ModelCheckpoint* checkpoint_callback = nullptr;

  // Resolved loop flags.
  int64_t max_epochs = 1000;  // -1: unlimited
  int64_t max_steps = -1;
  BatchLimit limit_train = 1.0, limit_val = 1.0, limit_test = 1.0, limit_predict = 1.0;
  int64_t num_sanity_val_steps = 2;

  // Run state.
  Module* module = nullptr;
  Stage stage = Stage::Fit;
  bool sanity_checking = false;
  bool training = false;
  int64_t current_epoch = 0;
  int64_t global_step = 0;
  int64_t batch_idx = 0;
  int64_t batch_position = 0;  // training batches done in the current epoch
  int64_t batches_that_stepped = 0;
  // An earlier micro-batch of the current accumulation window ran backward.
  bool window_has_gradient = false;
  int64_t num_training_batches = -1;
  bool should_stop = false;
  std::string stop_reason;
  bool in_epoch_end = false;          // checkpoints taken now resume at the next epoch
  int64_t validated_at_position = -1;  // batch position of the last in-epoch validation
  std::shared_ptr<DataLoader> train_loader;
  std::shared_ptr<DataLoader> val_loader;
  OptimizerConfig optimizer_config;
  Metrics callback_metrics;
  Metrics progress_bar_metrics;
  detail::LogSink train_log;
  detail::LogSink eval_log;

  // ---- Entry points (trainer.cpp).
  FitResult run_fit(Module& module, std::shared_ptr<DataLoader> train,
                    std::shared_ptr<DataLoader> val, DataModule* data, const FitOptions& fit);
  Metrics run_evaluation(Module& module, std::shared_ptr<DataLoader> loader, DataModule* data,
                         Stage stage, const std::string& ckpt_path);
  std::vector<Batch> run_predict(Module& module, std::shared_ptr<DataLoader> loader,
                                 DataModule* data, const std::string& ckpt_path);
  /// Attaches the module, runs `body` (through the launcher when there is
  /// one), and always detaches and tears down.
  void run_stage(Module& module, Stage stage, const std::function<void()>& body,
                 const LaunchResults& results = {});
  /// How a forked run's rank 0 returns the fit's results and weights.
  LaunchResults fit_results(Module& module, FitResult& result);
  /// Splits `loader` across the ranks (train: `even`, padded; evaluation:
  /// exact) unless use_distributed_sampler is off or there is one rank.
  void distribute(DataLoader& loader, bool even, const char* which);

  // ---- Fit loop (fit_loop.cpp).
  void fit_loop();
  void train_epoch();
  void training_batch(Batch& batch, int64_t batch_idx, bool is_last_batch);
  void automatic_step(Batch& batch, int64_t batch_idx, bool should_step);
  void step_optimizers();
  void step_schedulers(Interval interval);
  bool should_validate_now(int64_t position, bool is_last_batch) const;
  void run_validation(bool sanity);
  bool stop_requested_by_limits(bool boundary);
  /// DataModule::prepare_data() on each node's local rank 0, a barrier, then
  /// setup(s) on every rank.
  void prepare_and_set_up(DataModule& data, Stage s);
  void manual_backward(Module& module, const at::Tensor& loss);
  void manual_optimizer_step(Module& module, torch::optim::Optimizer& optimizer);

  // ---- Evaluation (evaluation_loop.cpp).
  /// Runs `limit` batches of `loader` through the module's step for `stage`.
  Metrics evaluation_epoch(DataLoader& loader, Stage stage, std::optional<int64_t> limit);
  std::vector<Batch> prediction_epoch(DataLoader& loader, std::optional<int64_t> limit);

  // ---- Checkpoints (checkpointing.cpp).
  void dump_checkpoint(torch::serialize::OutputArchive& archive);
  void save_checkpoint(const std::string& path);
  /// Loads `path` into the module (weights only when `full` is false).
  void restore_checkpoint(const std::string& path, bool full);
  std::string resolve_ckpt_path(const std::string& ckpt_path) const;
  /// Every callback's state under "callbacks", one archive per state_key()
  /// (checkpoints, and a forked run's results); loading skips callbacks the
  /// archive has no state for.
  void save_callback_states(torch::serialize::OutputArchive& archive);
  void load_callback_states(torch::serialize::InputArchive& archive);

  // ---- Logging (logging.cpp).
  void publish_step_metrics();
  /// Publishes the sink's epoch aggregates and returns them.
  Metrics publish_epoch_metrics(detail::LogSink& sink);
  /// Sets callback/progress-bar metrics; `base` is the name without its
  /// _step/_epoch suffix, which follows the latest value too.
  void publish(const std::vector<detail::LogSink::Value>& values, const char* suffix,
               bool to_loggers);

  // ---- Hook dispatch: the Module's hook first, then every callback's.
  template <class ModuleHook, class CallbackHook>
  void call_hooks(ModuleHook module_hook, CallbackHook callback_hook) {
    module_hook(*module);
    for (auto& cb : callbacks) callback_hook(*cb);
  }
  std::string root_dir() const;
};

}  // namespace fulgur
