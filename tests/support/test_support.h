// File: tests/support/test_support.h
//
// What the unit tests share:
//   - EXPECT_THROWS_WITH(Type, statement, {"substring", ...}): the statement
//     throws Type (or a subclass) and what() contains every substring;
//   - TempDir: a fresh directory under /tmp, removed with everything in it;
//   - test_options(dir): TrainerOptions for tests (CPU, one epoch, no
//     progress bar, no logger, no checkpoints, outputs under `dir`);
//   - deterministic data (regression_dataset, regression_loader) that uses no
//     random generator;
//   - LinearRegression: a Module that records every hook it sees and counts
//     its steps; RecordingCallback, ValidationRecorder, RecordingDataModule.
//
//   TEST(FitLoop, Example) {
//     fulgur::test::TempDir dir;
//     fulgur::test::LinearRegression model;
//     fulgur::Trainer trainer(fulgur::test::test_options(dir));
//     trainer.fit(model, fulgur::test::regression_loader(/*num_batches=*/4));
//     EXPECT_EQ(model.training_steps, 4);
//   }
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <typeinfo>
#include <utility>
#include <vector>

#include "fulgur/fulgur.h"

namespace fulgur {
class ProcessGroup;
}  // namespace fulgur

namespace fulgur::test {

// ---- Exceptions.

/// Success when `what` contains every one of `substrings`; otherwise a
/// failure naming the missing ones and quoting the whole message.
::testing::AssertionResult message_contains(const std::string& what,
                                            const std::vector<std::string>& substrings);
/// The demangled name of a type, for failure messages.
std::string type_name(const std::type_info& type);

/// Runs `fn`; success when it throws `Exception` (or a subclass) whose what()
/// contains every substring.
template <class Exception, class Fn>
::testing::AssertionResult throws_with(Fn&& fn, const std::vector<std::string>& substrings) {
  try {
    fn();
  } catch (const Exception& e) {
    return message_contains(e.what(), substrings);
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure()
           << "expected " << type_name(typeid(Exception)) << ", but it threw "
           << type_name(typeid(e)) << ": " << e.what();
  } catch (...) {
    return ::testing::AssertionFailure() << "expected " << type_name(typeid(Exception))
                                         << ", but it threw something that is not a "
                                            "std::exception";
  }
  return ::testing::AssertionFailure()
         << "expected " << type_name(typeid(Exception)) << ", but nothing was thrown";
}

}  // namespace fulgur::test

/// EXPECT_THROWS_WITH(fulgur::ConfigError, Trainer({.max_epochs = -5}), {"max_epochs=-5"});
/// A statement with a top-level comma outside parentheses must be wrapped in
/// parentheses.
#define EXPECT_THROWS_WITH(ExceptionType, statement, ...)                                       \
  EXPECT_TRUE(::fulgur::test::throws_with<ExceptionType>([&] { statement; },                    \
                                                         std::vector<std::string> __VA_ARGS__)) \
      << "  statement: " #statement
#define ASSERT_THROWS_WITH(ExceptionType, statement, ...)                                       \
  ASSERT_TRUE(::fulgur::test::throws_with<ExceptionType>([&] { statement; },                    \
                                                         std::vector<std::string> __VA_ARGS__)) \
      << "  statement: " #statement

/// Skips the current test unless `n` CUDA devices are visible.
#define FULGUR_SKIP_UNLESS_CUDA(n)                                                        \
  do {                                                                                    \
    const auto fulgur_found_cuda_ = static_cast<int64_t>(torch::cuda::device_count());    \
    if (fulgur_found_cuda_ < static_cast<int64_t>(n)) {                                   \
      GTEST_SKIP() << "needs " << (n) << " CUDA device(s), found " << fulgur_found_cuda_; \
    }                                                                                     \
  } while (false)

namespace fulgur::test {

// ---- Files.

/// A fresh directory /tmp/fulgur_test_XXXXXX (mkdtemp); the destructor
/// removes it and everything below it.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  /// `path()/relative` (not created).
  std::string file(const std::string& relative) const;

 private:
  std::string path_;
};

