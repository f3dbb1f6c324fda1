// Private: the logger connector. What a Module logs goes into a LogSink
// (one for training, one for evaluation); the connector publishes it to the
// callback metrics, the progress bar's metrics and the loggers, and owns all
// of them. Not installed.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "fulgur/core/module.h"
#include "fulgur/core/state_dict.h"
#include "fulgur/loggers/logger.h"
#include "fulgur/trainer/trainer.h"
#include "core/module_log_sink.h"
#include "utilities/host_copy.h"

namespace fulgur {

class Strategy;

namespace detail {

/// `metrics` in `state` under `key` (key.names, key.values): what rank 0 of
/// a forked run sends back, and the callback metrics in a checkpoint.
void write_metrics(StateDict& state, const std::string& key, const Metrics& metrics);
/// What write_metrics wrote: CheckpointError where the names and values
/// differ in number (StateDict's own errors name a missing or mistyped
/// entry).
Metrics read_metrics(const StateDict& state, const std::string& key);
/// `metrics` as bytes for a collective (Strategy::values_where_they_differ),
/// and back: the names and every value's bits.
std::string metrics_bytes(const Metrics& metrics);
Metrics metrics_from_bytes(const std::string& bytes);

/// Collects what a Module logs during one loop (training or evaluation):
/// step values, and epoch aggregates weighted by batch size.
///
/// A tensor logged stays where it is: its step value is copied into a
/// buffer on its device and its epoch aggregate accumulated there, with no
/// read-back (on a GPU, no host synchronisation per step). The number is
/// read when something needs it: a logger's row (every log_every_n_steps),
/// callback_metrics() or progress_bar_metrics() (a callback, the progress
/// bar's refresh), the epoch's end.
class LogSink final : public ModuleLogSink {
 public:
  struct Entry {
    LogOptions options;
    bool on_step = false;
    bool on_epoch = false;
    double step_value = 0.0;
    at::Tensor step_tensor;   // defined: the step value is this (unread) tensor
    bool step_fresh = false;  // logged since the last clear_step_flags()
    // This step's value is reduced and in the callback metrics (logged
    // again since: not).
    bool step_published = false;
    bool step_in_row = false;  // this step's value went to the loggers
    double epoch_sum = 0.0;   // mean: weighted sum; sum: sum; max/min: extreme
    at::Tensor epoch_tensor;  // defined: epoch_sum lives here (float64, the values' device)
    double epoch_weight = 0.0;
    bool epoch_has_value = false;
    /// Logged as a metric: its epoch value is computed from its states.
    metrics::Metric* metric = nullptr;
  };

  /// An evaluation's sink: its values are published per epoch only, so a
  /// value logged per step only is refused (it went nowhere).
  explicit LogSink(bool publishes_steps = true) : publishes_steps_(publishes_steps) {}

  /// Defaults for unset on_step/on_epoch: per step inside training_step,
  /// per epoch everywhere else (evaluation steps, epoch hooks).
  void set_context(bool training_step, int64_t batch_size) {
    in_step_ = training_step;
    batch_size_ = batch_size;
    if (training_step) stepped_since_restore_ = true;
  }
  void log(std::string_view name, double value, const LogOptions& options) override;
  /// `value` has one element; it is not read here.
  void log(std::string_view name, const at::Tensor& value, const LogOptions& options) override;
  void log(std::string_view name, metrics::Metric& metric, const LogOptions& options) override;
  void log_dict(metrics::MetricCollection& collection, const LogOptions& options) override;

