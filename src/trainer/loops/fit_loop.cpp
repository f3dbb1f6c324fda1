// The fit loop: epochs, training batches, automatic and manual
// optimization, gradient accumulation and clipping, schedulers, and when to
// validate. Order of hooks per batch (automatic optimization):
//   on_train_batch_start → training_step → on_before_backward → backward →
//   on_after_backward → [stepping batch: on_before_optimizer_step →
//   configure_gradient_clipping → optimizer.step → on_before_zero_grad →
//   optimizer_zero_grad → lr_scheduler_step for the step's schedulers] →
//   on_train_batch_end → validation when due.
#include "trainer/loops/fit_loop.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdio>

#include "fulgur/callbacks/callback.h"
#include "fulgur/core/errors.h"
#include "fulgur/optim/lr_scheduler.h"
#include "fulgur/plugins/precision/precision.h"
#include "fulgur/utilities/seed.h"
#include "trainer/torch_profiler.h"
#include "trainer/trainer_impl.h"

namespace fulgur::detail {

namespace {
std::vector<at::Tensor> optimizer_params(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> params;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) params.push_back(p);
  }
  return params;
}

/// Sets a flag for its lifetime (a phase of the step that a save from
/// within it reads).
class ScopedFlag {
 public:
  explicit ScopedFlag(bool& flag) : flag_(flag) { flag_ = true; }
  ~ScopedFlag() { flag_ = false; }
  ScopedFlag(const ScopedFlag&) = delete;
  ScopedFlag& operator=(const ScopedFlag&) = delete;

 private:
  bool& flag_;
};
}  // namespace

bool FitLoop::validates() const { return val_loader_ && !trainer_.limits.val.is_zero(); }

bool FitLoop::max_steps_reached() const {
  return trainer_.limits.max_steps >= 0 && global_step_ >= trainer_.limits.max_steps;
}

bool FitLoop::stop_requested_by_limits(bool boundary) {
  // A stop requested on one rank (request_stop() from its step, a hook or a
  // callback) is agreed by every rank here, after each batch and before each
  // epoch: a rank leaving the loop alone would leave its peers waiting in
  // their next collective until the timeout. Every rank calls it equally
  // often, so it comes before any early return. After a plain batch the
  // strategy may answer from votes already exchanged in it (DDP: in the
  // gradient all-reduce), so a request made after that batch's backward
  // is agreed after the next; before an epoch and after a validation it
  // covers every request. A request not agreed yet stays pending here.
  const bool stop = trainer_.drive().agree_to_stop(should_stop_, boundary);
  if (stop) should_stop_ = true;
  if (stop && trainer_.signals.armed()) {
    // Is the job ending (a preemption signal on some rank)? Every rank saw
    // `stop` here, so every rank asks; it ends the process when so.
    // Gradients accumulated in a window that has not stepped yet are in no
    // checkpoint (a resume would step with the window's later micro-batches
    // alone): the save waits for the window's step, a few batches.
    int signal = trainer_.signals.received();
    int window_open = window_has_gradient_ ? 1 : 0;
    if (trainer_.strategy->world_size() > 1) {
      const at::Tensor agreed = trainer_.strategy->all_reduce(
          torch::tensor({signal, window_open}, torch::kInt), ReduceOp::kMax);
      signal = agreed[0].item<int>();
      window_open = agreed[1].item<int>();
    }
    if (signal != 0 && window_open == 0) trainer_.end_by_preemption(signal);
    if (signal != 0) {
      if (!preemption_deferred_noted_ && trainer_.strategy->is_global_zero()) {
        preemption_deferred_noted_ = true;
        detail::print_note(str(detail::signal_name(signal), " within an accumulation window (",
                               "accumulate_grad_batches=", accumulate_,
                               "): the checkpoint follows the window's optimizer step, so that "
                               "it holds the window's gradients' effect."));
      }
      return false;
    }
  }
  if (max_steps_reached()) {
    stop_reason_ = "max_steps";
    return true;
  }
  if (stop && current_epoch_ >= trainer_.options.min_epochs &&
      global_step_ >= trainer_.options.min_steps) {
    stop_reason_ = "should_stop";
    return true;
  }
  return false;
}

void FitLoop::set_accumulate_grad_batches(int64_t n) {
  if (n < 1) {
    throw ConfigError(str("accumulate_grad_batches=", n, ": must be >= 1."));
  }
  if (n != 1 && trainer_.module != nullptr && !trainer_.module->automatic_optimization()) {
    throw ConfigError(str("accumulate_grad_batches=", n,
                          " with manual optimization: accumulation is the Module's job when it "
                          "steps itself."));
  }
  if (n != 1 && cuda_graph_) {
    throw ConfigError(str("accumulate_grad_batches=", n,
                          " with cuda_graph=true: a captured step steps the optimizers every "
                          "batch. Keep accumulate_grad_batches=1, or pass cuda_graph=false."));
  }
  if (window_has_gradient_ && n != accumulate_) {
    throw ConfigError(str("accumulate_grad_batches changed from ", accumulate_, " to ", n,
                          " inside an accumulation window (after batch ", batch_idx_,
                          "): change it at an epoch's start (on_train_epoch_start)."));
  }
  accumulate_ = n;
}

void FitLoop::count_training_batches() {
  num_training_batches_ =
      trainer_.limits.train.apply(train_loader_->num_batches(), trainer_.limits.train_flag)
          .value_or(-1);
  // The validation limit too, before any training (a fraction of it that
  // rounds to no batch failed only at the first validation, an epoch in).
  if (val_loader_)
    (void)trainer_.limits.val.apply(val_loader_->num_batches(), trainer_.limits.val_flag);
  agree_on_end_ = trainer_.require_equal_pass_lengths(
      num_training_batches_, !train_loader_->num_batches(), "training", trainer_.limits.train_flag);
  if (trainer_.options.val_check_interval.is_fraction() &&
      trainer_.options.val_check_interval.fraction() < 1.0 && num_training_batches_ < 0) {
    throw ConfigError(str("val_check_interval=", trainer_.options.val_check_interval.text(),
                          ": a fraction of an epoch needs a training loader of known length. "
                          "Pass an int (validate every N batches) instead."));
  }
  if (!trainer_.options.val_check_interval.is_fraction() &&
      trainer_.options.check_val_every_n_epoch && num_training_batches_ >= 0 &&
      trainer_.options.val_check_interval.count() > num_training_batches_ && val_loader_) {
    throw ConfigError(str("val_check_interval=", trainer_.options.val_check_interval.count(),
                          " is larger than the ", num_training_batches_,
                          " training batches per epoch. Pass a value <= ", num_training_batches_,
                          ", or check_val_every_n_epoch=std::nullopt to count batches across "
                          "epochs."));
  }
}