/// Regular files below `dir`, as sorted paths relative to `dir`; empty when
/// `dir` does not exist.
std::vector<std::string> list_files(const std::string& dir);
/// The names of what is in `dir` (files and directories, not below them),
/// sorted.
std::vector<std::string> entries_of(const std::string& dir);
std::string read_text(const std::string& path);
std::vector<std::string> read_lines(const std::string& path);
void write_text(const std::string& path, const std::string& text);
/// A checkpoint holding one tensor under "value", through `io`.
void save_tensor(fulgur::CheckpointIO& io, const at::Tensor& value, const std::string& path);
/// The "value" of such a checkpoint.
at::Tensor load_tensor(fulgur::CheckpointIO& io, const std::string& path);
/// A pid no process has: a child that exited and was reaped.
pid_t dead_pid();
/// This machine's name, as temporary checkpoint files record their writer's.
std::string host_name();
/// Flips the bits of the byte in the middle of `path` (a checkpoint's data;
/// its checksum footer stays intact).
void damage_middle_byte(const std::string& path);
/// "a,b,,c" → {"a", "b", "", "c"}.
std::vector<std::string> split(const std::string& text, char sep);

// ---- Trainer options.

/// CPU, max_epochs = 1, outputs under `dir`, no progress bar, no logger, no
/// checkpointing. Tests change what they exercise.
fulgur::TrainerOptions test_options(const TempDir& dir);
/// test_options for resuming from every point of a run: no sanity check,
/// checkpointing on, and two ModelCheckpoints keeping every file they
/// write: one after each training step in `root/<dir>/steps`, and one
/// after each validation (monitoring val_loss) in `root/<dir>/validated`.
fulgur::TrainerOptions checkpoint_every_step_options(const TempDir& root, const std::string& dir);
/// How many times `what` occurs in `text` (overlapping occurrences too).
int count_occurrences(const std::string& text, const std::string& what);
/// test_options with checkpointing on and one ModelCheckpoint of `checkpoint`'s
/// options as the only callback (returned through `callback` when given).
fulgur::TrainerOptions checkpointed_options(
    const TempDir& dir, fulgur::ModelCheckpointOptions checkpoint,
    std::shared_ptr<fulgur::ModelCheckpoint>* callback = nullptr);

// ---- Data. No random generator is involved: the same call gives the same
// tensors in every process.

/// `n` samples: x[i, j] = sin(0.37 * (i * in_features + j) + 0.1),
/// y = x · linspace(-1, 1) + 0.3 (shape [n, 1]). Batches are (x, y) pairs.
std::shared_ptr<fulgur::TensorDataset> regression_dataset(int64_t n, int64_t in_features = 3);
/// A loader of exactly `num_batches` batches of `batch_size` samples.
std::shared_ptr<fulgur::DatasetLoader> regression_loader(int64_t num_batches,
                                                         int64_t batch_size = 2,
                                                         bool shuffle = false);
/// 10 regression samples in batches of 4, 4 and 2 (an uneven last batch).
std::shared_ptr<fulgur::DatasetLoader> uneven_loader();
/// regression_loader(num_batches)'s batches from a generator that does not
/// say its length (a loader of unknown length).
std::shared_ptr<fulgur::IterableLoader> generator_loader(int64_t num_batches);
/// A dataset of one int64 tensor 0..n-1 (tensor batches): shows the order.
std::shared_ptr<fulgur::TensorDataset> index_dataset(int64_t n);
/// The values of a 1-d int64 tensor.
std::vector<int64_t> to_vector(const at::Tensor& tensor);

// ---- Parameters.

/// The state a LibTorch archive written by `write` holds (written, then
/// read back as a checkpoint is): what nn::Module::save or Optimizer::save
/// put in an archive, to compare with a StateDict.
fulgur::StateDict archived(const std::function<void(torch::serialize::OutputArchive&)>& write);

/// The tensors torch::save wrote to `path` as a vector (a worker's parameters).
std::vector<at::Tensor> load_tensors(const std::string& path);
/// How close two saved tensor lists must be: bit-identical (the same ranks
/// on another launch path), or allclose(rtol 1e-4, atol) (one process with
/// the double batch sums in another order).
struct TensorMatch {
  bool exact = false;
  double atol = 1e-5;
};
/// The two files of load_tensors hold as many tensors, pairwise matching.
::testing::AssertionResult same_params(const std::string& a, const std::string& b,
                                       TensorMatch match = {});

