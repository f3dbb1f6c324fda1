#include "fulgur/strategies/fsdp.h"

#include <torch/torch.h>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <set>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/distributed/process_group.h"
#include "fulgur/distributed/sharded_parameters.h"
#include "fulgur/nn/fsdp_unit.h"
#include "fulgur/plugins/precision/amp.h"
#include "fulgur/strategies/checkpoint_layout.h"
#include "fulgur/utilities/torch_compat.h"
#include "strategies/fsdp_auto_wrap.h"

namespace fulgur {

// One declared fulgur::nn::FSDPUnit under FULL_SHARD: which shards hold its
// parameters, whether their full values are here, and how many of its
// gradients this backward has completed.
class FSDPStrategy::Unit : public nn::UnitHooks, public std::enable_shared_from_this<Unit> {
 public:
  /// `shards`: FULL_SHARD (its parameters are released between uses);
  /// under SHARD_GRAD_OP a unit only reduce-scatters its gradients in
  /// backward (prefetch).
  Unit(FSDPStrategy& strategy, bool shards) : strategy_(strategy), shards_(shards) {}
  ~Unit() override {
    for (size_t k = 0; k < accumulators_.size(); ++k) {
      accumulators_[k]->del_post_hook(hook_keys_[k]);
    }
  }

  void attach_module(std::shared_ptr<torch::nn::Module> module) {
    module_ = std::move(module);
    static_cast<nn::FSDPUnitBase&>(*module_).set_unit_hooks(shared_from_this());
  }
  void detach_module() {
    if (module_) static_cast<nn::FSDPUnitBase&>(*module_).set_unit_hooks(nullptr);
    module_.reset();
  }
  /// (ShardedParameters, its indices) of this unit's parameters.
  std::vector<std::pair<ShardedParameters*, std::vector<size_t>>> members;

  void watch_gradients();
  /// Starts gathering the parameters (a prefetch); gather() ends it.
  void start_gather() {
    if (!shards_ || gathered_ || !gathering_.empty()) return;
    for (auto& [sharded, indices] : members) {
      gathering_.push_back(sharded->start_all_gather_parameters(indices));
    }
    strategy_.note_held_parameters();
  }
  void gather() {
    if (gathered_) return;
    start_gather();
    for (auto& exchange : gathering_) exchange.wait();
    gathering_.clear();
    gathered_ = true;
    strategy_.note_held_parameters();
  }
  void release() {
    if (!shards_) return;
    if (!gathering_.empty()) gather();  // a prefetch under way ends first
    if (!gathered_) return;
    for (auto& [sharded, indices] : members) sharded->release_parameters(indices);
    gathered_ = false;
  }
  void start_backward() {
    ready_ = 0;
    reduced_ = false;
  }
  bool reduced() const { return reduced_; }

  void before_forward() override {
    if (!shards_) return;
    gather();
    if (at::GradMode::is_enabled()) strategy_.unit_forward_started(this);
  }
  void after_forward(const std::vector<at::Tensor>& outputs) override {
    if (!shards_) return;
    if (!at::GradMode::is_enabled()) {
      release();
      return;
    }
    if (outputs.empty()) return;  // unseen results: whole until the backward
    std::weak_ptr<Unit> self = weak_from_this();
    for (const auto& out : outputs) {
      if (!out.defined() || !out.requires_grad()) continue;
      // Runs when the output's gradient arrives, before any of the unit's
      // own backward: the parameters its graph saved are needed again.
      out.register_hook([self](const at::Tensor&) {
        if (auto unit = self.lock()) {
          unit->gather();
          unit->strategy_.unit_backward_started(unit.get());
        }
      });
    }
    release();
  }
  void gradient_ready() {
    if (++ready_ < static_cast<int>(accumulators_.size())) return;
    if (strategy_.sync_) {
      // With prefetch, the reduce-scatter runs while the rest of backward
      // does (one unit's under way at a time); without, now.
      if (strategy_.options_.prefetch) strategy_.finish_reductions();
      for (auto& [sharded, indices] : members) {
        ShardedExchange exchange = sharded->start_reduce_scatter_gradients(indices);
        if (strategy_.options_.prefetch) {
          strategy_.reducing_.push_back(std::move(exchange));
        } else {
          exchange.wait();
        }
      }
      reduced_ = true;
    }
    release();
  }