void FitLoop::load_loaders_for(int64_t epoch) {
  const int64_t every = trainer_.options.reload_dataloaders_every_n_epochs;
  if (every <= 0 || data_ == nullptr) return;
  const int64_t made_at = epoch / every * every;
  if (made_at == loaders_epoch_) return;
  Trainer::Impl::FitLoaders loaders = trainer_.make_fit_loaders(*data_, made_at);
  train_loader_ = std::move(loaders.train);
  val_loader_ = std::move(loaders.val);
  loaders_epoch_ = made_at;
  try {
    count_training_batches();
  } catch (const ConfigError& e) {
    throw ConfigError(str("reload_dataloaders_every_n_epochs=", every,
                          ", the loaders made for epoch ", made_at, ": ", e.what()));
  }
}

void FitLoop::run() {
  Module& m = *trainer_.module;
  if (!m.automatic_optimization()) {
    if (trainer_.options.accumulate_grad_batches != 1) {
      throw ConfigError(
          str("Trainer(accumulate_grad_batches=", trainer_.options.accumulate_grad_batches,
              ") with manual optimization: accumulation is the Module's job when "
              "it steps itself. Pass accumulate_grad_batches=1 and step every N "
              "batches in training_step."));
    }
    if (trainer_.options.gradient_clip_val && *trainer_.options.gradient_clip_val > 0) {
      throw ConfigError(str("Trainer(gradient_clip_val=", *trainer_.options.gradient_clip_val,
                            ") with manual optimization: clip in training_step before "
                            "optimizer_step (clip_gradients(optimizer, value): through the "
                            "strategy, unscaled under 16-mixed), and leave gradient_clip_val "
                            "unset."));
    }
  }
  // The training batches were counted at the fit's start (before
  // configure_optimizers), and again where a resume reloaded the loaders.
  // A fit that failed within a step may have left gradients unscaled.
  trainer_.strategy->precision().forget_unscaled();
  stepped_since_update_.clear();
  for (auto& opt : optimizers_.optimizers) opt->zero_grad();
  window_has_gradient_ = false;
  accumulate_ = trainer_.options.accumulate_grad_batches;
  if (num_training_batches_ == 0) {
    if (train_loader_->num_batches() == std::optional<int64_t>(0)) {
      // Not a limit: the loader has nothing to give. Said, not silent.
      stop_reason_ = "no training batches";
      if (trainer_.strategy->is_global_zero()) {
        detail::print_note(
            "Trainer.fit: the training loader gives no batch in an epoch (an empty dataset, "
            "drop_last with fewer samples than batch_size, or a shard of none on this rank): "
            "nothing was trained. Check the dataset and the loader's options.");
      }
    } else {
      stop_reason_ = str(trainer_.limits.train_flag, "=0");
    }
    return;
  }
  // Nothing to train (max_epochs=0, or a resumed run that had ended): no
  // training hook runs, as Lightning's fit loop skips itself then.
  if (!resumes_within_epoch_ && resumed_hook_.empty()) {
    if (trainer_.limits.max_epochs >= 0 && current_epoch_ >= trainer_.limits.max_epochs) {
      stop_reason_ = "max_epochs";
    } else if (max_steps_reached()) {
      stop_reason_ = "max_steps";
    }
    if (!stop_reason_.empty()) return;
  }

  training_ = true;
  profiler_.reset();
  if (trainer_.options.profiler == ProfilerKind::kSimple) {
    profiler_ = std::make_unique<SimpleProfiler>();
  } else if (trainer_.options.profiler == ProfilerKind::kPyTorch) {
    std::string dir = trainer_.self.log_dir();
    if (dir.empty()) dir = trainer_.self.default_root_dir();
    profiler_ = std::make_unique<TorchProfiler>(
        trainer_.options.profiler_wait, trainer_.options.profiler_active, dir + "/profiler",
        trainer_.strategy->global_rank(), trainer_.strategy->root_device().is_cuda());
  }
  // A fit that fails lets go of a recording still running (LibTorch's
  // profiler is one per thread).
  struct LetGo {
    LoopProfiler* profiler;
    ~LetGo() {
      if (profiler != nullptr) profiler->abandon();
    }
  } let_go{profiler_.get()};
  if (profiler_) profiler_->start();
  m.train(true);
  // Before the first epoch, whose start resets the sink: what on_train_start
  // logged was dropped there (or, without a sanity check, log() found no
  // sink and said it was called outside a Trainer run).
  Trainer::Impl::set_log_sink(
      m, &trainer_.logging.closed_train_sink(
             "on_train_start runs before the first epoch, whose start would drop the value. Log "
             "it from on_train_epoch_start (a value per epoch) or from training_step."));
  trainer_.call_hooks([](Module& mod) { mod.on_train_start(); },
                      [&](Callback& cb) { cb.on_train_start(trainer_.self, m); });
  if (resumed_hook_ == kTrainEpochEnd) finish_resumed_epoch_end();
  while (true) {
    if (trainer_.limits.max_epochs >= 0 && current_epoch_ >= trainer_.limits.max_epochs) {
      stop_reason_ = "max_epochs";
      break;
    }
    // A resumed epoch goes on from its last batch's stop check (in
    // train_epoch), which may still have its validation and end to run:
    // a checkpoint at max_steps comes before both.
    if (!resumes_within_epoch_ && stop_requested_by_limits(/*boundary=*/true)) break;
    train_epoch();
    if (batches_before_epoch_ >= 0) batches_before_epoch_ += batch_position_;
    ++current_epoch_;
    // A stop decided within the epoch keeps its reason (max_epochs reached
    // as well would otherwise name that).
    if (!stop_reason_.empty()) break;
  }
  if (profiler_) {
    const std::string report = profiler_->finish();
    if (!report.empty() && trainer_.strategy->is_global_zero()) {
      std::fputs(report.c_str(), stdout);
      std::fflush(stdout);
    }
  }
  trainer_.call_hooks([](Module& mod) { mod.on_train_end(); },
                      [&](Callback& cb) { cb.on_train_end(trainer_.self, m); });
  training_ = false;
}

