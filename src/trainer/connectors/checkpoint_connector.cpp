// The training state as a checkpoint, and back. Layout (keys of the
// StateDict, as the torch checkpoint IO writes them into a LibTorch archive):
//   fulgur_format_version  int      format of this layout (kFormatVersion)
//   fulgur_version         str
//   state_dict             section  module parameters and buffers (strategy)
//   optimizer_states       section  "count", then "0", "1", ... per optimizer
//   lr_schedulers          list     step count of each scheduler
//   lr_scheduler_states    section  "<i>": what scheduler i saves (SchedulerState)
//   precision              section  the precision plugin's state
//   loops                  section  epoch, global_step, batch_position, ...,
//                                   callback_metrics (global rank 0's) and,
//                                   where the ranks' differ, each rank's
//   train_loader           section  epoch, position, sampler state
//   callbacks              section  one section per callback state_key()
//   loggers                section  one section per logger state_key()
//   train_metrics          section  "count", then the metric states logged so far
//   rng                    section  every RNG state
//   hparams                section  the module's hyper-parameters
//   module                 section  what Module::on_save_checkpoint adds
#include "utilities/file_kind.h"
#include "trainer/connectors/checkpoint_connector.h"

#include <torch/torch.h>

#include <exception>
#include <filesystem>
#include <iostream>
#include <vector>

#include "fulgur/callbacks/callback.h"
#include "fulgur/callbacks/model_checkpoint.h"
#include "fulgur/strategies/checkpoint_layout.h"
#include "fulgur/core/errors.h"
#include "fulgur/nn/state_dict.h"
#include "fulgur/optim/lr_scheduler.h"
#include "fulgur/optim/state_dict.h"
#include "fulgur/plugins/environments/cluster_environment.h"
#include "fulgur/plugins/io/checkpoint_io.h"
#include "fulgur/plugins/precision/precision.h"
#include "fulgur/utilities/seed.h"
#include "strategies/every_rank.h"
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

// The checkpoint at `path` as this rank reads it alone, with no collective
// (the ranks may not agree on the path yet): its file, or this rank's
// shard of a directory (global rank 0's when the directory's world size is
// another).
StateDict read_alone(Strategy& strategy, const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec))
    return strategy.checkpoint_io().load_checkpoint(path);
  const ShardedCheckpoint::Manifest manifest = ShardedCheckpoint::read_manifest(path);
  const int rank = strategy.global_rank() < manifest.world_size ? strategy.global_rank() : 0;
  return strategy.checkpoint_io().load_checkpoint(
      ShardedCheckpoint::shard_path(path, rank, manifest.world_size));
}

}  // namespace

