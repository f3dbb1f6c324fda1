// Private: the Trainer's hub. It holds what every piece of a run shares (the
// options, the strategy, the callbacks, the attached module and stage) and
// the pieces themselves, each a class owning its state:
//   FitLoop              epochs, batches, optimization, progress  (loops/fit_loop.h)
//   EvaluationLoop       validation and test passes               (loops/evaluation_loop.h)
//   PredictionLoop       predict passes                           (loops/evaluation_loop.h)
//   CheckpointConnector  the training state to and from files (connectors/checkpoint_connector.h)
//   LoggerConnector      logged values to metrics and loggers     (connectors/logger_connector.h)
// The stage runners (fit, validate, test, predict) live in trainer.cpp. A
// Module reaches the hub only through TrainerLink. Not installed.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fulgur/callbacks/callback.h"
#include "fulgur/core/module.h"
#include "fulgur/data/data_loader.h"
#include "fulgur/distributed/launchers/launcher.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/connectors/resolution.h"
#include "fulgur/trainer/trainer.h"
#include "core/trainer_link.h"
#include "strategies/strategy_driver.h"
#include "trainer/connectors/checkpoint_connector.h"
#include "trainer/connectors/logger_connector.h"
#include "trainer/connectors/signal_connector.h"
#include "trainer/loops/evaluation_loop.h"
#include "trainer/loops/fit_loop.h"

namespace fulgur {

struct Trainer::Impl final : detail::TrainerLink {
  explicit Impl(Trainer& self, TrainerOptions options);

  Trainer& self;
  TrainerOptions options;
  std::shared_ptr<Strategy> strategy;
  /// The strategy's protocol (setup, steps, checkpoints), as the loops call it.
  detail::StrategyDriver drive() const { return detail::StrategyDriver(*strategy); }
  Resolution resolution;  // the connector's choices, with the Trainer's notes added
  std::vector<std::shared_ptr<Callback>> callbacks;
  ModelCheckpoint* checkpoint_callback = nullptr;
  detail::LoopLimits limits;

  // The stage being run.
  Module* module = nullptr;
  Stage stage = Stage::kFit;
  /// While the callbacks' on_exception run: a checkpoint saved then may be
  /// one rank's alone, and runs no collective of the Trainer's own.
  bool handling_exception = false;
  /// The stage's setup hooks ran (set_up_stage_data): its teardown hooks
  /// are due.
  bool stage_set_up = false;

  detail::LoggerConnector logging;
  detail::FitLoop fit_loop{*this};
  detail::EvaluationLoop evaluation_loop{*this};
  detail::PredictionLoop prediction_loop{*this};
  detail::CheckpointConnector checkpoints{*this};
  /// The cluster environment's preemption signals, armed during fit.
  detail::SignalConnector signals;

  // ---- Stage runners (trainer.cpp).
  FitResult run_fit(Module& module, std::shared_ptr<DataLoader> train,
                    std::shared_ptr<DataLoader> val, DataModule* data, const FitOptions& fit);
  Metrics run_evaluation(Module& module, std::shared_ptr<DataLoader> loader, DataModule* data,
                         Stage stage, const std::string& ckpt_path);
  std::vector<Batch> run_predict(Module& module, std::shared_ptr<DataLoader> loader,
                                 DataModule* data, const std::string& ckpt_path);

  // ---- TrainerLink: what the Module may ask.
  Trainer& trainer() const override { return self; }
  int64_t current_epoch() const override { return self.current_epoch(); }
  int64_t global_step() const override { return self.global_step(); }
  std::shared_ptr<ProcessGroup> process_group() const override {
    return strategy->shared_process_group();
  }
  std::string_view strategy_name() const override { return strategy->name(); }
  const OptimizerConfig& configured_optimizers() const override { return fit_loop.optimizers(); }
  void manual_backward(Module& m, const at::Tensor& loss) override {
    fit_loop.manual_backward(m, loss);
  }
  void manual_optimizer_step(Module& m, torch::optim::Optimizer& optimizer) override {
    fit_loop.manual_optimizer_step(m, optimizer);
  }
  void clip_gradients(torch::optim::Optimizer& optimizer, double value,
                      GradientClipAlgorithm algorithm) override {
    fit_loop.clip_gradients(optimizer, value, algorithm);
  }

  /// Where the loops point the Module's log() (null: nowhere; a sink of
  /// its own while a CUDA graph captures the step).
  static void set_log_sink(Module& m, detail::ModuleLogSink* sink) {
    detail::TrainerLink::set_log_sink(m, sink);
  }

  /// Hook dispatch: the Module's hook first, then every callback's.
  template <class ModuleHook, class CallbackHook>
  void call_hooks(ModuleHook module_hook, CallbackHook callback_hook) {
    module_hook(*module);
    for (auto& cb : callbacks) callback_hook(*cb);
  }
  std::string root_dir() const;
  /// Every rank agreed the job is ending by `signal` (preemption, time
  /// limit, requeue request): saves last.ckpt in the checkpoint directory,
  /// waits until it is durable on every rank, lets global rank 0 requeue
  /// the job (ClusterEnvironment::requeue), and ends the process by the
  /// signal.
  [[noreturn]] void end_by_preemption(int signal);