 private:
  FSDPStrategy& strategy_;
  const bool shards_;
  std::shared_ptr<torch::nn::Module> module_;
  bool gathered_ = true;
  std::vector<ShardedExchange> gathering_;  // a prefetch under way
  bool reduced_ = false;
  int ready_ = 0;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
};

namespace {

// Calls visit(tensor, set) for each per-element tensor of a torch::optim
// state (Adam's, AdamW's, SGD's, RMSprop's, Adagrad's) in a fixed order
// (every rank gathers the same ones), `set` replacing it in the state;
// false for the state of another optimizer.
template <typename Visit>
bool visit_state_tensors(torch::optim::OptimizerParamState& state, Visit&& visit) {
  auto one = [&](const at::Tensor& t, const auto& set) {
    if (t.defined()) visit(t, set);
  };
  auto moments = [&](auto* s) {  // Adam's and AdamW's
    one(s->exp_avg(), [&](const at::Tensor& v) { s->exp_avg(v); });
    one(s->exp_avg_sq(), [&](const at::Tensor& v) { s->exp_avg_sq(v); });
    one(s->max_exp_avg_sq(), [&](const at::Tensor& v) { s->max_exp_avg_sq(v); });
  };
  namespace optim = torch::optim;
  if (auto* adam = dynamic_cast<optim::AdamParamState*>(&state)) {
    moments(adam);
  } else if (auto* adamw = dynamic_cast<optim::AdamWParamState*>(&state)) {
    moments(adamw);
  } else if (auto* sgd = dynamic_cast<optim::SGDParamState*>(&state)) {
    one(sgd->momentum_buffer(), [&](const at::Tensor& v) { sgd->momentum_buffer(v); });
  } else if (auto* rms = dynamic_cast<optim::RMSpropParamState*>(&state)) {
    one(rms->square_avg(), [&](const at::Tensor& v) { rms->square_avg(v); });
    one(rms->momentum_buffer(), [&](const at::Tensor& v) { rms->momentum_buffer(v); });
    one(rms->grad_avg(), [&](const at::Tensor& v) { rms->grad_avg(v); });
  } else if (auto* ada = dynamic_cast<optim::AdagradParamState*>(&state)) {
    one(ada->sum(), [&](const at::Tensor& v) { ada->sum(v); });
  } else {
    return false;
  }
  return true;
}

// Replaces each per-element tensor of `state` with change(tensor).
template <typename Change>
bool change_state_tensors(torch::optim::OptimizerParamState& state, Change&& change) {
  return visit_state_tensors(state, [&](const at::Tensor& t, const auto& set) { set(change(t)); });
}

// Runs after autograd accumulated a unit parameter's gradient.
class UnitGradientHook : public torch::autograd::FunctionPostHook {
 public:
  explicit UnitGradientHook(std::function<void()> ready) : ready_(std::move(ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    ready_();
    return outputs;
  }

 private:
  std::function<void()> ready_;
};

}  // namespace

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
  };
  for (const auto& [key, state] : optimizer.state()) {
    (void)key;
    // Only read: the visitor's setters go unused.
    const bool per_element =
        visit_state_tensors(const_cast<torch::optim::OptimizerParamState&>(*state),
                            [&](const at::Tensor& t, const auto&) { add(t); });
    if (per_element) continue;
    // LBFGS keeps one state for all its parameters, with its history.
    if (const auto* lbfgs = dynamic_cast<const torch::optim::LBFGSParamState*>(state.get())) {
      add(lbfgs->d());
      add(lbfgs->H_diag());
      add(lbfgs->prev_flat_grad());
      for (const auto* history : {&lbfgs->old_dirs(), &lbfgs->old_stps(), &lbfgs->ro()}) {
        for (const auto& t : *history) add(t);
      }
      if (lbfgs->al()) {
        for (const auto& t : *lbfgs->al()) add(t);
      }
    }
  }
  return bytes;
}

void FSDPStrategy::Unit::watch_gradients() {
  std::weak_ptr<Unit> self = weak_from_this();
  for (auto& [sharded, indices] : members) {
    for (size_t i : indices) {
      auto accumulator = torch::autograd::impl::grad_accumulator(sharded->parameters()[i]);
      FULGUR_ASSERT(accumulator != nullptr, "a unit parameter is not a leaf");
      hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<UnitGradientHook>([self] {
        if (auto unit = self.lock()) unit->gradient_ready();
      })));
      accumulators_.push_back(std::move(accumulator));
    }
  }
}