StateDict CheckpointConnector::dump() {
  FULGUR_ASSERT(trainer_.module != nullptr, "dump() without a module");
  auto& optimizers = trainer_.fit_loop.optimizers();
  StateDict checkpoint;
  checkpoint.set("fulgur_format_version", kFormatVersion);
  checkpoint.set("fulgur_version", std::string(kVersion));

  checkpoint.set_section("state_dict", trainer_.drive().module_state(*trainer_.module));

  StateDict& optimizer_states = checkpoint.section("optimizer_states");
  optimizer_states.set("count", static_cast<int64_t>(optimizers.optimizers.size()));
  for (size_t i = 0; i < optimizers.optimizers.size(); ++i) {
    optimizer_states.set_section(std::to_string(i),
                                 trainer_.drive().optimizer_state(*optimizers.optimizers[i]));
  }

  c10::List<int64_t> steps;
  for (auto& s : optimizers.schedulers) steps.push_back(SchedulerAccess::step_count(*s.scheduler));
  checkpoint.set("lr_schedulers", steps);
  StateDict& scheduler_states = checkpoint.section("lr_scheduler_states");
  for (size_t i = 0; i < optimizers.schedulers.size(); ++i) {
    auto* stateful = dynamic_cast<SchedulerState*>(optimizers.schedulers[i].scheduler.get());
    if (stateful != nullptr) scheduler_states.set_section(std::to_string(i), stateful->state_dict());
  }

  checkpoint.set_section("precision", trainer_.strategy->precision().state_dict());

  const FitProgress progress = trainer_.fit_loop.progress();
  StateDict& loops = checkpoint.section("loops");
  loops.set("epoch", progress.epoch);
  loops.set("global_step", progress.global_step);
  loops.set("batch_position", progress.batch_position);
  loops.set("batches_that_stepped", progress.batches_that_stepped);
  loops.set("batches_before_epoch", progress.batches_before_epoch);
  loops.set("epoch_done", progress.epoch_done);
  loops.set("validated_at_position", progress.validated_at_position);
  loops.set("monitored_step_due", progress.monitored_step_due);
  // Within the end of a validation or an epoch: the resume finishes it (a
  // save on an exception runs it again, as the whole validation).
  if (!progress.hook.empty() && !trainer_.handling_exception) {
    loops.set("hook", progress.hook);
    loops.set("hook_started", c10::List<std::string>(progress.hook_started));
  }
  // What the callbacks read, as they read it now: a resume reads what the
  // validations before it published (the uninterrupted run's values) until
  // the next one, instead of nothing.
  const Metrics& published = trainer_.logging.callback_metrics();
  write_metrics(loops, "callback_metrics", published);
  // A value logged without sync_dist is each rank's own: where the ranks'
  // differ, every rank's, so that each resumes with what it read (one
  // all-gather of a hash where they agree). Every rank saves at the same
  // point (Trainer::save_checkpoint's rule; ModelCheckpoint decides on
  // global rank 0's values), except from on_exception, which may be one
  // rank's alone: that file keeps its writer's only.
  if (trainer_.strategy->world_size() > 1 && !trainer_.handling_exception) {
    const std::vector<std::string> by_rank =
        trainer_.strategy->values_where_they_differ(metrics_bytes(published));
    if (!by_rank.empty()) {
      loops.set("callback_metrics.ranks", static_cast<int64_t>(by_rank.size()));
      for (size_t r = 0; r < by_rank.size(); ++r) {
        write_metrics(loops, str("callback_metrics.rank", r), metrics_from_bytes(by_rank[r]));
      }
    }
  }

  if (DataLoader* train_loader = trainer_.fit_loop.train_loader()) {
    checkpoint.set_section("train_loader", train_loader->state_dict());
  }

  save_callback_states(checkpoint);

  StateDict& loggers = checkpoint.section("loggers");
  for (const auto& logger : trainer_.logging.loggers()) {
    loggers.set_section(logger->state_key(), logger->state_dict());
  }

  // The metric objects logged so far in this epoch, every rank's states
  // combined (collectives: every rank saves at the same point; a save from
  // on_exception may be one rank's alone and keeps none). A resumed run's
  // global rank 0 merges them into its metrics, so the epoch's values count
  // every batch. None at an epoch's end: the next epoch starts afresh.
  StateDict& metrics = checkpoint.section("train_metrics");
  int64_t metric_count = 0;
  if (!trainer_.handling_exception && !progress.epoch_done) {
    for (const auto& [name, saved] :
         trainer_.logging.train_sink().metric_states(*trainer_.strategy)) {
      auto updates = saved.states.find("updates");
      if (updates == saved.states.end() || updates->second.item<int64_t>() == 0) continue;
      StateDict& one = metrics.section(std::to_string(metric_count++));
      one.set("name", name);
      StateDict& tensors = one.section("states");
      for (const auto& [key, tensor] : saved.states) tensors.set_buffer(key, tensor);
      // What the epoch publishes if it is not logged again (a save after
      // the epoch's last batch), and how.
      if (saved.value) one.set("value", *saved.value);
      one.set("logger", saved.logger);
      one.set("prog_bar", saved.prog_bar);
    }
  }
  metrics.set("count", metric_count);

  checkpoint.set_section("rng", rng_state_dict());

  StateDict& hparams = checkpoint.section("hparams");
  for (const auto& [key, value] : trainer_.module->hparams()) {
    std::visit([&](const auto& v) { hparams.set(key, c10::IValue(v)); }, value);
  }

  trainer_.module->on_save_checkpoint(checkpoint.section("module"));
  return checkpoint;
}