void FitLoop::train_epoch() {
  Module& m = *trainer_.module;
  load_loaders_for(current_epoch_);
  DataLoader& loader = *train_loader_;
  // A resumed run arrives with the loader already positioned in this epoch.
  if (!loader_positioned_ || loader.epoch() != current_epoch_) loader.start_epoch(current_epoch_);
  loader_positioned_ = false;
  const int64_t start = loader.position();
  batch_position_ = start;
  trainer_.logging.train_sink().reset();
  m.train(true);
  // What the epoch's start logs is per epoch by default (as Lightning's),
  // in every epoch alike.
  log_to_train_sink(m, /*training_step=*/false, 1);
  trainer_.call_hooks([](Module& mod) { mod.on_train_epoch_start(); },
                      [&](Callback& cb) { cb.on_train_epoch_start(trainer_.self, m); });

  const int64_t limit = num_training_batches_;  // -1: until the loader ends
  // Resumed from a checkpoint written after one of this epoch's batches
  // (on_train_batch_end, or its validation's callbacks): run what the
  // uninterrupted run ran after it. That is the validation that followed
  // the batch, when the checkpoint came before its end (the monitored
  // schedulers read it), then the stop check (max_steps reached at that
  // batch ends the epoch here). The last batch of a loader of unknown
  // length is known to be the last only below.
  bool stopped = false;
  if (resumes_within_epoch_) {
    resumes_within_epoch_ = false;
    // The epoch's last batch as training_batch counts it: max_steps ends
    // the epoch too.
    const bool ended_epoch = (limit >= 0 && start >= limit) || max_steps_reached();
    if (resumed_hook_ == kValidationEnd) {
      finish_resumed_validation_end();
    } else if (validated_at_position_ != start && should_validate_now(start, ended_epoch)) {
      run_validation(false);
    }
    // Written within on_train_batch_end (or training_step): the monitored
    // schedulers had not read that step's values yet.
    step_monitored_schedulers();
    stopped = stop_after_batch(start);
  }
  // With prefetch, each batch goes to the device as soon as the loader gives
  // it, one batch ahead of the step that takes it. The loader is then one
  // batch ahead of the loop, as it is without a known length (the look-ahead
  // for the last batch); a checkpoint records the loop's position.
  feed_.reset(*trainer_.strategy, trainer_.options.prefetch_to_device, m);
  // A loader of unknown length on some rank (each rank reads its own part:
  // use_distributed_sampler=false) can end sooner there than on its peers.
  // The ranks (all of them, as count_training_batches decided) agree on
  // each batch's look-ahead, so the epoch ends for all at the shortest
  // rank's end (the longer ranks' other batches are left out, as a
  // sampler's drop_last leaves a tail out) instead of a rank waiting alone
  // in a collective. It costs one small all-reduce per batch.
  auto agree = [&](std::optional<Batch>& ahead) {
    if (agree_on_end_) trainer_.end_at_the_shortest_rank(ahead, "training", noted_shorter_peer_);
  };
  int64_t idx = start;
  std::optional<Batch> batch;
  {
    LoopProfiler::Scope fetch(profiler_.get(), LoopProfiler::Phase::kFetch);
    if (!stopped && (limit < 0 || idx < limit)) {
      batch = loader.next();
      agree(batch);
    }
    if (batch) feed_.put(*batch);
  }
  while (batch) {
    if (profiler_) profiler_->batch_begin();
    std::optional<Batch> next_batch;
    bool last;
    bool looked_ahead = true;
    {
      // Timed only where it fetches: ahead of the step, or to learn
      // whether this batch is the last.
      const bool fetches = limit < 0 || agree_on_end_ || (feed_.enabled() && idx + 1 < limit);
      LoopProfiler::Scope fetch(fetches ? profiler_.get() : nullptr,
                                  LoopProfiler::Phase::kFetch);
      if (limit >= 0 && !agree_on_end_) {
        last = idx + 1 >= limit;
        looked_ahead = feed_.enabled() && !last;
        if (looked_ahead) next_batch = loader.next();
      } else {
        // Look ahead: is this the last batch? At the cap every rank knows.
        if (limit < 0 || idx + 1 < limit) {
          next_batch = loader.next();
          agree(next_batch);
        }
        last = !next_batch.has_value();
      }
      if (next_batch) feed_.put(*next_batch);
    }
    batch_idx_ = idx;
    training_batch(*batch, idx, last);
    if (profiler_) profiler_->batch_end();
    ++idx;
    const bool stop = stop_after_batch(idx);
    if (stop || last) break;
    if (looked_ahead) {
      batch = std::move(next_batch);
    } else {
      LoopProfiler::Scope fetch(profiler_.get(), LoopProfiler::Phase::kFetch);
      batch = loader.next();
    }
  }
  feed_.clear();
  loader.release_workers();
  if (idx == start && start > 0 && validated_at_position_ != start &&
      should_validate_now(start, /*is_last_batch=*/true)) {
    // Resumed from a checkpoint written after the epoch's last batch (of a
    // loader of unknown length) but before its validation: run what the
    // uninterrupted run ran next.
    run_validation(false);
    stop_requested_by_limits(/*boundary=*/true);  // as after the uninterrupted run's
  }

  LoopProfiler::Scope epoch_end(profiler_.get(), LoopProfiler::Phase::kEpochEnd);
  log_to_train_sink(m, /*training_step=*/false, 1);
  m.on_train_epoch_end();
  trainer_.logging.publish_epoch(trainer_.logging.train_sink(), *trainer_.strategy,
                                 sanity_checking_, current_epoch_, global_step_, /*in_fit=*/true);
  // States a resume brought for metrics this epoch never logged again.
  trainer_.logging.train_sink().drop_restored_metrics();
  // After the module's on_train_epoch_end and the epoch's values (a
  // monitored scheduler reads the epoch's mean, or what that hook logged),
  // as Lightning's; before the callbacks' hooks, so that a checkpoint
  // written there has the epoch's scheduler step.
  if (m.automatic_optimization()) {
    step_schedulers(Interval::kEpoch, /*monitored=*/false);
    step_schedulers(Interval::kEpoch, /*monitored=*/true);
  }
  // From here a checkpoint resumes at the next epoch (one the module's
  // on_train_epoch_end wrote resumes this epoch's end, which it ran
  // before the epoch's scheduler step).
  in_epoch_end_ = true;
  // Histograms read every parameter: a sharded strategy gathers them (on
  // every rank) around rank 0's logging.
  auto log_parameters = [&] {
    if (trainer_.strategy->is_global_zero()) trainer_.logging.log_parameters(m, global_step_);
  };
  if (trainer_.logging.logs_parameters()) {
    trainer_.drive().with_full_parameters(m, log_parameters);
  } else {
    log_parameters();
  }
  run_resumable_hook(kTrainEpochEnd, nullptr, &Callback::on_train_epoch_end, {});
  in_epoch_end_ = false;
  validated_at_position_ = -1;
}

