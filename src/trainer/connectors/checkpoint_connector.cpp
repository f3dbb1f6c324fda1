// The training state as a checkpoint, and back. Layout (keys of the
// LibTorch archive):
//   fulgur_format_version  int      format of this layout (kFormatVersion)
//   fulgur_version         str
//   state_dict             archive  module parameters and buffers (strategy)
//   optimizer_states       archive  "count", then "0", "1", ... per optimizer
//   lr_schedulers          list     step count of each scheduler
//   lr_scheduler_states    archive  "<i>": what scheduler i saves (SchedulerState)
//   precision              archive  the precision plugin's state
//   loops                  archive  epoch, global_step, batch_position, ...
//   train_loader           archive  epoch, position, sampler state
//   callbacks              archive  one archive per callback state_key()
//   loggers                archive  one archive per logger state_key()
//   rng                    archive  every RNG state
//   hparams                archive  the module's hyper-parameters
//   module                 archive  what Module::on_save_checkpoint adds
#include "trainer/connectors/checkpoint_connector.h"

#include <torch/torch.h>

#include <filesystem>
#include <iostream>
#include <vector>

#include "fulgur/callbacks/callback.h"
#include "fulgur/callbacks/model_checkpoint.h"
#include "fulgur/core/errors.h"
#include "fulgur/optim/lr_scheduler.h"
#include "fulgur/plugins/io/checkpoint_io.h"
#include "fulgur/plugins/precision/precision.h"
#include "fulgur/utilities/seed.h"
#include "trainer/trainer_impl.h"

