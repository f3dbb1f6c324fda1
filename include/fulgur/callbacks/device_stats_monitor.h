// File: fulgur/callbacks/device_stats_monitor.h
//
// Logs the statistics of the device a rank trains on to the loggers, as
// PyTorch Lightning's DeviceStatsMonitor does: on a GPU its memory (the
// caching allocator's allocated, reserved and active bytes, their peaks,
// allocation retries and out-of-memory errors, the device's free memory),
// on the CPU the process's resident memory and the machine's memory, swap
// and CPU use (fulgur::HostStats). Each value is logged as
// "DeviceStatsMonitor.<hook>/<name>", e.g.
// "DeviceStatsMonitor.on_train_batch_end/allocated_bytes.all.peak", at the
// start and end of the training batches whose values go to the loggers
// (every log_every_n_steps-th batch that steps: Trainer::batches_that_stepped),
// and of every log_every_n_steps-th validation and test batch; global rank
// 0 logs its own device's. Reading the statistics waits for no kernel.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "fulgur/accelerators/cpu.h"
#include "fulgur/callbacks/callback.h"

namespace fulgur {

struct DeviceStatsMonitorOptions {
  /// The host's statistics (HostStats' cpu_* values): unset, only where
  /// the device is the CPU (they are its statistics); true, also beside a
  /// GPU's; false, never (on the CPU the monitor then logs nothing).
  std::optional<bool> cpu_stats;
};

class DeviceStatsMonitor : public Callback {
 public:
  explicit DeviceStatsMonitor(DeviceStatsMonitorOptions options = {});
  std::string state_key() const override { return "DeviceStatsMonitor"; }
  /// ConfigError when a fit's Trainer has no logger (logger=false) outside
  /// fast_dev_run: there is nowhere to log (validate, test and predict
  /// log nothing then, as Lightning's).
  void setup(Trainer& trainer, Module& module, Stage stage) override;
  void on_train_start(Trainer& trainer, Module& module) override;
  void on_train_batch_start(Trainer& trainer, Module& module, const Batch& batch,
                            int64_t batch_idx) override;
  void on_train_batch_end(Trainer& trainer, Module& module, const at::Tensor& loss,
                          const Batch& batch, int64_t batch_idx) override;
  void on_validation_batch_start(Trainer& trainer, Module& module, const Batch& batch,
                                 int64_t batch_idx) override;
  void on_validation_batch_end(Trainer& trainer, Module& module, const Batch& batch,
                               int64_t batch_idx) override;
  void on_test_batch_start(Trainer& trainer, Module& module, const Batch& batch,
                           int64_t batch_idx) override;
  void on_test_batch_end(Trainer& trainer, Module& module, const Batch& batch,
                         int64_t batch_idx) override;
  /// What it logged last (prefixed name → value), for programs and tests.
  const std::map<std::string, double>& last_logged() const { return last_; }

 private:
  void log(Trainer& trainer, const char* hook);
  void log_evaluation_batch(Trainer& trainer, int64_t batch_idx, const char* hook);
  DeviceStatsMonitorOptions options_;
  HostStats host_;  // beside a GPU's (cpu_stats = true)
  std::map<std::string, double> last_;
  // Trainer::batches_that_stepped() at the last training log, per hook.
  int64_t logged_start_ = -1;
  int64_t logged_end_ = -1;
};

}  // namespace fulgur
