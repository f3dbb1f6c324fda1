#include "fulgur/trainer/trainer.h"

#include <torch/torch.h>

#include <filesystem>

#include "fulgur/callbacks/model_checkpoint.h"
#include "fulgur/callbacks/progress_bar.h"
#include "fulgur/core/errors.h"
#include "fulgur/loggers/csv_logger.h"
#include "fulgur/strategies/launchers/launcher.h"
#include "fulgur/trainer/connectors/accelerator_connector.h"
#include "fulgur/utilities/seed.h"
#include "trainer/trainer_impl.h"

namespace fulgur {

namespace {

// The problems with the loop flags; the connector reports them together
// with its own in one FlagError.
std::vector<std::string> check_loop_flags(const TrainerOptions& o) {
  std::vector<std::string> problems;
  auto check = [&](bool ok, std::string message) {
    if (!ok) problems.push_back(std::move(message));
  };
  if (o.max_epochs) {
    check(*o.max_epochs >= -1, str("max_epochs=", *o.max_epochs,
                                   ": must be >= -1 (-1 trains until max_steps)."));
  }
  check(o.min_epochs >= 0, str("min_epochs=", o.min_epochs, ": must be >= 0."));
  check(o.max_steps >= -1, str("max_steps=", o.max_steps, ": must be >= -1 (-1: no limit)."));
  check(o.min_steps >= 0, str("min_steps=", o.min_steps, ": must be >= 0."));
  check(o.fast_dev_run >= 0, str("fast_dev_run=", o.fast_dev_run,
                                 ": must be >= 0 (true or N runs N batches, 0 is off)."));
  check(o.accumulate_grad_batches >= 1,
        str("accumulate_grad_batches=", o.accumulate_grad_batches, ": must be >= 1."));
  check(o.log_every_n_steps >= 1,
        str("log_every_n_steps=", o.log_every_n_steps,
            ": must be >= 1. Pass logger=false to turn logging off."));
  check(o.num_sanity_val_steps >= -1,
        str("num_sanity_val_steps=", o.num_sanity_val_steps, ": must be >= -1 (-1: all)."));
  if (o.gradient_clip_val) {
    check(*o.gradient_clip_val >= 0.0,
          str("gradient_clip_val=", *o.gradient_clip_val,
              ": must be >= 0 (0 or unset turns clipping off)."));
  }
  if (o.check_val_every_n_epoch) {
    check(*o.check_val_every_n_epoch >= 1,
          str("check_val_every_n_epoch=", *o.check_val_every_n_epoch,
              ": must be >= 1, or unset to validate by batch count across epochs."));
  }
  auto check_limit = [&](const BatchLimit& l, const char* name) {
    if (l.is_fraction()) {
      check(l.fraction() >= 0.0 && l.fraction() <= 1.0,
            str(name, "=", l.text(), ": a fraction must be in [0.0, 1.0]; pass an int for a "
                "number of batches."));
    } else {
      check(l.count() >= 0, str(name, "=", l.text(), ": a batch count must be >= 0."));
    }
  };
  check_limit(o.limit_train_batches, "limit_train_batches");
  check_limit(o.limit_val_batches, "limit_val_batches");
  check_limit(o.limit_test_batches, "limit_test_batches");
  check_limit(o.limit_predict_batches, "limit_predict_batches");
  if (o.val_check_interval.is_fraction()) {
    check(o.val_check_interval.fraction() > 0.0 && o.val_check_interval.fraction() <= 1.0,
          str("val_check_interval=", o.val_check_interval.text(),
              ": a fraction of the epoch must be in (0.0, 1.0]; pass an int to validate every "
              "N batches."));
  } else {
    check(o.val_check_interval.count() >= 1,
          str("val_check_interval=", o.val_check_interval.text(),
              ": a batch count must be >= 1."));
  }
  if (o.max_epochs && o.min_epochs > 0 && *o.max_epochs >= 0) {
    check(o.min_epochs <= *o.max_epochs, str("min_epochs=", o.min_epochs, " > max_epochs=",
                                             *o.max_epochs, ": lower min_epochs or raise max_epochs."));
  }
  for (size_t i = 0; i < o.callbacks.size(); ++i) {
    check(o.callbacks[i] != nullptr, str("callbacks[", i, "] is null: pass an instance."));
  }
  for (size_t i = 0; i < o.loggers.size(); ++i) {
    check(o.loggers[i] != nullptr, str("loggers[", i, "] is null: pass an instance."));
  }
  return problems;
}

}  // namespace

Trainer::Impl::Impl(Trainer& owner, TrainerOptions opts) : self(owner), options(std::move(opts)) {
  auto connected = connect(options, EnvView(), check_loop_flags(options));
  strategy = std::move(connected.strategy);
  resolution = std::move(connected.resolution);
  apply_torch_flags(resolution);

  limit_train = options.limit_train_batches;
  limit_val = options.limit_val_batches;
  limit_test = options.limit_test_batches;
  limit_predict = options.limit_predict_batches;
  num_sanity_val_steps = options.num_sanity_val_steps;
  max_steps = options.max_steps;
  if (options.max_epochs) {
    max_epochs = *options.max_epochs;
  } else if (options.max_steps != -1) {
    max_epochs = -1;
    resolution.notes.push_back("max_epochs=-1 because max_steps is set and max_epochs is not");
  } else {
    max_epochs = 1000;
    resolution.notes.push_back("max_epochs=1000 because neither max_epochs nor max_steps is set");
  }
  bool fast = options.fast_dev_run > 0;
  if (fast) {
    int64_t n = options.fast_dev_run;
    limit_train = limit_val = limit_test = limit_predict = BatchLimit(static_cast<long long>(n));
    max_steps = n;
    max_epochs = 1;
    num_sanity_val_steps = 0;
    options.val_check_interval = 1.0;
    options.check_val_every_n_epoch = 1;
    resolution.notes.push_back(str("fast_dev_run=", n, ": ", n,
                        " batch(es) per loop, 1 epoch, no sanity check, no checkpoints, no "
                        "loggers"));
  }

  for (const auto& cb : options.callbacks) {
    callbacks.push_back(cb);
    if (!checkpoint_callback) checkpoint_callback = dynamic_cast<ModelCheckpoint*>(cb.get());
  }
  if (options.enable_checkpointing && !checkpoint_callback && !fast) {
    auto cb = std::make_shared<ModelCheckpoint>();
    checkpoint_callback = cb.get();
    callbacks.push_back(cb);
  }
  if (!options.enable_checkpointing || fast) {
    // A ModelCheckpoint passed explicitly is kept but never asked to write.
    if (checkpoint_callback && fast) resolution.notes.push_back("fast_dev_run: checkpoint callback disabled");
  }
  if (options.enable_progress_bar) callbacks.push_back(std::make_shared<ProgressBar>());
  // Checkpoint callbacks run last, so that every other callback's state in a
  // checkpoint is already updated for the step being saved (as Lightning does).
  std::stable_partition(callbacks.begin(), callbacks.end(), [](const auto& cb) {
    return dynamic_cast<ModelCheckpoint*>(cb.get()) == nullptr;
  });
  if (options.logger && !fast) {
    if (options.loggers.empty()) {
      loggers.push_back(std::make_shared<CSVLogger>(CSVLoggerOptions{.save_dir = root_dir()}));
    } else {
      loggers = options.loggers;
    }
  }
}

std::string Trainer::Impl::root_dir() const {
  if (!options.default_root_dir.empty()) return options.default_root_dir;
  return std::filesystem::current_path().string();
}

void Trainer::Impl::distribute(DataLoader& loader, bool even, const char* which) {
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

namespace {

// What rank 0 of a forked run sends back to the calling process.
void write_metrics(torch::serialize::OutputArchive& archive, const std::string& key,
                   const Metrics& metrics) {
  std::vector<std::string> names;
  std::vector<double> values;
  for (const auto& [name, value] : metrics) {
    names.push_back(name);
    values.push_back(value);
  }
  archive.write(key + ".names", c10::IValue(c10::List<std::string>(names)));
  archive.write(key + ".values", torch::tensor(values, torch::kDouble));
}

Metrics read_metrics(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue names;
  at::Tensor values;
  archive.read(key + ".names", names);
  archive.read(key + ".values", values);
  Metrics out;
  auto list = names.toList();
  for (size_t i = 0; i < list.size(); ++i) {
    out[list.get(i).toStringRef()] = values[static_cast<int64_t>(i)].item<double>();
  }
  return out;
}

}  // namespace

void Trainer::Impl::run_stage(Module& m, Stage s, const std::function<void()>& body,
                              const LaunchResults& results) {
  module = &m;
  stage = s;
  m.trainer_ = &self;
  auto detach = [&] {
    m.trainer_ = nullptr;
    m.log_sink_ = nullptr;
    training = false;
    sanity_checking = false;
    strategy->teardown();
  };
  try {
    auto run = [&] {
      strategy->setup_environment();
      body();
    };
    if (auto* launcher = strategy->launcher()) {
      launcher->launch(run, results);
    } else {
      run();
    }
  } catch (const std::exception& e) {
    for (auto& cb : callbacks) {
      try {
        cb->on_exception(self, m, e);
      } catch (...) {
        // The original error is the one the user needs to see.
      }
    }
    detach();
    throw;
  }
  detach();
}

LaunchResults Trainer::Impl::fit_results(Module& m, FitResult& result) {
  return LaunchResults{
      [this, &m, &result](const std::string& path) {
        torch::serialize::OutputArchive archive;
        write_metrics(archive, "metrics", result.metrics);
        write_metrics(archive, "callback_metrics", callback_metrics);
        archive.write("global_step", c10::IValue(result.global_step));
        archive.write("epochs", c10::IValue(result.epochs));
        archive.write("stop_reason", c10::IValue(result.stop_reason));
        archive.write("best_model_path", c10::IValue(result.best_model_path));
        archive.write("last_model_path", c10::IValue(result.last_model_path));
        torch::serialize::OutputArchive module_state(archive.compilation_unit());
        strategy->save_module_state(m, module_state);
        archive.write("module", module_state);
        // The callbacks' state too (ModelCheckpoint's paths and scores), so
        // the caller's callback objects reflect the run.
        save_callback_states(archive);
        archive.save_to(path);
      },
      [this, &m, &result](const std::string& path) {
        torch::serialize::InputArchive archive;
        archive.load_from(path);
        result.metrics = read_metrics(archive, "metrics");
        callback_metrics = read_metrics(archive, "callback_metrics");
        c10::IValue v;
        archive.read("global_step", v);
        result.global_step = global_step = v.toInt();
        archive.read("epochs", v);
        result.epochs = current_epoch = v.toInt();
        archive.read("stop_reason", v);
        result.stop_reason = v.toStringRef();
        archive.read("best_model_path", v);
        result.best_model_path = v.toStringRef();
        archive.read("last_model_path", v);
        result.last_model_path = v.toStringRef();
        torch::serialize::InputArchive module_state;
        archive.read("module", module_state);
        strategy->load_module_state(m, module_state);
        load_callback_states(archive);
      }};
}

void Trainer::Impl::prepare_and_set_up(DataModule& data, Stage s) {
  // Once per node, then every rank waits for it: setup() reads what
  // prepare_data() downloads or unpacks.
  if (strategy->local_rank() == 0) data.prepare_data();
  if (strategy->world_size() > 1) strategy->barrier("prepare_data");
  data.setup(s);
}

FitResult Trainer::Impl::run_fit(Module& m, std::shared_ptr<DataLoader> train,
                                 std::shared_ptr<DataLoader> val, DataModule* data,
                                 const FitOptions& fit) {
  FitResult result;
  run_stage(m, Stage::Fit, [&] {
    if (options.seed) seed_everything(*options.seed);
    if (data) {
      prepare_and_set_up(*data, Stage::Fit);
      train = data->train_dataloader();
      val = data->val_dataloader();
    }
    if (!train) {
      throw ConfigError("Trainer.fit: no training data. Pass a train loader, or a DataModule "
                        "whose train_dataloader() returns one.");
    }
    train_loader = train;
    val_loader = val;
    train_loader->set_default_seed(options.seed.value_or(0));
    if (val_loader) val_loader->set_default_seed(options.seed.value_or(0));
    distribute(*train_loader, /*even=*/true, "training");
    if (val_loader) distribute(*val_loader, /*even=*/false, "validation");

    current_epoch = 0;
    global_step = 0;
    batch_idx = 0;
    batches_that_stepped = 0;
    should_stop = false;
    stop_reason.clear();
    validated_at_position = -1;
    callback_metrics.clear();
    progress_bar_metrics.clear();

    m.configure_model();
    strategy->setup(m);
    optimizer_config = strategy->setup_optimizers(m);
    std::string ckpt = resolve_ckpt_path(fit.ckpt_path);
    if (!ckpt.empty()) restore_checkpoint(ckpt, /*full=*/true);
    if (strategy->is_global_zero()) {
      for (auto& logger : loggers) logger->log_hyperparams(m.hparams());
    }

    call_hooks([](Module& mod) { mod.on_fit_start(); },
               [&](Callback& cb) { cb.on_fit_start(self, m); });
    if (val_loader && num_sanity_val_steps != 0) run_validation(/*sanity=*/true);
    fit_loop();
    call_hooks([](Module& mod) { mod.on_fit_end(); },
               [&](Callback& cb) { cb.on_fit_end(self, m); });
    if (strategy->is_global_zero()) {
      for (auto& logger : loggers) logger->finalize();
    }
    if (data) data->teardown(Stage::Fit);

    result.metrics = callback_metrics;
    result.global_step = global_step;
    result.epochs = current_epoch;
    result.stop_reason = stop_reason;
    if (checkpoint_callback) {
      result.best_model_path = checkpoint_callback->best_model_path();
      result.last_model_path = checkpoint_callback->last_model_path();
    }
    train_loader.reset();
    val_loader.reset();
  }, fit_results(m, result));
  return result;
}

Metrics Trainer::Impl::run_evaluation(Module& m, std::shared_ptr<DataLoader> loader,
                                      DataModule* data, Stage s, const std::string& ckpt_path) {
  Metrics out;
  run_stage(m, s, [&] {
    if (options.seed) seed_everything(*options.seed);
    if (data) {
      prepare_and_set_up(*data, s);
      loader = s == Stage::Test ? data->test_dataloader() : data->val_dataloader();
    }
    const char* what = s == Stage::Test ? "test" : "validate";
    if (!loader) {
      throw ConfigError(str("Trainer.", what, ": no data. Pass a loader, or a DataModule whose ",
                            s == Stage::Test ? "test" : "val", "_dataloader() returns one."));
    }
    distribute(*loader, /*even=*/false, s == Stage::Test ? "test" : "validation");
    strategy->setup(m);
    std::string ckpt = resolve_ckpt_path(ckpt_path);
    if (!ckpt.empty()) restore_checkpoint(ckpt, /*full=*/false);
    auto limit = (s == Stage::Test ? limit_test : limit_val)
                     .apply(loader->num_batches(),
                            s == Stage::Test ? "limit_test_batches" : "limit_val_batches");
    out = evaluation_epoch(*loader, s, limit);
    if (data) data->teardown(s);
  }, LaunchResults{[&](const std::string& path) {
                     torch::serialize::OutputArchive archive;
                     write_metrics(archive, "metrics", out);
                     archive.save_to(path);
                   },
                   [&](const std::string& path) {
                     torch::serialize::InputArchive archive;
                     archive.load_from(path);
                     out = read_metrics(archive, "metrics");
                   }});
  return out;
}

std::vector<Batch> Trainer::Impl::run_predict(Module& m, std::shared_ptr<DataLoader> loader,
                                              DataModule* data, const std::string& ckpt_path) {
  std::vector<Batch> out;
  run_stage(m, Stage::Predict, [&] {
    if (options.seed) seed_everything(*options.seed);
    if (data) {
      prepare_and_set_up(*data, Stage::Predict);
      loader = data->predict_dataloader();
    }
    if (!loader) {
      throw ConfigError("Trainer.predict: no data. Pass a loader, or a DataModule whose "
                        "predict_dataloader() returns one.");
    }
    distribute(*loader, /*even=*/false, "predict");
    strategy->setup(m);
    std::string ckpt = resolve_ckpt_path(ckpt_path);
    if (!ckpt.empty()) restore_checkpoint(ckpt, /*full=*/false);
    out = prediction_epoch(*loader, limit_predict.apply(loader->num_batches(),
                                                        "limit_predict_batches"));
    if (data) data->teardown(Stage::Predict);
  }, LaunchResults{[&](const std::string&) {},
                   [&](const std::string&) {
                     throw ConfigError(
                         "Trainer.predict under a forking strategy: the predictions stay in the "
                         "ranks that made them and do not come back to this process. Write them "
                         "from predict_step (e.g. to a file per rank), or run predict with "
                         "strategy=\"ddp\" or on one device.");
                   }});
  return out;
}

// ---- Trainer: thin forwarding to Impl.

Trainer::Trainer(TrainerOptions options)
    : impl_(std::make_unique<Impl>(*this, std::move(options))) {}
Trainer::~Trainer() = default;

FitResult Trainer::fit(Module& module, DataModule& data, FitOptions options) {
  return impl_->run_fit(module, nullptr, nullptr, &data, options);
}
FitResult Trainer::fit(Module& module, std::shared_ptr<DataLoader> train,
                       std::shared_ptr<DataLoader> val, FitOptions options) {
  return impl_->run_fit(module, std::move(train), std::move(val), nullptr, options);
}
Metrics Trainer::validate(Module& module, DataModule& data, const std::string& ckpt_path) {
  return impl_->run_evaluation(module, nullptr, &data, Stage::Validate, ckpt_path);
}
Metrics Trainer::validate(Module& module, std::shared_ptr<DataLoader> val,
                          const std::string& ckpt_path) {
  return impl_->run_evaluation(module, std::move(val), nullptr, Stage::Validate, ckpt_path);
}
Metrics Trainer::test(Module& module, DataModule& data, const std::string& ckpt_path) {
  return impl_->run_evaluation(module, nullptr, &data, Stage::Test, ckpt_path);
}
Metrics Trainer::test(Module& module, std::shared_ptr<DataLoader> test,
                      const std::string& ckpt_path) {
  return impl_->run_evaluation(module, std::move(test), nullptr, Stage::Test, ckpt_path);
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
const std::vector<std::shared_ptr<Callback>>& Trainer::callbacks() const { return impl_->callbacks; }
const std::vector<std::shared_ptr<Logger>>& Trainer::loggers() const { return impl_->loggers; }
ModelCheckpoint* Trainer::checkpoint_callback() const { return impl_->checkpoint_callback; }
const TrainerOptions& Trainer::options() const { return impl_->options; }
Stage Trainer::stage() const { return impl_->stage; }
bool Trainer::sanity_checking() const { return impl_->sanity_checking; }
int64_t Trainer::current_epoch() const { return impl_->current_epoch; }
int64_t Trainer::global_step() const { return impl_->global_step; }
int64_t Trainer::batch_idx() const { return impl_->batch_idx; }
int64_t Trainer::num_training_batches() const { return impl_->num_training_batches; }
void Trainer::request_stop() { impl_->should_stop = true; }
bool Trainer::should_stop() const { return impl_->should_stop; }
const Metrics& Trainer::callback_metrics() const { return impl_->callback_metrics; }
const Metrics& Trainer::progress_bar_metrics() const { return impl_->progress_bar_metrics; }
std::string Trainer::default_root_dir() const { return impl_->root_dir(); }
std::string Trainer::log_dir() const {
  return impl_->loggers.empty() ? std::string() : impl_->loggers.front()->log_dir();
}
void Trainer::save_checkpoint(const std::string& path) { impl_->save_checkpoint(path); }

int64_t Trainer::estimated_stepping_batches() const {
  const auto& i = *impl_;
  if (i.num_training_batches < 0) return i.max_steps;
  int64_t per_epoch = (i.num_training_batches + i.options.accumulate_grad_batches - 1) /
                      i.options.accumulate_grad_batches;
  int64_t total = i.max_epochs < 0 ? -1 : per_epoch * i.max_epochs;
  if (i.max_steps >= 0 && (total < 0 || i.max_steps < total)) total = i.max_steps;
  return total;
}

std::string Trainer::describe() const { return impl_->resolution.to_json(); }

const Resolution& Trainer::resolution() const { return impl_->resolution; }

}  // namespace fulgur