FSDPStrategy::FSDPStrategy(FSDPOptions options, std::string name)
    : ParallelStrategy(options.parallel, "FSDPStrategy"),
      options_(std::move(options)),
      name_(std::move(name)) {
  check_start_method(options_.start_method, "FSDPStrategy");
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
}

FSDPStrategy::~FSDPStrategy() = default;

void FSDPStrategy::configure_launcher() { configure_launcher_for(options_.start_method.value()); }

void FSDPStrategy::do_setup(Module& module) {
  module.to(root_device());
  if (sync_batchnorm()) connect_sync_batchnorm(module);
  // Every rank starts from rank 0's parameters and buffers.
  broadcast_parameters_from_rank_zero(module);
  torch::NoGradGuard no_grad;
  for (auto& b : module.buffers()) {
    if (b.defined() && b.numel() > 0) process_group().broadcast_(b, 0);
  }
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

OptimizerConfig FSDPStrategy::setup_optimizers(Module& module) {
  // The loss scaler decides from the gradients it sees whether to skip a
  // step; each rank sees only its shard, so an inf in one shard would make
  // that rank alone skip. A scaler that agrees across ranks is not here yet.
  if (auto* mixed = dynamic_cast<MixedPrecision*>(&precision()); mixed && mixed->scaler()) {
    throw ConfigError(str("strategy \"", name(), "\" with precision=\"", precision().name(),
                          "\": its loss scaler would judge each rank's shard of the gradients "
                          "alone, and ranks could disagree on skipping a step. Use "
                          "precision=\"bf16-mixed\" (no loss scaler), or strategy \"ddp\"."));
  }
  OptimizerConfig config = ParallelStrategy::setup_optimizers(module);
  sharded_.clear();
  std::set<const c10::TensorImpl*> taken;
  for (size_t o = 0; o < config.optimizers.size(); ++o) {
    torch::optim::Optimizer& optimizer = *config.optimizers[o];
    if (!optimizer.state().empty()) {
      throw ConfigError(str("strategy \"", name(), "\": optimizer ", o,
                            " of configure_optimizers() already has state; under sharded data "
                            "parallel its state is built on this rank's shards. Return a fresh "
                            "optimizer (a checkpoint restores its state)."));
    }
    std::vector<at::Tensor> params;
    for (auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        if (!p.requires_grad()) continue;  // frozen: stays whole, never stepped
        if (!taken.insert(p.unsafeGetTensorImpl()).second) {
          throw ConfigError(
              fulgur::str("strategy \"", name(), "\": a parameter of shape ", p.sizes(),
                          " is in two optimizers (or twice in one). Under sharded data "
                          "parallel each parameter is sharded for one optimizer: give "
                          "each parameter to one optimizer, once."));
        }
        params.push_back(p);
      }
    }
    if (params.empty()) continue;
    // SHARD_GRAD_OP keeps every parameter whole: the shards are views of
    // them (ZeRO 2's 4P + 12P/N). FULL_SHARD frees a unit's parameters
    // between uses, so its shards hold memory of their own.
    const bool whole = options_.sharding_strategy.value() == ShardingStrategy::kShardGradOp;
    auto sharded = std::make_unique<ShardedParameters>(params, shared_process_group(), whole);
    // The optimizer steps the shards, in the parameters' places (each keeps
    // its group's options).
    size_t k = 0;
    for (auto& group : optimizer.param_groups()) {
      for (auto& p : group.params()) {
        if (p.requires_grad()) p = sharded->shards()[k++];
      }
    }
    sharded_.emplace_back(&optimizer, std::move(sharded));
  }
  // Under SHARD_GRAD_OP the units matter only to reduce-scatter their
  // gradients during backward (prefetch).
  if (full_shard() || options_.prefetch) {
    attach_units(module);
  } else if (options_.auto_wrap_min_params > 0 && is_global_zero()) {
    detail::print_note(str("strategy \"", name(),
                           "\": auto_wrap_min_params = ", options_.auto_wrap_min_params,
                           " has no effect here: under SHARD_GRAD_OP every parameter stays "
                           "whole, and units only reduce-scatter their gradients early with "
                           "prefetch (FSDPOptions::prefetch)."));
  }
  index_whole_parameters();
  return config;
}

