// File: fulgur/loggers/logger.h
//
// A Logger receives metrics (name → value at a step) and hyper-parameters.
// The Trainer calls loggers on global rank 0 only. A logger with state (the
// version directory it writes to) saves it in checkpoints, so that a resumed
// run continues the same logs instead of starting a new version.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "fulgur/core/module.h"
#include "fulgur/core/registry.h"
#include "fulgur/core/state_dict.h"

namespace fulgur {

/// How a run ended, for loggers that record it (TensorBoard's HParams tab).
enum class RunStatus {
  kSuccess,
  kFailed,
  /// Stopped by a preemption signal, to be resumed.
  kInterrupted,
};

class Logger {
 public:
  virtual ~Logger() = default;
  virtual std::string name() const = 0;
  /// Where this logger writes (a directory), for messages.
  virtual std::string log_dir() const = 0;
  virtual void log_hyperparams(const HParams& params) = 0;
  virtual void log_metrics(const std::map<std::string, double>& metrics, int64_t step) = 0;
  /// At the end of every training epoch: loggers that record the module's
  /// parameters (histograms) read them here. Default: nothing.
  virtual void log_parameters(const Module& /*module*/, int64_t /*step*/) {}
  /// Whether log_parameters reads the parameters: a sharded strategy then
  /// gathers them first (every rank asks its own loggers, so configure
  /// them alike on every rank). Default: false.
  virtual bool logs_parameters() const { return false; }
  /// Flushes buffered rows; the Trainer calls it before every checkpoint.
  virtual void save() {}
  /// How the run ended; called before finalize(). Default: nothing.
  virtual void log_run_status(RunStatus /*status*/) {}
  /// Flushes and closes at the end of a run.
  virtual void finalize() { save(); }

  /// Identifies this logger's state in a checkpoint; unique among the run's
  /// loggers.
  virtual std::string state_key() const { return name(); }
  /// Identifies the files this logger writes: the Trainer refuses two
  /// loggers with the same one (or the same state_key()). Default:
  /// state_key().
  virtual std::string files_key() const { return state_key(); }
  /// What a resumed run needs to continue this logger's logs; the
  /// checkpoint holds it under "loggers/<state_key()>". Default: nothing.
  virtual StateDict state_dict() const { return {}; }
  /// Fit resumes at optimizer step `step` from a checkpoint holding what
  /// state_dict() returned; called before anything is logged, only when the
  /// checkpoint holds a section under this logger's state_key(). What the
  /// interrupted run logged after `step` is superseded.
  virtual void load_state_dict(const StateDict& /*state*/, int64_t /*step*/) {}
  /// Fit resumes at optimizer step `step` from a checkpoint without a
  /// section for this logger (its run logged elsewhere, or without this
  /// logger): what this logger wrote before (an earlier fit of the same
  /// Trainer) is not that run's. Called before anything is logged.
  /// Default: nothing.
  virtual void resume_without_state(int64_t /*step*/) {}
  /// Under several ranks, at each stage's start, on every rank but global
  /// rank 0 (which writes the logs): global rank 0's log_dir(), to take as
  /// this rank's, so that what every rank writes beside the logs (the
  /// PyTorch profiler's traces, a program's own files under log_dir()) lands
  /// in the one directory. Default: nothing.
  virtual void follow_log_dir(const std::string& /*dir*/) {}
};

/// A Logger that writes into `<save_dir>/<name>/version_<N>`: N is the
/// version given, or the next free one when the logger first needs it, or,
/// when fit resumes from a checkpoint this logger's run wrote under the same
/// root, that run's own (what it logged after the resumed step is then the
/// subclass's to supersede, see resume_step()).
class VersionedLogger : public Logger {
 public:
  std::string name() const override { return name_; }
  std::string log_dir() const override;
  /// "<kind>{<save_dir>/<name>}"
  std::string state_key() const override;
  /// state_key() with the root as an absolute path, its links resolved:
  /// "runs" and "./runs" are one.
  std::string files_key() const override;
  /// "log_dir": the version directory (log_dir()).
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state, int64_t step) override;
  /// A new version, unless one was given: the one chosen before holds
  /// another run's logs.
  void resume_without_state(int64_t step) override;
  /// The version of global rank 0's directory, unless one was given.
  void follow_log_dir(const std::string& dir) override;

 protected:
  /// `kind` names the logger in messages and its checkpoint state.
  VersionedLogger(std::string kind, std::string save_dir, std::string name,
                  std::optional<int64_t> version);
  /// The step fit resumed at when this logger continues a run's logs.
  const std::optional<int64_t>& resume_step() const { return resume_step_; }
  const std::string& kind() const { return kind_; }

 private:
  // After a resume of another run: the next free version, unless one was
  // given or none was chosen yet.
  void choose_version_again();

  std::string kind_, save_dir_, name_;
  std::optional<int64_t> explicit_version_;
  mutable std::optional<int64_t> version_;
  std::optional<int64_t> resume_step_;
};

/// Loggers by name, for TrainerOptions::logger ("csv,tensorboard") and the
/// CLI. A factory gets the run's root directory (default_root_dir, or the
/// working directory). Built in: "csv" (CSVLogger) and "tensorboard"
/// (TensorBoardLogger), both writing `<root>/fulgur_logs/version_<N>`.
using LoggerRegistry = Registry<Logger, const std::string&>;
LoggerRegistry& logger_registry();

}  // namespace fulgur
