// File: fulgur/strategies/fsdp.h
//
// Sharded data parallel: each rank keeps a shard of the gradients and of
// the optimizer state (and, under FULL_SHARD, of the parameters between
// their uses), as PyTorch's FSDP and DeepSpeed's ZeRO do. Per rank, with
// Adam in fp32 (16 bytes per parameter Ψ under DDP) and N ranks:
//
//   strategy              sharding (ZeRO stage)   model state per rank
//   "fsdp"                FULL_SHARD (3)          16Ψ/N + one unit's full parameters
//   "fsdp_shard_grad_op"  SHARD_GRAD_OP (2)       4Ψ + 12Ψ/N
//
//   fulgur::Trainer trainer({.strategy = "fsdp", .devices = 2});
//
// SHARD_GRAD_OP: every rank holds the whole model for its forward and
// backward, as under DDP; the gradients are reduce-scattered so that each
// rank keeps its shard of their mean, the optimizer keeps state for that
// shard only and steps it, and the parameters are all-gathered after the
// step. FULL_SHARD does the same for the parameters outside every unit,
// and shards the parameters of each fulgur::nn::FSDPUnit the module
// declares (fulgur/nn/fsdp_unit.h), and of each large layer of a
// torch::nn::Sequential with FSDPOptions::auto_wrap_min_params, between
// their uses: gathered before the
// unit's forward and freed after it, gathered again before its backward,
// and freed once its gradients are reduce-scattered, in backward, as each
// unit's gradients complete. Shards are per parameter (ShardedParameters),
// so each keeps its own optimizer options and state, and DDP's rule for a
// parameter without a gradient holds.
//
// The same launchers, cluster environments and process groups as DDP;
// gradient accumulation, manual optimization, precision plugins (not
// 16-mixed's loss scaler) and gradient clipping (the norm over every
// shard) work as under DDP. Checkpoints are sharded (ShardedCheckpoint):
// each rank writes the model (gathered) and its optimizer shard, and
// resuming needs the same world size; with state_dict_type = "full", rank 0
// writes one file a single process could have written.
//
// Under FULL_SHARD every rank must run the same forwards and backwards (the
// gathers are collectives): a step the optimizers take where training_step
// returned no loss on some ranks only is the same error on every rank, and
// validation is split evenly (padded).
//
// `fulgur checkpoint consolidate DIR OUT` turns a sharded checkpoint into
// the full one (consolidate_sharded_checkpoint below).
//
// sync_batchnorm connects fulgur::nn::SyncBatchNorm layers as under DDP.
//
// With FSDPOptions::prefetch, each unit's reduce-scatter overlaps the rest
// of backward (both strategies; every rank then runs every backward) and,
// under FULL_SHARD, the next unit's gather is prefetched.
//
// Under Gloo the exchanges are rings of sends and receives between the
// tensors themselves (ProcessGroup::all_gather_into, reduce_scatter_sum_).
//
// Not yet: building the model sharded (every rank builds it whole first),
// CPU offload.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fulgur/strategies/parallel.h"