bool FitLoop::stop_after_batch(int64_t position) {
  // A validation (its metrics may decide a stop) makes a boundary.
  const bool stop = stop_requested_by_limits(/*boundary=*/validated_at_position_ == position);
  if (stop && stop_reason_ == "should_stop" && validated_at_position_ != position &&
      validates_this_epoch()) {
    // A requested stop (request_stop(), max_time, a callback) validates
    // where it stops, as Lightning's does: the run's last weights are
    // measured, and a checkpoint monitoring a validation metric sees them.
    run_validation(false);
  }
  return stop;
}

void FitLoop::log_to_train_sink(Module& m, bool training_step, int64_t batch_size) {
  trainer_.logging.train_sink().set_context(training_step, batch_size);
  Trainer::Impl::set_log_sink(m, &trainer_.logging.train_sink());
}

void FitLoop::training_batch(Batch& batch, int64_t idx, bool is_last_batch) {
  Module& m = *trainer_.module;
  trainer_.drive().heartbeat("train batch");
  // A preemption signal is a stop request, voted with this batch.
  if (trainer_.signals.received() != 0) should_stop_ = true;
  trainer_.drive().raise_checkpoint_errors();
  // What a batch's start logs is per step by default (as Lightning's), in
  // every epoch alike (the context was the last epoch end's).
  log_to_train_sink(m, /*training_step=*/true, batch.batch_size());
  trainer_.call_hooks([&](Module& mod) { mod.on_train_batch_start(batch, idx); },
                      [&](Callback& cb) { cb.on_train_batch_start(trainer_.self, m, batch, idx); });
  Batch on_device = feed_.take(batch);
  log_to_train_sink(m, /*training_step=*/true, on_device.batch_size());

  const int64_t steps_before = global_step_;
  bool should_step = (idx + 1) % accumulate_ == 0 || is_last_batch;
  at::Tensor loss;
  // A checkpoint saved from within the step (its hooks, training_step)
  // keeps the module's weights as they are (CheckpointConnector::save).
  std::optional<ScopedFlag> within_step(std::in_place, within_step_);
  if (cuda_graph_) {
    LoopProfiler::Scope timed(profiler_.get(), LoopProfiler::Phase::kGraphStep);
    loss = graph_training_batch(on_device, idx, is_last_batch);
  } else if (m.automatic_optimization()) {
    // Micro-batches that do not step accumulate locally, without a
    // cross-rank gradient sync (nor, under DDP, a buffer broadcast).
    trainer_.drive().set_gradient_sync(should_step);
    {
      LoopProfiler::Scope timed(profiler_.get(), LoopProfiler::Phase::kTrainingStep);
      auto scope = trainer_.drive().step_scope();
      loss = trainer_.drive().training_step(m, on_device, idx);
    }
    if (loss.defined()) {
      check_loss(loss);
      at::Tensor scaled = accumulate_ > 1 ? loss / accumulate_ : loss;
      {
        LoopProfiler::Scope timed(profiler_.get(), LoopProfiler::Phase::kBackward);
        backward_with_hooks(m, loss, scaled, /*vote=*/true);
      }
      window_has_gradient_ = !should_step;
      if (should_step) step_optimizers();
    } else if (should_step) {
      // No loss here, but earlier micro-batches may have accumulated
      // gradients, and under DDP the peers may have a loss: every replica
      // must take the same step (or none).
      const bool accumulated = window_has_gradient_;
      window_has_gradient_ = false;
      trainer_.drive().set_stop_vote(should_stop_);
      if (trainer_.drive().steps_without_loss(m, accumulated)) step_optimizers();
    }
  } else {
    trainer_.drive().set_gradient_sync(true);
    // Manual optimization: training_step holds its backward and steps.
    LoopProfiler::Scope timed(profiler_.get(), LoopProfiler::Phase::kTrainingStep);
    auto scope = trainer_.drive().step_scope();
    loss = trainer_.drive().training_step(m, on_device, idx);
    if (global_step_ > steps_before) ++batches_that_stepped_;
    end_scaler_iteration();
  }
  within_step.reset();
  batch_position_ = idx + 1;
  {
    // For on_train_batch_end's callbacks (ModelCheckpoint's
    // every_n_train_steps reads the callback metrics).
    LoopProfiler::Scope timed(profiler_.get(), LoopProfiler::Phase::kLogging);
    trainer_.logging.publish_step_values(*trainer_.strategy);
  }
  const bool ends_epoch = is_last_batch || max_steps_reached();
  const bool validates = should_validate_now(idx + 1, ends_epoch);
  // The hooks get the loss without its graph. Backward is done, so the loss
  // itself is detached in place (no allocation); a view, or a leaf (which
  // could be a parameter), is copied instead.
  at::Tensor detached = loss;
  if (loss.defined() && loss.requires_grad()) {
    if (loss.is_view() || loss.grad_fn() == nullptr) {
      detached = loss.detach();
    } else {
      detached.detach_();
    }
  }
  {
    LoopProfiler::Scope timed(profiler_.get(), LoopProfiler::Phase::kBatchEnd);
    const ScopedFlag in_batch_end(in_batch_end_);
    trainer_.call_hooks(
        [&](Module& mod) { mod.on_train_batch_end(detached, batch, idx); },
        [&](Callback& cb) { cb.on_train_batch_end(trainer_.self, m, detached, batch, idx); });
  }
  {
    // The step's row, with what on_train_batch_end logged.
    LoopProfiler::Scope timed(profiler_.get(), LoopProfiler::Phase::kLogging);
    publish_step_metrics();
  }
  // The monitored schedulers read the step's values, those logged in
  // on_train_batch_end included (as Lightning's plateau schedulers step
  // after those hooks); where a validation follows, its values.
  if (validates) {
    run_validation(false);
  } else {
    step_monitored_schedulers();
  }
}

