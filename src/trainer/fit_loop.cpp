// The fit loop: epochs, training batches, automatic and manual
// optimization, gradient accumulation and clipping, schedulers, and when to
// validate. Order of hooks per batch (automatic optimization):
//   on_train_batch_start → training_step → on_before_backward → backward →
//   on_after_backward → [stepping batch: on_before_optimizer_step → clip →
//   optimizer.step → on_before_zero_grad → zero_grad → step schedulers] →
//   on_train_batch_end → validation when due.
#include <torch/torch.h>

#include "fulgur/callbacks/callback.h"
#include "fulgur/core/errors.h"
#include "fulgur/plugins/precision/precision.h"
#include "trainer/trainer_impl.h"

namespace fulgur {

namespace {
std::vector<at::Tensor> optimizer_params(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> params;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) params.push_back(p);
  }
  return params;
}
}  // namespace

bool Trainer::Impl::stop_requested_by_limits(bool boundary) {
  // A stop requested on one rank (request_stop() from its step, a hook or a
  // callback) is agreed by every rank here, after each batch and before each
  // epoch: a rank leaving the loop alone would leave its peers waiting in
  // their next collective until the timeout. Every rank calls it equally
  // often, so it comes before any early return. After a plain batch the
  // strategy may answer from votes already exchanged in it (DDP: in the
  // gradient all-reduce), so a request made after that batch's backward
  // is agreed after the next; before an epoch and after a validation it
  // covers every request. A request not agreed yet stays pending here.
  const bool stop = strategy->agree_to_stop(should_stop, boundary);
  if (stop) should_stop = true;
  if (max_steps >= 0 && global_step >= max_steps) {
    stop_reason = "max_steps";
    return true;
  }
  if (stop && current_epoch >= options.min_epochs && global_step >= options.min_steps) {
    stop_reason = "should_stop";
    return true;
  }
  return false;
}

void Trainer::Impl::fit_loop() {
  Module& m = *module;
  if (!m.automatic_optimization()) {
    if (options.accumulate_grad_batches != 1) {
      throw ConfigError(str("Trainer(accumulate_grad_batches=", options.accumulate_grad_batches,
                            ") with manual optimization: accumulation is the Module's job when "
                            "it steps itself. Pass accumulate_grad_batches=1 and step every N "
                            "batches in training_step."));
    }
    if (options.gradient_clip_val && *options.gradient_clip_val > 0) {
      throw ConfigError(str("Trainer(gradient_clip_val=", *options.gradient_clip_val,
                            ") with manual optimization: clip in training_step before "
                            "optimizer_step (torch::nn::utils::clip_grad_norm_), and leave "
                            "gradient_clip_val unset."));
    }
  }
  num_training_batches =
      limit_train.apply(train_loader->num_batches(), "limit_train_batches").value_or(-1);
  if (options.val_check_interval.is_fraction() && options.val_check_interval.fraction() < 1.0 &&
      num_training_batches < 0) {
    throw ConfigError(str("val_check_interval=", options.val_check_interval.text(),
                          ": a fraction of an epoch needs a training loader of known length. "
                          "Pass an int (validate every N batches) instead."));
  }
  if (!options.val_check_interval.is_fraction() && options.check_val_every_n_epoch &&
      num_training_batches >= 0 && options.val_check_interval.count() > num_training_batches &&
      val_loader) {
    throw ConfigError(str("val_check_interval=", options.val_check_interval.count(),
                          " is larger than the ", num_training_batches,
                          " training batches per epoch. Pass a value <= ", num_training_batches,
                          ", or check_val_every_n_epoch=std::nullopt to count batches across "
                          "epochs."));
  }
  for (auto& opt : optimizer_config.optimizers) opt->zero_grad();
  window_has_gradient = false;
  if (num_training_batches == 0) {
    stop_reason = "limit_train_batches=0";
    return;
  }

  training = true;
  m.train(true);
  call_hooks([](Module& mod) { mod.on_train_start(); },
             [&](Callback& cb) { cb.on_train_start(self, m); });
  while (true) {
    if (max_epochs >= 0 && current_epoch >= max_epochs) {
      stop_reason = "max_epochs";
      break;
    }
    if (stop_requested_by_limits(/*boundary=*/true)) break;
    train_epoch();
    ++current_epoch;
  }
  call_hooks([](Module& mod) { mod.on_train_end(); },
             [&](Callback& cb) { cb.on_train_end(self, m); });
  training = false;
}

