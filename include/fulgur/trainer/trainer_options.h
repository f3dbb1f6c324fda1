// File: fulgur/trainer/trainer_options.h
//
// TrainerOptions holds the flags exactly as the user typed them ("auto" and
// unset allowed). The connector resolves them; Trainer::describe() shows
// the result and every default chosen.
//
//   fulgur::Trainer trainer({.accelerator = "cpu", .max_epochs = 3,
//                            .limit_val_batches = 0.25, .seed = 42});
//
// Designated initializers must follow declaration order: the most-used
// fields come first within each group.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "fulgur/accelerators/accelerator.h"
#include "fulgur/core/choice.h"
#include "fulgur/core/gradient_clipping.h"
#include "fulgur/trainer/determinism.h"

namespace fulgur {

class Callback;
class Logger;
class Strategy;
class Precision;
class CheckpointIO;
class ClusterEnvironment;

/// A batch count (int) or a fraction of the loader (double in [0, 1]).
/// `10` means ten batches, `0.25` a quarter, `1.0` all of them.
class BatchLimit {
 public:
  BatchLimit(int count) : count_(count) {}              // NOLINT: implicit on purpose
  BatchLimit(long count) : count_(count) {}             // NOLINT
  BatchLimit(long long count) : count_(count) {}        // NOLINT
  BatchLimit(double fraction) : fraction_(fraction) {}  // NOLINT

  bool is_fraction() const { return fraction_.has_value(); }
  int64_t count() const { return count_.value_or(0); }
  double fraction() const { return fraction_.value_or(0.0); }
  /// No batches: the count 0 or the fraction 0.0.
  bool is_zero() const { return is_fraction() ? fraction() == 0.0 : count() == 0; }
  /// "10" or "0.25", for messages.
  std::string text() const;
  /// The number of batches out of `available` (nullopt: unknown length).
  /// Throws ConfigError naming `flag` when a fraction is applied to a loader
  /// of unknown length, or rounds a non-zero fraction down to 0 batches.
  std::optional<int64_t> apply(std::optional<int64_t> available, const char* flag) const;

 private:
  std::optional<int64_t> count_;
  std::optional<double> fraction_;
};

/// The Trainer's profiler: "none", "simple" (time per phase of the fit
/// loop) or "pytorch" (LibTorch's operator profiler over a window of steps).
enum class ProfilerKind { kNone, kSimple, kPyTorch };
template <>
struct ChoiceNames<ProfilerKind> {
  static constexpr std::pair<ProfilerKind, const char*> kNames[] = {
      {ProfilerKind::kNone, "none"},
      {ProfilerKind::kSimple, "simple"},
      {ProfilerKind::kPyTorch, "pytorch"}};
};

/// The precision flag as written: "32-true", "64-true", "bf16-mixed",
/// "16-mixed", "bf16-true", "16-true", or a legacy spelling that PyTorch
/// Lightning 2.x also accepts: 32, 64, 16, "bf16" (and "32", "64", "16").
class PrecisionFlag {
 public:
  PrecisionFlag() = default;                                   // "32-true"
  PrecisionFlag(int bits) : text_(std::to_string(bits)) {}     // NOLINT: 16, 32, 64
  PrecisionFlag(const char* text) : text_(text) {}             // NOLINT
  PrecisionFlag(std::string text) : text_(std::move(text)) {}  // NOLINT
  /// As the user wrote it.
  const std::string& text() const { return text_; }
  /// The registered name a legacy spelling stands for ("16" -> "16-mixed");
  /// other text unchanged.
  std::string canonical() const;
  bool is_legacy() const { return canonical() != text_; }
  bool operator==(const PrecisionFlag& other) const { return text_ == other.text_; }

 private:
  std::string text_ = "32-true";
};

/// A plugin as a registered name ("slurm") or an instance.
/// Which loggers the Trainer adds when `loggers` is empty: true (a
/// CSVLogger), false (none), or names of logger_registry() entries, comma-
/// separated ("csv,tensorboard").
class LoggerFlag {
 public:
  LoggerFlag(bool enabled = true)  // NOLINT: implicit on purpose
      : names_(enabled ? std::vector<std::string>{"csv"} : std::vector<std::string>{}) {}
  LoggerFlag(const char* text);                         // NOLINT
  LoggerFlag(std::string text) : LoggerFlag(text.c_str()) {}  // NOLINT
  LoggerFlag(std::vector<std::string> names);           // NOLINT
  explicit operator bool() const { return !names_.empty(); }
  const std::vector<std::string>& names() const { return names_; }
  /// "false", or the names joined by commas; the text as given where it has
  /// a problem (an empty name).
  std::string text() const;
  /// What is wrong with the text (an empty name); "" when nothing is.
  /// Unknown names are the Trainer's to report, with the registry's list.
  const std::string& problem() const { return problem_; }