/// Every parameter bit-identical (torch::equal), matched by name.
::testing::AssertionResult parameters_equal(const torch::nn::Module& a, const torch::nn::Module& b);
/// Every parameter allclose(rtol, atol), matched by name.
::testing::AssertionResult parameters_close(const torch::nn::Module& a, const torch::nn::Module& b,
                                            double rtol = 1e-5, double atol = 1e-6);
/// Copies every parameter of `from` into `to` (same names and shapes).
void copy_parameters(const torch::nn::Module& from, torch::nn::Module& to);
/// Detached copies of the parameters, in order.
std::vector<at::Tensor> clone_parameters(const torch::nn::Module& module);
/// As many tensors in `a` as in `b`, each bit-identical (torch::equal) to
/// its pair; a failure names the index.
void expect_tensors_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b);
/// The lr of the first param group of an SGD optimizer.
double sgd_lr(torch::optim::Optimizer& optimizer);

// ---- Ranks as threads.

/// Runs body(rank, group) on `world` ranks of this process at once, a
/// thread each, every one with a real Gloo group over 127.0.0.1 (20 s
/// timeout); rethrows the first rank's failure once all have ended.
void on_ranks(int world,
              const std::function<void(int, std::shared_ptr<fulgur::ProcessGroup>)>& body);

// ---- Recording fixtures.

/// Keeps the events named in `names`, in order.
std::vector<std::string> only(const std::vector<std::string>& events,
                              std::initializer_list<std::string_view> names);
/// Keeps the events starting with `prefix`, in order.
std::vector<std::string> with_prefix(const std::vector<std::string>& events,
                                     std::string_view prefix);
/// Keeps the events starting with any of `prefixes`, in order.
std::vector<std::string> with_prefix(const std::vector<std::string>& events,
                                     std::initializer_list<std::string_view> prefixes);

struct LinearRegressionOptions {
  int64_t in_features = 3;
  double lr = 0.05;
  double momentum = 0.0;
  bool bias = true;
};

/// y = fc(x) with MSE loss and SGD. Records the name of every step and hook
/// the Trainer calls into `events` ("training_step", "on_train_epoch_end",
/// ...), counts steps, and logs "train_loss", "val_loss" and "test_loss".
/// The *_hook members let a test add behaviour to a step.
class LinearRegression : public fulgur::Module {
 public:
  using StepHook = std::function<void(LinearRegression&, fulgur::Batch&, int64_t)>;

  explicit LinearRegression(LinearRegressionOptions options = {});

  at::Tensor forward(const at::Tensor& x);

  at::Tensor training_step(fulgur::Batch& batch, int64_t batch_idx) override;
  void validation_step(fulgur::Batch& batch, int64_t batch_idx) override;
  void test_step(fulgur::Batch& batch, int64_t batch_idx) override;
  fulgur::Batch predict_step(fulgur::Batch& batch, int64_t batch_idx) override;
  fulgur::OptimizerConfig configure_optimizers() override;

  void configure_model() override;
  void on_fit_start() override;
  void on_fit_end() override;
  void on_train_start() override;
  void on_train_end() override;
  void on_train_epoch_start() override;
  void on_train_epoch_end() override;
  void on_train_batch_start(const fulgur::Batch& batch, int64_t batch_idx) override;
  void on_train_batch_end(const at::Tensor& loss, const fulgur::Batch& batch,
                          int64_t batch_idx) override;
  void on_validation_epoch_start() override;
  void on_validation_epoch_end() override;
  void on_test_epoch_start() override;
  void on_test_epoch_end() override;
  void on_predict_epoch_start() override;
  void on_predict_epoch_end() override;
  void on_before_backward(const at::Tensor& loss) override;
  void on_after_backward() override;
  void on_before_optimizer_step(torch::optim::Optimizer& optimizer) override;
  void on_before_zero_grad(torch::optim::Optimizer& optimizer) override;
  void on_save_checkpoint(fulgur::StateDict& checkpoint) override;
  void on_load_checkpoint(const fulgur::StateDict& checkpoint) override;

  /// How many times `event` was recorded.
  int64_t count(const std::string& event) const;

  LinearRegressionOptions config;
  torch::nn::Linear fc{nullptr};
  /// The optimizer of the latest configure_optimizers call.
  std::shared_ptr<torch::optim::SGD> optimizer;
  /// When set, configure_optimizers also returns these schedulers.
  std::function<std::vector<fulgur::SchedulerConfig>(torch::optim::Optimizer&)> make_schedulers;
  /// Called at the start of the step, before the forward pass.
  StepHook train_hook, val_hook, test_hook;
  /// Called from on_train_epoch_end.
  std::function<void(LinearRegression&)> train_epoch_end_hook;