void Trainer::Impl::train_epoch() {
  Module& m = *module;
  DataLoader& loader = *train_loader;
  // A resumed run arrives with the loader already positioned in this epoch.
  if (loader.epoch() != current_epoch) loader.start_epoch(current_epoch);
  const int64_t start = loader.position();
  batch_position = start;
  train_log.reset();
  m.train(true);
  call_hooks([](Module& mod) { mod.on_train_epoch_start(); },
             [&](Callback& cb) { cb.on_train_epoch_start(self, m); });

  const int64_t limit = num_training_batches;  // -1: until the loader ends
  int64_t idx = start;
  std::optional<Batch> batch;
  if (limit < 0 || idx < limit) batch = loader.next();
  while (batch) {
    std::optional<Batch> next_batch;
    bool last;
    if (limit >= 0) {
      last = idx + 1 >= limit;
    } else {
      next_batch = loader.next();  // look ahead: is this the last batch?
      last = !next_batch.has_value();
    }
    batch_idx = idx;
    training_batch(*batch, idx, last);
    ++idx;
    // A validation (its metrics may decide a stop) makes a boundary.
    if (stop_requested_by_limits(/*boundary=*/validated_at_position == idx) || last) break;
    batch = limit >= 0 ? loader.next() : std::move(next_batch);
  }
  if (idx == start && start > 0 && validated_at_position != start &&
      should_validate_now(start, /*is_last_batch=*/true)) {
    // Resumed from a checkpoint written after the epoch's last batch but
    // before its validation: run what the uninterrupted run ran next.
    run_validation(false);
  }

  in_epoch_end = true;
  if (m.automatic_optimization()) step_schedulers(Interval::Epoch);
  train_log.set_context(/*training_step=*/false, 1);
  m.log_sink_ = &train_log;
  m.on_train_epoch_end();
  publish_epoch_metrics(train_log);
  for (auto& cb : callbacks) cb->on_train_epoch_end(self, m);
  in_epoch_end = false;
  validated_at_position = -1;
}

void Trainer::Impl::training_batch(Batch& batch, int64_t idx, bool is_last_batch) {
  Module& m = *module;
  strategy->heartbeat("train batch");
  call_hooks([&](Module& mod) { mod.on_train_batch_start(batch, idx); },
             [&](Callback& cb) { cb.on_train_batch_start(self, m, batch, idx); });
  Batch on_device = strategy->batch_to_device(batch);
  train_log.set_context(/*training_step=*/true, on_device.batch_size());
  m.log_sink_ = &train_log;

  const int64_t steps_before = global_step;
  bool should_step = (idx + 1) % options.accumulate_grad_batches == 0 || is_last_batch;
  at::Tensor loss;
  if (m.automatic_optimization()) {
    // Micro-batches that do not step accumulate locally, without a
    // cross-rank gradient sync (nor, under DDP, a buffer broadcast).
    strategy->set_gradient_sync(should_step);
    auto scope = strategy->step_scope();
    loss = strategy->training_step(m, on_device, idx);
    scope.reset();
    if (loss.defined()) {
      if (loss.numel() != 1) {
        throw ConfigError(str("training_step returned a tensor of shape ", c10::str(loss.sizes()),
                              "; return a scalar loss (e.g. .mean()), or an undefined tensor "
                              "to skip the batch."));
      }
      if (!loss.requires_grad()) {
        throw ConfigError("training_step returned a loss that does not require grad: it was "
                          "computed without the module's parameters, or under NoGradGuard. "
                          "Return the loss of the forward pass.");
      }
      at::Tensor scaled =
          options.accumulate_grad_batches > 1 ? loss / options.accumulate_grad_batches : loss;
      call_hooks([&](Module& mod) { mod.on_before_backward(loss); }, [](Callback&) {});
      strategy->backward(scaled, m);
      call_hooks([](Module& mod) { mod.on_after_backward(); }, [](Callback&) {});
      window_has_gradient = !should_step;
      if (should_step) step_optimizers();
    } else if (should_step) {
      // No loss here, but earlier micro-batches may have accumulated
      // gradients, and under DDP the peers may have a loss: every replica
      // must take the same step (or none).
      const bool accumulated = window_has_gradient;
      window_has_gradient = false;
      if (strategy->backward_skipped(m, accumulated)) step_optimizers();
    }
  } else {
    strategy->set_gradient_sync(true);
    auto scope = strategy->step_scope();
    loss = strategy->training_step(m, on_device, idx);
    if (global_step > steps_before) ++batches_that_stepped;
  }
  batch_position = idx + 1;
  publish_step_metrics();
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
  call_hooks([&](Module& mod) { mod.on_train_batch_end(detached, batch, idx); },
             [&](Callback& cb) { cb.on_train_batch_end(self, m, detached, batch, idx); });
  bool ends_epoch = is_last_batch || (max_steps >= 0 && global_step >= max_steps);
  if (should_validate_now(idx + 1, ends_epoch)) run_validation(false);
}

