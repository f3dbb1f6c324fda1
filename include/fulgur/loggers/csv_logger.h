// File: fulgur/loggers/csv_logger.h
#pragma once

#include <optional>
#include <set>
#include <vector>

#include "fulgur/loggers/logger.h"

namespace fulgur {

struct CSVLoggerOptions {
  /// Root of the logs; version directories are created below it.
  std::string save_dir = "";
  std::string name = "fulgur_logs";
  /// Explicit version; default: the next free `version_N`.
  std::optional<int64_t> version = std::nullopt;
  /// Rows kept in memory before a write.
  int64_t flush_every = 100;
  /// At the end of fit, draw metrics.png next to metrics.csv (gnuplot; one
  /// line on stderr instead when it is missing).
  bool plot = true;
};

/// Writes `<save_dir>/<name>/version_<N>/metrics.csv` (one row per step, one
/// column per metric, empty cells where a metric was not logged) and
/// `hparams.yaml` next to it. New columns rewrite the file with the wider
/// header, so the CSV is always rectangular. At the end of fit, metrics.png:
/// the curves (fulgur/loggers/plot.h). A run resumed from a checkpoint
/// continues the same version: the rows the interrupted run wrote after the
/// resumed step are dropped, the others kept.
class CSVLogger : public VersionedLogger {
 public:
  explicit CSVLogger(CSVLoggerOptions options = {});
  void log_hyperparams(const HParams& params) override;
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) override;
  void save() override;
  /// save(), then metrics.png when `plot` is on.
  void finalize() override;
  /// Path of metrics.csv.
  std::string metrics_file() const;

 private:
  // A resumed run: the rows of metrics.csv up to `resume_step_`.
  void read_previous_rows();

  CSVLoggerOptions options_;
  std::vector<std::string> columns_;  // "step" first, then metric names in order seen
  std::vector<std::pair<int64_t, std::map<std::string, double>>> pending_;
  std::vector<std::pair<int64_t, std::map<std::string, double>>> written_;
  bool header_written_ = false;
  bool header_changed_ = false;
  bool previous_rows_read_ = false;
};

}  // namespace fulgur
