#include "fulgur/callbacks/ema.h"

#include <torch/torch.h>

#include <chrono>
#include <string>

#include "callbacks/whole_parameters.h"
#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/plugins/environments/cluster_environment.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"

namespace fulgur {

EMA::EMA(EMAOptions options) : options_(options) {
  std::vector<std::string> problems;
  if (!(options_.decay >= 0.0 && options_.decay < 1.0)) {
    problems.push_back(str("decay=", options_.decay, ": must be in [0, 1), e.g. 0.999"));
  }
  if (options_.every_n_steps < 1) {
    problems.push_back(str("every_n_steps=", options_.every_n_steps, ": must be >= 1"));
  }
  if (!problems.empty()) throw ConfigError(str("EMA(", join(problems, "; "), ")."));
}

void EMA::on_fit_start(Trainer&, Module&) {}

void EMA::on_train_start(Trainer& trainer, Module& module) {
  // Under fsdp the parameters are gathered to be read (every rank, here).
  detail::with_whole_parameters(trainer.strategy(), module, [&] {
    const auto parameters = module.parameters();
    if (!average_.empty()) {
      // From a checkpoint: it must be this module's.
      bool fits = average_.size() == parameters.size();
      for (size_t i = 0; fits && i < parameters.size(); ++i) {
        fits = average_[i].sizes() == parameters[i].sizes();
      }
      if (!fits) {
        throw ConfigError(str("EMA: the checkpoint's average holds ", average_.size(),
                              " tensors that do not fit the module's ", parameters.size(),
                              " parameters: it was written for another model. Resume from a "
                              "checkpoint of this model, or start without it."));
      }
      for (size_t i = 0; i < parameters.size(); ++i) {
        average_[i] = average_[i].to(parameters[i].device(), parameters[i].scalar_type());
      }
      return;
    }
    torch::NoGradGuard no_grad;
    for (const auto& p : parameters) average_.push_back(p.detach().clone());
  });
}

void EMA::on_train_batch_end(Trainer& trainer, Module& module, const at::Tensor&, const Batch&,
                             int64_t) {
  const int64_t step = trainer.global_step();
  // Once per optimizer step (not per micro-batch of gradient accumulation).
  if (step <= 0 || step == last_update_step_ || step % options_.every_n_steps != 0) return;
  last_update_step_ = step;
  detail::with_whole_parameters(trainer.strategy(), module, [&] {
    torch::NoGradGuard no_grad;
    const auto parameters = module.parameters();
    for (size_t i = 0; i < parameters.size() && i < average_.size(); ++i) {
      average_[i].mul_(options_.decay).add_(parameters[i].detach(), 1.0 - options_.decay);
    }
  });
}

void EMA::swap_in(Module& module) {
  if (average_.empty() || !training_weights_.empty()) return;
  Strategy& strategy = module.trainer().strategy();
  detail::with_whole_parameters(strategy, module, [&] {
    torch::NoGradGuard no_grad;
    for (const auto& p : module.parameters()) training_weights_.push_back(p.detach().clone());
  });
  detail::assign_parameters(strategy, module, average_);
}

void EMA::swap_out(Module& module) {
  if (training_weights_.empty()) return;
  std::vector<at::Tensor> weights = std::move(training_weights_);
  training_weights_.clear();
  detail::assign_parameters(module.trainer().strategy(), module, weights);
}

void EMA::on_validation_start(Trainer&, Module& module) {
  if (options_.validate_with_average) swap_in(module);
}

void EMA::on_validation_end(Trainer&, Module& module) { swap_out(module); }

void EMA::on_exception(Trainer& trainer, Module& module, const std::exception&) {
  if (training_weights_.empty()) return;
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
    training_weights_.clear();
    detail::print_note(str("EMA: rank ", strategy.global_rank(),
                           " keeps the averaged weights it was validating with: under strategy \"",
                           strategy.name(), "\" putting the training weights back needs every "
                           "rank, and not every rank failed here within 10 s."));
    return;
  }
  swap_out(module);
}

void EMA::on_train_end(Trainer& trainer, Module& module) {
  swap_out(module);
  if (!options_.apply_at_end || average_.empty()) return;
  detail::assign_parameters(trainer.strategy(), module, average_);
}

// count (int), last_update_step (int), and the average as buffers
// average_0 .. average_<count-1>, in the module's parameters() order. No
// count (a checkpoint from before the average was kept): nothing is loaded.
StateDict EMA::state_dict() const {
  StateDict state;
  state.set("count", static_cast<int64_t>(average_.size()));
  state.set("last_update_step", last_update_step_);
  for (size_t i = 0; i < average_.size(); ++i) {
    state.set_buffer("average_" + std::to_string(i), average_[i]);
  }
  return state;
}

void EMA::load_state_dict(const StateDict& state) {
  if (!state.contains("count")) return;
  const int64_t count = state.integer("count");
  if (state.contains("last_update_step")) last_update_step_ = state.integer("last_update_step");
  std::vector<at::Tensor> average;
  for (int64_t i = 0; i < count; ++i) {
    const c10::IValue* t = state.find("average_" + std::to_string(i));
    if (t == nullptr || !t->isTensor()) {
      throw ConfigError(str("EMA: the checkpoint's average lacks tensor ", i, " of ", count,
                            ": the file is damaged or was written by another program."));
    }
    average.push_back(t->toTensor());
  }
  average_ = std::move(average);
}

}  // namespace fulgur
