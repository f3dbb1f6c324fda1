// File: fulgur/trainer/trainer.h
//
// The Trainer runs the loops — fit, validate, test, predict — over a Module
// and its data, with callbacks and loggers. Everything device-, rank- and
// file-related goes through the Strategy the connector built from the
// flags, so the same code runs on one CPU or many processes.
//
//   fulgur::Trainer trainer({.max_epochs = 5, .seed = 42});
//   auto result = trainer.fit(model, data);           // DataModule
//   auto metrics = trainer.test(model, data);
//   std::cout << metrics.at("test_acc") << "\n";
//
// Construction resolves the flags and throws ConfigError listing every
// problem; describe() states what was chosen and why.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fulgur/data/batch.h"
#include "fulgur/data/data_module.h"
#include "fulgur/trainer/connectors/resolution.h"
#include "fulgur/trainer/trainer_options.h"

namespace fulgur {

class Callback;
class DataLoader;
class Logger;
class Module;
class ModelCheckpoint;
class Strategy;

using Metrics = std::map<std::string, double>;

/// What fit returns.
struct FitResult {
  /// The latest value of every logged metric (epoch aggregates included).
  Metrics metrics;
  /// Best checkpoint by the monitored metric (or the latest); "" when none.
  std::string best_model_path;
  /// last.ckpt; "" when checkpointing is off.
  std::string last_model_path;
  int64_t global_step = 0;
  /// Epochs completed.
  int64_t epochs = 0;
  /// Why training stopped ("max_epochs", "max_steps", "should_stop", ...).
  std::string stop_reason;
};

class Trainer {
 public:
  explicit Trainer(TrainerOptions options = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // ---- Entry points.
  FitResult fit(Module& module, DataModule& data, FitOptions options = {});
  FitResult fit(Module& module, std::shared_ptr<DataLoader> train,
                std::shared_ptr<DataLoader> val = nullptr, FitOptions options = {});
  /// Runs one pass over the validation data; returns the epoch metrics.
  /// `ckpt_path` loads weights first ("" keeps the module's current ones).
  Metrics validate(Module& module, DataModule& data, const std::string& ckpt_path = "");
  Metrics validate(Module& module, std::shared_ptr<DataLoader> val,
                   const std::string& ckpt_path = "");
  Metrics test(Module& module, DataModule& data, const std::string& ckpt_path = "");
  Metrics test(Module& module, std::shared_ptr<DataLoader> test, const std::string& ckpt_path = "");
  /// predict_step's outputs, one per batch, in order.
  std::vector<Batch> predict(Module& module, DataModule& data, const std::string& ckpt_path = "");
  std::vector<Batch> predict(Module& module, std::shared_ptr<DataLoader> data,
                             const std::string& ckpt_path = "");

  // ---- Components.
  Strategy& strategy() const;
  const std::vector<std::shared_ptr<Callback>>& callbacks() const;
  const std::vector<std::shared_ptr<Logger>>& loggers() const;
  /// The first ModelCheckpoint among the callbacks; null when none.
  ModelCheckpoint* checkpoint_callback() const;
  const TrainerOptions& options() const;
  /// The resolved configuration as the JSON object `fulgur resolve` prints
  /// for the same flags: names, counts, ranks, and the notes explaining
  /// every default chosen (the connector's and the loops').
  std::string describe() const;
  const Resolution& resolution() const;

  // ---- Run state (valid during and after a run).
  Stage stage() const;
  bool sanity_checking() const;
  /// Epoch being trained (0-based); after fit, the number completed.
  int64_t current_epoch() const;
  /// Optimizer steps taken.
  int64_t global_step() const;
  /// Training batches after which the optimizers stepped (Lightning's
  /// _batches_that_stepped): global_step under automatic optimization, one
  /// per batch that stepped any optimizer under manual optimization. The
  /// loggers get a batch's values when it ends with this a multiple of
  /// log_every_n_steps; the monitoring callbacks keep the same cadence.
  int64_t batches_that_stepped() const;
  /// Batch index within the current training epoch.
  int64_t batch_idx() const;
  /// Training batches per epoch after limits; -1 when unknown.
  int64_t num_training_batches() const;
  /// The epoch limit of fit as resolved (max_epochs, or its default); -1:
  /// none (max_steps or max_time ends the fit).
  int64_t max_epochs() const;
  /// The loader fit trains on (sharded for this rank); null outside fit.
  /// A callback that reads it (a pass over the data at the end of fit)
  /// puts its position back (state_dict / load_state_dict).
  DataLoader* train_dataloader() const;
  /// The loader of the predict pass running (its sample_indices() name the
  /// samples of each batch); nullptr outside Trainer::predict.
  DataLoader* predict_dataloader() const;
  /// Batches of the validation, test or predict pass running (or last
  /// run), after limits; -1 when unknown.
  int64_t num_evaluation_batches() const;
  /// Asks the fit loop to stop at the next safe point (respects min_epochs).
  /// With several ranks, one rank's request stops them all after the same
  /// batch (the ranks agree on it after every batch).
  void request_stop();
  /// Batches per optimizer step now: accumulate_grad_batches, or what a
  /// callback set (GradientAccumulationScheduler).
  int64_t accumulate_grad_batches() const;
  /// Changes it from the next batch on; call at an epoch's start
  /// (on_train_epoch_start). ConfigError when < 1, inside an accumulation
  /// window, or with manual optimization.
  void set_accumulate_grad_batches(int64_t n);
  bool should_stop() const;
  /// The fit running has validation to run (a validation loader, and
  /// limit_val_batches not 0), whether or not it has run yet.
  bool fit_validates() const;
  /// Latest value of every logged metric.
  const Metrics& callback_metrics() const;
  /// Metrics logged with prog_bar.
  const Metrics& progress_bar_metrics() const;
  /// Root directory of this run's outputs.
  std::string default_root_dir() const;
  /// Where the loggers write ("" without loggers).
  std::string log_dir() const;
  /// Number of optimizer steps remaining is unknown; estimated stepping
  /// batches for schedulers that need it (-1 when the loader length is unknown).
  int64_t estimated_stepping_batches() const;

  // ---- Checkpoints.
  /// Writes the complete training state (for resume) to `path` through the
  /// strategy. Call from callbacks, on every rank at the same point (as the
  /// Trainer's own saves are made): with several ranks a save is collective
  /// (the ranks' callback metrics are compared and the states of the metric
  /// objects logged in training_step combined), so a save on some ranks only
  /// waits for the others and is named as a desync.
  void save_checkpoint(const std::string& path);

  /// Internal state, shared with the loops (src/trainer/trainer_impl.h).
  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fulgur