void CheckpointConnector::save_callback_states(StateDict& state) {
  StateDict& callbacks = state.section("callbacks");
  for (auto& cb : trainer_.callbacks) callbacks.set_section(cb->state_key(), cb->state_dict());
}

void CheckpointConnector::load_callback_states(const StateDict& state) {
  const StateDict* callbacks = state.find_section("callbacks");
  if (callbacks == nullptr) return;
  for (auto& cb : trainer_.callbacks) {
    if (const StateDict* one = callbacks->find_section(cb->state_key())) cb->load_state_dict(*one);
  }
}

void CheckpointConnector::note_callback_states_left(const StateDict& checkpoint,
                                                    const std::string& path) const {
  const StateDict* saved = checkpoint.find_section("callbacks");
  if (saved == nullptr || !trainer_.strategy->is_global_zero()) return;
  std::vector<std::string> left;
  bool average_as_module = false;
  for (const std::string& key : saved->keys()) {
    const StateDict* one = saved->find_section(key);
    if (one == nullptr || one->empty()) continue;
    bool loaded = false;
    for (const auto& cb : trainer_.callbacks) loaded = loaded || cb->state_key() == key;
    if (loaded) continue;
    left.push_back(str("\"", key, "\""));
    const c10::IValue* holds = one->find("module_holds_average");
    average_as_module =
        average_as_module || (holds != nullptr && holds->isBool() && holds->toBool());
  }
  if (left.empty()) return;
  detail::print_note(
      str("checkpoint \"", path, "\" holds the state of callback(s) ", join(left),
          ", which this fit has none of (no callback of that state_key()): not loaded.",
          average_as_module ? " Its module weights are an EMA's average (the training weights are "
                              "in that EMA's state), so training goes on from the average."
                            : "",
          " To go on with them, pass the callbacks the run that wrote it had, with the same "
          "options (and the Trainer options that add callbacks: max_time adds a Timer, "
          "enable_checkpointing and every_n_train_steps a ModelCheckpoint); otherwise nothing is "
          "needed."));
}

