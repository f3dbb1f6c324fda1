// File: fulgur/loggers/tensorboard_logger.h
//
// Event files that TensorBoard reads (`tensorboard --logdir <save_dir>`):
// scalars with step and wall time, the run's hyper-parameters for the
// HParams tab, and, on request, histograms of the parameters.
//
//   auto tb = std::make_shared<fulgur::TensorBoardLogger>(
//       fulgur::TensorBoardLoggerOptions{.save_dir = "runs", .log_histograms = true});
//   fulgur::Trainer trainer({.loggers = {tb, std::make_shared<fulgur::CSVLogger>(...)}});
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "fulgur/loggers/logger.h"

namespace fulgur {

struct TensorBoardLoggerOptions {
  /// Root of the logs; version directories are created below it.
  std::string save_dir = "";
  std::string name = "fulgur_logs";
  /// Explicit version; default: the next free `version_N` (the same one a
  /// CSVLogger of the same save_dir and name writes to), or the resumed
  /// run's.
  std::optional<int64_t> version = std::nullopt;
  /// Events kept in memory before a write (they are also written before
  /// every checkpoint and at the end of the run).
  int64_t flush_every = 10;
  /// A histogram of every parameter at the end of each training epoch.
  bool log_histograms = false;
  /// An event file that reaches this size is closed and a new one opened
  /// (TensorBoard reads them in name order as one run).
  int64_t max_file_bytes = int64_t{256} << 20;
};

/// Writes `<save_dir>/<name>/version_<N>/events.out.tfevents.<time>.<host>.
/// <pid>.<seq, 6 digits>`: TFRecord framing (length, masked CRC32C of the length, the
/// Event, masked CRC32C of the Event) of tensorflow.Event messages. A run
/// resumed from a checkpoint appends to the same directory: its next event
/// (in a new file, or the same logger's open one when the same Trainer fits
/// again) is a SessionLog START just after the resumed step, which tells
/// TensorBoard to drop what the interrupted run logged after it.
class TensorBoardLogger : public VersionedLogger {
 public:
  explicit TensorBoardLogger(TensorBoardLoggerOptions options = {});
  /// Writes what is buffered; errors are reported on stderr, never thrown.
  ~TensorBoardLogger() override;
  TensorBoardLogger(const TensorBoardLogger&) = delete;
  TensorBoardLogger& operator=(const TensorBoardLogger&) = delete;

  /// The HParams plugin's session start: the hyper-parameters of this run.
  void log_hyperparams(const HParams& params) override;
  /// One scalar per metric, at `step`, with the wall time.
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) override;
  /// Histograms of the parameters, when `log_histograms` is on.
  void log_parameters(const Module& module, int64_t step) override;
  bool logs_parameters() const override { return options_.log_histograms; }
  /// A histogram of `values` (any shape and floating dtype) under `tag`.
  void log_histogram(const std::string& tag, const at::Tensor& values, int64_t step);
  void save() override;
  /// The HParams plugin's session end: success, failure, or running (an
  /// interrupted run is resumed later).
  void log_run_status(RunStatus status) override;
  void finalize() override;
  /// Continues the run's directory (see above).
  void load_state_dict(const StateDict& state, int64_t step) override;
  void resume_without_state(int64_t step) override;

  /// The event file being written ("" before the first event).
  const std::string& event_file() const { return file_; }

 private:
  void add_event(const std::string& event);
  void open_file();
  void append_start();
  // After a resume: closes an earlier fit's file in a directory other than
  // log_dir(), and starts the resumed run's events.
  void continue_in(const std::string& dir_before);

  TensorBoardLoggerOptions options_;
  std::string file_;
  int fd_ = -1;
  int64_t file_bytes_ = 0;
  int files_opened_ = 0;
  bool start_pending_ = false;  // resumed: a SessionLog START goes before the next event
  int64_t pending_events_ = 0;
  std::string pending_;  // framed records not yet written
};

}  // namespace fulgur
