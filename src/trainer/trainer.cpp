#include "fulgur/trainer/trainer.h"

#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <typeindex>
#include <variant>

#include "fulgur/callbacks/model_checkpoint.h"
#include "fulgur/callbacks/on_exception_checkpoint.h"
#include "fulgur/callbacks/progress_bar.h"
#include "fulgur/callbacks/timer.h"
#include "fulgur/core/errors.h"
#include "fulgur/nn/state_dict.h"
#include "fulgur/distributed/launchers/launcher.h"
#include "fulgur/loggers/logger.h"
#include "fulgur/plugins/environments/cluster_environment.h"
#include "fulgur/trainer/connectors/accelerator_connector.h"
#include "fulgur/utilities/host_allocator.h"
#include "fulgur/utilities/seed.h"
#include "fulgur/utilities/torch_compat.h"
#include "distributed/launchers/heartbeat.h"
#include "strategies/early_failure.h"
#include "strategies/every_rank.h"
#include "trainer/loop_flags.h"
#include "trainer/trainer_impl.h"
#include "trainer/tuner_trial.h"

namespace fulgur {

namespace {

// Whether `saved` holds an entry (at any depth of its sections) that `own`
// does not: the weights of layers this module has not built.
bool has_entries_beyond(const StateDict& saved, const StateDict& own) {
  for (const auto& key : saved.keys()) {
    if (const StateDict* section = saved.find_section(key)) {
      const StateDict* mine = own.find_section(key);
      if (mine == nullptr || has_entries_beyond(*section, *mine)) return true;
    } else if (!own.contains(key)) {
      return true;
    }
  }
  return false;
}

}  // namespace

namespace detail {

// The problems with the loop flags; the connector reports them together
// with its own in one FlagError.
std::vector<std::string> check_loop_flags(const TrainerOptions& o) {
  std::vector<std::string> problems;
  auto check = [&](bool ok, std::string message) {
    if (!ok) problems.push_back(std::move(message));
  };
  if (o.max_epochs) {
    check(*o.max_epochs >= -1,
          str("max_epochs=", *o.max_epochs, ": must be >= -1 (-1 trains until max_steps)."));
  }
  check(o.min_epochs >= 0, str("min_epochs=", o.min_epochs, ": must be >= 0."));
  check(o.max_steps >= -1, str("max_steps=", o.max_steps, ": must be >= -1 (-1: no limit)."));
  check(o.min_steps >= 0, str("min_steps=", o.min_steps, ": must be >= 0."));
  check(o.fast_dev_run >= 0, str("fast_dev_run=", o.fast_dev_run,
                                 ": must be >= 0 (true or N runs N batches, 0 is off)."));
  check(o.accumulate_grad_batches >= 1,
        str("accumulate_grad_batches=", o.accumulate_grad_batches, ": must be >= 1."));
  check(o.log_every_n_steps >= 1, str("log_every_n_steps=", o.log_every_n_steps,
                                      ": must be >= 1. Pass logger=false to turn logging off."));
  check(o.profiler.is_valid(),
        str("profiler=\"", o.profiler.text(), "\": pass \"simple\" (time per phase of the fit loop), "
            "\"pytorch\" (LibTorch's operator profiler over a window of batches) or \"none\"."));
  check(o.profiler_wait >= 0,
        str("profiler_wait=", o.profiler_wait,
            ": must be >= 0 (the training batches run before the pytorch profiler records)."));
  check(o.profiler_active >= 1,
        str("profiler_active=", o.profiler_active,
            ": must be >= 1 (the training batches the pytorch profiler records)."));
  check(o.num_sanity_val_steps >= -1,
        str("num_sanity_val_steps=", o.num_sanity_val_steps, ": must be >= -1 (-1: all)."));
  check(o.gradient_clip_algorithm.is_valid(),
        str("gradient_clip_algorithm=\"", o.gradient_clip_algorithm.text(), "\": pass ",
            Choice<GradientClipAlgorithm>::spellings(), "."));
  if (o.gradient_clip_val) {
    check(std::isfinite(*o.gradient_clip_val) && *o.gradient_clip_val >= 0.0,
          str("gradient_clip_val=", *o.gradient_clip_val,
              ": must be finite and >= 0 (0 or unset turns clipping off)."));
  }
  if (o.check_val_every_n_epoch) {
    check(*o.check_val_every_n_epoch >= 1,
          str("check_val_every_n_epoch=", *o.check_val_every_n_epoch,
              ": must be >= 1, or unset to validate by batch count across epochs."));
  }
  auto check_limit = [&](const BatchLimit& l, const char* name) {
    if (l.is_fraction()) {
      check(l.fraction() >= 0.0 && l.fraction() <= 1.0,
            str(name, "=", l.text(),
                ": a fraction must be in [0.0, 1.0]; pass an int for a "
                "number of batches."));
    } else {
      check(l.count() >= 0, str(name, "=", l.text(), ": a batch count must be >= 0."));
    }
  };
  check_limit(o.limit_train_batches, "limit_train_batches");
  check_limit(o.limit_val_batches, "limit_val_batches");
  check_limit(o.limit_test_batches, "limit_test_batches");
  check_limit(o.limit_predict_batches, "limit_predict_batches");
  check_limit(o.overfit_batches, "overfit_batches");
  if (!o.overfit_batches.is_zero()) {
    // overfit_batches sets both limits: a second value for either is a
    // conflict, not something to pick a winner for.
    auto alone = [&](const BatchLimit& l, const char* name) {
      check(l.is_fraction() && l.fraction() == 1.0,
            str("overfit_batches=", o.overfit_batches.text(), " sets ", name,
                ", which is given too (", name, "=", l.text(),
                "): pass one of them (overfit_batches trains and validates on the same first "
                "batches every epoch)."));
    };
    alone(o.limit_train_batches, "limit_train_batches");
    alone(o.limit_val_batches, "limit_val_batches");
    check(o.fast_dev_run == 0,
          str("overfit_batches=", o.overfit_batches.text(), " and fast_dev_run=", o.fast_dev_run,
              " both set how many batches run: pass one of them."));
  }
  check(o.reload_dataloaders_every_n_epochs >= 0,
        str("reload_dataloaders_every_n_epochs=", o.reload_dataloaders_every_n_epochs,
            ": must be >= 0 (0: the loaders are made once per fit)."));
  check(!(o.detect_anomaly && o.cuda_graph),
        "detect_anomaly=true with cuda_graph=true: anomaly detection reads every backward "
        "operation's output back to the host, which a CUDA graph cannot capture. Find the "
        "anomaly without cuda_graph, then capture.");
  if (o.val_check_interval.is_fraction()) {
    check(o.val_check_interval.fraction() > 0.0 && o.val_check_interval.fraction() <= 1.0,
          str("val_check_interval=", o.val_check_interval.text(),
              ": a fraction of the epoch must be in (0.0, 1.0]; pass an int to validate every "
              "N batches."));
    // Lightning refuses it too: unset counts batches across epochs.
    check(o.check_val_every_n_epoch || o.val_check_interval.fraction() >= 1.0,
          str("val_check_interval=", o.val_check_interval.text(),
              " with check_val_every_n_epoch unset: a fraction is of each epoch, and unset "
              "counts batches across epochs. Pass an int val_check_interval (validate every N "
              "batches since the start), or set check_val_every_n_epoch (1: a fraction of "
              "every epoch)."));
  } else {
    check(o.val_check_interval.count() >= 1,
          str("val_check_interval=", o.val_check_interval.text(), ": a batch count must be >= 1."));
  }
  if (o.max_epochs && o.min_epochs > 0 && *o.max_epochs >= 0) {
    check(o.min_epochs <= *o.max_epochs,
          str("min_epochs=", o.min_epochs, " > max_epochs=", *o.max_epochs,
              ": lower min_epochs or raise max_epochs."));
  }
  check(o.max_steps < 0 || o.min_steps <= o.max_steps,
        str("min_steps=", o.min_steps, " > max_steps=", o.max_steps,
            ": training stops at max_steps, so min_steps could never be met. Lower min_steps "
            "or raise max_steps."));
  if (o.max_time) {
    check(o.max_time->count() > 0,
          str("max_time=", o.max_time->count(), " ms: must be > 0, or unset for no limit."));
  }
  check(o.max_restarts >= 0,
        str("max_restarts=", o.max_restarts, ": must be >= 0 (0: no restart)."));
  check(o.heartbeat_timeout.count() >= 0,
        str("heartbeat_timeout=", o.heartbeat_timeout.count(), " ms: must be >= 0 (0: off)."));
  check(o.every_n_train_steps >= 0,
        str("every_n_train_steps=", o.every_n_train_steps, ": must be >= 0 (0: once per epoch)."));
  if (o.every_n_train_steps > 0) {
    check(o.enable_checkpointing,
          str("every_n_train_steps=", o.every_n_train_steps,
              " sets how often checkpoints are saved, but enable_checkpointing=false saves none: "
              "drop one of the two."));
  }
  // Each callback: present, and not a second home for a Trainer flag.
  for (size_t i = 0; i < o.callbacks.size(); ++i) {
    const Callback* cb = o.callbacks[i].get();
    check(cb != nullptr, str("callbacks[", i, "] is null: pass an instance."));
    if (o.max_time) {
      check(dynamic_cast<const Timer*>(cb) == nullptr,
            str("max_time is set and callbacks[", i,
                "] is a Timer too: set the duration in one place (TimerOptions::duration or "
                "max_time)."));
    }
    if (o.every_n_train_steps > 0) {
      check(dynamic_cast<const ModelCheckpoint*>(cb) == nullptr,
            str("every_n_train_steps=", o.every_n_train_steps,
                " sets the cadence of the ModelCheckpoint the Trainer adds, but callbacks[", i,
                "] is a ModelCheckpoint of your own: set ModelCheckpointOptions::"
                "every_n_train_steps on it instead."));
    }
  }
  // (The list may be as long as a config file: each problem is said once,
  // with the list shortened.)
  const std::string logger_text = shortened(o.logger.text());
  if (!o.logger.problem().empty()) {
    check(false, str("logger=\"", logger_text, "\": ", o.logger.problem()));
  }
  std::set<std::string> logger_names, logger_problems;
  for (const auto& name : o.logger.names()) {
    if (!logger_registry().contains(name) && logger_problems.insert(name).second) {
      check(false,
            str("logger=\"", logger_text, "\": ", logger_registry().unknown_name_message(name)));
    }
    if (!logger_names.insert(name).second && logger_problems.insert(name).second) {
      check(false, str("logger=\"", logger_text, "\": \"", shortened(name),
                       "\" is given twice; its files would mix. Name each logger once."));
    }
  }
  std::map<std::string, size_t> logger_keys, logger_files;
  for (size_t i = 0; i < o.loggers.size(); ++i) {
    check(o.loggers[i] != nullptr, str("loggers[", i, "] is null: pass an instance."));
    if (o.loggers[i] == nullptr) continue;
    const auto [it, fresh] = logger_keys.emplace(o.loggers[i]->state_key(), i);
    const auto [same, fresh_files] = logger_files.emplace(o.loggers[i]->files_key(), i);
    check(fresh && fresh_files,
          str("loggers[", fresh ? same->second : it->second, "] and loggers[", i,
              "] both write to ", fresh ? o.loggers[i]->files_key() : o.loggers[i]->state_key(),
              ": their files would mix. Give one of them another save_dir or name."));
  }
  return problems;
}

}  // namespace detail

namespace {

// Checkpoint callbacks run last, so that every other callback's state in a
// checkpoint is already updated for the step being saved, and an exception's
// checkpoint is written once the others put back what they changed (EMA's
// weights), as Lightning does.
void checkpoints_last(std::vector<std::shared_ptr<Callback>>& callbacks) {
  std::stable_partition(callbacks.begin(), callbacks.end(), [](const auto& cb) {
    return dynamic_cast<ModelCheckpoint*>(cb.get()) == nullptr &&
           dynamic_cast<OnExceptionCheckpoint*>(cb.get()) == nullptr;
  });
}

template <class T>
bool has_callback(const std::vector<std::shared_ptr<Callback>>& callbacks) {
  return std::any_of(callbacks.begin(), callbacks.end(),
                     [](const auto& cb) { return dynamic_cast<T*>(cb.get()) != nullptr; });
}

// Each callback's state has its own place in a checkpoint.
void check_unique_state_keys(const std::vector<std::shared_ptr<Callback>>& callbacks,
                             const char* where) {
  std::map<std::string, std::string> keys;
  for (const auto& cb : callbacks) {
    const std::string name = c10::demangle(typeid(*cb).name());
    auto [it, fresh] = keys.emplace(cb->state_key(), name);
    if (!fresh) {
      throw ConfigError(str(where, ": a ", name, " and a ", it->second,
                            " have the same state_key() \"", it->first,
                            "\", so a checkpoint could not tell their states apart. Give one "
                            "of them other values of the options the key shows (other options, "
                            "such as a dirpath or a patience, are not in it), or another "
                            "state_key() (a subclass that overrides it)."));
    }
  }
}

}  // namespace

Trainer::Impl::Impl(Trainer& owner, TrainerOptions opts) : self(owner), options(std::move(opts)) {
  auto connected = connect(options, EnvView(), detail::check_loop_flags(options));
  strategy = std::move(connected.strategy);
  resolution = std::move(connected.resolution);
  apply_torch_flags(resolution, strategy->accelerator());

  limits.train = options.limit_train_batches;
  limits.val = options.limit_val_batches;
  limits.test = options.limit_test_batches;
  limits.predict = options.limit_predict_batches;
  limits.num_sanity_val_steps = options.num_sanity_val_steps;
  limits.max_steps = options.max_steps;
  if (options.max_epochs) {
    limits.max_epochs = *options.max_epochs;
  } else if (options.max_steps != -1) {
    limits.max_epochs = -1;
    resolution.notes.push_back("max_epochs=-1 because max_steps is set and max_epochs is not");
  } else {
    limits.max_epochs = 1000;
    resolution.notes.push_back("max_epochs=1000 because neither max_epochs nor max_steps is set");
  }
  bool fast = options.fast_dev_run > 0;
  if (fast) {
    int64_t n = options.fast_dev_run;
    limits.train = limits.val = limits.test = limits.predict =
        BatchLimit(static_cast<long long>(n));
    limits.max_steps = n;
    limits.max_epochs = 1;
    limits.num_sanity_val_steps = 0;
    options.val_check_interval = 1.0;
    options.check_val_every_n_epoch = 1;
    resolution.notes.push_back(
        str("fast_dev_run=", n, ": ", n,
            " batch(es) per loop, 1 epoch, no sanity check, no checkpoints, no "
            "loggers"));
  }
  if (!options.overfit_batches.is_zero()) {
    limits.train = limits.val = options.overfit_batches;
    limits.train_flag = limits.val_flag = "overfit_batches";
    const std::string n = options.overfit_batches.text();
    const std::string what =
        options.overfit_batches.is_fraction() ? "fraction " + n : n + " batch(es)";
    resolution.notes.push_back(str("overfit_batches=", n, ": every epoch trains on the same first ",
                                   what,
                                   " of the training loader (in order) and validates on the "
                                   "first ",
                                   what, " of the validation loader"));
  }
  if (options.detect_anomaly) {
    resolution.notes.push_back(
        "detect_anomaly=true: during fit every backward operation's outputs are checked for NaN "
        "(slow; for debugging)");
  }

  for (const auto& cb : options.callbacks) {
    callbacks.push_back(cb);
    if (!checkpoint_callback) checkpoint_callback = dynamic_cast<ModelCheckpoint*>(cb.get());
  }

  if (options.enable_checkpointing && !checkpoint_callback && !fast) {
    auto cb = std::make_shared<ModelCheckpoint>(
        ModelCheckpointOptions{.every_n_train_steps = options.every_n_train_steps});
    checkpoint_callback = cb.get();
    callbacks.push_back(cb);
  }
  if (!options.enable_checkpointing || fast) {
    // A ModelCheckpoint passed explicitly is kept but never asked to write.
    if (checkpoint_callback && fast)
      resolution.notes.push_back("fast_dev_run: checkpoint callback disabled");
  }
  if (options.max_time && options.max_time->count() > 0) {
    callbacks.push_back(std::make_shared<Timer>(TimerOptions{.duration = *options.max_time}));
  }
  if (options.max_restarts > 0) {
    if (strategy->launcher() == nullptr) {
      // A rank that fulgur's launcher started: the launcher above it
      // restarts it (and has said what max_restarts does there).
      if (!strategy->cluster_environment().started_by_fulgur_launcher()) {
        resolution.notes.push_back(str(
            "max_restarts=", options.max_restarts,
            " has no effect: no launcher of fulgur's starts ",
            "the ranks here (cluster environment \"", strategy->cluster_environment().name(),
            "\", strategy \"", strategy->name(),
            "\"). Restart with torchrun --max-restarts or SLURM's requeue: restarted ranks resume "
            "from the newest checkpoint that verifies by themselves"));
      }
    } else if (!checkpoint_callback || !options.enable_checkpointing) {
      resolution.notes.push_back(str("max_restarts=", options.max_restarts,
                                     ": no checkpoints are saved (enable_checkpointing=false), "
                                     "so a restart trains again from the beginning"));
    }
  }
  // A ProgressBar given is the one shown.
  if (options.enable_progress_bar && !has_callback<ProgressBar>(options.callbacks)) {
    callbacks.push_back(std::make_shared<ProgressBar>());
  }
  checkpoints_last(callbacks);
  check_unique_state_keys(callbacks, "TrainerOptions::callbacks");
  if (options.logger && !fast) {
    if (options.loggers.empty()) {
      std::vector<std::shared_ptr<Logger>> loggers;
      for (const auto& name : options.logger.names()) {
        loggers.push_back(logger_registry().create(name, root_dir()));
      }
      logging.set_loggers(std::move(loggers));
    } else {
      logging.set_loggers(options.loggers);
    }
  }
}

std::string Trainer::Impl::root_dir() const {
  if (!options.default_root_dir.empty()) return options.default_root_dir;
  return std::filesystem::current_path().string();
}

void Trainer::Impl::distribute(DataLoader& loader, bool even, const char* which) {
  loader.set_default_pin_memory(strategy->root_device().is_cuda());
  const int world = strategy->world_size();
  if (world <= 1 || !options.use_distributed_sampler) return;
  if (!loader.set_shard(strategy->global_rank(), world, even)) {
    throw ConfigError(str("Trainer: the ", which, " loader cannot be split across the ", world,
                          " ranks (it has no sampler, e.g. an IterableLoader), so every rank "
                          "would see the same data. Give each rank its own part (strategy()."
                          "global_rank() of strategy().world_size()) and pass "
                          "use_distributed_sampler=false."));
  }
}

bool Trainer::Impl::require_equal_pass_lengths(int64_t batches, bool unknown_length,
                                               const char* which, const char* limit_flag) {
  if (strategy->world_size() <= 1) return false;
  const at::Tensor all =
      strategy
          ->all_gather(torch::tensor({batches, static_cast<int64_t>(unknown_length)}, torch::kLong))
          .cpu()
          .reshape({-1, 2});
  const at::Tensor counts = all.select(1, 0);
  if ((counts == batches).all().item<bool>()) return all.select(1, 1).any().item<bool>();
  std::vector<std::string> count_of_rank;
  int64_t fewest = -1;
  for (int64_t r = 0; r < counts.size(0); ++r) {
    const int64_t n = counts[r].item<int64_t>();
    if (n >= 0 && (fewest < 0 || n < fewest)) fewest = n;
    count_of_rank.push_back(n < 0 ? std::string("unknown (a loader without a length)")
                                  : str(n, n == 1 ? " batch" : " batches"));
  }
  // fast_dev_run=N caps every loop, over the limit_*_batches flags.
  const std::string cap = options.fast_dev_run > 0 ? "fast_dev_run" : limit_flag;
  throw ConfigError(
      str("the ", which, " loader has a different number of batches on different ranks (",
          by_rank(count_of_rank, ": "), "). ",
          std::string_view(which) == "training"
              ? "Every rank must run as many training batches (each ends in a collective every "
                "rank joins: the gradients' average, the stop vote)"
              : str("Under ", strategy->name(),
                    " every rank must evaluate as many batches (each forward gathers "
                    "parameters from every rank)"),
          ", or the ranks with more wait in a collective until the process-group timeout. "
          "With use_distributed_sampler=true (the default) the Trainer splits one dataset into "
          "shards of one length; with use_distributed_sampler=",
          options.use_distributed_sampler ? "true, make the loader the same on every rank"
                                          : "false, give every rank as many samples",
          fewest > 0 ? str(", or cap the pass with ", cap, "=", fewest) : std::string(), "."));
}

void Trainer::Impl::end_at_the_shortest_rank(std::optional<Batch>& ahead, const char* which,
                                             bool& noted) {
  if (!strategy->reduce_boolean_decision(!ahead, /*all=*/false) || !ahead) return;
  if (!noted) {
    noted = true;
    detail::print_note(str("rank ", strategy->global_rank(), ": the ", which,
                           " loader (of unknown length) ended sooner on another rank; this rank's "
                           "pass over it ends there too, and its further batches are left out "
                           "(noted once)"));
  }
  ahead.reset();
}

namespace {

// detect_anomaly: LibTorch's anomaly mode (one for the whole process) while
// a fit runs. The fits that asked for it are counted: the first turns it on,
// the last sets it back as it was before the first, so that fits in several
// threads never turn it off under each other. (LibTorch's
// DetectAnomalyGuard turns it off when it ends, whatever it was before.)
class AnomalyDetection {
 public:
  explicit AnomalyDetection(bool on) : on_(on) {
    if (!on_) return;
    std::lock_guard<std::mutex> lock(mutex());
    State& s = state();
    if (s.fits++ == 0) {
      s.was_enabled = torch::autograd::AnomalyMode::is_enabled();
      s.checked_nan = torch::autograd::AnomalyMode::should_check_nan();
      torch::autograd::AnomalyMode::set_enabled(true, /*check_nan=*/true);
    }
  }
  ~AnomalyDetection() {
    if (!on_) return;
    std::lock_guard<std::mutex> lock(mutex());
    State& s = state();
    if (--s.fits == 0) torch::autograd::AnomalyMode::set_enabled(s.was_enabled, s.checked_nan);
  }
  AnomalyDetection(const AnomalyDetection&) = delete;
  AnomalyDetection& operator=(const AnomalyDetection&) = delete;

