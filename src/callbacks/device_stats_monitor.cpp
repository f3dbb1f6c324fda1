#include "fulgur/callbacks/device_stats_monitor.h"

#include "fulgur/accelerators/accelerator.h"
#include "fulgur/core/errors.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"

#include "callbacks/log_support.h"

namespace fulgur {

DeviceStatsMonitor::DeviceStatsMonitor(DeviceStatsMonitorOptions options) : options_(options) {}

void DeviceStatsMonitor::setup(Trainer& trainer, Module&, Stage stage) {
  detail::require_logger_to_fit(trainer, stage, "DeviceStatsMonitor", "the device statistics");
}

void DeviceStatsMonitor::on_train_start(Trainer&, Module&) {
  logged_start_ = -1;
  logged_end_ = -1;
}

void DeviceStatsMonitor::log(Trainer& trainer, const char* hook) {
  Strategy& strategy = trainer.strategy();
  if (!strategy.is_global_zero() || trainer.loggers().empty()) return;
  const c10::Device device = strategy.root_device();
  const bool on_cpu = device.is_cpu();
  if (on_cpu && options_.cpu_stats == false) return;
  std::map<std::string, double> stats = strategy.accelerator().device_stats(device);
  if (!on_cpu && options_.cpu_stats == true) stats.merge(host_.read());
  const std::string prefix = str("DeviceStatsMonitor.", hook, "/");
  std::map<std::string, double> prefixed;
  for (const auto& [name, value] : stats) prefixed[prefix + name] = value;
  last_ = prefixed;
  detail::log_to_loggers(trainer, prefixed);
}

void DeviceStatsMonitor::on_train_batch_start(Trainer& trainer, Module&, const Batch&, int64_t) {
  if (detail::due_at_train_batch_start(trainer, logged_start_)) {
    log(trainer, "on_train_batch_start");
  }
}

void DeviceStatsMonitor::on_train_batch_end(Trainer& trainer, Module&, const at::Tensor&,
                                            const Batch&, int64_t) {
  if (detail::due_at_train_batch_end(trainer, logged_end_)) log(trainer, "on_train_batch_end");
}

void DeviceStatsMonitor::log_evaluation_batch(Trainer& trainer, int64_t batch_idx,
                                              const char* hook) {
  // Not the sanity check's batches, which the loggers see nothing of.
  if (trainer.sanity_checking()) return;
  if ((batch_idx + 1) % trainer.options().log_every_n_steps == 0) log(trainer, hook);
}

void DeviceStatsMonitor::on_validation_batch_start(Trainer& trainer, Module&, const Batch&,
                                                   int64_t batch_idx) {
  log_evaluation_batch(trainer, batch_idx, "on_validation_batch_start");
}

void DeviceStatsMonitor::on_validation_batch_end(Trainer& trainer, Module&, const Batch&,
                                                 int64_t batch_idx) {
  log_evaluation_batch(trainer, batch_idx, "on_validation_batch_end");
}

void DeviceStatsMonitor::on_test_batch_start(Trainer& trainer, Module&, const Batch&,
                                             int64_t batch_idx) {
  log_evaluation_batch(trainer, batch_idx, "on_test_batch_start");
}

void DeviceStatsMonitor::on_test_batch_end(Trainer& trainer, Module&, const Batch&,
                                           int64_t batch_idx) {
  log_evaluation_batch(trainer, batch_idx, "on_test_batch_end");
}

}  // namespace fulgur
