// The fsdp strategy (FSDPStrategy): its lifecycle, backward and optimizer
// steps over the units (unit.cpp) and sharded parameters (parameters.cpp),
// gradient clipping over every shard, and the module's state in
// checkpoints. Optimizer state: optimizer_state.cpp. Its registered names:
// strategies/builtin.cpp.
#include "fulgur/strategies/fsdp.h"

#include <torch/torch.h>

#include <cmath>
#include <map>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/distributed/process_group.h"
#include "fulgur/distributed/sharded_parameters.h"
#include "fulgur/strategies/checkpoint_layout.h"
#include "strategies/fsdp/auto_wrap.h"
#include "strategies/fsdp/unit.h"

namespace fulgur {

FSDPStrategy::FSDPStrategy(FSDPOptions options, std::string name)
    : ParallelStrategy(options.parallel, "FSDPStrategy", options.start_method),
      options_(std::move(options)),
      name_(std::move(name)) {
  if (options_.auto_wrap_min_params < 0) {
    throw ConfigError(str("FSDPStrategy: auto_wrap_min_params=", options_.auto_wrap_min_params,
                          " is negative: pass the number of parameters from which a layer of "
                          "a torch::nn::Sequential becomes a unit, or 0 to turn auto-wrap off."));
  }
  if (!options_.state_dict_type.is_valid()) {
    throw ConfigError(str("FSDPStrategy: state_dict_type=\"", options_.state_dict_type.text(),
                          "\" is not one of \"sharded\" (each rank writes its shard) or \"full\" "
                          "(rank 0 writes one file that loads on any world size)."));
  }
  if (!options_.sharding_strategy.is_valid()) {
    throw ConfigError(str("FSDPStrategy: sharding_strategy=\"", options_.sharding_strategy.text(),
                          "\" is not one of \"FULL_SHARD\" (strategy \"fsdp\") or "
                          "\"SHARD_GRAD_OP\" (strategy \"fsdp_shard_grad_op\")."));
  }
  // Each rank's optimizer state is its own shard; a full state dict is one
  // file, rank 0's.
  if (options_.state_dict_type.value() == StateDictType::kSharded) {
    set_checkpoint_layout(std::make_shared<ShardedCheckpoint>());
  }
  // fulgur::nn::SyncBatchNorm layers reduce their statistics across ranks;
  // FULL_SHARD's forward gathers the units' parameters; every save gathers
  // (the units' parameters, a full state's optimizer state).
  set_traits({.sync_batchnorm_unsupported_reason = {},
              .forward_is_collective = full_shard(),
              .save_gathers = true,
              .trainable_change_unsupported_reason =
                  "it shards the parameters that are trainable when the fit starts and steps "
                  "only those shards; a parameter made trainable later would be stepped whole "
                  "on every rank without its gradient reduced"});
}

FSDPStrategy::~FSDPStrategy() = default;

void FSDPStrategy::do_setup(Module& module) {
  module.to(root_device());
  if (sync_batchnorm()) connect_sync_batchnorm(module);
  // Every rank starts from rank 0's parameters and buffers.
  broadcast_parameters_from_rank_zero(module);
  torch::NoGradGuard no_grad;
  for (auto& b : module.buffers()) {
    if (b.defined() && b.numel() > 0) process_group().broadcast_(b, 0);
  }
  vote_exchanges_ = 0;
  votes_say_stop_ = false;
  restart_stop_votes(0);
  set_stop_vote(false);
}

void FSDPStrategy::votes_exchanged(int64_t sum) {
  ++vote_exchanges_;
  votes_say_stop_ = sum > 0;
}

bool FSDPStrategy::agree_to_stop(bool requested, bool boundary) {
  return agree_to_stop_from_votes(requested, boundary, vote_exchanges_,
                                  [this] { return votes_say_stop_; });
}

void FSDPStrategy::do_teardown() {
  // The module leaves fit whole, as it came (after a failed stage the peers
  // may be gone: no gather, and a released parameter stays unreadable).
  if (stage_completed()) gather_units();
  detach_units();
  whole_.clear();
  sharded_.clear();
  ParallelStrategy::do_teardown();
}

bool FSDPStrategy::backward_is_collective() const { return !units_.empty() || sync_batchnorm(); }

void FSDPStrategy::agree_on_backward(bool has_loss) {
  // Under FULL_SHARD the backward itself runs collectives (each unit's
  // gather and reduce-scatter), as SyncBatchNorm's does: a rank without a
  // loss cannot join its peers' backward. Every rank learns how many have
  // one, so a mixed step is the same error everywhere instead of a hang.
  // The stop votes ride along.
  at::Tensor count = torch::tensor({has_loss ? int64_t{1} : 0, stop_vote() ? int64_t{1} : 0});
  process_group().all_reduce_(count, ReduceOp::kSum);
  const int64_t with_loss = count[0].item<int64_t>();
  votes_exchanged(count[1].item<int64_t>());
  if (with_loss == 0 || with_loss == world_size()) return;
  const bool units = !units_.empty();
  const char* why = !units ? "SyncBatchNorm reduces across ranks in backward"
                    : full_shard()
                        ? "Each unit's gather and reduce-scatter in backward is a collective"
                        : "Each unit's reduce-scatter in backward (prefetch) is a collective";
  const char* instead = !units         ? "turn sync_batchnorm off."
                        : full_shard() ? "use strategy \"fsdp_shard_grad_op\"."
                                       : "turn prefetch off.";
  throw ConfigError(str("strategy \"", name(),
                        !units         ? "\" with sync_batchnorm=true"
                        : full_shard() ? "\" (FULL_SHARD)"
                                       : "\" with prefetch",
                        ": training_step returned no loss on ", world_size() - with_loss, " of ",
                        world_size(), " ranks (this rank: ", has_loss ? "a loss" : "none",
                        ") at a step the optimizers take. ", why,
                        ", so every rank runs the backward of every step, or none does: return a "
                        "loss on every rank (e.g. 0 * output.sum() for a batch to ignore), or ",
                        instead));
}

void FSDPStrategy::backward(const at::Tensor& loss, Module& module) {
  if (backward_is_collective() && gradient_sync()) agree_on_backward(true);
  for (auto& unit : units_) unit->start_backward();
  ParallelStrategy::backward(loss, module);
  finish_reductions();
  last_forward_order_ = std::move(forward_order_);
  forward_order_.clear();
  // A unit whose parameters did not all get a gradient is still whole.
  release_units();
  if (gradient_sync()) reduce_gradients();
}

bool FSDPStrategy::steps_without_loss(Module& /*module*/, bool accumulated) {
  forward_order_.clear();  // no backward: nothing to learn the order from
  if (!gradient_sync()) return accumulated;
  if (backward_is_collective()) agree_on_backward(false);
  for (auto& unit : units_) unit->start_backward();  // no unit reduced in this step yet
  // The peers reduce-scatter now: join them with what this rank has
  // accumulated (or nothing). The step is taken when any rank has a
  // gradient, from the all-reduced flags, so every rank comes to the same
  // answer (not whether a shard's gradient is defined: zero_grad may leave
  // zeros there, and a step on them would move momentum where one process
  // would not step at all).
  return reduce_gradients(/*contributes=*/accumulated);
}

bool FSDPStrategy::optimizer_step(torch::optim::Optimizer& optimizer, Module& module) {
  const bool stepped = ParallelStrategy::optimizer_step(optimizer, module);
  // The parameters outside every unit are whole again; a unit's stay
  // sharded until its next forward (one still whole, never used since its
  // last gather, is stale now: released).
  release_units();
  if (ShardedParameters* sharded = sharded_for(optimizer)) {
    sharded->all_gather_parameters(whole_.at(sharded));
    note_held_parameters();
  }
  return stepped;
}

void FSDPStrategy::clip_gradients_norm(const std::vector<at::Tensor>& parameters, double max_norm) {
  // The 2-norm over every rank's shards: the sum of squares, all-reduced
  // (padding holds zeros), then the factor torch::nn::utils::clip_grad_norm_
  // applies. Summed, reduced and applied on the gradients' device under
  // NCCL: nothing is read back (Gloo reduces host memory).
  torch::NoGradGuard no_grad;
  at::Tensor total;
  for (const auto& p : parameters) {
    if (!p.grad().defined()) continue;
    const at::Tensor squares = p.grad().detach().to(torch::kDouble).pow(2).sum();
    total = total.defined() ? total.add_(squares.to(total.device())) : squares;
  }
  // Every rank joins the all-reduce, with or without gradients of its own.
  if (!total.defined()) total = torch::zeros({}, torch::kDouble);
  if (process_group_backend() != "nccl") total = total.cpu();
  process_group().all_reduce_(total, ReduceOp::kSum);
  const at::Tensor factor = (max_norm / (total.sqrt() + 1e-6)).clamp_max(1.0);
  for (const auto& p : parameters) {
    if (p.grad().defined()) p.grad().mul_(factor.to(p.grad().device()));
  }
}

StateDict FSDPStrategy::module_state(Module& module) {
  if (units_.empty() || !full_shard()) return ParallelStrategy::module_state(module);
  // The state keeps the tensors it is given until it is written, and a
  // unit's parameters are freed again: it gets copies, one unit gathered
  // at a time.
  std::map<const c10::TensorImpl*, at::Tensor> copies;
  torch::NoGradGuard no_grad;
  for (auto& unit : units_) {
    unit->gather();
    for (const auto& [sharded, indices] : unit->members) {
      for (size_t i : indices) {
        const at::Tensor& p = sharded->parameters()[i];
        copies[p.unsafeGetTensorImpl()] = p.detach().clone().requires_grad_(p.requires_grad());
      }
    }
    unit->release();
  }
  StateDict state = ParallelStrategy::module_state(module);
  state.transform_tensors([&copies](const at::Tensor& t) {
    auto it = copies.find(t.unsafeGetTensorImpl());
    return it != copies.end() ? it->second : t;
  });
  return state;
}

void FSDPStrategy::load_module_state(Module& module, const StateDict& state) {
  // Every parameter whole to take the checkpoint's values; the shards are
  // then taken from them, and the units stay whole until their next
  // forward (resuming happens at fit start, where they are whole anyway).
  gather_units();
  ParallelStrategy::load_module_state(module, state);
  for (auto& entry : sharded_) entry.second->take_from_parameters();
}

bool FSDPStrategy::full_shard() const {
  return options_.sharding_strategy.value() == ShardingStrategy::kFullShard;
}

void FSDPStrategy::with_full_parameters(Module& /*module*/, const std::function<void()>& body) {
  gather_units();
  note_held_parameters();
  try {
    body();
  } catch (...) {
    release_units();
    throw;
  }
  release_units();
}

}  // namespace fulgur