  std::vector<std::string> events;
  int64_t training_steps = 0;
  /// validation_step calls outside the sanity check / during it.
  int64_t validation_steps = 0;
  int64_t sanity_steps = 0;
  int64_t test_steps = 0;
  int64_t predict_steps = 0;
  /// Set when validation_step ran with the module in training mode.
  bool validated_in_training_mode = false;
};

/// Keeps every log_metrics call.
class RecordingLogger : public fulgur::Logger {
 public:
  std::string name() const override { return "recording"; }
  std::string log_dir() const override { return ""; }
  void log_hyperparams(const fulgur::HParams&) override {}
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) override {
    calls.emplace_back(step, metrics);
  }
  /// The values of `key` in logging order, with their steps.
  std::vector<std::pair<int64_t, double>> series(const std::string& key) const;
  std::vector<std::pair<int64_t, std::map<std::string, double>>> calls;
};

/// test_options with `logger` as the only logger (logging every step) and
/// `callback` as the only callback.
fulgur::TrainerOptions logged_options(const TempDir& dir, std::shared_ptr<RecordingLogger> logger,
                                      std::shared_ptr<fulgur::Callback> callback);

/// Appends "cb:<hook>" to `events` (shared with a LinearRegression to check
/// that callbacks run right after the Module's hook of the same name).
class RecordingCallback : public fulgur::Callback {
 public:
  explicit RecordingCallback(std::vector<std::string>* events) : events_(events) {}
  std::string state_key() const override { return "RecordingCallback"; }
  void on_fit_start(fulgur::Trainer&, fulgur::Module&) override;
  void on_fit_end(fulgur::Trainer&, fulgur::Module&) override;
  void on_train_start(fulgur::Trainer&, fulgur::Module&) override;
  void on_train_end(fulgur::Trainer&, fulgur::Module&) override;
  void on_train_epoch_start(fulgur::Trainer&, fulgur::Module&) override;
  void on_train_epoch_end(fulgur::Trainer&, fulgur::Module&) override;
  void on_train_batch_start(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch&,
                            int64_t) override;
  void on_train_batch_end(fulgur::Trainer&, fulgur::Module&, const at::Tensor&,
                          const fulgur::Batch&, int64_t) override;
  void on_validation_start(fulgur::Trainer&, fulgur::Module&) override;
  void on_validation_end(fulgur::Trainer&, fulgur::Module&) override;
  void on_before_optimizer_step(fulgur::Trainer&, fulgur::Module&,
                                torch::optim::Optimizer&) override;

 private:
  void record(const char* hook);
  std::vector<std::string>* events_;
};

/// Records the global step at which every (non-sanity) validation run starts,
/// and counts sanity-check runs.
class ValidationRecorder : public fulgur::Callback {
 public:
  std::string state_key() const override { return "ValidationRecorder"; }
  void on_validation_start(fulgur::Trainer& trainer, fulgur::Module&) override;

  std::vector<int64_t> steps_at_validation;
  /// (epoch, batch_idx) at each validation run.
  std::vector<std::pair<int64_t, int64_t>> positions;
  int64_t sanity_runs = 0;
};

/// A DataModule recording "prepare_data", "setup:<stage>",
/// "teardown:<stage>" and "<name>_dataloader" calls, with regression loaders
/// of the given sizes.
class RecordingDataModule : public fulgur::DataModule {
 public:
  explicit RecordingDataModule(int64_t train_batches = 4, int64_t val_batches = 2,
                               int64_t batch_size = 2);
  void prepare_data() override;
  void setup(fulgur::Stage stage) override;
  void teardown(fulgur::Stage stage) override;
  std::shared_ptr<fulgur::DataLoader> train_dataloader() override;
  std::shared_ptr<fulgur::DataLoader> val_dataloader() override;
  std::shared_ptr<fulgur::DataLoader> test_dataloader() override;
  std::shared_ptr<fulgur::DataLoader> predict_dataloader() override;

  std::vector<std::string> events;
  int64_t train_batches;
  int64_t val_batches;
  int64_t batch_size;
};

}  // namespace fulgur::test