void FitLoop::step_monitored_schedulers() {
  if (!monitored_step_due_) return;
  monitored_step_due_ = false;
  step_schedulers(Interval::kStep, /*monitored=*/true);
}

void FitLoop::step_optimizers() {
  LoopProfiler::Scope timed(profiler_.get(), LoopProfiler::Phase::kOptimizerStep);
  run_optimizer_steps();
  finish_optimizer_steps(/*zero_grads=*/true);
}

void FitLoop::run_optimizer_steps() {
  Module& m = *trainer_.module;
  for (auto& opt : optimizers_.optimizers) {
    trainer_.drive().unscale_gradients(*opt);
    trainer_.call_hooks([&](Module& mod) { mod.on_before_optimizer_step(*opt); },
                        [&](Callback& cb) { cb.on_before_optimizer_step(trainer_.self, m, *opt); });
    m.configure_gradient_clipping(*opt, trainer_.options.gradient_clip_val,
                                  trainer_.options.gradient_clip_algorithm.value());
    trainer_.drive().optimizer_step(*opt, m);
  }
  trainer_.strategy->precision().update();
}

void FitLoop::finish_optimizer_steps(bool zero_grads) {
  Module& m = *trainer_.module;
  for (auto& opt : optimizers_.optimizers) {
    trainer_.call_hooks([&](Module& mod) { mod.on_before_zero_grad(*opt); },
                        [&](Callback& cb) { cb.on_before_zero_grad(trainer_.self, m, *opt); });
    if (zero_grads) m.optimizer_zero_grad(current_epoch_, batch_idx_, *opt);
  }
  ++global_step_;
  ++batches_that_stepped_;
  step_schedulers(Interval::kStep, /*monitored=*/false);
  monitored_step_due_ = true;  // after the step's values (and its validation's)
}

void FitLoop::check_loss(const at::Tensor& loss) {
  if (loss.numel() != 1) {
    throw ConfigError(str("training_step returned a tensor of shape ", c10::str(loss.sizes()),
                          "; return a scalar loss (e.g. .mean()), or an undefined tensor "
                          "to skip the batch."));
  }
  if (!loss.requires_grad()) {
    throw ConfigError(
        "training_step returned a loss that does not require grad: it was "
        "computed without the module's parameters, or under NoGradGuard. "
        "Return the loss of the forward pass.");
  }
}

void FitLoop::clip_gradients(torch::optim::Optimizer& optimizer, double value,
                             GradientClipAlgorithm algorithm) {
  if (!training_) {
    throw ConfigError(
        "clip_gradients(optimizer, value): called outside training. Call it from "
        "configure_gradient_clipping, or from training_step under manual optimization.");
  }
  trainer_.drive().unscale_gradients(optimizer);  // once per step
  auto params = optimizer_params(optimizer);
  if (algorithm == GradientClipAlgorithm::kValue) {
    torch::nn::utils::clip_grad_value_(params, value);
  } else {
    // On the device, without reading the norm back. A captured step runs
    // it too (single_device or a subclass: an override that reads the norm
    // back cannot be captured).
    trainer_.drive().clip_gradients_norm(params, value);
  }
}

at::Tensor FitLoop::step_body(Batch& on_device, int64_t idx) {
  Module& m = *trainer_.module;
  auto scope = trainer_.drive().step_scope();
  at::Tensor loss = trainer_.drive().training_step(m, on_device, idx);
  scope.reset();
  if (!loss.defined()) {
    throw ConfigError(str("cuda_graph=true: training_step returned no loss for batch ", idx,
                          ": a captured step always steps. Return a loss for every batch, or "
                          "pass cuda_graph=false to skip batches."));
  }
  check_loss(loss);
  backward_with_hooks(m, loss, loss, /*vote=*/false);
  run_optimizer_steps();
  return loss;
}

at::Tensor FitLoop::graph_training_batch(Batch& on_device, int64_t idx, bool is_last_batch) {
  Module& m = *trainer_.module;
  trainer_.drive().set_gradient_sync(true);
  trainer_.drive().set_stop_vote(should_stop_);
  at::Tensor loss = graph_.run(
      on_device, is_last_batch, [&](Batch& batch) { return step_body(batch, idx); }, m,
      trainer_.logging.train_sink(), optimizers_, trainer_.strategy->is_global_zero());
  // The gradients are not zeroed: the next step's backward writes them
  // afresh.
  window_has_gradient_ = false;
  finish_optimizer_steps(/*zero_grads=*/false);
  return loss;
}

void FitLoop::read_learning_rates(std::vector<double>& out) const {
  out.clear();
  for (const auto& opt : optimizers_.optimizers) {
    for (const auto& group : opt->param_groups()) out.push_back(group.options().get_lr());
  }
}

void FitLoop::check_learning_rates(size_t index, const std::vector<double>& before) {
  const auto& config = optimizers_.schedulers[index];
  size_t k = 0;
  for (size_t o = 0; o < optimizers_.optimizers.size(); ++o) {
    const auto& groups = optimizers_.optimizers[o]->param_groups();
    for (size_t g = 0; g < groups.size(); ++g, ++k) {
      const double lr = groups[g].options().get_lr();
      // Only the rates this step changed are the scheduler's doing.
      if (k < before.size() && (lr == before[k] || (std::isnan(lr) && std::isnan(before[k])))) {
        continue;
      }
      if (std::isfinite(lr) && (lr >= 0 || negative_rate_noted_)) continue;
      const std::string what = str(
          "scheduler ", index, " (interval ", config.interval == Interval::kStep ? "step" : "epoch",
          ") set the learning rate of parameter group ", g, " of optimizer ", o, " to ", lr, " at ",
          config.interval == Interval::kStep ? "step " : "the end of epoch ",
          config.interval == Interval::kStep ? global_step_ : current_epoch_);
      if (!std::isfinite(lr)) {
        throw ConfigError(str(what,
                              ": the next step would make every parameter it steps NaN. Check "
                              "the scheduler's factors (gamma, a lambda's value) for NaN and "
                              "infinity."));
      }
      negative_rate_noted_ = true;
      if (trainer_.strategy->is_global_zero()) {
        detail::print_note(str(what,
                               ": a negative rate climbs the loss. If that is not meant, "
                               "check the scheduler's factors (gamma, a lambda's value)."));
      }
    }
  }
}

