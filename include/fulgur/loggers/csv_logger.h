// File: fulgur/loggers/csv_logger.h
#pragma once

#include <optional>
#include <set>
#include <string_view>
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
/// header, so the CSV is always rectangular; the rows are in memory only
/// until they are written (every `flush_every` rows and before every
/// checkpoint). At the end of fit, metrics.png:
/// the curves (fulgur/loggers/plot.h). A run resumed from a checkpoint
/// continues the same version: the rows the interrupted run wrote after the
/// resumed step are dropped, the others kept.
class CSVLogger : public VersionedLogger {
 public:
  explicit CSVLogger(CSVLoggerOptions options = {});
  void log_hyperparams(const HParams& params) override;
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) override;
  void save() override;
  /// Continues the run's file (see above).
  void load_state_dict(const StateDict& state, int64_t step) override;
  void resume_without_state(int64_t step) override;
  /// save(), then metrics.png when `plot` is on.
  void finalize() override;
  /// Path of metrics.csv.
  std::string metrics_file() const;
  /// Why a metric of this name cannot be a column of metrics.csv (empty,
  /// "step", or holding a comma, a double quote or a line break: the file
  /// reads no quoting), as a clause ("it holds a comma, ..."); empty when it
  /// can. Module::log refuses the same names.
  static std::string why_not_a_column(std::string_view name);

 private:
  // Rows of metrics.csv to write again: as they are in the file, under its
  // `columns`.
  struct FileRows {
    std::vector<std::string> columns;
    std::vector<std::string> lines;
  };
  // A resumed run: the file's rows up to resume_step(), and a note on those
  // dropped.
  FileRows read_previous_rows();
  // The rows this logger wrote (to widen the header).
  FileRows read_written_rows() const;
  // Forgets the file written so far: the next save writes one anew.
  void start_anew();

  CSVLoggerOptions options_;
  std::vector<std::string> columns_;  // metric names, in the file's order, then new ones
  // Rows not written yet: all of them are in memory only until then.
  std::vector<std::pair<int64_t, std::map<std::string, double>>> pending_;
  // The file as this logger last wrote it: the metric columns of its
  // header (none before its first save), its size and its rows.
  std::optional<size_t> file_columns_;
  uintmax_t file_bytes_ = 0;
  int64_t file_rows_ = 0;
  bool rewrite_ = false;    // an append failed: the next save writes the file anew
  bool reconcile_ = false;  // resumed: the next save keeps the file's rows up to the step
};

}  // namespace fulgur
