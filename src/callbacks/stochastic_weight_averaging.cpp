#include "fulgur/callbacks/stochastic_weight_averaging.h"

#include <torch/torch.h>

#include <cmath>
#include <optional>

#include "callbacks/parameter_copy.h"
#include "fulgur/callbacks/ema.h"
#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/data/data_loader.h"
#include "fulgur/nn/sync_batch_norm.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"
#include "strategies/strategy_driver.h"

namespace fulgur {

namespace {

// LibTorch 1.13's c10::optional, 2.x's std::optional.
using Momentum = std::decay_t<decltype(std::declval<torch::nn::BatchNormOptions&>().momentum())>;

// A BatchNorm layer's options (torch's 1d/2d/3d, fulgur's SyncBatchNorm);
// null for any other module.
torch::nn::BatchNormOptions* batch_norm_options(torch::nn::Module& m) {
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm1dImpl*>(&m)) return &bn->options;
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm2dImpl*>(&m)) return &bn->options;
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm3dImpl*>(&m)) return &bn->options;
  if (auto* bn = dynamic_cast<nn::SyncBatchNormImpl*>(&m)) return &bn->options;
  return nullptr;
}

}  // namespace

StochasticWeightAveraging::StochasticWeightAveraging(SWAOptions options)
    : options_(options), average_(std::make_unique<detail::ParameterCopy>()) {
  std::vector<std::string> problems;
  if (!(options_.swa_lr > 0.0 && std::isfinite(options_.swa_lr))) {
    problems.push_back(str("swa_lr=", options_.swa_lr, ": must be a rate > 0, e.g. 0.01"));
  }
  const double start = options_.swa_epoch_start;
  const bool fraction = start > 0.0 && start < 1.0;
  // An epoch number an int64_t holds (2^62: converting more is undefined).
  const bool epoch = start >= 1.0 && std::floor(start) == start && start <= 0x1p62;
  if (!fraction && !epoch) {
    problems.push_back(str("swa_epoch_start=", start,
                           ": pass a fraction of max_epochs in (0, 1) (0.8) or an epoch number "
                           "counted from 1 (an integral value from 1 to 2^62)"));
  }
  if (options_.annealing_epochs < 0) {
    problems.push_back(str("annealing_epochs=", options_.annealing_epochs, ": must be >= 0"));
  }
  if (!options_.annealing_strategy.is_valid()) {
    problems.push_back(str("annealing_strategy=\"", options_.annealing_strategy.text(),
                           "\": pass ", options_.annealing_strategy.spellings()));
  }
  if (!problems.empty()) {
    throw ConfigError(str("StochasticWeightAveraging(", join(problems, "; "), ")."));
  }
}

StochasticWeightAveraging::~StochasticWeightAveraging() = default;

const std::vector<at::Tensor>& StochasticWeightAveraging::average() const {
  return average_->values();
}

void StochasticWeightAveraging::on_fit_start(Trainer& trainer, Module&) {
  if (trainer.options().cuda_graph) {
    throw ConfigError(
        "StochasticWeightAveraging with cuda_graph=true: a captured step replays its rate, so "
        "the annealing would stop at the first captured one. Train with cuda_graph=false.");
  }
  for (const auto& cb : trainer.callbacks()) {
    const auto* ema = dynamic_cast<const EMA*>(cb.get());
    if (ema != nullptr && ema->options().apply_at_end) {
      throw ConfigError(
          "StochasticWeightAveraging and an EMA with apply_at_end=true both give the module "
          "their average at the end of fit, and the later one would silently win. Keep one, "
          "or pass EMAOptions{.apply_at_end = false}.");
    }
  }
  const int64_t max_epochs = trainer.max_epochs();
  const double start = options_.swa_epoch_start;
  // As Lightning: the epoch number counted from 1 (a fraction of max_epochs
  // rounds down), so its 0-based index is one less.
  int64_t number = static_cast<int64_t>(start);
  if (start > 0.0 && start < 1.0) {
    if (max_epochs < 0) {
      throw ConfigError(str("StochasticWeightAveraging: swa_epoch_start=", start,
                            " is a fraction of max_epochs, but this fit has no epoch limit "
                            "(max_steps ends it). Pass max_epochs, or the first averaged epoch "
                            "as a number counted from 1 (swa_epoch_start=10)."));
    }
    number = static_cast<int64_t>(std::floor(start * static_cast<double>(max_epochs)));
  }
  start_epoch_ = std::max<int64_t>(number - 1, 0);
  if (max_epochs >= 0 && start_epoch_ >= max_epochs) {
    throw ConfigError(str("StochasticWeightAveraging: swa_epoch_start=", start, " is epoch ",
                          start_epoch_ + 1, " (counted from 1), but the fit trains ",
                          max_epochs, " epoch(s): nothing would be averaged. Pass an earlier "
                          "start or more epochs."));
  }
  seen_.clear();
  // After a resume, the epoch before the current one has ended (a run
  // resumed from its last epoch's checkpoint averages that epoch at the end).
  ended_epoch_ = trainer.current_epoch() - 1;
  if (trainer.global_step() == 0 && trainer.current_epoch() == 0) {
    // A fit from the start: nothing of an earlier fit carries over.
    count_ = 0;
    last_epoch_ = -1;
    average_->clear();
    lr0_.clear();
  }
  average_->begin_fit();
}