void FitLoop::step_schedulers(Interval interval, bool monitored) {
  int64_t counter = interval == Interval::kStep ? global_step_ : current_epoch_ + 1;
  for (size_t i = 0; i < optimizers_.schedulers.size(); ++i) {
    auto& config = optimizers_.schedulers[i];
    if (config.interval != interval || counter % config.frequency != 0) continue;
    if (config.monitor.empty() == monitored) continue;
    read_learning_rates(rates_before_);
    if (config.monitor.empty()) {
      trainer_.module->lr_scheduler_step(*config.scheduler, std::nullopt);
      check_learning_rates(i, rates_before_);
      continue;
    }
    // Rank 0's value (or its absence) decides on every rank: the ranks'
    // learning rates never drift apart, whatever each one logged.
    const Metrics& metrics = trainer_.logging.callback_metrics();
    auto it = metrics.find(config.monitor);
    double found[2] = {it != metrics.end() ? 1.0 : 0.0, it != metrics.end() ? it->second : 0.0};
    if (trainer_.strategy->world_size() > 1) {
      auto agreed =
          trainer_.strategy->broadcast(torch::tensor({found[0], found[1]}, torch::kDouble), 0);
      agreed = agreed.cpu();
      found[0] = agreed[0].item<double>();
      found[1] = agreed[1].item<double>();
    }
    if (found[0] == 0.0) {
      std::vector<std::string> names;
      for (const auto& entry : metrics) names.push_back(entry.first);
      const std::string problem =
          str("scheduler ", i, " monitors \"", config.monitor, "\", which ",
              trainer_.strategy->world_size() > 1 ? "global rank 0 has" : "the module has",
              " not logged by ", interval == Interval::kStep ? "step " : "the end of epoch ",
              interval == Interval::kStep ? global_step_ : current_epoch_,
              " (logged: ", names.empty() ? std::string("nothing") : join(names), ")");
      if (config.strict) {
        throw ConfigError(str(problem,
                              ". Log it with log() before the scheduler steps (e.g. in "
                              "validation_step, which runs before an epoch's scheduler "
                              "step), or pass strict=false to skip the steps without it."));
      }
      if (missing_monitor_noted_.insert(i).second && trainer_.strategy->is_global_zero()) {
        detail::print_note(str(problem,
                               ": the scheduler skips this step and every other "
                               "without it (strict=false)."));
      }
      continue;
    }
    trainer_.module->lr_scheduler_step(*config.scheduler, found[1]);
    check_learning_rates(i, rates_before_);
  }
}

bool FitLoop::validates_this_epoch() const {
  if (!val_loader_ || sanity_checking_) return false;
  if (trainer_.limits.val.is_zero()) return false;
  return !trainer_.options.check_val_every_n_epoch ||
         (current_epoch_ + 1) % *trainer_.options.check_val_every_n_epoch == 0;
}

bool FitLoop::should_validate_now(int64_t position, bool is_last_batch) const {
  if (!validates_this_epoch()) return false;
  const auto& interval = trainer_.options.val_check_interval;
  if (interval.is_fraction()) {
    if (num_training_batches_ < 0) return is_last_batch;
    int64_t every = std::max<int64_t>(
        1, static_cast<int64_t>(static_cast<double>(num_training_batches_) * interval.fraction()));
    return position % every == 0 || (is_last_batch && interval.fraction() >= 1.0);
  }
  if (trainer_.options.check_val_every_n_epoch) return position % interval.count() == 0;
  // Counted across epochs: every N training batches since the start of fit
  // (epochs of other lengths, or of no known length, counted as they ran).
  // A checkpoint without the count (from before it was kept) assumes
  // epochs of this one's length.
  const int64_t before =
      batches_before_epoch_ >= 0
          ? batches_before_epoch_
          : (num_training_batches_ >= 0 ? current_epoch_ * num_training_batches_ : 0);
  return (before + position) % interval.count() == 0;
}

void FitLoop::run_validation(bool sanity) {
  Module& m = *trainer_.module;
  auto limit = trainer_.limits.val.apply(val_loader_->num_batches(), trainer_.limits.val_flag);
  if (sanity && trainer_.limits.num_sanity_val_steps >= 0) {
    limit = limit ? std::min(*limit, trainer_.limits.num_sanity_val_steps)
                  : trainer_.limits.num_sanity_val_steps;
  }
  if (limit && *limit == 0) {
    // A rank with no batches here still meets its peers' comparison of
    // their lengths (EvaluationLoop::run) when the forward is collective.
    if (trainer_.drive().forward_is_collective()) {
      trainer_.require_equal_pass_lengths(0, !val_loader_->num_batches(), "validation",
                                          trainer_.limits.val_flag);
    }
    // What the validation's values would have been read by.
    if (!sanity) step_monitored_schedulers();
    return;
  }
  LoopProfiler::Scope timed(sanity ? nullptr : profiler_.get(), LoopProfiler::Phase::kValidation);
  sanity_checking_ = sanity;
  // (It puts back each submodule's mode.)
  trainer_.evaluation_loop.run(*val_loader_, Stage::kValidate, limit);
  sanity_checking_ = false;
  // After it: a checkpoint written during it (by its callbacks, or when it
  // failed) resumes with it run again, whose metrics the epoch's end reads.
  if (!sanity) validated_at_position_ = batch_position_;
  Trainer::Impl::set_log_sink(m, &trainer_.logging.train_sink());
}

void FitLoop::validation_end(Module& m) {
  run_resumable_hook(kValidationEnd, [&] { m.on_validation_end(); }, &Callback::on_validation_end,
                     {});
}