  /// A value ready to publish, under its published name.
  struct Value {
    std::string name;
    double value;
    at::Tensor tensor;  // defined: the value is this tensor's, not yet read
    bool logger;
    bool prog_bar;
    /// An epoch mean whose batch sizes added up to 0 (on every rank): nan.
    bool weightless = false;
    double read() const;
  };
  /// Values logged with on_step since clear_step_flags() (name, or
  /// name_step when the metric is also aggregated per epoch) that are not
  /// published yet this step (kToPublish) or not in a row to the loggers
  /// yet (kToRow; kPublishedToRow: of those, the published ones, reduced
  /// across ranks where they are); they are then marked so.
  /// The vector is the sink's own, reused from step to step (no allocation
  /// in steady state); valid until the next call.
  enum class StepValues { kToPublish, kToRow, kPublishedToRow };
  const std::vector<Value>& collect_step(StepValues which);
  /// When in a training step a value is reduced and published: what the
  /// step logged up to training_step's end (read by on_train_batch_end's
  /// callbacks), then what on_train_batch_end logged (before the step's
  /// row goes to the loggers).
  enum StepPhase { kTrainingStep = 0, kBatchEnd = 1 };
  /// Reduces the step values logged with sync_dist and not published yet
  /// this step across ranks, as Lightning does (collectives: every rank
  /// calls, at each training step's `phase`). Each phase keeps its own
  /// agreement: at the epoch's first step the ranks agree whether any of
  /// them reduces such values in it (one all-reduce) and, if so, on the
  /// union of the names (agree_step_names); every step then reduces the
  /// agreed names' values on their device, one all_reduce per reduction,
  /// nothing read back (a rank without a value at a step adds nothing). A
  /// name not agreed on keeps its rank's value at that step, and the count
  /// of ranks with such names rides in the step's reduction: read at the
  /// next step, it makes the ranks agree again, so the name is reduced from
  /// then on. In an epoch whose first step had none to reduce, a later one
  /// keeps its rank's step values (a note says so; its epoch value is
  /// reduced).
  void sync_step_values(Strategy& strategy, StepPhase phase);
  /// At a stage's start: no names agreed on.
  void forget_step_names();
  void clear_step_flags();
  /// Epoch aggregates: name, or name_epoch when also logged per step.
  /// Reduces sync_dist values across ranks and computes the logged metrics
  /// from every rank's states, then resets them (collectives: every rank
  /// calls).
  std::vector<Value> collect_epoch(Strategy& strategy) const;
  void reset() {
    entries_.clear();
    for (auto& agreement : step_agreements_) agreement.sync = StepSync::kUndecided;
    closed_because_.clear();
  }
  /// Until reset(), a value logged would go nowhere: log() is refused, the
  /// ConfigError saying `because` (after "log(\"<name>\"): ") and where to
  /// log instead. publish_epoch closes the sink so; the fit before its first
  /// epoch (on_train_start).
  void close(std::string because) { closed_because_ = std::move(because); }

  /// A metric object logged this epoch, as a checkpoint keeps it.
  struct SavedMetric {
    /// Its states, every rank's combined (Metric::state_dict(group)); a
    /// resume gives them to global rank 0 only, which merges them.
    std::map<std::string, at::Tensor> states;
    /// The value they give (what the epoch would publish were it to end
    /// there), and how it was logged; absent from older checkpoints.
    std::optional<double> value;
    bool logger = true;
    bool prog_bar = false;
  };
  using MetricStates = std::map<std::string, SavedMetric>;
  /// The metric objects logged so far this epoch, by logged name
  /// (collectives under several ranks: every rank calls, at the same
  /// point), for a checkpoint. A ConfigError where the ranks logged
  /// different ones.
  MetricStates metric_states(Strategy& strategy) const;
  /// What a resumed run takes back: each saved state merges into the
  /// metric object first logged under its name (Metric::merge_state_dict).
  /// A metric not logged again before the resumed epoch ends (a checkpoint
  /// written after the epoch's last batch) publishes its saved value. Until
  /// drop_restored_metrics() (the end of the resumed epoch).
  /// `within_epoch`: the checkpoint was written after a batch of the epoch
  /// it resumes, so a metric object first logged after the resume without a
  /// saved state counted batches before it that no checkpoint kept (it was
  /// not logged before the save): the epoch's end says so.
  void restore_metric_states(MetricStates states, bool within_epoch) {
    restored_ = std::move(states);
    stepped_since_restore_ = false;
    resumed_within_epoch_ = within_epoch;
    unsaved_at_resume_.clear();
  }
  void drop_restored_metrics() {
    restored_.clear();
    resumed_within_epoch_ = false;
    unsaved_at_resume_.clear();
  }
  bool empty() const { return entries_.empty(); }

