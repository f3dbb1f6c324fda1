// File: fulgur/callbacks/monitors.h
//
// Callbacks that watch a run and report, deciding nothing:
//
//  - LearningRateMonitor: every optimizer's learning rate (and momentum, on
//    request) to the loggers, as "lr-SGD", "lr-Adam", "lr-Adam/pg1" for a
//    second parameter group, "lr-SGD-1" for a second SGD: the rate each
//    optimizer step is about to use, at that step's index.
//  - ThroughputMonitor: batches/s and samples/s of training over a window
//    of recent batches, to the loggers as "throughput/batches_per_sec" and
//    "throughput/samples_per_sec" (samples counted on every rank).
//  - ModelSummary: a table of the module's layers (name, type, parameters,
//    trainable or frozen, size in MB) printed by global rank 0 at fit start.
//
// Loggers get them on global rank 0, every log_every_n_steps optimizer steps
// (LearningRateMonitor with interval "epoch": at each epoch's end).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <utility>

#include "fulgur/callbacks/callback.h"
#include "fulgur/core/choice.h"

namespace torch::nn {
class Module;
}

namespace fulgur {

/// When LearningRateMonitor logs.
enum class LoggingInterval { kStep, kEpoch };
template <>
struct ChoiceNames<LoggingInterval> {
  static constexpr std::pair<LoggingInterval, const char*> kNames[] = {
      {LoggingInterval::kStep, "step"}, {LoggingInterval::kEpoch, "epoch"}};
};

struct LearningRateMonitorOptions {
  /// "step" (every log_every_n_steps optimizer steps) or "epoch".
  Choice<LoggingInterval> logging_interval = LoggingInterval::kStep;
  /// Also "momentum-<name>": SGD's momentum, Adam's and AdamW's beta1,
  /// RMSprop's momentum.
  bool log_momentum = false;
};

class LearningRateMonitor : public Callback {
 public:
  explicit LearningRateMonitor(LearningRateMonitorOptions options = {});
  std::string state_key() const override { return "LearningRateMonitor"; }
  void on_train_batch_start(Trainer& trainer, Module& module, const Batch& batch,
                            int64_t batch_idx) override;
  void on_train_epoch_end(Trainer& trainer, Module& module) override;
  /// What it logged last (name → value), for programs and tests.
  const std::map<std::string, double>& last_logged() const { return last_; }

 private:
  void log(Trainer& trainer, Module& module);
  LearningRateMonitorOptions options_;
  std::map<std::string, double> last_;
  int64_t logged_step_ = -1;
};

struct ThroughputMonitorOptions {
  /// Batches the rates are averaged over (>= 2).
  int64_t window = 50;
};

class ThroughputMonitor : public Callback {
 public:
  explicit ThroughputMonitor(ThroughputMonitorOptions options = {});
  std::string state_key() const override { return "ThroughputMonitor"; }
  void on_train_epoch_start(Trainer& trainer, Module& module) override;
  void on_train_batch_end(Trainer& trainer, Module& module, const at::Tensor& loss,
                          const Batch& batch, int64_t batch_idx) override;
  /// The latest rates (0 before the window has two batches).
  double batches_per_sec() const { return batches_per_sec_; }
  double samples_per_sec() const { return samples_per_sec_; }

 private:
  ThroughputMonitorOptions options_;
  /// (end of batch, samples in it) of the window's batches.
  std::deque<std::pair<std::chrono::steady_clock::time_point, int64_t>> window_;
  double batches_per_sec_ = 0;
  double samples_per_sec_ = 0;
  int64_t logged_step_ = -1;
};

struct ModelSummaryOptions {
  /// Depth of the layers listed (1: the module's direct children; 0: only
  /// the totals).
  int max_depth = 1;
};

class ModelSummary : public Callback {
 public:
  explicit ModelSummary(ModelSummaryOptions options = {});
  std::string state_key() const override { return "ModelSummary"; }
  void on_fit_start(Trainer& trainer, Module& module) override;
  /// The table, as printed.
  static std::string summarize(const torch::nn::Module& module, int max_depth = 1);

 private:
  ModelSummaryOptions options_;
};

}  // namespace fulgur