  /// The fit's loaders made again for `epoch` (reload_dataloaders_every_n_
  /// epochs): the DataModule's train_dataloader() and val_dataloader() with
  /// DataModule::current_epoch() at `epoch`, made ready as at the fit's
  /// start (seeded, split across ranks). ConfigError when there is no
  /// training loader; the validation loader may be null (none this epoch).
  struct FitLoaders {
    std::shared_ptr<DataLoader> train;
    std::shared_ptr<DataLoader> val;
  };
  FitLoaders make_fit_loaders(DataModule& data, int64_t epoch);

  /// Under several ranks, where every rank must run as many batches (a
  /// fit's training; an evaluation whose forward is collective): the
  /// `batches` of this pass (-1: unknown) compared across the ranks, one
  /// all-gather. Ranks that differ would wait in a collective until the
  /// process-group timeout; this names every rank's count instead
  /// (ConfigError on every rank, with `limit_flag`'s cap as one fix).
  /// Returns whether some rank's loader has an `unknown_length` (the pass
  /// may then end sooner on one rank than its count says): every rank then
  /// agrees on each batch's look-ahead. False on one rank.
  bool require_equal_pass_lengths(int64_t batches, bool unknown_length, const char* which,
                                  const char* limit_flag);
  /// Where require_equal_pass_lengths said so: every rank's `ahead` (the
  /// `which` loader's next batch, or none at its end) agreed with one
  /// all-reduce, and reset on every rank when some rank's loader ended, so
  /// that the pass ends for all at the shortest rank's end; a rank that
  /// drops a batch so says it once while `noted` is false.
  void end_at_the_shortest_rank(std::optional<Batch>& ahead, const char* which, bool& noted);

 private:
  /// What every stage does first, in this order: seed, the DataModule's
  /// prepare_data/setup and its loader for `s` (or `loader`), the split
  /// across ranks. Returns the loader; ConfigError when there is none.
  std::shared_ptr<DataLoader> set_up_stage_data(Stage s, DataModule* data,
                                                std::shared_ptr<DataLoader> loader);
  /// The strategy's setup of the module, then the checkpoint `ckpt_path`
  /// names (weights only), for evaluation and predict.
  void set_up_module_and_load_weights(Module& m, const std::string& ckpt_path);
  /// What a stage's global rank 0 sends to a calling process that is not a
  /// rank (the fork launcher): `send` runs on rank 0 after the stage,
  /// `receive` in the caller with those bytes.
  struct StageResults {
    std::function<std::string()> send;
    std::function<void(const std::string&)> receive;
  };
  /// Attaches the module, runs `body` (through the launcher when there is
  /// one), and always detaches and tears down.
  /// `resume_point`: what a restarted rank resumes from, for the
  /// launcher's restart message (empty: the stage starts again).
  void run_stage(Module& module, Stage stage, const std::function<void()>& body,
                 const StageResults& results = {}, std::function<std::string()> resume_point = {});
  /// The checkpoint fit starts from: `requested` resolved, or on a restart
  /// (the cluster environment's restart_count() > 0) the newest checkpoint
  /// that verifies, falling back to `requested` while there is none.
  std::string fit_start_checkpoint(const std::string& requested);
  // `resolve` (a checkpoint path for ckpt_path=`requested`, or "" for none)
  // run on every rank; the ranks agree on how it went and on its path.
  std::string agreed_checkpoint(const std::string& requested,
                                const std::function<std::string()>& resolve);
  /// What a restarted fit resumes from: the newest checkpoint of the run's
  /// directory that verifies (`newest`), else `requested` resolved.
  struct RestartPoint {
    std::string path;
    bool newest = false;
  };
  RestartPoint restart_checkpoint(const std::string& requested);
  /// How a forked run's rank 0 returns the fit's results and weights.
  StageResults fit_results(Module& module, FitResult& result);
  /// Splits `loader` across the ranks (train: `even`, padded; evaluation:
  /// exact) unless use_distributed_sampler is off or there is one rank.
  void distribute(DataLoader& loader, bool even, const char* which);
  /// A fit's training loader made ready: its default seed, its order under
  /// overfit_batches (with a note when `notes`), the split across ranks.
  void ready_train_loader(DataLoader& loader, bool notes);
  /// A fit's validation loader made ready: its default seed, the split.
  void ready_val_loader(DataLoader& loader);
  // ConfigError when fit's validation loader is its training loader.
  void refuse_one_loader_for_both(const DataLoader* train, const DataLoader* val,
                                  bool from_data_module);
  /// DataModule::prepare_data() on each node's local rank 0, a barrier, then
  /// setup(s) on every rank.
  void prepare_and_set_up(DataModule& data, Stage s);
  /// Module::configure_callbacks() joined to `callbacks` for the stage: one
  /// of a type already there replaces it (with a note), checkpoint
  /// callbacks last; ConfigError for a null one or a repeated state_key().
  void add_module_callbacks(Module& m);
  /// The Module's and the callbacks' teardown(s) when their setup(s) ran;
  /// after a failure (`failed`) their errors are notes, not thrown.
  void tear_down_stage(Stage s, bool failed);
};

}  // namespace fulgur