void FSDPStrategy::attach_units(Module& module) {
  detach_units();
  // Which shard holds each trainable parameter.
  std::map<const c10::TensorImpl*, std::pair<ShardedParameters*, size_t>> where;
  for (auto& entry : sharded_) {
    const auto& params = entry.second->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      where[params[i].unsafeGetTensorImpl()] = {entry.second.get(), i};
    }
  }
  std::set<const c10::TensorImpl*> taken;
  auto add_unit = [&](const std::shared_ptr<torch::nn::Module>& unit_module) {
    auto unit = std::make_shared<Unit>(*this, full_shard());
    std::map<ShardedParameters*, std::vector<size_t>> members;
    for (const auto& p : unit_module->parameters()) {
      auto it = where.find(p.unsafeGetTensorImpl());
      if (it == where.end() || !taken.insert(it->first).second) continue;
      members[it->second.first].push_back(it->second.second);
    }
    for (auto& [sharded, indices] : members)
      unit->members.emplace_back(sharded, std::move(indices));
    unit->watch_gradients();
    unit->attach_module(unit_module);
    units_.push_back(std::move(unit));
  };
  // Innermost units first: a parameter belongs to the innermost unit
  // around it. The auto-wrapped layers hold no other unit.
  if (options_.auto_wrap_min_params != 0) {
    auto_wrap_ =
        std::make_unique<detail::SequentialAutoWrap>(module, options_.auto_wrap_min_params);
    for (const auto& layer : auto_wrap_->layers()) add_unit(layer.unit);
    if (is_global_zero()) {
      detail::print_note(
          auto_wrap_->layers().empty()
              ? str("strategy \"", name(),
                    "\": auto_wrap_min_params = ", options_.auto_wrap_min_params,
                    " made no unit: no torch::nn::Sequential of the module holds a layer "
                    "(Linear, Conv, Embedding, a norm) with that many parameters. Lower it, "
                    "or declare units with fulgur::nn::FSDPUnit.")
              : str("strategy \"", name(), "\": auto_wrap_min_params = ",
                    options_.auto_wrap_min_params, " made units of ", auto_wrap_->describe(), "."));
    }
  }
  auto named = module.named_modules(/*name_prefix=*/"", /*include_self=*/false);
  for (size_t m = named.size(); m-- > 0;) {
    if (dynamic_cast<nn::FSDPUnitBase*>(named[m].value().get()) != nullptr) {
      add_unit(named[m].value());
    }
  }
  if (units_.empty() && full_shard() && is_global_zero() && options_.auto_wrap_min_params == 0) {
    detail::print_note(
        str("strategy \"", name(),
            "\": the module declares no fulgur::nn::FSDPUnit, so every parameter stays "
            "whole between its uses (only the gradients and the optimizer state are "
            "sharded, as under fsdp_shard_grad_op). Wrap the large layers: "
            "register_module(\"fc1\", fulgur::nn::FSDPUnit(torch::nn::Linear(...))), or "
            "set FSDPOptions::auto_wrap_min_params for the layers of a torch::nn::Sequential."));
  }
  // The units stay whole until their first forward (the module came whole:
  // releasing them now would save nothing, and hooks such as the model
  // summary at fit start see every parameter).
  peak_parameter_bytes_ = 0;
}

void FSDPStrategy::detach_units() {
  // The module may outlive the strategy: its units forget the hooks.
  for (auto& unit : units_) unit->detach_module();
  auto_wrap_.reset();  // the Sequentials' own entries back
  forward_order_.clear();
  last_forward_order_.clear();
  reducing_.clear();
  units_.clear();
}

void FSDPStrategy::gather_units() {
  for (auto& unit : units_) unit->gather();
}

void FSDPStrategy::release_units() {
  for (auto& unit : units_) unit->release();
}

void FSDPStrategy::unit_forward_started(Unit* unit) {
  auto at = std::find(forward_order_.begin(), forward_order_.end(), unit);
  const auto position = static_cast<size_t>(at - forward_order_.begin());
  if (at == forward_order_.end()) forward_order_.push_back(unit);
  // The unit after this one in the last step's forward, when this step has
  // followed it so far (every rank has: their forwards are the same).
  if (!options_.prefetch || position + 1 >= last_forward_order_.size() ||
      last_forward_order_[position] != unit) {
    return;
  }
  last_forward_order_[position + 1]->start_gather();
}