 private:
  std::vector<std::string> names_;
  std::string problem_;
  std::optional<std::string> text_with_problem_;  // as given ("" too)
};

using Plugin = std::variant<std::string, std::shared_ptr<Precision>, std::shared_ptr<CheckpointIO>,
                            std::shared_ptr<ClusterEnvironment>>;

struct TrainerOptions {
  // ---- Hardware: where and how the loops run.
  /// "auto", "cpu", "cuda" (alias "gpu"), a registered name, or an instance.
  std::variant<std::string, std::shared_ptr<Accelerator>> accelerator = std::string("auto");
  /// "auto", "single_device", ..., a registered name, or an instance.
  std::variant<std::string, std::shared_ptr<Strategy>> strategy = std::string("auto");
  /// "auto", a count, -1 for all, or a list of indices.
  DevicesSpec devices = DevicesSpec();
  int num_nodes = 1;
  /// "32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true",
  /// "16-true"; legacy 32, 64, 16, "bf16" accepted.
  PrecisionFlag precision = PrecisionFlag();
  std::vector<Plugin> plugins = {};
  /// Synchronise BatchNorm statistics across ranks (fulgur::nn::SyncBatchNorm
  /// layers; DDP only).
  bool sync_batchnorm = false;
  /// true: deterministic algorithms only (a nondeterministic op throws);
  /// "warn": warn on one instead; false: off. Unset (none, null on command
  /// lines and in YAML): LibTorch's flag as it is (off, unless the program
  /// or an earlier Trainer turned it on), as Lightning's None.
  DeterministicFlag deterministic = {};
  /// cuDNN autotuning for fixed input shapes (CUDA only).
  bool benchmark = false;
  /// Move each batch to the device while the step before it runs. On a GPU
  /// the copy runs on a side stream, from page-locked memory (the loaders'
  /// pin_memory defaults to true there), and a step waits for its batch on
  /// the device, never on the host. Unset ("auto"): on where the device is a
  /// GPU. true: also elsewhere, where the move is only made one batch early
  /// (the same batches in the same order). false: each batch is moved when
  /// its step starts. Either way a hook's `batch` is the loader's batch and
  /// a step's is the moved one.
  std::optional<bool> prefetch_to_device = std::nullopt;
  /// Capture each training step (forward, backward, clipping, optimizer
  /// steps) into a CUDA graph after 3 warm-up steps and replay it: one
  /// launch per step instead of hundreds. Needs accelerator "cuda",
  /// single_device, automatic optimization without accumulation, a
  /// precision without loss scaler, and fulgur::optim's SGD, Adam or AdamW
  /// (their learning rates and bias corrections live in device tensors, so
  /// schedulers work); anything else is refused up front. Host code in
  /// training_step and the step hooks runs only for the capture; log() a
  /// tensor there (it is read from the graph's output every step). A batch
  /// of other shapes (a last partial batch) runs eagerly.
  bool cuda_graph = false;
  /// With several ranks, split every loader across them (training padded
  /// to equal lengths, evaluation exact). Off: each rank's loaders are used
  /// as they are (the user splits the data).
  bool use_distributed_sampler = true;
  /// Make the fit's loaders again every N epochs (0: once per fit): the
  /// DataModule's train_dataloader() and val_dataloader() are called at
  /// the start of epochs 0, N, 2N, ... with DataModule::current_epoch()
  /// saying which, so that its data can change as training goes on (a
  /// curriculum, a growing dataset). A resumed fit makes them for the epoch
  /// the uninterrupted run made them at. Needs a DataModule (loaders passed
  /// to fit cannot be made again). Under ddp every rank makes its own: they
  /// must be the same on every rank.
  int64_t reload_dataloaders_every_n_epochs = 0;

  // ---- Run length.
  /// Epochs to train; unset: 1000, or unlimited when max_steps is set.
  std::optional<int64_t> max_epochs = std::nullopt;
  int64_t min_epochs = 0;
  /// Optimizer steps to train for; -1 means no limit.
  int64_t max_steps = -1;
  int64_t min_steps = 0;
  /// Training time after which fit stops (a Timer callback; the stop is
  /// agreed by every rank and ends fit as usual, its checkpoints included).
  std::optional<std::chrono::milliseconds> max_time = std::nullopt;
  /// Run N (true = 1) batches of train/val/test/predict and stop; no
  /// checkpoints, no loggers, no sanity check. For smoke-testing a Module.
  int64_t fast_dev_run = 0;
  BatchLimit limit_train_batches = 1.0;
  BatchLimit limit_val_batches = 1.0;
  BatchLimit limit_test_batches = 1.0;
  BatchLimit limit_predict_batches = 1.0;
  /// Train and validate on the same batches every epoch, to see that the
  /// model can fit them (one that cannot has a bug): the first N (int) or
  /// the fraction (double) of the training loader and of the validation
  /// loader. 0: off. The training loader visits its samples in order for
  /// the fit (a RandomSampler's shuffle is bypassed, with a note). It sets
  /// limit_train_batches and limit_val_batches, so it is refused beside
  /// them and beside fast_dev_run.
  BatchLimit overfit_batches = 0.0;
  /// LibTorch's autograd anomaly detection during fit (slow: for
  /// debugging): a backward operation that returns NaN stops the fit,
  /// naming the operation ("Function 'MulBackward1' returned nan values in
  /// its 0th output"). Not with cuda_graph (each check reads the GPU back).
  bool detect_anomaly = false;