void Trainer::Impl::step_optimizers() {
  Module& m = *module;
  for (auto& opt : optimizer_config.optimizers) {
    strategy->unscale_gradients(*opt);
    call_hooks([&](Module& mod) { mod.on_before_optimizer_step(*opt); },
               [&](Callback& cb) { cb.on_before_optimizer_step(self, m, *opt); });
    if (options.gradient_clip_val && *options.gradient_clip_val > 0) {
      auto params = optimizer_params(*opt);
      if (options.gradient_clip_algorithm == GradientClipAlgorithm::Norm) {
        torch::nn::utils::clip_grad_norm_(params, *options.gradient_clip_val);
      } else {
        torch::nn::utils::clip_grad_value_(params, *options.gradient_clip_val);
      }
    }
    strategy->optimizer_step(*opt, m);
  }
  strategy->precision().update();
  for (auto& opt : optimizer_config.optimizers) {
    call_hooks([&](Module& mod) { mod.on_before_zero_grad(*opt); }, [](Callback&) {});
    opt->zero_grad();
  }
  ++global_step;
  ++batches_that_stepped;
  step_schedulers(Interval::Step);
}

void Trainer::Impl::step_schedulers(Interval interval) {
  int64_t counter = interval == Interval::Step ? global_step : current_epoch + 1;
  for (auto& config : optimizer_config.schedulers) {
    if (config.interval == interval && counter % config.frequency == 0) config.scheduler->step();
  }
}

bool Trainer::Impl::should_validate_now(int64_t position, bool is_last_batch) const {
  if (!val_loader || sanity_checking) return false;
  if (!limit_val.is_fraction() && limit_val.count() == 0) return false;
  if (limit_val.is_fraction() && limit_val.fraction() == 0.0) return false;
  const auto& interval = options.val_check_interval;
  if (options.check_val_every_n_epoch &&
      (current_epoch + 1) % *options.check_val_every_n_epoch != 0) {
    return false;
  }
  if (interval.is_fraction()) {
    if (num_training_batches < 0) return is_last_batch;
    int64_t every = std::max<int64_t>(
        1, static_cast<int64_t>(static_cast<double>(num_training_batches) * interval.fraction()));
    return position % every == 0 || (is_last_batch && interval.fraction() >= 1.0);
  }
  if (options.check_val_every_n_epoch) return position % interval.count() == 0;
  // Counted across epochs: every N training batches since the start of fit.
  int64_t seen = (num_training_batches >= 0 ? current_epoch * num_training_batches : 0) + position;
  return seen % interval.count() == 0;
}

void Trainer::Impl::run_validation(bool sanity) {
  Module& m = *module;
  auto limit = limit_val.apply(val_loader->num_batches(), "limit_val_batches");
  if (sanity && num_sanity_val_steps >= 0) {
    limit = limit ? std::min(*limit, num_sanity_val_steps) : num_sanity_val_steps;
  }
  if (limit && *limit == 0) return;
  bool was_training = m.is_training();
  sanity_checking = sanity;
  for (auto& cb : callbacks) cb->on_validation_start(self, m);
  evaluation_epoch(*val_loader, Stage::Validate, limit);
  for (auto& cb : callbacks) cb->on_validation_end(self, m);
  sanity_checking = false;
  if (!sanity) validated_at_position = batch_position;
  m.train(was_training);
  m.log_sink_ = &train_log;
}

void Trainer::Impl::manual_backward(Module& m, const at::Tensor& loss) {
  if (!training) {
    throw ConfigError("manual_backward(loss): called outside training_step. Call it from "
                      "training_step while fitting.");
  }
  call_hooks([&](Module& mod) { mod.on_before_backward(loss); }, [](Callback&) {});
  strategy->backward(loss, m);
  call_hooks([](Module& mod) { mod.on_after_backward(); }, [](Callback&) {});
}

void Trainer::Impl::manual_optimizer_step(Module& m, torch::optim::Optimizer& optimizer) {
  if (!training) {
    throw ConfigError("optimizer_step(optimizer): called outside training_step. Call it from "
                      "training_step while fitting.");
  }
  strategy->unscale_gradients(optimizer);
  call_hooks([&](Module& mod) { mod.on_before_optimizer_step(optimizer); },
             [&](Callback& cb) { cb.on_before_optimizer_step(self, m, optimizer); });
  strategy->optimizer_step(optimizer, m);
  strategy->precision().update();
  ++global_step;
}

}  // namespace fulgur