void FSDPStrategy::unit_backward_started(Unit* unit) {
  if (!options_.prefetch) return;
  // Backward meets the units in the reverse of this step's forward.
  auto at = std::find(forward_order_.begin(), forward_order_.end(), unit);
  if (at != forward_order_.end() && at != forward_order_.begin()) (*(at - 1))->start_gather();
}

void FSDPStrategy::finish_reductions() {
  auto reducing = std::move(reducing_);
  reducing_.clear();
  for (auto& exchange : reducing) exchange.wait();
}

void FSDPStrategy::note_held_parameters() {
  int64_t held = 0;
  for (const auto& entry : sharded_) held += entry.second->held_parameter_bytes();
  peak_parameter_bytes_ = std::max(peak_parameter_bytes_, held);
}

void FSDPStrategy::index_whole_parameters() {
  whole_.clear();
  for (const auto& entry : sharded_) {
    std::vector<char> in_unit(entry.second->parameters().size(), 0);
    // Under SHARD_GRAD_OP every parameter stays whole, units' too.
    for (const auto& unit : full_shard() ? units_ : std::vector<std::shared_ptr<Unit>>()) {
      for (const auto& [s, indices] : unit->members) {
        if (s != entry.second.get()) continue;
        for (size_t i : indices) in_unit[i] = 1;
      }
    }
    std::vector<size_t>& whole = whole_[entry.second.get()];
    for (size_t i = 0; i < in_unit.size(); ++i) {
      if (in_unit[i] == 0) whole.push_back(i);
    }
  }
}

ShardedParameters* FSDPStrategy::sharded_for(const torch::optim::Optimizer& optimizer) const {
  for (const auto& [opt, sharded] : sharded_) {
    if (opt == &optimizer) return sharded.get();
  }
  return nullptr;
}

bool FSDPStrategy::reduce_gradients(bool contributes) {
  bool any = false;
  // What the units did not reduce in backward: the parameters outside every
  // unit, and units with a parameter that got no gradient.
  for (auto& entry : sharded_) {
    std::vector<char> reduced(entry.second->parameters().size(), 0);
    for (const auto& unit : units_) {
      if (!unit->reduced()) continue;
      for (const auto& [s, indices] : unit->members) {
        if (s != entry.second.get()) continue;
        for (size_t i : indices) reduced[i] = 1;
      }
    }
    std::vector<size_t> rest;
    for (size_t i = 0; i < reduced.size(); ++i) {
      if (reduced[i] == 0) rest.push_back(i);
    }
    any = entry.second->reduce_scatter_gradients(rest, contributes) || any;
  }
  return any;
}

bool FSDPStrategy::backward_is_collective() const { return !units_.empty() || sync_batchnorm(); }

void FSDPStrategy::agree_on_backward(bool has_loss) {
  // Under FULL_SHARD the backward itself runs collectives (each unit's
  // gather and reduce-scatter), as SyncBatchNorm's does: a rank without a
  // loss cannot join its peers' backward. Every rank learns how many have
  // one, so a mixed step is the same error everywhere instead of a hang.
  at::Tensor count = torch::full({1}, has_loss ? 1 : 0, torch::kLong);
  process_group().all_reduce_(count, ReduceOp::Sum);
  const int64_t with_loss = count.item<int64_t>();
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
  if (backward_is_collective() && sync_) agree_on_backward(true);
  for (auto& unit : units_) unit->start_backward();
  ParallelStrategy::backward(loss, module);
  finish_reductions();
  last_forward_order_ = std::move(forward_order_);
  forward_order_.clear();
  // A unit whose parameters did not all get a gradient is still whole.
  release_units();
  if (sync_) reduce_gradients();
}

bool FSDPStrategy::backward_skipped(Module& /*module*/, bool accumulated) {
  forward_order_.clear();  // no backward: nothing to learn the order from
  if (!sync_) return accumulated;
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
  // (padding holds zeros). As torch::nn::utils::clip_grad_norm_ then does.
  // Summed on the gradients' device, read once (not once per parameter).
  at::Tensor total = torch::zeros({1}, torch::kDouble);
  for (const auto& p : parameters) {
    if (!p.grad().defined()) continue;
    if (total.device() != p.grad().device()) total = total.to(p.grad().device());
    total += p.grad().detach().to(torch::kDouble).pow(2).sum();
  }
  total = total.cpu();
  process_group().all_reduce_(total, ReduceOp::Sum);
  const double norm = std::sqrt(total.item<double>());
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1.0) return;
  torch::NoGradGuard no_grad;
  for (const auto& p : parameters) {
    if (p.grad().defined()) p.grad().mul_(coef);
  }
}