void FitLoop::run_resumable_hook(const char* hook, const std::function<void()>& module_part,
                                 CallbackHook fn, const std::vector<std::string>& started) {
  struct Done {
    FitLoop& loop;
    ~Done() {
      loop.hook_.clear();
      loop.hook_started_.clear();
    }
  } done{*this};
  hook_ = hook;
  hook_started_ = started;
  if (module_part) module_part();
  for (auto& cb : trainer_.callbacks) {
    std::string key = cb->state_key();
    if (std::find(started.begin(), started.end(), key) != started.end()) continue;
    hook_started_.push_back(std::move(key));
    ((*cb).*fn)(trainer_.self, *trainer_.module);
  }
}

void FitLoop::finish_resumed_validation_end() {
  // As the validation left things when its hook ran: the module in
  // evaluation mode, no gradients, nothing to log to.
  Module& m = *trainer_.module;
  const std::vector<std::string> started = std::move(resumed_started_);
  resumed_hook_.clear();
  {
    torch::NoGradGuard no_grad;
    m.eval();
    Trainer::Impl::set_log_sink(m, nullptr);
    run_resumable_hook(kValidationEnd, nullptr, &Callback::on_validation_end, started);
  }
  m.train(true);
  Trainer::Impl::set_log_sink(m, &trainer_.logging.train_sink());
}

void FitLoop::finish_resumed_epoch_end() {
  // restore() moved to the next epoch: the hook sees the one that ended.
  const std::vector<std::string> started = std::move(resumed_started_);
  resumed_hook_.clear();
  const int64_t next_epoch = current_epoch_;
  const int64_t before_next = batches_before_epoch_;
  --current_epoch_;
  if (batches_before_epoch_ >= 0) batches_before_epoch_ -= resumed_epoch_length_;
  batch_position_ = resumed_epoch_length_;
  in_epoch_end_ = true;
  run_resumable_hook(kTrainEpochEnd, nullptr, &Callback::on_train_epoch_end, started);
  in_epoch_end_ = false;
  current_epoch_ = next_epoch;
  batches_before_epoch_ = before_next;
  batch_position_ = 0;
}

void FitLoop::manual_backward(Module& m, const at::Tensor& loss) {
  if (!training_) {
    throw ConfigError(
        "manual_backward(loss): called outside training_step. Call it from "
        "training_step while fitting.");
  }
  // A backward after optimizer steps starts the loss scaler's next
  // iteration: those steps' verdicts set the scale it runs with.
  end_scaler_iteration();
  backward_with_hooks(m, loss, loss, /*vote=*/true);
}

void FitLoop::end_scaler_iteration() {
  if (stepped_since_update_.empty()) return;
  // update() forgets what was unscaled: gradients unscaled (clip_gradients)
  // but not stepped would be unscaled again at their step.
  Precision& precision = trainer_.strategy->precision();
  const auto& all = optimizers_.optimizers;
  for (size_t i = 0; i < all.size(); ++i) {
    if (stepped_since_update_.count(all[i].get()) != 0 || !precision.gradients_unscaled(*all[i])) {
      continue;
    }
    stepped_since_update_.clear();
    precision.forget_unscaled();
    throw ConfigError(str("manual optimization under precision=\"", precision.name(),
                          "\": optimizer ", i,
                          "'s gradients were unscaled (clip_gradients) and it has not stepped "
                          "before the next backward or the end of training_step, where the loss "
                          "scaler's iteration ends; they would be unscaled again. Clip each "
                          "optimizer's gradients right before its own optimizer_step."));
  }
  stepped_since_update_.clear();
  precision.update();
}

void FitLoop::backward_with_hooks(Module& m, const at::Tensor& loss, const at::Tensor& scaled,
                                  bool vote) {
  trainer_.call_hooks([&](Module& mod) { mod.on_before_backward(loss); },
                      [&](Callback& cb) { cb.on_before_backward(trainer_.self, m, loss); });
  // After on_before_backward: a stop it requests is in this backward's vote.
  if (vote) trainer_.drive().set_stop_vote(should_stop_);
  detail::note_autograd_used();
  trainer_.drive().backward(scaled, m);
  trainer_.call_hooks([](Module& mod) { mod.on_after_backward(); },
                      [&](Callback& cb) { cb.on_after_backward(trainer_.self, m); });
}

void FitLoop::manual_optimizer_step(Module& m, torch::optim::Optimizer& optimizer) {
  if (!training_) {
    throw ConfigError(
        "optimizer_step(optimizer): called outside training_step. Call it from "
        "training_step while fitting.");
  }
  trainer_.drive().unscale_gradients(optimizer);
  trainer_.call_hooks(
      [&](Module& mod) { mod.on_before_optimizer_step(optimizer); },
      [&](Callback& cb) { cb.on_before_optimizer_step(trainer_.self, m, optimizer); });
  // The loss scaler's iteration ends at the next backward or at the end of
  // training_step (end_scaler_iteration), not here: every optimizer the
  // backward fed is unscaled with the scale that backward ran with (an
  // update() here grew or backed off the scale before the next optimizer's
  // gradients were unscaled: they stepped at half or twice their size).
  trainer_.drive().optimizer_step(optimizer, m);
  stepped_since_update_.insert(&optimizer);
  ++global_step_;
}

bool FitLoop::step_row_due() const {
  return batches_that_stepped_ > 0 &&
         batches_that_stepped_ % trainer_.options.log_every_n_steps == 0 &&
         batches_that_stepped_ != published_at_stepped_ && !sanity_checking_;
}

void FitLoop::publish_step_metrics() {
  const bool to_loggers = step_row_due();
  if (to_loggers) published_at_stepped_ = batches_that_stepped_;
  trainer_.logging.publish_step(*trainer_.strategy, to_loggers, current_epoch_, global_step_);
}

void FitLoop::write_step_row_before_save() {
  if (!in_batch_end_ || !step_row_due()) return;
  trainer_.logging.write_step_row(*trainer_.strategy, current_epoch_, global_step_,
                                  /*published_only=*/true);
}