void CheckpointConnector::save(const std::string& path) {
  if (trainer_.module == nullptr) {
    throw ConfigError(str("Trainer.save_checkpoint(\"", path,
                          "\"): no module is attached. Call "
                          "it during fit (e.g. from a callback)."));
  }
  // What the loggers hold reaches their files first: a run resumed from
  // this checkpoint keeps the logs up to its step and does not log them again.
  // Global rank 0's: the others' loggers write nothing (a save of theirs
  // after a resume would write the file anew with the resumed step's rows).
  // A save from on_train_batch_end writes its step's row first.
  trainer_.fit_loop.write_step_row_before_save();
  if (trainer_.strategy->is_global_zero()) trainer_.logging.save_quietly();
  // The callbacks' hooks around the save (EMA's average saved as the
  // module's weights). Not in a save from on_exception (it may be one
  // rank's alone, and EMA has put the training weights back by then), nor
  // from within a step (autograd may hold the parameters, which a swap
  // would write), nor in a save from one of these hooks (it would run
  // them again, without end).
  const bool hooks =
      !trainer_.handling_exception && !trainer_.fit_loop.within_step() && !in_save_hooks_;
  const auto& callbacks = trainer_.callbacks;
  Trainer& trainer = trainer_.self;
  Module& module = *trainer_.module;
  struct InHooks {
    bool& flag;
    bool was;
    ~InHooks() { flag = was; }
  } in_hooks{in_save_hooks_, in_save_hooks_};
  in_save_hooks_ = in_save_hooks_ || hooks;
  size_t begun = 0;
  try {
    for (; hooks && begun < callbacks.size(); ++begun) {
      callbacks[begun]->on_before_checkpoint_save(trainer, module);
    }
    StateDict checkpoint = dump();
    trainer_.drive().save_checkpoint(checkpoint, path);
  } catch (...) {
    // Also the one whose on_before_checkpoint_save failed (part of its
    // change done).
    for (size_t i = 0; hooks && i <= begun && i < callbacks.size(); ++i) {
      try {
        callbacks[i]->on_after_checkpoint_save(trainer, module, /*failed=*/true);
      } catch (const std::exception& e) {
        detail::print_note(
            str("callback \"", callbacks[i]->state_key(),
                "\": on_after_checkpoint_save after a failed save failed too: ", e.what()));
      }
    }
    throw;
  }
  // Every callback's, also after one that threw (an EMA later in the list
  // puts its training weights back); then the first error.
  std::exception_ptr first;
  for (size_t i = 0; hooks && i < callbacks.size(); ++i) {
    try {
      callbacks[i]->on_after_checkpoint_save(trainer, module, /*failed=*/false);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

std::string CheckpointConnector::checkpoint_dir() const {
  const ModelCheckpoint* callback = trainer_.checkpoint_callback;
  if (callback && !callback->dirpath().empty()) return callback->dirpath();
  if (callback && !callback->options().dirpath.empty()) return callback->options().dirpath;
  return (std::filesystem::path(trainer_.root_dir()) / "checkpoints").string();
}

std::string CheckpointConnector::resolve_path(const std::string& ckpt_path) const {
  if (ckpt_path == "best") return best_path();
  if (ckpt_path != "last" && ckpt_path != "auto") return ckpt_path;
  return newest_checkpoint(ckpt_path);
}

std::string CheckpointConnector::newest_checkpoint(const std::string& keyword) const {
  const std::string dir = checkpoint_dir();
  const std::vector<std::string> found = checkpoints_newest_first(dir);
  if (found.empty()) {
    // (A fresh start's first save names a directory that cannot be one.)
    if (keyword == "auto") return {};
    if (const std::string why = detail::unusable_directory(dir).why; !why.empty()) {
      throw CheckpointError(str("ckpt_path=\"", keyword, "\": the checkpoint directory \"", dir,
                                "\" cannot be one: ", why,
                                ". Pass a default_root_dir (or ModelCheckpoint dirpath) that is "
                                "a directory, or a directory to be made."));
    }
    throw CheckpointError(str("ckpt_path=\"", keyword, "\": there is no checkpoint in \"", dir,
                              "\". Train once with checkpointing enabled (ModelCheckpoint) in "
                              "this default_root_dir, ",
                              keyword == "last" ? "pass ckpt_path=\"auto\" to start fresh when "
                                                  "there is none, "
                                                : "",
                              "or pass a checkpoint path."));
  }
  std::vector<std::string> skipped;
  for (const auto& candidate : found) {
    const std::string problem = trainer_.drive().verify_checkpoint(candidate);
    if (problem.empty()) {
      if (!skipped.empty() && trainer_.strategy->is_global_zero()) {
        detail::print_note(
            str("ckpt_path=\"", keyword, "\": skipped ", join(skipped, "; "),
                keyword == "best" ? ". Reading the best from \"" : ". Resuming from \"", candidate,
                "\", the newest checkpoint of its directory that verifies."));
      }
      return candidate;
    }
    skipped.push_back(str("\"", candidate, "\", which is corrupt or incomplete (", problem, ")"));
  }
  throw CheckpointError(str("ckpt_path=\"", keyword, "\": none of the ", found.size(),
                            " checkpoint(s) in \"", dir, "\" verifies: ", join(skipped, "; "),
                            ". Nothing was loaded or changed. Move the damaged files away and "
                            "pass ckpt_path=\"\" to start fresh, or restore a copy."));
}

std::string CheckpointConnector::best_path() const {
  namespace fs = std::filesystem;
  const ModelCheckpoint* callback = trainer_.checkpoint_callback;
  if (callback == nullptr) {
    throw CheckpointError(
        "ckpt_path=\"best\": this Trainer has no ModelCheckpoint (enable_checkpointing=false), "
        "so no checkpoint is known as the best. Pass ckpt_path=\"last\" or a checkpoint's path.");
  }
  std::string best = callback->best_model_path();
  std::string recorded_by;  // the checkpoint that said which is the best
  if (best.empty()) {
    // A new process: the best the run's newest checkpoint recorded (its
    // ModelCheckpoint's state; each checkpoint records the list it joined).
    recorded_by = newest_checkpoint("best");
    // Read by each rank alone: resolving the path is no collective (the
    // ranks agree on its outcome after it, Trainer::Impl::agreed_checkpoint).
    const StateDict state = read_alone(*trainer_.strategy, recorded_by);
    const StateDict* callbacks = state.find_section("callbacks");
    const StateDict* own = callbacks ? callbacks->find_section(callback->state_key()) : nullptr;
    if (own != nullptr && own->contains("best_model_path")) best = own->string("best_model_path");
    if (best.empty()) {
      throw CheckpointError(str(
          "ckpt_path=\"best\": \"", recorded_by, "\", the newest checkpoint, records no best one (",
          own == nullptr ? str("it holds no state of a ModelCheckpoint like this Trainer's, \"",
                               callback->state_key(), "\"")
                         : std::string("its ModelCheckpoint had ranked none when it was saved: "
                                       "save_top_k=0, or a save before the first ranking"),
          "). Pass ckpt_path=\"last\" or a checkpoint's path."));
    }
    // The best is a file of the same directory: one the run wrote under a
    // relative path, or a directory since moved, is found there.
    std::error_code ec;
    const fs::path beside = fs::path(recorded_by).parent_path() / fs::path(best).filename();
    if (!fs::exists(best, ec) && fs::exists(beside, ec)) best = beside.string();
  }
  const std::string source = recorded_by.empty()
                                 ? std::string("this Trainer's ModelCheckpoint")
                                 : str("the ModelCheckpoint state of \"", recorded_by, "\"");
  const std::string problem = trainer_.drive().verify_checkpoint(best);
  if (!problem.empty()) {
    throw CheckpointError(str("ckpt_path=\"best\": the best checkpoint ", source, " names, \"",
                              best, "\", cannot be loaded: ", problem,
                              ". Pass ckpt_path=\"last\" or another checkpoint's path."));
  }
  if (trainer_.strategy->is_global_zero() && !recorded_by.empty()) {
    detail::print_note(str("ckpt_path=\"best\": \"", best, "\", as ", source, " names it."));
  }
  return best;
}

void CheckpointConnector::note_checkpoints_of_an_earlier_run() const {
  const TrainerOptions& options = trainer_.options;
  // A restart that found none of its own to resume from is not a new run.
  if (!options.enable_checkpointing || options.fast_dev_run != 0 ||
      trainer_.checkpoint_callback == nullptr || !trainer_.strategy->is_global_zero() ||
      trainer_.strategy->cluster_environment().restart_count() > 0) {
    return;
  }
  const std::string dir = checkpoint_dir();
  const std::vector<std::string> found = checkpoints_newest_first(dir);
  if (found.empty()) return;
  detail::print_note(str(
      "this fit starts from scratch, and its checkpoint directory \"", dir, "\" already holds ",
      found.size(), " checkpoint(s) of an earlier run (the newest: \"",
      std::filesystem::path(found.front()).filename().string(),
      "\"); this run's saves replace those of the same names. Pass ckpt_path=\"last\" to "
      "continue that run, or give this run another default_root_dir (or ModelCheckpoint "
      "dirpath) to keep both."));
}

void CheckpointConnector::restore(const std::string& path, bool full) {
  // Every rank reads it (a sharded checkpoint's ranks their own shards): a
  // rank that cannot (a node whose disk lacks the file) stops them all,
  // instead of its peers waiting in the stage's first collective.
  StateDict checkpoint;
  detail::on_every_rank(*trainer_.strategy, "cannot read the checkpoint, so no rank resumes",
                        [&] { checkpoint = trainer_.drive().load_checkpoint(path); });
  try {
    restore(checkpoint, path, full);
  } catch (const CheckpointError& e) {
    // A component's required entry: named with the file it is missing from.
    const std::string what = e.what();
    if (what.find(path) != std::string::npos) throw;
    throw CheckpointError(str("checkpoint \"", path, "\": ", what));
  }
}

void CheckpointConnector::restore(const StateDict& checkpoint, const std::string& path, bool full) {
  const c10::IValue* version = checkpoint.find("fulgur_format_version");
  if (version == nullptr || !version->isInt()) {
    auto keys = checkpoint.keys();
    throw CheckpointError(str("\"", path,
                              "\" is not a fulgur checkpoint: it is a LibTorch archive "
                              "without a \"fulgur_format_version\" entry (it holds: ",
                              keys.empty() ? std::string("nothing") : join(keys),
                              "). A file written by torch::save is loaded with torch::load; pass "
                              "a checkpoint written by fulgur's Trainer."));
  }
  if (version->toInt() > kFormatVersion || version->toInt() < 1) {
    throw CheckpointError(str("checkpoint \"", path, "\" has format version ", version->toInt(),
                              "; this fulgur (", kVersion, ") reads versions 1 to ", kFormatVersion,
                              ". Use a matching fulgur."));
  }
  auto section = [&](const StateDict& in, const std::string& key) -> const StateDict& {
    if (const StateDict* found = in.find_section(key)) return *found;
    throw CheckpointError(str("checkpoint \"", path, "\" is incomplete: section \"",
                              in.path().empty() ? key : in.path() + "/" + key,
                              "\" is missing. Use a checkpoint written by fulgur's Trainer."));
  };

  try {
    trainer_.drive().load_module_state(*trainer_.module, section(checkpoint, "state_dict"));
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    if (what.find(path) != std::string::npos) throw;
    if (what.find(kPrecisionChanged) != std::string::npos) {
      throw CheckpointError(str("checkpoint \"", path, "\" does not fit module ",
                                trainer_.module->name(), ": ", what,
                                ". Load it under the precision it was trained with (this run's is "
                                "\"", trainer_.strategy->precision().name(), "\")."));
    }
    throw CheckpointError(str("checkpoint \"", path, "\" does not fit module ",
                              trainer_.module->name(), ": ", what,
                              ". Build the same model (same layers and sizes) before loading."));
  } catch (const c10::Error& e) {
    throw CheckpointError(str("checkpoint \"", path, "\" does not fit module ",
                              trainer_.module->name(), ": ", e.what_without_backtrace(),
                              ". Build the same model (same layers and sizes) before loading."));
  }
  if (const StateDict* extra = checkpoint.find_section("module")) {
    trainer_.module->on_load_checkpoint(*extra);
  }
  if (!full) return;

  // The callbacks first: one may rebuild the optimizers' parameter groups
  // (on_restore_optimizers) so that their saved states fit.
  load_callback_states(checkpoint);
  note_callback_states_left(checkpoint, path);
  for (auto& cb : trainer_.callbacks) cb->on_restore_optimizers(trainer_.self, *trainer_.module);

  auto& optimizers = trainer_.fit_loop.optimizers();
  const StateDict& optimizer_states = section(checkpoint, "optimizer_states");
  const int64_t count = optimizer_states.integer("count");
  if (count != static_cast<int64_t>(optimizers.optimizers.size())) {
    throw CheckpointError(str("checkpoint \"", path, "\" holds ", count,
                              " optimizer state(s) but configure_optimizers returned ",
                              optimizers.optimizers.size(),
                              ". Resume with the same optimizers it was trained with."));
  }
  for (int64_t i = 0; i < count; ++i) {
    const StateDict& one = section(optimizer_states, std::to_string(i));
    try {
      auto& optimizer = *optimizers.optimizers[static_cast<size_t>(i)];
      trainer_.drive().load_optimizer_state(optimizer, one);
      check_optimizer_state_shapes(optimizer, [&](const at::Tensor& param) {
        for (const auto& item : trainer_.module->named_parameters(/*recurse=*/true)) {
          if (item.value().is_same(param)) return item.key();
        }
        return std::string();
      });
    } catch (const CheckpointError& e) {
      throw CheckpointError(str("checkpoint \"", path, "\": optimizer ", i,
                                " state does not fit: ", e.what(),
                                ". Resume with the same optimizer type and parameters."));
    } catch (const c10::Error& e) {
      throw CheckpointError(str("checkpoint \"", path, "\": optimizer ", i,
                                " state does not fit: ", e.what_without_backtrace(),
                                ". Resume with the same optimizer type and parameters."));
    }
  }

  if (const c10::IValue* steps = checkpoint.find("lr_schedulers"); steps && steps->isIntList()) {
    auto list = steps->toIntList();
    if (list.size() != optimizers.schedulers.size()) {
      throw CheckpointError(str("checkpoint \"", path, "\" holds ", list.size(),
                                " scheduler state(s) but configure_optimizers returned ",
                                optimizers.schedulers.size(), ". Resume with the same schedulers."));
    }
    for (size_t i = 0; i < list.size(); ++i) {
      SchedulerAccess::step_count(*optimizers.schedulers[i].scheduler) =
          static_cast<unsigned>(list.get(i));
    }
  }
  const StateDict* scheduler_states = checkpoint.find_section("lr_scheduler_states");
  for (size_t i = 0; i < optimizers.schedulers.size(); ++i) {
    auto* stateful = dynamic_cast<SchedulerState*>(optimizers.schedulers[i].scheduler.get());
    if (stateful == nullptr) continue;
    const StateDict* one =
        scheduler_states ? scheduler_states->find_section(std::to_string(i)) : nullptr;
    if (one == nullptr) {
      throw CheckpointError(str("checkpoint \"", path, "\" holds no state for scheduler ", i,
                                ", which keeps one (a fulgur::SchedulerState): the schedule "
                                "could not go on as it was. Resume with the schedulers it was "
                                "saved with, or start this schedule from the beginning."));
    }
    try {
      stateful->load_state_dict(*one);
    } catch (const std::exception& e) {
      throw CheckpointError(str("checkpoint \"", path, "\": the state of scheduler ", i,
                                " does not fit: ", e.what(),
                                ". Resume with the schedulers it was saved with."));
    }
  }

  if (const StateDict* precision = checkpoint.find_section("precision")) {
    trainer_.strategy->precision().load_state_dict(*precision);
  }

  const StateDict& loops = section(checkpoint, "loops");
  FitProgress progress;
  progress.epoch = loops.integer("epoch");
  progress.global_step = loops.integer("global_step");
  progress.batches_that_stepped = loops.integer("batches_that_stepped");
  progress.batch_position = loops.integer("batch_position");
  // Written since val_check_interval counts the batches of every epoch.
  if (const c10::IValue* before = loops.find("batches_before_epoch");
      before != nullptr && before->isInt()) {
    progress.batches_before_epoch = before->toInt();
  }
  progress.validated_at_position = loops.integer("validated_at_position");
  // Written since monitored step-interval schedulers step after the
  // validation that follows their step.
  if (const c10::IValue* due = loops.find("monitored_step_due"); due != nullptr && due->isBool()) {
    progress.monitored_step_due = due->toBool();
  }
  progress.epoch_done = loops.boolean("epoch_done");
  // Written since a resume finishes the hook it was written in.
  if (const c10::IValue* hook = loops.find("hook"); hook != nullptr && hook->isString()) {
    progress.hook = hook->toStringRef();
    if (progress.hook != kValidationEnd && progress.hook != kTrainEpochEnd) {
      throw CheckpointError(str("checkpoint \"", path, "\" was written in the hook \"",
                                progress.hook, "\", which this fulgur does not resume within (",
                                kValidationEnd, ", ", kTrainEpochEnd,
                                "). Resume it with the fulgur that wrote it."));
    }
    // A validation's end comes after a batch of an epoch; the callbacks'
    // epoch end, at a completed epoch.
    const bool fits = progress.hook == kTrainEpochEnd
                          ? progress.epoch_done
                          : !progress.epoch_done && progress.batch_position > 0;
    if (!fits) {
      throw CheckpointError(
          str("checkpoint \"", path, "\" was written in ", progress.hook, " at ",
              progress.epoch_done ? std::string("a completed epoch")
                                  : str("batch position ", progress.batch_position),
              ", where that hook does not run: its loop state (section \"loops\") is inconsistent. "
              "Resume from another checkpoint."));
    }
    progress.hook_started = loops.strings("hook_started");
  }
  trainer_.fit_loop.restore(progress, checkpoint.find_section("train_loader"));
  if (loops.find("callback_metrics.names") != nullptr) {
    Metrics metrics = read_metrics(loops, "callback_metrics");
    if (loops.find("callback_metrics.ranks") != nullptr) {
      const Strategy& strategy = *trainer_.strategy;
      const int64_t count = loops.integer("callback_metrics.ranks");
      if (count == strategy.world_size()) {
        metrics = read_metrics(loops, str("callback_metrics.rank", strategy.global_rank()));
      } else if (strategy.is_global_zero()) {
        detail::print_note(str("checkpoint \"", path, "\" holds the callback metrics of ", count,
                               " ranks, which differ (values logged without sync_dist); this run "
                               "has ",
                               strategy.world_size(),
                               ": every rank starts from global rank 0's until they are logged "
                               "again."));
      }
    }
    trainer_.logging.restore_callback_metrics(std::move(metrics));
  }

  // The states (combined across the ranks that saved them) go to global
  // rank 0 alone, so they count once; the value, to every rank.
  detail::LogSink::MetricStates metric_states;
  const StateDict* metrics = checkpoint.find_section("train_metrics");
  if (metrics != nullptr) {
    const int64_t metric_count = metrics->integer("count");
    for (int64_t i = 0; i < metric_count; ++i) {
      const StateDict& one = section(*metrics, std::to_string(i));
      detail::LogSink::SavedMetric& saved = metric_states[one.string("name")];
      if (one.contains("value")) saved.value = one.real("value");
      if (one.contains("logger")) saved.logger = one.boolean("logger");
      if (one.contains("prog_bar")) saved.prog_bar = one.boolean("prog_bar");
      if (!trainer_.strategy->is_global_zero()) continue;
      const StateDict& tensors = section(one, "states");
      for (const auto& key : tensors.keys()) {
        if (const c10::IValue* t = tensors.find(key); t != nullptr && t->isTensor()) {
          saved.states[key] = t->toTensor();
        }
      }
    }
  }
  trainer_.logging.train_sink().restore_metric_states(
      std::move(metric_states), !progress.epoch_done && progress.batch_position > 0);
  // Global rank 0's loggers (the others write nothing: they take its
  // directories after this).
  const StateDict* loggers = checkpoint.find_section("loggers");
  if (trainer_.strategy->is_global_zero()) {
    for (auto& logger : trainer_.logging.loggers()) {
      if (const StateDict* one =
              loggers != nullptr ? loggers->find_section(logger->state_key()) : nullptr) {
        logger->load_state_dict(*one, progress.global_step);
      } else {
        logger->resume_without_state(progress.global_step);
      }
    }
  }
  // Last: nothing above may draw random numbers after the RNGs are restored.
  if (const StateDict* rng = checkpoint.find_section("rng")) load_rng_state_dict(*rng);
}

}  // namespace fulgur::detail