namespace {

// nn::Module::save's layout, with `copies` in place of the parameters they
// name; a submodule without any goes through its own save().
bool holds_any(const torch::nn::Module& module,
               const std::map<const c10::TensorImpl*, at::Tensor>& copies) {
  for (const auto& p : module.parameters()) {
    if (copies.count(p.unsafeGetTensorImpl()) != 0) return true;
  }
  return false;
}

void save_with_copies(const torch::nn::Module& module, torch::serialize::OutputArchive& archive,
                      const std::map<const c10::TensorImpl*, at::Tensor>& copies) {
  if (!holds_any(module, copies)) {
    module.save(archive);
    return;
  }
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    auto it = copies.find(p.value().unsafeGetTensorImpl());
    archive.write(p.key(), it != copies.end() ? it->second : p.value());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    archive.write(b.key(), b.value(), /*is_buffer=*/true);
  }
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;
    torch::serialize::OutputArchive nested(archive.compilation_unit());
    save_with_copies(*child.value(), nested, copies);
    archive.write(child.key(), nested);
  }
}

}  // namespace

void FSDPStrategy::save_module_state(Module& module, torch::serialize::OutputArchive& archive) {
  if (units_.empty() || !full_shard()) {
    ParallelStrategy::save_module_state(module, archive);
    return;
  }
  // The archive keeps the tensors it is given until it is written, and a
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
  save_with_copies(module, archive, copies);
}

void FSDPStrategy::load_module_state(Module& module, torch::serialize::InputArchive& archive) {
  // Every parameter whole to take the checkpoint's values; the shards are
  // then taken from them, and the units stay whole until their next
  // forward (resuming happens at fit start, where they are whole anyway).
  gather_units();
  ParallelStrategy::load_module_state(module, archive);
  for (auto& entry : sharded_) entry.second->take_from_parameters();
}

namespace {

// The optimizer's state of each of `sharded`'s shards, by shard index.
std::vector<torch::optim::OptimizerParamState*> shard_states(torch::optim::Optimizer& optimizer,
                                                             const ShardedParameters& sharded) {
  std::vector<torch::optim::OptimizerParamState*> states;
  for (const auto& shard : sharded.shards()) {
    auto it = optimizer.state().find(compat::optimizer_state_key(shard));
    states.push_back(it == optimizer.state().end() ? nullptr : it->second.get());
  }
  return states;
}

}  // namespace

void FSDPStrategy::write_shard_record(const torch::optim::Optimizer& optimizer,
                                      const ShardedParameters& sharded,
                                      torch::serialize::OutputArchive& archive) const {
  std::map<const c10::TensorImpl*, size_t> index;
  for (size_t i = 0; i < sharded.shards().size(); ++i) {
    index[sharded.shards()[i].unsafeGetTensorImpl()] = i;
  }
  torch::serialize::OutputArchive record(archive.compilation_unit());
  record.write("world_size", c10::IValue(static_cast<int64_t>(world_size())));
  record.write("rank", c10::IValue(static_cast<int64_t>(global_rank())));
  int64_t position = 0;  // over the parameter groups, in order (the optimizer's own)
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (auto it = index.find(p.unsafeGetTensorImpl()); it != index.end()) {
        record.write(str("sizes/", position), c10::IValue(sharded.full_sizes(it->second)));
      }
      ++position;
    }
  }
  record.write("positions", c10::IValue(position));
  archive.write(kShardRecordKey, record);
}