 private:
  struct State {
    int fits = 0;
    bool was_enabled = false;
    bool checked_nan = true;
  };
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static State& state() {
    static State s;
    return s;
  }
  bool on_;
};

}  // namespace

void Trainer::Impl::run_stage(Module& m, Stage s, const std::function<void()>& body,
                              const StageResults& results,
                              std::function<std::string()> resume_point) {
  module = &m;
  stage = s;
  attach(m, this);
  // The Module's own callbacks join the Trainer's for this stage only.
  const std::vector<std::shared_ptr<Callback>> trainer_callbacks = callbacks;
  ModelCheckpoint* const trainer_checkpoint = checkpoint_callback;
  stage_set_up = false;
  auto detach = [&](bool completed) {
    callbacks = trainer_callbacks;
    checkpoint_callback = trainer_checkpoint;
    signals.disarm();
    attach(m, nullptr);
    fit_loop.detach();
    drive().teardown(completed);
  };
  try {
    // Before any rank starts: a forked rank inherits it, a launched one
    // comes here itself.
    tune_host_allocator();
    add_module_callbacks(m);
    auto run = [&] {
      try {
        drive().setup_environment();
        // Every rank's loggers write (and name) global rank 0's directory.
        logging.agree_log_dirs(*strategy);
        stage_set_up = false;
        try {
          body();
        } catch (...) {
          // What the stage logged so far reaches the files (fit's marked
          // as failed).
          if (strategy->is_global_zero()) {
            if (s == Stage::kFit) {
              logging.finalize_quietly(RunStatus::kFailed);
            } else {
              logging.save_quietly();
            }
          }
          throw;
        }
        tear_down_stage(s, /*failed=*/false);
      } catch (const std::exception& e) {
        // A launched rank tells its launcher how it failed (unless a
        // collective already said that a peer was lost).
        detail::report_failure(/*peer_lost=*/false, nullptr, error_message(e));
        // ...and its peers, where no launcher of fulgur's does.
        drive().announce_failure(error_message(e));
        throw;
      }
    };
    if (auto* launcher = strategy->launcher()) {
#if FULGUR_TORCH_AT_LEAST(2, 0)
      if (s == Stage::kFit && launcher->name() == "fork" && detail::autograd_used()) {
        // LibTorch 2.x marks a child forked after a backward and refuses
        // its backward ("Unable to handle autograd's threading in
        // combination with fork-based multiprocessing"): every rank would
        // fail at its first step. (Evaluations run no backward.)
        throw ConfigError(str(
            "strategy \"", strategy->name(),
            "\" forks its ranks, and this process has already run a training step (an earlier "
            "fit, a tuner's sweep): LibTorch ",
            TORCH_VERSION, " cannot run a backward pass in a process forked after one. Run the \"",
            strategy->name(),
            "\" fit before any training in this process, or use strategy \"ddp\" (the program is "
            "re-executed once per rank)."));
      }
#endif
      // Forked ranks inherit the loggers' directories.
      logging.choose_versions();
      Supervision& supervision = launcher->supervision();
      supervision.max_restarts = options.max_restarts;
      supervision.heartbeat_timeout = options.heartbeat_timeout;
      supervision.resume_point = std::move(resume_point);
      auto bytes = launcher->launch([&] {
        try {
          run();
        } catch (...) {
          // A rank the launcher created ends without this process's
          // teardown: a checkpoint still being written there finishes first.
          try {
            drive().wait_for_checkpoints();
          } catch (const std::exception& e) {
            detail::print_note(e.what());
          }
          // Its setup hooks ran here; on_exception runs in the caller.
          tear_down_stage(s, /*failed=*/true);
          throw;
        }
        // The strategy lets go of the module first (fsdp gathers its sharded
        // parameters back, on every rank), so rank 0's results hold it whole.
        drive().teardown();
        // Only rank 0's reach the caller: the others serialise nothing.
        return results.send && strategy->is_global_zero() ? results.send() : std::string();
      });
      if (bytes && results.receive) results.receive(*bytes);
    } else {
      run();
    }
  } catch (const std::exception& e) {
    handling_exception = true;
    for (auto& cb : callbacks) {
      try {
        cb->on_exception(self, m, e);
      } catch (...) {
        // The original error is the one the user needs to see.
      }
    }
    handling_exception = false;
    // After on_exception (as Lightning): a checkpoint saved there sees the
    // module before its teardown.
    tear_down_stage(s, /*failed=*/true);
    detach(/*completed=*/false);
    throw;
  }
  detach(/*completed=*/true);
}

namespace detail {
namespace {
thread_local TunerTrial* innermost_trial = nullptr;
}  // namespace
TunerTrial::TunerTrial(std::function<void(Module&)> configured)
    : configured_(std::move(configured)), outer_(innermost_trial) {
  innermost_trial = this;
}
TunerTrial::~TunerTrial() { innermost_trial = outer_; }
bool TunerTrial::active() { return innermost_trial != nullptr; }
void TunerTrial::module_configured(Module& module) {
  if (innermost_trial != nullptr && innermost_trial->configured_) {
    innermost_trial->configured_(module);
  }
}
}  // namespace detail

void Trainer::Impl::add_module_callbacks(Module& m) {
  if (detail::TunerTrial::active()) return;
  std::vector<std::shared_ptr<Callback>> brought = m.configure_callbacks();
  if (brought.empty()) return;
  std::set<std::type_index> types;
  for (size_t i = 0; i < brought.size(); ++i) {
    if (brought[i] == nullptr) {
      throw ConfigError(str("Module::configure_callbacks() returned a null callback at [", i,
                            "]: return instances."));
    }
    types.insert(typeid(*brought[i]));
  }
  // A callback of a type the Module brings is replaced by the Module's.
  std::vector<std::string> replaced;
  std::erase_if(callbacks, [&](const std::shared_ptr<Callback>& cb) {
    if (types.count(typeid(*cb)) == 0) return false;
    replaced.push_back(c10::demangle(typeid(*cb).name()));
    return true;
  });
  callbacks.insert(callbacks.end(), brought.begin(), brought.end());
  checkpoints_last(callbacks);
  // A ModelCheckpoint the Module brings is the stage's checkpoint callback.
  if (std::any_of(brought.begin(), brought.end(),
                  [](const auto& cb) { return dynamic_cast<ModelCheckpoint*>(cb.get()); })) {
    checkpoint_callback = nullptr;
    for (const auto& cb : callbacks) {
      if ((checkpoint_callback = dynamic_cast<ModelCheckpoint*>(cb.get()))) break;
    }
  }
  check_unique_state_keys(callbacks, "Module::configure_callbacks()");
  if (!replaced.empty() && strategy->is_global_zero()) {
    detail::print_note(str("Module::configure_callbacks() replaces the Trainer's ", join(replaced),
                           " for this ", to_string(stage), "."));
  }
}

void Trainer::Impl::tear_down_stage(Stage s, bool failed) {
  if (!stage_set_up) return;
  stage_set_up = false;
  if (!failed) {
    call_hooks([s](Module& mod) { mod.teardown(s); },
               [&](Callback& cb) { cb.teardown(self, *module, s); });
    return;
  }
  // After a failure every hook still runs; the first error is the one the
  // user sees, so theirs are only noted.
  auto quietly = [&](const std::string& who, const std::function<void()>& hook) {
    try {
      hook();
    } catch (const std::exception& e) {
      detail::print_note(
          str(who, " teardown(", to_string(s), ") failed after the stage failed: ", e.what()));
    } catch (...) {
      detail::print_note(str(who, " teardown(", to_string(s),
                             ") failed after the stage failed, by an exception that is not a "
                             "std::exception"));
    }
  };
  quietly("the Module's", [&] { module->teardown(s); });
  for (auto& cb : callbacks) {
    quietly(str("the ", c10::demangle(typeid(*cb).name()), "'s"),
            [&] { cb->teardown(self, *module, s); });
  }
}

Trainer::Impl::StageResults Trainer::Impl::fit_results(Module& m, FitResult& result) {
  return StageResults{[this, &m, &result] {
                        StateDict state;
                        detail::write_metrics(state, "metrics", result.metrics);
                        detail::write_metrics(state, "callback_metrics",
                                              logging.callback_metrics());
                        state.set("global_step", result.global_step);
                        state.set("epochs", result.epochs);
                        state.set("stop_reason", result.stop_reason);
                        state.set("best_model_path", result.best_model_path);
                        state.set("last_model_path", result.last_model_path);
                        state.set_section("module", drive().module_state(m));
                        // The callbacks' state too (ModelCheckpoint's paths and scores), so
                        // the caller's callback objects reflect the run.
                        checkpoints.save_callback_states(state);
                        return to_bytes(state);
                      },
                      [this, &m, &result](const std::string& bytes) {
                        const StateDict state = from_bytes(bytes);
                        result.metrics = detail::read_metrics(state, "metrics");
                        logging.restore_callback_metrics(
                            detail::read_metrics(state, "callback_metrics"));
                        result.global_step = state.integer("global_step");
                        result.epochs = state.integer("epochs");
                        fit_loop.set_result(result.epochs, result.global_step);
                        result.stop_reason = state.string("stop_reason");
                        result.best_model_path = state.string("best_model_path");
                        result.last_model_path = state.string("last_model_path");
                        const StateDict& weights = state.section_at("module");
                        // The ranks built parts in configure_model(), which this
                        // process has not run: it runs here too, so that the ranks'
                        // weights have their layers to go into.
                        if (has_entries_beyond(weights, module_state_dict(m))) {
                          m.configure_model();
                        }
                        drive().load_module_state(m, weights);
                        checkpoints.load_callback_states(state);
                      }};
}

void Trainer::Impl::prepare_and_set_up(DataModule& data, Stage s) {
  // Once per node, then every rank waits for it: setup() reads what
  // prepare_data() downloads or unpacks.
  if (strategy->local_rank() == 0) data.prepare_data();
  if (strategy->world_size() > 1) strategy->barrier("prepare_data");
  data.setup(s);
}

std::shared_ptr<DataLoader> Trainer::Impl::set_up_stage_data(Stage s, DataModule* data,
                                                             std::shared_ptr<DataLoader> loader) {
  if (options.seed) seed_everything(*options.seed);
  if (data) prepare_and_set_up(*data, s);
  // The stage's setup hooks (teardown: run_stage, whatever way it ends).
  stage_set_up = true;
  call_hooks([s](Module& mod) { mod.setup(s); }, [&](Callback& cb) { cb.setup(self, *module, s); });
  if (data) {
    detail::set_loader_epoch(*data, 0);
    switch (s) {
      case Stage::kFit: loader = data->train_dataloader(); break;
      case Stage::kValidate: loader = data->val_dataloader(); break;
      case Stage::kTest: loader = data->test_dataloader(); break;
      case Stage::kPredict: loader = data->predict_dataloader(); break;
    }
  }
  if (!loader) {
    switch (s) {
      case Stage::kFit:
        throw ConfigError(
            "Trainer.fit: no training data. Pass a train loader, or a DataModule "
            "whose train_dataloader() returns one.");
      case Stage::kValidate:
      case Stage::kTest: {
        const bool test = s == Stage::kTest;
        throw ConfigError(str("Trainer.", test ? "test" : "validate",
                              ": no data. Pass a loader, "
                              "or a DataModule whose ",
                              test ? "test" : "val", "_dataloader() returns one."));
      }
      case Stage::kPredict:
        throw ConfigError(
            "Trainer.predict: no data. Pass a loader, or a DataModule whose "
            "predict_dataloader() returns one.");
    }
  }
  if (s == Stage::kFit) {
    ready_train_loader(*loader, /*notes=*/true);
    return loader;
  }
  // An evaluation or prediction whose forward is collective (fsdp's
  // FULL_SHARD: every rank must run as many forwards, or the ones with more
  // batches wait in a gather forever) takes shards of one length; metrics
  // leave the repeats out (DataLoader::padded_rows), and
  // PredictionFileWriter::read keeps each sample once.
  distribute(*loader, /*even=*/drive().forward_is_collective(),
             s == Stage::kValidate ? "validation"
             : s == Stage::kTest   ? "test"
                                   : "predict");
  return loader;
}

void Trainer::Impl::ready_train_loader(DataLoader& loader, bool notes) {
  loader.set_default_seed(options.seed.value_or(0));
  // Set for every fit, so that a loader overfit once shuffles again in
  // the next fit without overfit_batches.
  const bool overfit = !options.overfit_batches.is_zero();
  const bool reordered = loader.set_in_order(overfit);
  if (overfit && notes && strategy->is_global_zero()) {
    auto* in_dataset = dynamic_cast<DatasetLoader*>(&loader);
    if (reordered) {
      detail::print_note(str("overfit_batches=", options.overfit_batches.text(),
                             ": the training loader shuffles; in this fit it visits its samples "
                             "in order, so that every epoch trains on the same batches"));
    } else if (in_dataset == nullptr ||
               dynamic_cast<const SequentialSampler*>(&in_dataset->sampler()) == nullptr) {
      detail::print_note(str("overfit_batches=", options.overfit_batches.text(),
                             ": the training loader's order is its own (a sampler or loader "
                             "fulgur cannot put in order); if it shuffles, each epoch trains "
                             "on other batches"));
    }
  }
  // Training takes shards of one length (every rank steps as often).
  distribute(loader, /*even=*/true, "training");
}

void Trainer::Impl::refuse_one_loader_for_both(const DataLoader* train, const DataLoader* val,
                                               bool from_data_module) {
  if (train == nullptr || train != val) return;
  // One position in one epoch: each validation would restart it and read it
  // to its end, and training go on from there (batches skipped, epochs cut
  // short), and its shard would be the validation's.
  throw ConfigError(
      str("Trainer.fit: ",
          from_data_module
              ? "the DataModule's val_dataloader() returned the loader its train_dataloader() "
                "returned (one DataLoader object)"
              : "the validation loader is the training loader (one DataLoader object)",
          ": a loader keeps one position in its epoch, so each validation would move training's "
          "(training batches skipped, epochs cut short). ",
          from_data_module ? "Return a loader of its own from val_dataloader()"
                           : "Pass a second loader for validation",
          ", over the same dataset if that is the intent (make_data_loader(dataset, options) "
          "again), or no validation loader."));
}

void Trainer::Impl::ready_val_loader(DataLoader& loader) {
  loader.set_default_seed(options.seed.value_or(0));
  distribute(loader, /*even=*/drive().forward_is_collective(), "validation");
}

Trainer::Impl::FitLoaders Trainer::Impl::make_fit_loaders(DataModule& data, int64_t epoch) {
  detail::set_loader_epoch(data, epoch);
  FitLoaders loaders{data.train_dataloader(), data.val_dataloader()};
  if (!loaders.train) {
    throw ConfigError(
        str("reload_dataloaders_every_n_epochs=", options.reload_dataloaders_every_n_epochs,
            ": the DataModule's train_dataloader() returned no loader for epoch ", epoch,
            " (DataModule::current_epoch()). Return one for every epoch."));
  }
  refuse_one_loader_for_both(loaders.train.get(), loaders.val.get(), /*from_data_module=*/true);
  ready_train_loader(*loaders.train, /*notes=*/false);
  if (loaders.val) ready_val_loader(*loaders.val);
  return loaders;
}

void Trainer::Impl::set_up_module_and_load_weights(Module& m, const std::string& ckpt_path) {
  drive().setup(m);
  std::string ckpt =
      agreed_checkpoint(ckpt_path, [&] { return checkpoints.resolve_path(ckpt_path); });
  if (!ckpt.empty()) checkpoints.restore(ckpt, /*full=*/false);
}

std::string Trainer::Impl::agreed_checkpoint(const std::string& requested,
                                             const std::function<std::string()>& resolve) {
  // Each rank finds it in its own view of the files ("last", "best" and
  // "auto" read the checkpoint directory): a rank that fails stops them
  // all, and ranks that found different ones (node-local disks) are an
  // error on every rank, not a resume of different states.
  std::string path;
  detail::on_every_rank(*strategy, "cannot find the checkpoint to load, so no rank loads one",
                        [&] { path = resolve(); });
  if (strategy->world_size() <= 1) return path;
  // What each found is told by its fingerprint (size and CRC32C; the
  // built-in IOs read them from a footer or manifest, not the whole file):
  // one save under two names (mounts of one share, a copy on each node) is
  // one checkpoint, and one name of different files (node-local copies of
  // different saves) is not. A rank that cannot read it compares names:
  // the read that follows says why.
  std::optional<FileFingerprint> found;
  if (!path.empty()) {
    try {
      found = drive().checkpoint_fingerprint(path);
    } catch (const std::exception&) {
    }
  }
  auto as_text = [](const std::optional<FileFingerprint>& f) {
    if (!f) return std::string();
    std::ostringstream crc;
    crc << std::hex << std::setw(8) << std::setfill('0') << f->crc32c;
    return str(f->size, " bytes, CRC32C ", crc.str());
  };
  // Rank 0's fingerprint (no line break), a line break, its path.
  const std::string zero = strategy->broadcast_bytes(str(as_text(found), "\n", path), 0);
  const size_t split = zero.find('\n');
  const std::string zero_found = zero.substr(0, split);
  const std::string zero_path = zero.substr(split + 1);
  detail::on_every_rank(*strategy, "finds another checkpoint than global rank 0", [&] {
    if (path.empty() && zero_path.empty()) return;
    const bool compared = found && !zero_found.empty();
    if (!path.empty() && !zero_path.empty() &&
        (compared ? as_text(found) == zero_found : path == zero_path)) {
      return;
    }
    // Fingerprints, where both were read.
    auto named = [compared](const std::string& p, const std::string& fingerprint) {
      if (p.empty()) return std::string("none (a fresh start)");
      return compared ? str("\"", p, "\" (", fingerprint, ")") : str("\"", p, "\"");
    };
    throw CheckpointError(
        str("ckpt_path=\"", requested, "\": rank ", strategy->global_rank(), " of ",
            strategy->world_size(), " finds ", named(path, as_text(found)), ", global rank 0 ",
            path == zero_path ? str("another file at that path (", zero_found, ")")
                              : named(zero_path, zero_found),
            ". Every rank reads the checkpoint itself: give every node the same files at the "
            "same path (a filesystem they share, or a copy on each) and the same ckpt_path."));
  });
  return path;
}

FitResult Trainer::Impl::run_fit(Module& m, std::shared_ptr<DataLoader> train,
                                 std::shared_ptr<DataLoader> val, DataModule* data,
                                 const FitOptions& fit) {
  if (options.reload_dataloaders_every_n_epochs > 0 && data == nullptr) {
    throw ConfigError(
        str("reload_dataloaders_every_n_epochs=", options.reload_dataloaders_every_n_epochs,
            ": fit was given its loaders, which fulgur cannot make again. Pass a "
            "DataModule whose train_dataloader() and val_dataloader() make them "
            "(they can read DataModule::current_epoch()), or "
            "reload_dataloaders_every_n_epochs=0."));
  }
  FitResult result;
  run_stage(
      m, Stage::kFit,
      [&] {
        train = set_up_stage_data(Stage::kFit, data, std::move(train));
        if (data) val = data->val_dataloader();
        refuse_one_loader_for_both(train.get(), val.get(), data != nullptr);
        if (val) ready_val_loader(*val);
        fit_loop.start(train, val, data);
        logging.reset_metrics();

        // SLURM's requeue signal and SIGTERM: a checkpoint, then the end.
        signals.arm(strategy->cluster_environment().preemption_signals());
        m.configure_model();
        detail::TunerTrial::module_configured(m);
        drive().setup(m);
        // Before configure_optimizers: estimated_stepping_batches() counts them.
        fit_loop.count_training_batches();
        fit_loop.set_optimizers(drive().setup_optimizers(m));
        std::string ckpt =
            agreed_checkpoint(fit.ckpt_path, [&] { return fit_start_checkpoint(fit.ckpt_path); });
        if (ckpt.empty()) {
          checkpoints.note_checkpoints_of_an_earlier_run();
        } else {
          checkpoints.restore(ckpt, /*full=*/true);
          // The loggers continue the checkpoint's run (or another version):
          // the other ranks take rank 0's directories again.
          logging.agree_log_dirs(*strategy);
        }
        if (strategy->is_global_zero()) logging.log_hyperparams(m.hparams());

        // log() there is refused naming the hook (without a sink it said
        // "outside a Trainer run"), as Lightning refuses it.
        set_log_sink(m, &logging.closed_train_sink(
                            "on_fit_start runs before the sanity check and the first epoch, whose "
                            "start would drop the value. Log it from on_train_epoch_start (a value "
                            "per epoch) or from training_step."));
        call_hooks([](Module& mod) { mod.on_fit_start(); },
                   [&](Callback& cb) { cb.on_fit_start(self, m); });
        set_log_sink(m, nullptr);
        {
          const AnomalyDetection anomalies(options.detect_anomaly);
          fit_loop.run_sanity_check();
          fit_loop.run();
        }
        call_hooks([](Module& mod) { mod.on_fit_end(); },
                   [&](Callback& cb) { cb.on_fit_end(self, m); });
        // Fit returns only once its checkpoints are durable.
        drive().wait_for_checkpoints();
        if (strategy->is_global_zero()) logging.finalize();
        if (data) {
          detail::set_loader_epoch(*data, 0);
          data->teardown(Stage::kFit);
        }

        result.metrics = logging.callback_metrics();
        result.global_step = fit_loop.global_step();
        result.epochs = fit_loop.current_epoch();
        result.stop_reason = fit_loop.stop_reason();
        if (checkpoint_callback) {
          result.best_model_path = checkpoint_callback->best_model_path();
          result.last_model_path = checkpoint_callback->last_model_path();
        }
        fit_loop.finish();
      },
      fit_results(m, result),
      [this, requested = fit.ckpt_path]() -> std::string {
        // In the launching process, before the ranks start again: what
        // fit_start_checkpoint() will pick in them.
        try {
          const std::string path = restart_checkpoint(requested).path;
          return path.empty() ? std::string() : str("\"", path, "\"");
        } catch (const std::exception& e) {
          return str("nothing: ", e.what());
        }
      });
  return result;
}

void Trainer::Impl::end_by_preemption(int signal) {
  if (detail::TunerTrial::active()) {
    // A tuner's trial is not the run: a last.ckpt of the sweep's weights,
    // rates and steps would be what the requeued job's fit resumes. Nothing
    // is saved; the requeued job tunes again.
    if (strategy->is_global_zero()) {
      const std::string requeued = strategy->cluster_environment().requeue(signal);
      detail::print_note(str(detail::signal_name(signal), " (cluster environment \"",
                             strategy->cluster_environment().name(),
                             "\") during a tuner trial (lr_find, scale_batch_size) at its step ",
                             fit_loop.global_step(),
                             ": no checkpoint is saved, the trial is not "
                             "the run",
                             (requeued.empty() ? std::string() : "; " + requeued),
                             ". A run of this job tunes again. Ending by the signal (status ",
                             128 + signal, ")."));
    }
    detail::end_by_signal(signal);
  }
  const std::string path =
      (std::filesystem::path(checkpoints.checkpoint_dir()) / "last.ckpt").string();
  checkpoints.save(path);
  drive().wait_for_checkpoints();
  // Every rank's part is durable before anyone asks for the requeue.
  if (strategy->world_size() > 1) strategy->barrier("preemption checkpoint");
  if (strategy->is_global_zero()) {
    const std::string requeued = strategy->cluster_environment().requeue(signal);
    logging.finalize_quietly(RunStatus::kInterrupted);
    detail::print_note(str(detail::signal_name(signal), " (cluster environment \"",
                           strategy->cluster_environment().name(), "\"): saved \"", path,
                           "\" at step ", fit_loop.global_step(),
                           (requeued.empty() ? std::string() : "; " + requeued),
                           ". A run of this job with ckpt_path=\"auto\" (a requeued one does so by "
                           "itself) resumes from it. Ending by the signal (status ",
                           128 + signal, ")."));
  }
  detail::end_by_signal(signal);
}

Trainer::Impl::RestartPoint Trainer::Impl::restart_checkpoint(const std::string& requested) {
  std::string newest = checkpoints.resolve_path("auto");
  if (!newest.empty()) return {std::move(newest), true};
  return {checkpoints.resolve_path(requested), false};
}

std::string Trainer::Impl::fit_start_checkpoint(const std::string& requested) {
  const int restarts = strategy->cluster_environment().restart_count();
  // A Tuner's trial is not the job's fit: a restarted job's newest
  // checkpoint is the fit's to resume (the trial would start at its step).
  if (restarts == 0 || detail::TunerTrial::active()) return checkpoints.resolve_path(requested);
  RestartPoint point = restart_checkpoint(requested);
  // fulgur's own launcher has said what the ranks resume from; after a
  // restart by torchrun or SLURM, rank 0 says it.
  const bool fulgur_launcher = strategy->launcher() != nullptr ||  // ddp_fork's ranks
                               strategy->cluster_environment().started_by_fulgur_launcher();
  if (strategy->is_global_zero() && !fulgur_launcher) {
    detail::print_note(
        str("restart ", restarts, " (cluster environment \"",
            strategy->cluster_environment().name(), "\"): ",
            (point.newest ? str("resuming from \"", point.path, "\"")
             : requested.empty()
                 ? std::string("no checkpoint that verifies yet, starting from the beginning")
                 : str("no checkpoint that verifies yet, starting from ckpt_path=\"", requested,
                       "\" as the first run did")),
            "."));
  }
  return std::move(point.path);
}

Metrics Trainer::Impl::run_evaluation(Module& m, std::shared_ptr<DataLoader> loader,
                                      DataModule* data, Stage s, const std::string& ckpt_path) {
  Metrics out;
  run_stage(
      m, s,
      [&] {
        // A stage's callback and progress-bar metrics are its own, as
        // Lightning's (an earlier fit's train_loss is not this test's).
        logging.reset_metrics();
        loader = set_up_stage_data(s, data, std::move(loader));
        set_up_module_and_load_weights(m, ckpt_path);
        auto limit = (s == Stage::kTest ? limits.test : limits.val)
                         .apply(loader->num_batches(),
                                s == Stage::kTest ? "limit_test_batches" : limits.val_flag);
        out = evaluation_loop.run(*loader, s, limit);
        // Its logged values are on disk before it returns (a full disk
        // fails the stage, as at fit's end, instead of a note at exit).
        if (strategy->is_global_zero()) logging.save();
        if (data) data->teardown(s);
      },
      StageResults{[&] {
                     StateDict state;
                     detail::write_metrics(state, "metrics", out);
                     return to_bytes(state);
                   },
                   [&](const std::string& bytes) {
                     out = detail::read_metrics(from_bytes(bytes), "metrics");
                   }});
  return out;
}

std::vector<Batch> Trainer::Impl::run_predict(Module& m, std::shared_ptr<DataLoader> loader,
                                              DataModule* data, const std::string& ckpt_path) {
  if (auto* launcher = strategy->launcher(); launcher && launcher->returns_to_caller()) {
    // Refused before any rank starts: their predictions could not come back.
    throw ConfigError(str("Trainer.predict under strategy \"", strategy->name(), "\" (launcher ",
                          launcher->name(),
                          "): the predictions would stay in the ranks that "
                          "made them and never come back to this process. Run predict with "
                          "strategy=\"ddp\" and a PredictionFileWriter (every rank writes its "
                          "part; PredictionFileWriter::read joins them), or on one device."));
  }
  std::vector<Batch> out;
  run_stage(m, Stage::kPredict, [&] {
    logging.reset_metrics();
    loader = set_up_stage_data(Stage::kPredict, data, std::move(loader));
    set_up_module_and_load_weights(m, ckpt_path);
    out = prediction_loop.run(*loader,
                              limits.predict.apply(loader->num_batches(), "limit_predict_batches"));
    if (data) data->teardown(Stage::kPredict);
  });
  return out;
}

// ---- Trainer: thin forwarding to Impl.

namespace detail {

void check_trainer_options(const TrainerOptions& options) {
  // A Trainer made and dropped runs every check a program's Trainer runs on
  // these options; it opens no file and starts nothing before fit(). When
  // the program passes components as instances (a strategy, an accelerator,
  // a plugin), they are not handed to it (building wires them together and
  // sets ranks on them): then the connector's checks and the Trainer's
  // checks of its loop flags run, without building.
  const bool all_named =
      std::holds_alternative<std::string>(options.strategy) &&
      std::holds_alternative<std::string>(options.accelerator) &&
      std::all_of(options.plugins.begin(), options.plugins.end(),
                  [](const Plugin& p) { return std::holds_alternative<std::string>(p); });
  if (all_named) {
    Trainer probe(options);
  } else {
    resolve(options, ConnectorContext(), check_loop_flags(options));
  }
}

}  // namespace detail

Trainer::Trainer(TrainerOptions options) try
    : impl_(std::make_unique<Impl>(*this, std::move(options))) {
} catch (const std::exception& e) {
  // One rank of several whose options fail on its machine only (a device
  // count, a variable): the others would wait for it at the rendezvous.
  // (Rethrown.)
  detail::announce_failure_before_joining(error_message(e));
}
Trainer::~Trainer() = default;

FitResult Trainer::fit(Module& module, DataModule& data, FitOptions options) {
  return impl_->run_fit(module, nullptr, nullptr, &data, options);
}
FitResult Trainer::fit(Module& module, std::shared_ptr<DataLoader> train,
                       std::shared_ptr<DataLoader> val, FitOptions options) {
  return impl_->run_fit(module, std::move(train), std::move(val), nullptr, options);
}
Metrics Trainer::validate(Module& module, DataModule& data, const std::string& ckpt_path) {
  return impl_->run_evaluation(module, nullptr, &data, Stage::kValidate, ckpt_path);
}
Metrics Trainer::validate(Module& module, std::shared_ptr<DataLoader> val,
                          const std::string& ckpt_path) {
  return impl_->run_evaluation(module, std::move(val), nullptr, Stage::kValidate, ckpt_path);
}
Metrics Trainer::test(Module& module, DataModule& data, const std::string& ckpt_path) {
  return impl_->run_evaluation(module, nullptr, &data, Stage::kTest, ckpt_path);
}
Metrics Trainer::test(Module& module, std::shared_ptr<DataLoader> test,
                      const std::string& ckpt_path) {
  return impl_->run_evaluation(module, std::move(test), nullptr, Stage::kTest, ckpt_path);
}
std::vector<Batch> Trainer::predict(Module& module, DataModule& data,
                                    const std::string& ckpt_path) {
  return impl_->run_predict(module, nullptr, &data, ckpt_path);
}
std::vector<Batch> Trainer::predict(Module& module, std::shared_ptr<DataLoader> data,
                                    const std::string& ckpt_path) {
  return impl_->run_predict(module, std::move(data), nullptr, ckpt_path);
}

Strategy& Trainer::strategy() const { return *impl_->strategy; }
const std::vector<std::shared_ptr<Callback>>& Trainer::callbacks() const {
  return impl_->callbacks;
}
const std::vector<std::shared_ptr<Logger>>& Trainer::loggers() const {
  return impl_->logging.loggers();
}
ModelCheckpoint* Trainer::checkpoint_callback() const { return impl_->checkpoint_callback; }
const TrainerOptions& Trainer::options() const { return impl_->options; }
Stage Trainer::stage() const { return impl_->stage; }
bool Trainer::sanity_checking() const { return impl_->fit_loop.sanity_checking(); }
int64_t Trainer::current_epoch() const { return impl_->fit_loop.current_epoch(); }
int64_t Trainer::global_step() const { return impl_->fit_loop.global_step(); }
int64_t Trainer::batches_that_stepped() const { return impl_->fit_loop.batches_that_stepped(); }
int64_t Trainer::batch_idx() const { return impl_->fit_loop.batch_idx(); }
int64_t Trainer::num_training_batches() const { return impl_->fit_loop.num_training_batches(); }
int64_t Trainer::max_epochs() const { return impl_->limits.max_epochs; }
DataLoader* Trainer::train_dataloader() const { return impl_->fit_loop.train_loader(); }
DataLoader* Trainer::predict_dataloader() const { return impl_->prediction_loop.loader(); }
int64_t Trainer::num_evaluation_batches() const {
  return stage() == Stage::kPredict ? impl_->prediction_loop.num_batches()
                                   : impl_->evaluation_loop.num_batches();
}
void Trainer::request_stop() { impl_->fit_loop.request_stop(); }
int64_t Trainer::accumulate_grad_batches() const {
  return impl_->fit_loop.accumulate_grad_batches();
}
void Trainer::set_accumulate_grad_batches(int64_t n) {
  impl_->fit_loop.set_accumulate_grad_batches(n);
}
bool Trainer::should_stop() const { return impl_->fit_loop.should_stop(); }
bool Trainer::fit_validates() const { return impl_->fit_loop.validates(); }
const Metrics& Trainer::callback_metrics() const { return impl_->logging.callback_metrics(); }
const Metrics& Trainer::progress_bar_metrics() const {
  return impl_->logging.progress_bar_metrics();
}
std::string Trainer::default_root_dir() const { return impl_->root_dir(); }
std::string Trainer::log_dir() const {
  const auto& loggers = impl_->logging.loggers();
  return loggers.empty() ? std::string() : loggers.front()->log_dir();
}
void Trainer::save_checkpoint(const std::string& path) { impl_->checkpoints.save(path); }

int64_t Trainer::estimated_stepping_batches() const {
  const auto& i = *impl_;
  const auto& limits = i.limits;
  const int64_t batches = i.fit_loop.num_training_batches();
  if (batches < 0) return limits.max_steps;
  int64_t per_epoch =
      (batches + i.options.accumulate_grad_batches - 1) / i.options.accumulate_grad_batches;
  int64_t total = limits.max_epochs < 0 ? -1 : per_epoch * limits.max_epochs;
  if (limits.max_steps >= 0 && (total < 0 || limits.max_steps < total)) total = limits.max_steps;
  return total;
}

std::string Trainer::describe() const { return impl_->resolution.to_json(); }

const Resolution& Trainer::resolution() const { return impl_->resolution; }

}  // namespace fulgur