namespace fulgur::detail {

namespace {

constexpr int64_t kFormatVersion = 1;
constexpr const char* kVersion = FULGUR_VERSION;  // project() in CMakeLists.txt

// LRScheduler keeps its step count protected and has no state_dict in
// LibTorch; a derived type may name the member to read and restore it.
struct SchedulerAccess : torch::optim::LRScheduler {
  static unsigned& step_count(torch::optim::LRScheduler& s) {
    return s.*(&SchedulerAccess::step_count_);
  }
};

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

int64_t read_int(InputArchive& archive, const char* key, const std::string& path) {
  c10::IValue v;
  if (!archive.try_read(key, v) || !v.isInt()) {
    throw CheckpointError(str("checkpoint \"", path, "\" is incomplete: entry \"", key,
                              "\" is missing or not an integer. Use a checkpoint written by "
                              "fulgur's Trainer."));
  }
  return v.toInt();
}

InputArchive read_section(InputArchive& archive, const char* key, const std::string& path) {
  InputArchive section;
  if (!archive.try_read(key, section)) {
    throw CheckpointError(str("checkpoint \"", path, "\" is incomplete: section \"", key,
                              "\" is missing. Use a checkpoint written by fulgur's Trainer."));
  }
  return section;
}

}  // namespace

void CheckpointConnector::dump(OutputArchive& archive) {
  FULGUR_ASSERT(trainer_.module != nullptr, "dump() without a module");
  auto cu = archive.compilation_unit();
  archive.write("fulgur_format_version", c10::IValue(kFormatVersion));
  archive.write("fulgur_version", c10::IValue(std::string(kVersion)));

  OutputArchive state(cu);
  trainer_.drive().save_module_state(*trainer_.module, state);
  archive.write("state_dict", state);

  OutputArchive optimizers(cu);
  optimizers.write(
      "count", c10::IValue(static_cast<int64_t>(trainer_.fit_loop.optimizers().optimizers.size())));
  for (size_t i = 0; i < trainer_.fit_loop.optimizers().optimizers.size(); ++i) {
    OutputArchive one(cu);
    trainer_.drive().save_optimizer_state(*trainer_.fit_loop.optimizers().optimizers[i], one);
    optimizers.write(std::to_string(i), one);
  }
  archive.write("optimizer_states", optimizers);

  c10::List<int64_t> steps;
  for (auto& s : trainer_.fit_loop.optimizers().schedulers) {
    steps.push_back(SchedulerAccess::step_count(*s.scheduler));
  }
  archive.write("lr_schedulers", c10::IValue(steps));
  OutputArchive scheduler_states(cu);
  for (size_t i = 0; i < trainer_.fit_loop.optimizers().schedulers.size(); ++i) {
    auto* stateful =
        dynamic_cast<SchedulerState*>(trainer_.fit_loop.optimizers().schedulers[i].scheduler.get());
    if (stateful == nullptr) continue;
    OutputArchive one(cu);
    stateful->save_state(one);
    scheduler_states.write(std::to_string(i), one);
  }
  archive.write("lr_scheduler_states", scheduler_states);

  OutputArchive precision(cu);
  trainer_.strategy->precision().save_state(precision);
  archive.write("precision", precision);

  const FitProgress progress = trainer_.fit_loop.progress();
  OutputArchive loops(cu);
  loops.write("epoch", c10::IValue(progress.epoch));
  loops.write("global_step", c10::IValue(progress.global_step));
  loops.write("batch_position", c10::IValue(progress.batch_position));
  loops.write("batches_that_stepped", c10::IValue(progress.batches_that_stepped));
  loops.write("epoch_done", c10::IValue(progress.epoch_done));
  loops.write("validated_at_position", c10::IValue(progress.validated_at_position));
  archive.write("loops", loops);

  if (DataLoader* train_loader = trainer_.fit_loop.train_loader()) {
    OutputArchive loader(cu);
    train_loader->save_state(loader);
    archive.write("train_loader", loader);
  }

  save_callback_states(archive);

  OutputArchive loggers(cu);
  for (const auto& logger : trainer_.logging.loggers()) {
    OutputArchive one(cu);
    logger->save_state(one);
    loggers.write(logger->state_key(), one);
  }
  archive.write("loggers", loggers);

  // The metric objects logged so far in this epoch, every rank's states
  // combined (collectives: every rank saves at the same point; a save from
  // on_exception may be one rank's alone and keeps none). A resumed run's
  // global rank 0 merges them into its metrics, so the epoch's values count
  // every batch. None at an epoch's end: the next epoch starts afresh.
  OutputArchive metrics(cu);
  int64_t metric_count = 0;
  if (!trainer_.handling_exception && !progress.epoch_done) {
    for (const auto& [name, states] :
         trainer_.logging.train_sink().metric_states(*trainer_.strategy)) {
      auto updates = states.find("updates");
      if (updates == states.end() || updates->second.item<int64_t>() == 0) continue;
      OutputArchive one(cu);
      one.write("name", c10::IValue(name));
      OutputArchive tensors(cu);
      for (const auto& [key, tensor] : states) tensors.write(key, tensor, /*is_buffer=*/true);
      one.write("states", tensors);
      metrics.write(std::to_string(metric_count++), one);
    }
  }
  metrics.write("count", c10::IValue(metric_count));
  archive.write("train_metrics", metrics);

  OutputArchive rng(cu);
  save_rng_states(rng);
  archive.write("rng", rng);

  OutputArchive hparams(cu);
  for (const auto& [key, value] : trainer_.module->hparams()) {
    std::visit([&](const auto& v) { hparams.write(key, c10::IValue(v)); }, value);
  }
  archive.write("hparams", hparams);

  OutputArchive extra(cu);
  trainer_.module->on_save_checkpoint(extra);
  archive.write("module", extra);
}

void CheckpointConnector::save_callback_states(OutputArchive& archive) {
  OutputArchive cbs(archive.compilation_unit());
  for (auto& cb : trainer_.callbacks) {
    OutputArchive one(archive.compilation_unit());
    cb->save_state(one);
    cbs.write(cb->state_key(), one);
  }
  archive.write("callbacks", cbs);
}

void CheckpointConnector::load_callback_states(InputArchive& archive) {
  InputArchive cbs;
  if (!archive.try_read("callbacks", cbs)) return;
  for (auto& cb : trainer_.callbacks) {
    InputArchive one;
    if (cbs.try_read(cb->state_key(), one)) cb->load_state(one);
  }
}

void CheckpointConnector::save(const std::string& path) {
  if (trainer_.module == nullptr) {
    throw ConfigError(str("Trainer.save_checkpoint(\"", path,
                          "\"): no module is attached. Call "
                          "it during fit (e.g. from a callback)."));
  }
  // What the loggers hold reaches their files first: a run resumed from
  // this checkpoint keeps the logs up to its step and does not log them again.
  for (const auto& logger : trainer_.logging.loggers()) {
    try {
      logger->save();
    } catch (const std::exception& e) {
      detail::print_note(e.what());
    }
  }
  OutputArchive archive;
  dump(archive);
  trainer_.drive().save_checkpoint(archive, path);
}

std::string CheckpointConnector::checkpoint_dir() const {
  const ModelCheckpoint* callback = trainer_.checkpoint_callback;
  if (callback && !callback->dirpath().empty()) return callback->dirpath();
  if (callback && !callback->options().dirpath.empty()) return callback->options().dirpath;
  return (std::filesystem::path(trainer_.root_dir()) / "checkpoints").string();
}

std::string CheckpointConnector::resolve_path(const std::string& ckpt_path) const {
  if (ckpt_path != "last" && ckpt_path != "auto") return ckpt_path;
  const std::string dir = checkpoint_dir();
  const std::vector<std::string> found = checkpoints_newest_first(dir);
  if (found.empty()) {
    if (ckpt_path == "auto") return {};
    throw CheckpointError(str("ckpt_path=\"last\": there is no checkpoint in \"", dir,
                              "\". Train once with checkpointing enabled (ModelCheckpoint) in "
                              "this default_root_dir, pass ckpt_path=\"auto\" to start fresh "
                              "when there is none, or pass a checkpoint path."));
  }
  std::vector<std::string> skipped;
  for (const auto& candidate : found) {
    const std::string problem = trainer_.drive().verify_checkpoint(candidate);
    if (problem.empty()) {
      if (!skipped.empty() && trainer_.strategy->is_global_zero()) {
        detail::print_note(str("ckpt_path=\"", ckpt_path, "\": skipped ", join(skipped, "; "),
                               ". Resuming from \"", candidate,
                               "\", the newest checkpoint of its directory that verifies."));
      }
      return candidate;
    }
    skipped.push_back(str("\"", candidate, "\", which is corrupt or incomplete (", problem, ")"));
  }
  throw CheckpointError(str("ckpt_path=\"", ckpt_path, "\": none of the ", found.size(),
                            " checkpoint(s) in \"", dir, "\" verifies: ", join(skipped, "; "),
                            ". Nothing was loaded or changed. Move the damaged files away and "
                            "pass ckpt_path=\"\" to start fresh, or restore a copy."));
}

void CheckpointConnector::restore(const std::string& path, bool full) {
  InputArchive archive;
  trainer_.drive().load_checkpoint(path, archive);
  c10::IValue version;
  if (!archive.try_read("fulgur_format_version", version) || !version.isInt()) {
    auto keys = archive.keys();
    throw CheckpointError(str("\"", path,
                              "\" is not a fulgur checkpoint: it is a LibTorch archive "
                              "without a \"fulgur_format_version\" entry (it holds: ",
                              keys.empty() ? std::string("nothing") : join(keys),
                              "). A file written by torch::save is loaded with torch::load; pass "
                              "a checkpoint written by fulgur's Trainer."));
  }
  if (version.toInt() > kFormatVersion || version.toInt() < 1) {
    throw CheckpointError(str("checkpoint \"", path, "\" has format version ", version.toInt(),
                              "; this fulgur (", kVersion, ") reads versions 1 to ", kFormatVersion,
                              ". Use a matching fulgur."));
  }

  auto state = read_section(archive, "state_dict", path);
  try {
    trainer_.drive().load_module_state(*trainer_.module, state);
  } catch (const c10::Error& e) {
    throw CheckpointError(str("checkpoint \"", path, "\" does not fit module ",
                              trainer_.module->name(), ": ", e.what_without_backtrace(),
                              ". Build the same model (same layers and sizes) before loading."));
  }
  InputArchive extra;
  if (archive.try_read("module", extra)) trainer_.module->on_load_checkpoint(extra);
  if (!full) return;

  auto optimizers = read_section(archive, "optimizer_states", path);
  int64_t count = read_int(optimizers, "count", path);
  if (count != static_cast<int64_t>(trainer_.fit_loop.optimizers().optimizers.size())) {
    throw CheckpointError(str("checkpoint \"", path, "\" holds ", count,
                              " optimizer state(s) but configure_optimizers returned ",
                              trainer_.fit_loop.optimizers().optimizers.size(),
                              ". Resume with the same optimizers it was trained with."));
  }
  for (int64_t i = 0; i < count; ++i) {
    InputArchive one = read_section(optimizers, std::to_string(i).c_str(), path);
    try {
      trainer_.drive().load_optimizer_state(
          *trainer_.fit_loop.optimizers().optimizers[static_cast<size_t>(i)], one);
    } catch (const c10::Error& e) {
      throw CheckpointError(str("checkpoint \"", path, "\": optimizer ", i,
                                " state does not fit: ", e.what_without_backtrace(),
                                ". Resume with the same optimizer type and parameters."));
    }
  }

  c10::IValue steps;
  if (archive.try_read("lr_schedulers", steps) && steps.isIntList()) {
    auto list = steps.toIntList();
    if (list.size() != trainer_.fit_loop.optimizers().schedulers.size()) {
      throw CheckpointError(str("checkpoint \"", path, "\" holds ", list.size(),
                                " scheduler state(s) but configure_optimizers returned ",
                                trainer_.fit_loop.optimizers().schedulers.size(),
                                ". Resume with the same schedulers."));
    }
    for (size_t i = 0; i < list.size(); ++i) {
      SchedulerAccess::step_count(*trainer_.fit_loop.optimizers().schedulers[i].scheduler) =
          static_cast<unsigned>(list.get(i));
    }
  }
  InputArchive scheduler_states;
  const bool has_scheduler_states = archive.try_read("lr_scheduler_states", scheduler_states);
  for (size_t i = 0; i < trainer_.fit_loop.optimizers().schedulers.size(); ++i) {
    auto* stateful =
        dynamic_cast<SchedulerState*>(trainer_.fit_loop.optimizers().schedulers[i].scheduler.get());
    if (stateful == nullptr) continue;
    InputArchive one;
    if (!has_scheduler_states || !scheduler_states.try_read(std::to_string(i), one)) {
      throw CheckpointError(str("checkpoint \"", path, "\" holds no state for scheduler ", i,
                                ", which keeps one (a fulgur::SchedulerState): the schedule "
                                "could not go on as it was. Resume with the schedulers it was "
                                "saved with, or start this schedule from the beginning."));
    }
    try {
      stateful->load_state(one);
    } catch (const c10::Error& e) {
      throw CheckpointError(str("checkpoint \"", path, "\": the state of scheduler ", i,
                                " does not fit: ", e.what_without_backtrace(),
                                ". Resume with the schedulers it was saved with."));
    }
  }

  InputArchive precision;
  if (archive.try_read("precision", precision))
    trainer_.strategy->precision().load_state(precision);

  auto loops = read_section(archive, "loops", path);
  FitProgress progress;
  progress.epoch = read_int(loops, "epoch", path);
  progress.global_step = read_int(loops, "global_step", path);
  progress.batches_that_stepped = read_int(loops, "batches_that_stepped", path);
  progress.batch_position = read_int(loops, "batch_position", path);
  progress.validated_at_position = read_int(loops, "validated_at_position", path);
  c10::IValue epoch_done;
  loops.read("epoch_done", epoch_done);
  progress.epoch_done = epoch_done.toBool();
  InputArchive loader;
  const bool has_loader_state = archive.try_read("train_loader", loader);
  trainer_.fit_loop.restore(progress, has_loader_state ? &loader : nullptr);

  load_callback_states(archive);
  InputArchive metrics;
  detail::LogSink::MetricStates metric_states;
  if (archive.try_read("train_metrics", metrics) && trainer_.strategy->is_global_zero()) {
    const int64_t count = read_int(metrics, "count", path);
    for (int64_t i = 0; i < count; ++i) {
      InputArchive one = read_section(metrics, std::to_string(i).c_str(), path);
      c10::IValue name;
      one.read("name", name);
      InputArchive tensors = read_section(one, "states", path);
      auto& states = metric_states[name.toStringRef()];
      for (const auto& key : tensors.keys()) {
        at::Tensor t;
        if (tensors.try_read(key, t, /*is_buffer=*/true)) states[key] = t;
      }
    }
  }
  trainer_.logging.train_sink().restore_metric_states(std::move(metric_states));
  InputArchive loggers;
  if (archive.try_read("loggers", loggers)) {
    for (auto& logger : trainer_.logging.loggers()) {
      InputArchive one;
      if (loggers.try_read(logger->state_key(), one)) logger->load_state(one, progress.global_step);
    }
  }
  // Last: nothing above may draw random numbers after the RNGs are restored.
  InputArchive rng;
  if (archive.try_read("rng", rng)) load_rng_states(rng);
}

}  // namespace fulgur::detail