void FitLoop::start(std::shared_ptr<DataLoader> train, std::shared_ptr<DataLoader> val,
                    DataModule* data) {
  train_loader_ = std::move(train);
  val_loader_ = std::move(val);
  data_ = data;
  loaders_epoch_ = 0;
  optimizers_ = OptimizerConfig();
  current_epoch_ = 0;
  global_step_ = 0;
  batch_idx_ = 0;
  batch_position_ = 0;
  batches_that_stepped_ = 0;
  published_at_stepped_ = -1;
  batches_before_epoch_ = 0;
  monitored_step_due_ = false;
  negative_rate_noted_ = false;
  window_has_gradient_ = false;
  num_training_batches_ = -1;
  noted_shorter_peer_ = false;
  agree_on_end_ = false;
  should_stop_ = false;
  stop_reason_.clear();
  in_epoch_end_ = false;
  validated_at_position_ = -1;
  resumes_within_epoch_ = false;
  loader_positioned_ = false;
  hook_.clear();
  hook_started_.clear();
  resumed_hook_.clear();
  resumed_started_.clear();
  missing_monitor_noted_.clear();
}

void FitLoop::set_optimizers(OptimizerConfig optimizers) {
  optimizers_ = std::move(optimizers);
  // cuda_graph's refusals come before anything runs (the sanity check
  // included).
  cuda_graph_ = false;
  graph_.reset();
  if (trainer_.options.cuda_graph) {
    CudaGraphStep::check(*trainer_.strategy, *trainer_.module, optimizers_,
                         trainer_.options.accumulate_grad_batches);
    cuda_graph_ = true;
  }
}

void FitLoop::run_sanity_check() {
  if (!val_loader_ || trainer_.limits.num_sanity_val_steps == 0 || trainer_.limits.val.is_zero()) {
    return;
  }
  Module& m = *trainer_.module;
  // What it draws from the generators is put back after it, as Lightning's
  // isolate_rng: training (and a resumed run, whose generators the
  // checkpoint set) draws as without it.
  const StateDict generators = rng_state_dict();
  // The sanity hooks see trainer.sanity_checking() true, as Lightning's do.
  sanity_checking_ = true;
  for (auto& cb : trainer_.callbacks) cb->on_sanity_check_start(trainer_.self, m);
  run_validation(/*sanity=*/true);
  sanity_checking_ = true;
  for (auto& cb : trainer_.callbacks) cb->on_sanity_check_end(trainer_.self, m);
  sanity_checking_ = false;
  load_rng_state_dict(generators);
}

void FitLoop::finish() {
  train_loader_.reset();
  val_loader_.reset();
  data_ = nullptr;
}

void FitLoop::detach() {
  data_ = nullptr;
  // A fit that failed within an epoch: its loader's workers end too.
  if (train_loader_) train_loader_->release_workers();
  training_ = false;
  sanity_checking_ = false;
  if (cuda_graph_ && trainer_.strategy && trainer_.strategy->is_global_zero() &&
      graph_.captures() > 0) {
    print_note(str("cuda_graph: ", graph_.replayed_steps(), " steps replayed from ",
                   graph_.captures(), graph_.captures() == 1 ? " capture, " : " captures, ",
                   graph_.eager_steps(), " eager (", CudaGraphStep::kWarmupSteps,
                   " warm-up steps and batches of other shapes)."));
  }
  cuda_graph_ = false;
  graph_.release(&optimizers_);
}

FitProgress FitLoop::progress() const {
  return FitProgress{.epoch = current_epoch_,
                     .global_step = global_step_,
                     .batch_position = batch_position_,
                     .batches_that_stepped = batches_that_stepped_,
                     .batches_before_epoch = batches_before_epoch_,
                     .epoch_done = in_epoch_end_,
                     .validated_at_position = validated_at_position_,
                     .monitored_step_due = monitored_step_due_,
                     .hook = hook_,
                     .hook_started = hook_started_};
}

void FitLoop::restore(const FitProgress& p, const StateDict* loader_state) {
  global_step_ = p.global_step;
  batches_that_stepped_ = p.batches_that_stepped;
  // The checkpoint's batch published its count (before its save).
  published_at_stepped_ = p.batches_that_stepped;
  validated_at_position_ = p.validated_at_position;
  monitored_step_due_ = p.monitored_step_due && !p.epoch_done;
  resumes_within_epoch_ = !p.epoch_done && p.batch_position > 0;
  batches_before_epoch_ = p.batches_before_epoch;
  // Written within a hook that the resume finishes (the validation it
  // ends ran at this position).
  resumed_hook_ = p.hook;
  resumed_started_ = p.hook_started;
  resumed_epoch_length_ = p.batch_position;
  if (p.hook == kValidationEnd) validated_at_position_ = p.batch_position;
  // The last batch done, as the hooks after it saw it.
  batch_idx_ = std::max<int64_t>(p.batch_position - 1, 0);
  if (p.epoch_done) {
    // Written during on_train_epoch_end: that epoch is complete.
    current_epoch_ = p.epoch + 1;
    if (batches_before_epoch_ >= 0) batches_before_epoch_ += p.batch_position;
    validated_at_position_ = -1;
    // An epoch's end that the resume finishes runs with the loaders of the
    // epoch that ended (the next epoch's are made at its start).
    load_loaders_for(p.hook == kTrainEpochEnd ? p.epoch : current_epoch_);
    return;
  }
  current_epoch_ = p.epoch;
  // The loaders the uninterrupted run had in this epoch, before the
  // training loader is positioned in it.
  load_loaders_for(current_epoch_);
  if (!train_loader_) return;
  // The checkpoint holds global rank 0's loader state. A rank's loader
  // that the Trainer did not shard (use_distributed_sampler=false) is its
  // own, not that one: it is positioned without it.
  const Strategy& strategy = *trainer_.strategy;
  const bool state_is_this_ranks = strategy.world_size() <= 1 ||
                                   trainer_.options.use_distributed_sampler ||
                                   strategy.global_rank() == 0;
  if (loader_state != nullptr && state_is_this_ranks) {
    train_loader_->load_state_dict(*loader_state, p.batch_position);
  } else {
    train_loader_->seek(p.epoch, p.batch_position);
  }
  loader_positioned_ = true;
}

void FitLoop::set_result(int64_t epochs, int64_t global_step) {
  current_epoch_ = epochs;
  global_step_ = global_step;
}

}  // namespace fulgur::detail