void FSDPStrategy::save_optimizer_state(torch::optim::Optimizer& optimizer,
                                        torch::serialize::OutputArchive& archive) {
  ShardedParameters* sharded = sharded_for(optimizer);
  if (sharded == nullptr) {
    ParallelStrategy::save_optimizer_state(optimizer, archive);
    return;
  }
  if (options_.state_dict_type.value() == StateDictType::kSharded) {
    ParallelStrategy::save_optimizer_state(optimizer, archive);
    write_shard_record(optimizer, *sharded, archive);
    return;
  }
  // Every shard's state whole for the save (the archive keeps the whole
  // tensors), then the shards' own again. Every rank gathers the same
  // tensors in the same order.
  auto states = shard_states(optimizer, *sharded);
  std::vector<std::vector<at::Tensor>> kept(states.size());
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i] == nullptr) continue;
    const bool known = change_state_tensors(*states[i], [&](const at::Tensor& t) {
      kept[i].push_back(t);
      return t.numel() == sharded->chunk(i) ? sharded->gather_whole(i, t) : t;
    });
    if (!known) {
      throw ConfigError(
          str("strategy \"", name(), "\" with state_dict_type=\"full\": the state of ",
              "this optimizer is not one fulgur can gather (torch::optim's Adam, AdamW, "
              "SGD, RMSprop and Adagrad are); use state_dict_type=\"sharded\"."));
    }
  }
  ParallelStrategy::save_optimizer_state(optimizer, archive);
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i] == nullptr) continue;
    size_t k = 0;
    change_state_tensors(*states[i], [&](const at::Tensor&) { return kept[i][k++]; });
  }
}

void FSDPStrategy::load_optimizer_state(torch::optim::Optimizer& optimizer,
                                        torch::serialize::InputArchive& archive) {
  ParallelStrategy::load_optimizer_state(optimizer, archive);
  ShardedParameters* sharded = sharded_for(optimizer);
  if (sharded == nullptr) return;
  // A whole state (of the parameter's shape) becomes this rank's shard of
  // it; a shard's own state (a sharded checkpoint) is already one.
  auto states = shard_states(optimizer, *sharded);
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i] == nullptr) continue;
    const c10::IntArrayRef whole(sharded->full_sizes(i));
    change_state_tensors(*states[i], [&](const at::Tensor& t) {
      return t.sizes() == whole ? sharded->shard_of(i, t) : t;
    });
  }
}

bool FSDPStrategy::full_shard() const {
  return options_.sharding_strategy.value() == ShardingStrategy::kFullShard;
}

bool FSDPStrategy::forward_is_collective() const {
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

FSDPStrategy::Memory FSDPStrategy::memory() const {
  Memory m;
  for (const auto& entry : sharded_) {
    const ShardedParameters& sharded = *entry.second;
    m.parameters += sharded.held_parameter_bytes();
    m.shards += sharded.shard_bytes();
    for (size_t i = 0; i < sharded.parameters().size(); ++i) {
      const at::Tensor& g = sharded.parameters()[i].grad();
      if (g.defined()) m.gradients += static_cast<int64_t>(g.nbytes());
      const at::Tensor& sg = sharded.shards()[i].grad();
      if (sg.defined()) m.gradients += static_cast<int64_t>(sg.nbytes());
    }
    m.optimizer_state += optimizer_state_bytes(*entry.first);
  }
  return m;
}

void FSDPStrategy::register_strategies(StrategyRegistry& registry) {
  struct Variant {
    const char* name;
    const char* description;
    ShardingStrategy sharding;
    StartMethod start_method;
  };
  static constexpr Variant variants[] = {
      {"fsdp",
       "Sharded data parallel, FULL_SHARD (ZeRO 3): the parameters of each declared "
       "fulgur::nn::FSDPUnit sharded between their uses, gradients and optimizer state sharded; "
       "one process per device, launched by re-executing the program",
       ShardingStrategy::kFullShard, StartMethod::kPopen},
      {"fsdp_fork", "Sharded data parallel, FULL_SHARD (ZeRO 3), ranks forked at fit()",
       ShardingStrategy::kFullShard, StartMethod::kFork},
      {"fsdp_shard_grad_op",
       "Sharded data parallel, SHARD_GRAD_OP (ZeRO 2): gradients and optimizer state sharded, "
       "parameters whole; one process per device, launched by re-executing the program",
       ShardingStrategy::kShardGradOp, StartMethod::kPopen},
      {"fsdp_shard_grad_op_fork",
       "Sharded data parallel, SHARD_GRAD_OP (ZeRO 2), ranks forked at fit()",
       ShardingStrategy::kShardGradOp, StartMethod::kFork},
  };
  for (const auto& v : variants) {
    FSDPOptions options;
    options.sharding_strategy = v.sharding;
    options.start_method = v.start_method;
    const std::string name = v.name;
    registry.add(
        name, v.description,
        [options, name] { return std::make_unique<FSDPStrategy>(options, name); },
        str("sharding_strategy=", options.sharding_strategy.text(), ", start_method=",
            options.start_method.text(), describe_parallel_options(options.parallel)));
  }
}

}  // namespace fulgur