namespace fulgur {

class ShardedParameters;
class ShardedExchange;
namespace detail {
class SequentialAutoWrap;
}

/// Bytes of the tensors in an optimizer's state: those of torch::optim's
/// Adam, AdamW, SGD, RMSprop, Adagrad and LBFGS (another optimizer's state
/// is not counted).
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

/// PyTorch FSDP's names: FULL_SHARD shards the parameters of the declared
/// units between their uses too; SHARD_GRAD_OP keeps parameters whole.
enum class ShardingStrategy { kFullShard, kShardGradOp };
template <>
struct ChoiceNames<ShardingStrategy> {
  static constexpr std::pair<ShardingStrategy, const char*> kNames[] = {
      {ShardingStrategy::kFullShard, "FULL_SHARD"},
      {ShardingStrategy::kShardGradOp, "SHARD_GRAD_OP"}};
};

/// How checkpoints hold the sharded state: "sharded" (each rank writes its
/// shard; resuming needs the same world size) or "full" (rank 0 writes one
/// file with every optimizer state gathered whole, as a single process
/// would: it loads into single_device, ddp or fsdp on any world size).
enum class StateDictType { kSharded, kFull };
template <>
struct ChoiceNames<StateDictType> {
  static constexpr std::pair<StateDictType, const char*> kNames[] = {
      {StateDictType::kSharded, "sharded"}, {StateDictType::kFull, "full"}};
};

struct FSDPOptions {
  Choice<ShardingStrategy> sharding_strategy = ShardingStrategy::kFullShard;
  Choice<StateDictType> state_dict_type = StateDictType::kSharded;
  /// Reduce-scatter each declared unit's gradients while the rest of
  /// backward runs (both sharding strategies; every rank then runs every
  /// backward), and under FULL_SHARD also gather the next unit's parameters
  /// while the current unit computes (the next in the last step's forward
  /// order; in backward, the one before it). Up to two units' full
  /// parameters (and gradients) are held at once instead of one: faster
  /// (1.03-1.07x for FULL_SHARD in bench/RESULTS.md), but the largest model that
  /// fits is smaller (0.77x there, where each unit is a third of the
  /// model), so it is off unless asked for. PyTorch FSDP's backward_prefetch
  /// and forward_prefetch together.
  bool prefetch = false;
  /// Size-based auto-wrap (0: off): every layer held in a torch::nn::Sequential
  /// (at any depth, inside declared units too) with at least this many
  /// parameters becomes a unit, as if declared with fulgur::nn::FSDPUnit;
  /// names and checkpoints do not change. Layers whose forward takes and
  /// returns one tensor: Linear, Conv1d/2d/3d, Embedding, BatchNorm/
  /// InstanceNorm 1d/2d/3d, LayerNorm, GroupNorm. During fit the
  /// Sequential's ptr(i) / at<T>(i) give the unit around the layer (its
  /// held_module() is the layer). A layer held as a typed member
  /// (`torch::nn::Linear fc1;`) is called by its parent's forward directly,
  /// which LibTorch gives no hook into: declare it as a unit. PyTorch FSDP's
  /// size_based_auto_wrap_policy(min_num_params). Units matter under
  /// FULL_SHARD, and under SHARD_GRAD_OP with prefetch only.
  int64_t auto_wrap_min_params = 0;
  /// "popen" (re-execute the program per rank) or "fork", as for DDP.
  Choice<StartMethod> start_method = StartMethod::kPopen;
  /// The process group's timeout and backend, and the launcher's stop grace.
  ParallelOptions parallel;
};

class FSDPStrategy : public ParallelStrategy {
 public:
  explicit FSDPStrategy(FSDPOptions options = {}, std::string name = "fsdp");
  ~FSDPStrategy() override;

  std::string_view name() const override { return name_; }
  const FSDPOptions& options() const { return options_; }

  /// Bytes this rank holds now for the model state the strategy manages:
  /// full parameters (gathered or never sharded), shards, gradients (full
  /// and sharded) and the optimizers' state.
  struct Memory {
    int64_t parameters = 0;
    int64_t shards = 0;
    int64_t gradients = 0;
    int64_t optimizer_state = 0;
    int64_t total() const { return parameters + shards + gradients + optimizer_state; }
  };
  Memory memory() const;
  /// The most full-parameter bytes held at once when a unit was gathered
  /// since setup (the module comes whole; each unit is released after its
  /// first forward).
  int64_t peak_parameter_bytes() const { return peak_parameter_bytes_; }
  /// How many times a unit's full parameters were gathered since setup
  /// (FULL_SHARD): in each step, once before each unit's forward and once
  /// before its backward (also inside a fulgur::nn::Checkpoint, whose second
  /// run and backward share one gather); a prefetch counts as one, and
  /// saves, evaluation and the end of fit add theirs.
  int64_t unit_gathers() const { return unit_gathers_; }

  static void register_strategies(StrategyRegistry& registry);

  /// In a sharded save, each optimizer's state also holds this: the
  /// world size, the rank, and the whole shape of each position's
  /// parameter (`fulgur checkpoint consolidate` reads it).
  static constexpr const char* kShardRecordKey = "fulgur_fsdp_shards";

 protected:
  void do_setup(Module& module) override;
  void do_teardown() override;
  /// The module's optimizers, each rebuilt on the shards of the parameters
  /// it steps (ConfigError for a parameter two optimizers step, or an
  /// optimizer that already has state).
  OptimizerConfig setup_optimizers(Module& module) override;
  /// Backward; at the last micro-batch of a step, the reduce-scatter.
  void backward(const at::Tensor& loss, Module& module) override;
  /// Joins the peers' reduce-scatter with this rank's accumulated gradient
  /// (or none); the optimizers step when any rank has one.
  bool steps_without_loss(Module& module, bool accumulated) override;
  /// The step on the shards, then the all-gather of the parameters.
  bool optimizer_step(torch::optim::Optimizer& optimizer, Module& module) override;
  /// After a batch: from the stop votes that rode in its agreements (the
  /// ranks' losses before a collective backward, which parameters have
  /// gradients before the reduce-scatters), as DDP's ride in its gradient
  /// all-reduce; no collective of its own.
  bool agree_to_stop(bool requested, bool boundary) override;
  /// The norm over the shards of every rank (one all-reduce).
  void clip_gradients_norm(const std::vector<at::Tensor>& parameters, double max_norm) override;
  /// The module's state, its units' parameters gathered (one unit at a
  /// time, copied).
  StateDict module_state(Module& module) override;
  /// The module's state, then every shard taken from it again.
  void load_module_state(Module& module, const StateDict& state) override;
  /// state_dict_type "full": the state of every shard gathered into whole
  /// tensors of its parameter's shape (torch::optim's Adam, AdamW, SGD,
  /// RMSprop and Adagrad); "sharded": the shards' own.
  StateDict optimizer_state(torch::optim::Optimizer& optimizer) override;
  /// Takes this rank's shard of a whole state (a "full" checkpoint, or one
  /// written by single_device or ddp); a shard's state loads as it is.
  void load_optimizer_state(torch::optim::Optimizer& optimizer, const StateDict& state) override;
  void with_full_parameters(Module& module, const std::function<void()>& body) override;
  /// The shards of the parameters an optimizer steps (frozen ones whole).
  std::vector<at::Tensor> local_parameters(Module& module) override;
  /// Into the shards, then the parameters gathered again as after an
  /// optimizer step (FULL_SHARD's units at their next forward).
  void assign_local_parameters(Module& module, const std::vector<at::Tensor>& values) override;
  std::vector<at::Tensor> whole_from_local(Module& module,
                                           const std::vector<at::Tensor>& local) override;
  std::vector<at::Tensor> local_from_whole(Module& module,
                                           const std::vector<at::Tensor>& whole) override;