  /// How many logged tensors were read back to the host in this process
  /// (tests check that none is read between log intervals).
  static int64_t tensor_reads();
  /// Reads a logged tensor's value (counted in tensor_reads()).
  static double read_tensor(const at::Tensor& tensor);

 private:
  /// The entry of `name` for values (`metric` null) or for `metric`;
  /// ConfigError when the epoch logged the name the other way.
  Entry& entry(std::string_view name, const LogOptions& options, bool& on_step, bool& on_epoch,
               metrics::Metric* metric = nullptr);
  static void accumulate(Entry& e, const at::Tensor& value, double weight);
  /// step_names_ from every rank's step_names_, unagreed_names_ and
  /// `synced` (one all-gather of a hash, read back, and every rank's names
  /// only where they differ); a name reduced one way on one rank and
  /// another way on another is a ConfigError.
  struct StepAgreement;
  void agree_step_names(const std::map<std::string, Entry*>& synced, StepAgreement& agreement,
                        Strategy& strategy);

  std::map<std::string, Entry, std::less<>> entries_;
  std::string scratch_;  // entry()'s name lookups
  MetricStates restored_;
  bool publishes_steps_ = true;
  std::string closed_because_;
  bool stepped_since_restore_ = false;  // a training step ran since restore_metric_states
  bool resumed_within_epoch_ = false;
  // Metric objects first logged in the resumed epoch, by name, whose states
  // before the checkpoint it did not hold (see restore_metric_states).
  std::set<std::string> unsaved_at_resume_;
  std::vector<Value> step_values_;
  enum class StepSync { kUndecided, kOn, kOff };
  /// What the ranks agreed on for the step values of one StepPhase.
  struct StepAgreement {
    StepSync sync = StepSync::kUndecided;  // this epoch's, across ranks
    // The step values the ranks reduce (the same on every rank), those
    // this rank logged since outside them, and the count of ranks with
    // such names at the last step, on its way to the host.
    std::map<std::string, ReduceOp> names;
    std::map<std::string, ReduceOp> unagreed;
    detail::AsyncHostCopy unagreed_count;
  };
  StepAgreement step_agreements_[2];  // by StepPhase
  std::set<std::string> unsynced_noted_;
  bool in_step_ = true;
  int64_t batch_size_ = 1;
};

/// Where logged values go. The fit and evaluation loops hand their sinks'
/// values here at step and epoch ends; the Trainer's accessors read the
/// published metrics.
class LoggerConnector {
 public:
  void set_loggers(std::vector<std::shared_ptr<Logger>> loggers) {
    loggers_ = std::move(loggers);
    versions_chosen_ = false;
  }
  const std::vector<std::shared_ptr<Logger>>& loggers() const { return loggers_; }

  LogSink& train_sink() { return train_sink_; }
  /// The training sink emptied and closed with `because` (see
  /// LogSink::close): for the hooks before the first epoch.
  LogSink& closed_train_sink(std::string because) {
    train_sink_.reset();
    train_sink_.close(std::move(because));
    return train_sink_;
  }
  LogSink& eval_sink() { return eval_sink_; }

  /// The published metrics; logged tensors not read yet are read now.
  const Metrics& callback_metrics() const;
  const Metrics& progress_bar_metrics() const;
  /// Forgets every published metric (a new stage starts); a new run's end
  /// can be recorded.
  void reset_metrics();
  /// The callback metrics a forked run's rank 0 sent back.
  void restore_callback_metrics(Metrics metrics) {
    pending_callback_.clear();
    callback_metrics_ = std::move(metrics);
  }