  // ---- Validation schedule.
  /// Validate every N training batches (int) or fraction of an epoch; and
  /// where a requested stop (request_stop(), max_time, EarlyStopping on a
  /// training metric) ends the fit, as Lightning does.
  BatchLimit val_check_interval = 1.0;
  /// Validate at the end of every N-th epoch; unset with an int
  /// val_check_interval: validate every N training batches since the start
  /// of fit, counted over epochs of any length (a fraction is refused).
  std::optional<int64_t> check_val_every_n_epoch = 1;
  /// Validation batches run before training to catch bugs early; -1: all.
  int64_t num_sanity_val_steps = 2;

  // ---- Optimization.
  int64_t accumulate_grad_batches = 1;
  std::optional<double> gradient_clip_val = std::nullopt;
  Choice<GradientClipAlgorithm> gradient_clip_algorithm = GradientClipAlgorithm::kNorm;

  // ---- Reproducibility.
  /// Seeds every RNG the run uses (torch CPU and CUDA, the C library).
  std::optional<uint64_t> seed = std::nullopt;

  // ---- Outputs.
  /// Root of logs and checkpoints; default: the current directory.
  std::string default_root_dir = "";
  /// Add a ModelCheckpoint (saving last.ckpt) unless one is in callbacks.
  bool enable_checkpointing = true;
  bool enable_progress_bar = true;
  /// The loggers the Trainer adds unless `loggers` are given: true (a
  /// CSVLogger), names ("csv,tensorboard"), or false (no logging).
  LoggerFlag logger = true;
  std::vector<std::shared_ptr<Logger>> loggers = {};
  /// Logged metrics reach the loggers every N optimizer steps (under manual
  /// optimization, every N-th batch that steps: Trainer::batches_that_stepped).
  int64_t log_every_n_steps = 50;
  /// "simple": at the end of fit, global rank 0 prints where the fit loop's
  /// time went (fetching batches, training_step, backward, optimizer steps,
  /// logging, batch-end hooks and checkpoints, validation, epoch ends; calls,
  /// total, mean and max time). "pytorch": LibTorch's operator profiler
  /// records the training batches [profiler_wait, profiler_wait +
  /// profiler_active) of the fit; each rank writes a Chrome/Perfetto trace
  /// (fit-rank<R>.pt.trace.json; CUDA kernels too where LibTorch was built
  /// with Kineto) and a table of the operators that took the most time
  /// (fit-rank<R>.operators.txt) under <log_dir or default_root_dir>/profiler/,
  /// and global rank 0 prints its table. "none": no profiling, no cost.
  Choice<ProfilerKind> profiler = ProfilerKind::kNone;
  /// profiler = "pytorch": training batches run before the recording starts
  /// (the warm-up: first-step allocations, autotuning, graph capture).
  int64_t profiler_wait = 5;
  /// profiler = "pytorch": training batches recorded (>= 1).
  int64_t profiler_active = 5;
  std::vector<std::shared_ptr<Callback>> callbacks = {};

  // ---- Recovery (README: "When things fail").
  /// When a rank dies, freezes or hangs, fulgur's own launcher (strategy
  /// "ddp", "ddp_fork", ... with several devices) starts every local rank
  /// again, up to this many times; they resume from the newest checkpoint
  /// that verifies, or from the start when there is none yet. Under torchrun
  /// (--max-restarts) and SLURM requeue, restarted ranks resume the same way
  /// without it.
  int max_restarts = 0;
  /// A rank whose heartbeat (sent by a thread of its own, through long steps
  /// and long collectives) stops this long is named as frozen; one asleep
  /// outside any collective, using no CPU, while a peer waits for it in one
  /// this long is named as hung. Then the ranks are stopped, or restarted.
  /// 0: off (a rank is then bounded by the process group timeout only).
  std::chrono::milliseconds heartbeat_timeout = std::chrono::seconds(10);
  /// Save cadence of the ModelCheckpoint the Trainer adds: every N optimizer
  /// steps (also last.ckpt), the run's recovery points. 0: at the end of
  /// every epoch. For a ModelCheckpoint in `callbacks`, set its own
  /// ModelCheckpointOptions::every_n_train_steps instead.
  int64_t every_n_train_steps = 0;
};

/// Options of a single fit call.
struct FitOptions {
  /// Resume from this checkpoint: a path; "last", the newest checkpoint in
  /// the ModelCheckpoint's directory that verifies (last.ckpt first; a
  /// corrupt newer one is skipped with a note; an error when there is none);
  /// "auto", the same but a fresh start when the directory holds none; or
  /// "best", the best checkpoint by the ModelCheckpoint's monitor (the one
  /// the newest checkpoint records, in a new process; validate(), test()
  /// and predict() take the same words).
  std::string ckpt_path = "";
};


}  // namespace fulgur