double StochasticWeightAveraging::annealed_lr(double lr0, int64_t epoch) const {
  double a = 1.0;
  if (options_.annealing_epochs > 0) {
    // As torch's SWALR: the first averaged epoch at the optimizer's rate.
    const double t = std::min(1.0, static_cast<double>(epoch - start_epoch_) /
                                       static_cast<double>(options_.annealing_epochs));
    a = options_.annealing_strategy.value() == AnnealingStrategy::kCos
            ? (1.0 - std::cos(std::acos(-1.0) * t)) / 2.0
            : t;
  }
  return options_.swa_lr * a + lr0 * (1.0 - a);
}

void StochasticWeightAveraging::on_before_optimizer_step(Trainer& trainer, Module& module,
                                                         torch::optim::Optimizer& optimizer) {
  const int64_t epoch = trainer.current_epoch();
  if (start_epoch_ < 0 || epoch < start_epoch_) return;
  // The optimizer's place in configure_optimizers()'s list (a resumed run
  // may step them first in another order: a discriminator stepping every
  // other batch); one it did not return comes after those, in the order
  // they first step.
  const auto& listed = module.optimizers();
  size_t index = 0;
  while (index < listed.size() && listed[index].get() != &optimizer) ++index;
  if (index == listed.size()) {
    size_t other = 0;
    while (other < seen_.size() && seen_[other] != &optimizer) ++other;
    if (other == seen_.size()) seen_.push_back(&optimizer);
    index += other;
  }
  auto& groups = optimizer.param_groups();
  if (index >= lr0_.size()) {
    lr0_.resize(index + 1);
    for (const auto& group : groups) lr0_[index].push_back(group.options().get_lr());
  }
  if (lr0_[index].size() > groups.size()) {
    throw ConfigError(str("StochasticWeightAveraging: optimizer ", index, " has ", groups.size(),
                          " parameter groups, but ", lr0_[index].size(),
                          " when averaging began (from a checkpoint of another model?). "
                          "Resume with the optimizers it was saved with."));
  }
  // A group added since (BaseFinetuning's) anneals from the rate it has now.
  for (size_t g = lr0_[index].size(); g < groups.size(); ++g) {
    lr0_[index].push_back(groups[g].options().get_lr());
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    groups[g].options().set_lr(annealed_lr(lr0_[index][g], epoch));
  }
}

void StochasticWeightAveraging::on_train_epoch_start(Trainer& trainer, Module& module) {
  // The weights now are those at the end of the epoch before: a checkpoint
  // written at that end, whatever the callbacks' order, resumes here too.
  average_end_of(trainer.current_epoch() - 1, module);
}

void StochasticWeightAveraging::average_end_of(int64_t epoch, Module& module) {
  if (start_epoch_ < 0 || epoch < start_epoch_ || epoch <= last_epoch_) return;
  // Each rank averages its parts of the parameters (under fsdp its shards).
  Strategy& strategy = module.trainer().strategy();
  if (average_->empty()) {
    average_->copy_parameters(strategy, module);  // the first epoch's end
  } else {
    average_->make_parts_checked(strategy, module, "StochasticWeightAveraging");
    const double weight = 1.0 / static_cast<double>(count_ + 1);
    average_->update([weight](at::Tensor& average, const at::Tensor& weights) {
      average.add_(weights - average, weight);
    });
  }
  last_epoch_ = epoch;
  ++count_;
}

void StochasticWeightAveraging::on_train_epoch_end(Trainer& trainer, Module&) {
  ended_epoch_ = trainer.current_epoch();
}

void StochasticWeightAveraging::on_train_end(Trainer& trainer, Module& module) {
  average_end_of(ended_epoch_, module);  // the last epoch's weights
  if (count_ == 0) {
    detail::print_note(str("StochasticWeightAveraging: fit ended before epoch ", start_epoch_,
                           ", the first to average; the module keeps the weights as trained."));
    return;
  }
  average_->assign_to(trainer.strategy(), module, "StochasticWeightAveraging");
  if (options_.update_bn) update_batch_norm(trainer, module);
  average_->make_whole();  // a collective under fsdp, as the assignment
}