  /// Publishes what a training step logged up to training_step's end to the
  /// callback metrics and the progress bar's (reduced across ranks where
  /// logged with sync_dist: a collective), before on_train_batch_end: its
  /// callbacks read them.
  void publish_step_values(Strategy& strategy);
  /// After on_train_batch_end: publishes what it logged (likewise), then
  /// the step's row of everything it logged to the loggers when
  /// `to_loggers` (every log_every_n_steps-th batch that stepped), as
  /// Lightning does after those hooks.
  void publish_step(Strategy& strategy, bool to_loggers, int64_t epoch, int64_t step);
  /// The row of the step's values not in a row yet to the loggers (no
  /// collective); `published_only`: those published (reduced) already,
  /// before a checkpoint saved within on_train_batch_end (what its hooks
  /// logged is reduced after them).
  void write_step_row(Strategy& strategy, int64_t epoch, int64_t step, bool published_only);
  /// The epoch aggregates of `sink`, reduced across ranks for sync_dist
  /// metrics (a collective: every rank calls), published unless
  /// `sanity_checking`, and returned. `in_fit`: the epoch is a fit's (its
  /// training, or a validation within it), whose losses are watched for a
  /// divergence.
  Metrics publish_epoch(LogSink& sink, Strategy& strategy, bool sanity_checking, int64_t epoch,
                        int64_t step, bool in_fit);

  /// Every logger's version directory is chosen before any of them writes,
  /// so that loggers of the same save_dir and name share one.
  void log_hyperparams(const HParams& hparams);
  /// At the end of a training epoch (global rank 0).
  void log_parameters(const Module& module, int64_t step);
  /// Whether any logger reads the parameters in log_parameters.
  bool logs_parameters() const;
  /// Every logger's save(): what a stage logged is on disk when it returns
  /// (a logger that cannot write fails the stage, as at fit's end).
  void save();
  /// Every logger's run status, then its finalize().
  void finalize(RunStatus status = RunStatus::kSuccess);
  /// finalize() for a run that ends by an error or a signal: a logger's
  /// error goes to stderr, so that the run's own error stays the one raised.
  void finalize_quietly(RunStatus status) noexcept;
  /// save() for a stage other than fit that ends by an error: what it
  /// published so far reaches the files; a logger's error goes to stderr.
  void save_quietly() noexcept;
  /// Every logger's version directory, chosen once (no file is written):
  /// before any logger writes, and before a launcher forks the ranks, so
  /// that every stage of the run logs to the same directory.
  void choose_versions();
  /// Under several ranks, at each stage's start (a collective: every rank
  /// calls): every rank's loggers take global rank 0's directories (one
  /// broadcast), each rank having picked its own version otherwise.
  void agree_log_dirs(Strategy& strategy);

 private:
  /// Sets callback/progress-bar metrics; `suffix` ("_step", "_epoch") is
  /// stripped for the base name, which follows the latest value too.
  /// `in_fit`: the values are a fit's (note_divergence watches them).
  void publish(const std::vector<LogSink::Value>& values, const char* suffix, bool to_loggers,
               bool global_zero, int64_t epoch, int64_t step, bool in_fit);
  /// `values` as one row to every logger (on global rank 0).
  void write_row(const std::vector<LogSink::Value>& values, bool global_zero, int64_t epoch,
                 int64_t step, bool in_fit);
  /// On rank 0, once per fit: a note when a loss of the fit read for
  /// publishing (a logger's row, an epoch's value; not the sanity check's)
  /// is not finite: the run diverged and goes on with it. Reads nothing that
  /// was not read already.
  void note_divergence(const std::string& name, double value, int64_t epoch, int64_t step);
  /// On rank 0, once per metric and stage: a note that an epoch mean is nan
  /// because its batch sizes added up to 0.
  void note_weightless(const std::string& name, int64_t epoch);

  std::vector<std::shared_ptr<Logger>> loggers_;
  bool divergence_noted_ = false;
  std::set<std::string, std::less<>> weightless_noted_;
  bool versions_chosen_ = false;
  bool ended_ = false;  // this fit's end is recorded (finalize)
  LogSink train_sink_;
  LogSink eval_sink_{/*publishes_steps=*/false};
  // Published values are doubles, or tensors read on first access (the
  // pending maps; a tensor there is the sink's step buffer, so it holds the
  // latest value logged).
  mutable Metrics callback_metrics_;
  mutable Metrics progress_bar_metrics_;
  mutable std::map<std::string, at::Tensor> pending_callback_;
  mutable std::map<std::string, at::Tensor> pending_progress_bar_;
};

}  // namespace detail
}  // namespace fulgur