 private:
  class Unit;
  friend class Unit;

  ShardedParameters* sharded_for(const torch::optim::Optimizer& optimizer) const;
  /// kShardRecordKey's record of `optimizer`'s shards, into its state.
  void write_shard_record(const torch::optim::Optimizer& optimizer,
                          const ShardedParameters& sharded, StateDict& state) const;
  /// The reduce-scatter of what the units did not reduce in backward:
  /// one all-reduce agrees for every optimizer's shards which parameters
  /// have a gradient on some rank, how many ranks contribute, and the stop
  /// votes; then the reduce-scatters.
  bool reduce_gradients(bool contributes = true);
  /// The ranks' stop votes rode in a collective: `sum` of them.
  void votes_exchanged(int64_t sum);
  bool full_shard() const;
  /// Whether a backward runs collectives (FULL_SHARD's units,
  /// SyncBatchNorm): then every rank runs it, or none.
  bool backward_is_collective() const;
  void agree_on_backward(bool has_loss);
  void attach_units(Module& module);
  void detach_units();
  void gather_units();
  void release_units();
  void note_held_parameters();
  /// Prefetch (FSDPOptions::prefetch): a unit's forward or backward starts.
  void unit_forward_started(Unit* unit);
  void unit_backward_started(Unit* unit);
  /// Waits for the units' reduce-scatters under way.
  void finish_reductions();
  /// Fills whole_ (after the units are attached).
  void index_whole_parameters();
  /// For each parameter of `module` (parameters() order), the
  /// ShardedParameters holding it and its index there; null for one no
  /// optimizer steps (whole on every rank).
  std::vector<std::pair<ShardedParameters*, size_t>> locate_parameters(Module& module) const;

  FSDPOptions options_;
  std::string name_;
  std::vector<std::pair<const torch::optim::Optimizer*, std::unique_ptr<ShardedParameters>>>
      sharded_;
  std::vector<std::shared_ptr<Unit>> units_;
  // The Sequential entries auto_wrap_min_params made units (put back at
  // detach_units).
  std::unique_ptr<detail::SequentialAutoWrap> auto_wrap_;
  // The units in the order this step's forward met them, and the last
  // step's (what prefetch follows).
  std::vector<Unit*> forward_order_, last_forward_order_;
  std::vector<ShardedExchange> reducing_;
  // The indices of each ShardedParameters that no unit holds: whole
  // between steps, all-gathered after each.
  std::map<const ShardedParameters*, std::vector<size_t>> whole_;
  int64_t peak_parameter_bytes_ = 0;
  int64_t unit_gathers_ = 0;
  // The collectives that carried the stop votes since setup, and whether
  // the last one's said stop.
  int64_t vote_exchanges_ = 0;
  bool votes_say_stop_ = false;
};

/// `fulgur checkpoint consolidate DIR OUT`: the sharded checkpoint `dir`
/// (strategy fsdp, state_dict_type "sharded") as one file at `out`, the
/// file state_dict_type "full" writes at the same step: it loads into
/// single_device, ddp or fsdp on any world size. The module state, loops,
/// RNG and callbacks are rank 0's; each optimizer state tensor is the
/// ranks' shards made whole. Every shard is verified as it is read; `out`
/// is written as any checkpoint is (checksum, atomic rename). Needs the
/// memory of the whole optimizer state. CheckpointError naming the file and
/// what is wrong: not an fsdp sharded checkpoint, a missing, corrupt or
/// mismatched shard, `out` already there.
void consolidate_sharded_checkpoint(const std::string& dir, const std::string& out);

}  // namespace fulgur