void StochasticWeightAveraging::update_batch_norm(Trainer& trainer, Module& module) {
  DataLoader* loader = trainer.train_dataloader();
  std::vector<std::shared_ptr<torch::nn::Module>> layers;
  for (const auto& m : module.modules(/*include_self=*/false)) {
    const torch::nn::BatchNormOptions* options = batch_norm_options(*m);
    if (options != nullptr && options->track_running_stats()) layers.push_back(m);
  }
  if (layers.empty() || loader == nullptr) return;
  // What the pass changes, kept to put back if it fails: each layer's
  // statistics and momentum, the module's mode, the loader's position.
  struct Kept {
    torch::nn::BatchNormOptions* options;
    Momentum momentum;
    std::vector<std::pair<at::Tensor, at::Tensor>> buffers;  // (buffer, its values)
  };
  std::vector<Kept> kept;
  for (const auto& m : layers) {
    Kept k{batch_norm_options(*m), batch_norm_options(*m)->momentum(), {}};
    for (auto& b : m->named_buffers(/*recurse=*/false)) k.buffers.emplace_back(b.value(), b.value().clone());
    kept.push_back(std::move(k));
  }
  const StateDict position = loader->state_dict();
  const bool was_training = module.is_training();
  auto put_back_mode = [&] {
    for (auto& k : kept) k.options->momentum(k.momentum);
    module.train(was_training);
    loader->load_state_dict(position);
  };
  try {
    torch::NoGradGuard no_grad;
    // Fresh statistics, averaged over the pass with equal weight per batch.
    for (size_t i = 0; i < layers.size(); ++i) {
      for (auto& b : layers[i]->named_buffers(/*recurse=*/false)) {
        if (b.key() == "running_mean" || b.key() == "num_batches_tracked") b.value().zero_();
        if (b.key() == "running_var") b.value().fill_(1.0);
      }
      kept[i].options->momentum(Momentum());
    }
    module.train(true);
    loader->start_epoch(trainer.current_epoch());
    // The batches an epoch of this fit trains on (limit_train_batches).
    const int64_t limit = trainer.num_training_batches();
    detail::StrategyDriver driver(trainer.strategy());
    // The forward may be collective (fsdp's FULL_SHARD, SyncBatchNorm): on
    // several ranks, the pass ends for all where the shortest rank's loader
    // ends (one of unknown length may end sooner on one rank), as the
    // training epoch does.
    const bool agree_on_end = trainer.strategy().world_size() > 1;
    for (int64_t batch_idx = 0; limit < 0 || batch_idx < limit; ++batch_idx) {
      auto batch = loader->next();
      if (agree_on_end && trainer.strategy().reduce_boolean_decision(!batch, /*all=*/false)) break;
      if (!batch) break;
      // As the training step gets it (the Module's batch transfer hooks).
      Batch on_device = module.on_after_batch_transfer(
          driver.batch_to_device(module.on_before_batch_transfer(*batch)));
      try {
        module.predict_step(on_device, batch_idx);
      } catch (const ConfigError& e) {
        throw ConfigError(str("StochasticWeightAveraging recomputes the BatchNorm statistics of "
                              "the averaged weights with predict_step (the forward pass) over "
                              "the training data: ",
                              e.what(),
                              " Or pass SWAOptions{.update_bn = false} to keep the statistics "
                              "as trained."));
      }
    }
  } catch (...) {
    // The statistics as trained, not half-recomputed.
    torch::NoGradGuard no_grad;
    for (auto& k : kept) {
      for (auto& [buffer, values] : k.buffers) buffer.copy_(values);
    }
    put_back_mode();
    throw;
  }
  put_back_mode();
}

StateDict StochasticWeightAveraging::state_dict() const {
  StateDict state;
  state.set("count", count_);
  state.set("last_epoch", last_epoch_);
  // Whole (under fsdp gathered from the ranks' shards: every rank saves at
  // the same point).
  const std::vector<at::Tensor> average = average_->whole();
  for (size_t i = 0; i < average.size(); ++i) {
    state.set_buffer("average_" + std::to_string(i), average[i]);
  }
  state.set("optimizers", static_cast<int64_t>(lr0_.size()));
  for (size_t i = 0; i < lr0_.size(); ++i) state.set("lr0_" + std::to_string(i), lr0_[i]);
  return state;
}

void StochasticWeightAveraging::load_state_dict(const StateDict& state) {
  const int64_t count = state.integer("count");
  const int64_t last_epoch = state.integer("last_epoch");
  std::vector<at::Tensor> average;
  for (int64_t i = 0; count > 0; ++i) {
    const c10::IValue* t = state.find("average_" + std::to_string(i));
    if (t == nullptr) break;
    average.push_back(state.tensor("average_" + std::to_string(i)));
  }
  if (count > 0 && average.empty()) {
    throw CheckpointError(str("StochasticWeightAveraging: the checkpoint counts ", count,
                              " averaged epochs but holds no average: the file is damaged or "
                              "was written by another program."));
  }
  std::vector<std::vector<double>> lr0;
  const int64_t optimizers = state.integer("optimizers");
  for (int64_t i = 0; i < optimizers; ++i) lr0.push_back(state.reals("lr0_" + std::to_string(i)));
  count_ = count;
  last_epoch_ = last_epoch;
  average_->set_whole(std::move(average));
  lr0_ = std::move(lr0);
}

}  // namespace fulgur
