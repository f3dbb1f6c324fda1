#include "fulgur/callbacks/ema.h"

#include <torch/torch.h>

#include <chrono>
#include <string>

#include "callbacks/parameter_copy.h"
#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/plugins/environments/cluster_environment.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"

namespace fulgur {

EMA::EMA(EMAOptions options)
    : options_(options),
      average_(std::make_unique<detail::ParameterCopy>()),
      training_weights_(std::make_unique<detail::ParameterCopy>()) {
  std::vector<std::string> problems;
  if (!(options_.decay >= 0.0 && options_.decay < 1.0)) {
    problems.push_back(str("decay=", options_.decay, ": must be in [0, 1), e.g. 0.999"));
  }
  if (options_.every_n_steps < 1) {
    problems.push_back(str("every_n_steps=", options_.every_n_steps, ": must be >= 1"));
  }
  if (!problems.empty()) throw ConfigError(str("EMA(", join(problems, "; "), ")."));
}

EMA::~EMA() = default;

const std::vector<at::Tensor>& EMA::average() const { return average_->values(); }

void EMA::on_fit_start(Trainer& trainer, Module&) {
  if (trainer.global_step() == 0 && trainer.current_epoch() == 0) {
    // A fit from the start: it averages afresh (a resumed one goes on).
    average_->clear();
    last_update_step_ = -1;
  }
  loaded_training_weights_.clear();  // what a failed restore left
  failed_saves_ = 0;
  average_->begin_fit();
}

void EMA::on_restore_optimizers(Trainer& trainer, Module& module) {
  if (loaded_training_weights_.empty()) return;
  // The module was loaded with the checkpoint's average: it is the average
  // again, and the training weights go back into the module (every rank
  // restores at the same point: under fsdp a collective).
  detail::ParameterCopy weights;
  weights.set_whole(std::move(loaded_training_weights_));
  loaded_training_weights_.clear();
  average_->copy_parameters(trainer.strategy(), module);
  weights.assign_to(trainer.strategy(), module, "EMA");
}

void EMA::on_train_start(Trainer& trainer, Module& module) {
  training_ = true;
  // This rank's parts of the parameters (under fsdp its shards): a
  // checkpoint's average is taken apart, or the weights now are the first.
  if (average_->empty()) {
    average_->copy_parameters(trainer.strategy(), module);
  } else {
    average_->make_parts_checked(trainer.strategy(), module, "EMA");
  }
}

void EMA::on_train_batch_end(Trainer& trainer, Module& module, const at::Tensor&, const Batch&,
                             int64_t) {
  const int64_t step = trainer.global_step();
  // Once per optimizer step (not per micro-batch of gradient accumulation).
  if (step <= 0 || step == last_update_step_ || step % options_.every_n_steps != 0) return;
  last_update_step_ = step;
  average_->make_parts(trainer.strategy(), module, "EMA");
  const double decay = options_.decay;
  average_->update([decay](at::Tensor& average, const at::Tensor& weight) {
    average.mul_(decay).add_(weight, 1.0 - decay);
  });
}

void EMA::on_before_checkpoint_save(Trainer&, Module& module) {
  // During training only (a save at the end of fit or after it holds what
  // the module holds then), and not while a validation has swapped it in.
  if (!training_ || !options_.validate_with_average || average_->empty() ||
      !training_weights_->empty()) {
    return;
  }
  swapped_for_save_ = true;  // before: a swap that fails halfway is undone too
  swap_in(module);
}

void EMA::on_after_checkpoint_save(Trainer&, Module& module, bool failed) {
  if (!swapped_for_save_) return;
  Strategy& strategy = module.trainer().strategy();
  // A save that failed under fsdp may have failed on one rank only (global
  // rank 0 writes one file): putting the training weights back is a
  // collective its peers, training on, would pair with another of theirs.
  // Only when every rank failed here (a sharded checkpoint's ranks agree on
  // a failure); otherwise on_exception puts them back, or says why not.
  if (failed && detail::shards_parameters(strategy) &&
      !detail::StrategyDriver(strategy).peers_arrive(
          str("ema_failed_save/", strategy.cluster_environment().restart_count(), "/",
              module.trainer().global_step(), "/", ++failed_saves_),
          std::chrono::seconds(10))) {
    return;
  }
  swapped_for_save_ = false;
  swap_out(module);
}

void EMA::swap_in(Module& module) {
  if (average_->empty() || !training_weights_->empty()) return;
  Strategy& strategy = module.trainer().strategy();
  training_weights_->copy_parameters(strategy, module);
  average_->assign_to(strategy, module, "EMA");
}

void EMA::swap_out(Module& module) {
  if (training_weights_->empty()) return;
  // Cleared first: a failed assignment is not tried again.
  detail::ParameterCopy weights = std::move(*training_weights_);
  training_weights_->clear();
  weights.assign_to(module.trainer().strategy(), module, "EMA");
}

void EMA::on_validation_start(Trainer& trainer, Module& module) {
  // Fit's validations only: a standalone Trainer::validate evaluates the
  // module's weights (after fit, the average when apply_at_end; a
  // checkpoint's when it was given one).
  if (options_.validate_with_average && trainer.stage() == Stage::kFit) swap_in(module);
}

void EMA::on_validation_end(Trainer&, Module& module) { swap_out(module); }

void EMA::on_exception(Trainer& trainer, Module& module, const std::exception&) {
  training_ = false;
  const bool saving = swapped_for_save_;
  swapped_for_save_ = false;
  if (training_weights_->empty()) return;
  // Under fsdp putting the training weights back is a collective, which a
  // rank that failed alone must not start (its peers wait in another one):
  // only when every rank failed here. Otherwise the module keeps the
  // average, and OnExceptionCheckpoint (which waits for the same peers)
  // does not save it.
  Strategy& strategy = trainer.strategy();
  const std::string here = str("ema_on_exception/", strategy.cluster_environment().restart_count(),
                               "/", trainer.global_step());
  if (detail::shards_parameters(strategy) &&
      !detail::StrategyDriver(strategy).peers_arrive(here, std::chrono::seconds(10))) {
    training_weights_->clear();
    detail::print_note(
        str("EMA: rank ", strategy.global_rank(), " keeps the averaged weights ",
            saving ? "it swapped in for a checkpoint whose save failed" : "it was validating with",
            ": under strategy \"", strategy.name(),
            "\" putting the training weights back needs every "
            "rank, and not every rank failed here within 10 s."));
    return;
  }
  swap_out(module);
}

void EMA::on_train_end(Trainer& trainer, Module& module) {
  training_ = false;
  swap_out(module);
  if (average_->empty()) return;
  if (options_.apply_at_end) average_->assign_to(trainer.strategy(), module, "EMA");
  average_->make_whole();  // a collective under fsdp, as the assignment
}

// count (int), last_update_step (int), module_holds_average (bool), and
// count buffers in the module's parameters() order, whole (under fsdp
// gathered from the ranks' shards: every rank saves at the same point):
// where the module holds the average (a save of a fit that validates with
// it, or one within such a validation), the training weights training_0 ..
// training_<count-1>; otherwise the average, average_0 ... (A checkpoint
// without module_holds_average, from before it was written, is of the
// second kind. No count: from before the average was kept; nothing is
// loaded.)
StateDict EMA::state_dict() const {
  StateDict state;
  const bool module_holds_average = !training_weights_->empty();
  const std::vector<at::Tensor> kept =
      module_holds_average ? training_weights_->whole() : average_->whole();
  state.set("count", static_cast<int64_t>(kept.size()));
  state.set("last_update_step", last_update_step_);
  state.set("module_holds_average", module_holds_average);
  const std::string prefix = module_holds_average ? "training_" : "average_";
  for (size_t i = 0; i < kept.size(); ++i) state.set_buffer(prefix + std::to_string(i), kept[i]);
  return state;
}

void EMA::load_state_dict(const StateDict& state) {
  if (!state.contains("count")) return;
  const int64_t count = state.integer("count");
  if (state.contains("last_update_step")) last_update_step_ = state.integer("last_update_step");
  const bool module_holds_average =
      state.contains("module_holds_average") && state.boolean("module_holds_average");
  const std::string prefix = module_holds_average ? "training_" : "average_";
  std::vector<at::Tensor> kept;
  for (int64_t i = 0; i < count; ++i) {
    const c10::IValue* t = state.find(prefix + std::to_string(i));
    if (t == nullptr || !t->isTensor()) {
      throw ConfigError(str("EMA: the checkpoint's ",
                            module_holds_average ? "training weights lack" : "average lacks",
                            " tensor ", i, " of ", count,
                            ": the file is damaged or was written by another program."));
    }
    kept.push_back(t->toTensor());
  }
  if (module_holds_average) {
    // The average is the module's weights, loaded before; the training
    // weights go back into the module at on_restore_optimizers.
    average_->clear();
    loaded_training_weights_ = std::move(kept);
  } else {
    loaded_training_weights_.clear();
    average_->set_whole(std::move(kept));
  }
}

}  // namespace fulgur
