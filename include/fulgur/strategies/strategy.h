// File: fulgur/strategies/strategy.h
//
// The Strategy is the hub between the Trainer and the hardware. It owns the
// Accelerator, the Precision plugin, the CheckpointIO and the CheckpointLayout
// (which ranks write which files), the ClusterEnvironment, the parallel
// devices and the Launcher; it knows the ranks, places (and for
// parallel strategies wraps) the module, runs backward and optimizer steps
// through its precision, moves batches to the device, provides collectives,
// and decides which ranks touch checkpoint files. The Trainer reaches every
// device-, rank- and file-related operation through it and never checks its
// concrete type.
//
// Its public functions are what a user may call (trainer.strategy(): the
// components, the ranks, the collectives). The protocol the Trainer drives
// is protected, reached through detail::StrategyDriver, in this order:
//
//   setup_environment();                  // device, process group
//   module.configure_model();
//   setup(module);                        // dtype, placement, wrapping
//   auto batch = batch_to_device(raw);
//   auto loss = training_step(module, batch, batch_idx);
//   backward(loss, module);
//   optimizer_step(optimizer, module);
//   teardown();
//
// A strategy of one's own overrides the protected virtual functions (at
// most 20 in all) and declares what it can run in StrategyTraits.
//
// Missing components are filled lazily with the defaults: 32-true
// precision, TorchCheckpointIO, LightningEnvironment.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fulgur/core/registry.h"
#include "fulgur/core/state_dict.h"
#include "fulgur/data/batch.h"
#include "fulgur/distributed/types.h"
#include "fulgur/plugins/precision/precision.h"

namespace torch::optim {
class Optimizer;
}

namespace fulgur {

class Accelerator;
class CheckpointIO;
class CheckpointLayout;
struct FileFingerprint;
class ClusterEnvironment;
class Launcher;
class Module;
class ProcessGroup;
struct OptimizerConfig;

/// The ranks of this process as its strategy knows them.
struct Ranks {
  int global = 0;
  int local = 0;
  int node = 0;
  int world_size = 1;
};

/// What a strategy can run, declared once by its constructor.
struct StrategyTraits {
  /// The most processes it runs (1: one device on one node, and no process
  /// group); 0: no limit.
  int max_processes = 0;
  /// Empty when it synchronises BatchNorm statistics across ranks;
  /// otherwise why not ("one process has no peers"), for the connector's
  /// message rejecting sync_batchnorm=true.
  std::string sync_batchnorm_unsupported_reason =
      "it does not declare that it can (StrategyTraits::sync_batchnorm_unsupported_reason)";
  /// Whether the module's forward runs collectives (fsdp's FULL_SHARD
  /// gathers its units' parameters there): every rank must then run as
  /// many forwards, so evaluation is sharded evenly, padded as training is.
  bool forward_is_collective = false;
  /// Whether every save gathers what it writes on several ranks (fsdp):
  /// every rank must then save at the same point.
  bool save_gathers = false;
  /// Empty when it follows a change of which parameters are trainable
  /// during a fit (BaseFinetuning makes a frozen backbone trainable
  /// mid-fit); otherwise why not, for the refusal of such a callback.
  std::string trainable_change_unsupported_reason =
      "it does not declare that it can (StrategyTraits::trainable_change_unsupported_reason)";
};

namespace detail {
class StrategyDriver;
}

class Strategy {
 public:
  Strategy();
  virtual ~Strategy();
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  /// The registered name ("single_device", "ddp").
  virtual std::string_view name() const = 0;
  const StrategyTraits& traits() const { return traits_; }

  // ---- Components. Setters share ownership (a plugin instance passed to the
  // Trainer stays valid in the caller); getters throw ConfigError on an
  // empty slot that has no default (the accelerator). The connector fills
  // the slots left empty.
  void set_accelerator(std::shared_ptr<Accelerator> accelerator);
  bool has_accelerator() const { return accelerator_ != nullptr; }
  Accelerator& accelerator() const;
  void set_precision(std::shared_ptr<Precision> precision);
  bool has_precision() const { return precision_ != nullptr; }
  Precision& precision();
  void set_checkpoint_io(std::shared_ptr<CheckpointIO> io);
  bool has_checkpoint_io() const { return checkpoint_io_ != nullptr; }
  CheckpointIO& checkpoint_io();
  /// Default: SingleFileCheckpoint (global rank 0 writes one file).
  void set_checkpoint_layout(std::shared_ptr<CheckpointLayout> layout);
  CheckpointLayout& checkpoint_layout() const { return *checkpoint_layout_; }
  void set_cluster_environment(std::shared_ptr<ClusterEnvironment> env);
  bool has_cluster_environment() const { return cluster_environment_ != nullptr; }
  ClusterEnvironment& cluster_environment();
  const ClusterEnvironment& cluster_environment() const;
  void set_parallel_devices(std::vector<c10::Device> devices);
  const std::vector<c10::Device>& parallel_devices() const { return parallel_devices_; }
  int num_nodes() const { return num_nodes_; }
  void set_sync_batchnorm(bool enabled) { sync_batchnorm_ = enabled; }
  bool sync_batchnorm() const { return sync_batchnorm_; }
  /// The launcher that creates this strategy's processes; null when the
  /// current process simply runs (one process, or created externally).
  Launcher* launcher() const { return launcher_.get(); }

  // ---- Ranks.
  virtual Ranks ranks() const { return {}; }
  int global_rank() const { return ranks().global; }
  int local_rank() const { return ranks().local; }
  int node_rank() const { return ranks().node; }
  int world_size() const { return ranks().world_size; }
  bool is_global_zero() const { return global_rank() == 0; }
  /// The device this process computes on.
  virtual c10::Device root_device() const = 0;

  // ---- Collectives, over process_group(). On a strategy of one process
  // (StrategyTraits::max_processes 1) they return their input; a parallel
  // strategy throws DistributedError before its group exists (it does
  // inside fit/validate/test/predict).
  /// The group of this strategy's ranks (Module::process_group() hands it
  /// to the module): null on a strategy of one process.
  std::shared_ptr<ProcessGroup> shared_process_group() const;
  /// The same group; DistributedError where there is none.
  ProcessGroup& process_group() const;
  /// `name` says at the call site what the ranks wait for.
  void barrier(std::string_view name = {});
  at::Tensor broadcast(const at::Tensor& tensor, int src = 0);
  /// Small serialised values (a path, a decision, an archive's bytes).
  std::string broadcast_bytes(const std::string& value, int src = 0);
  /// Every rank's `value`, by rank, when they are not all the same; empty
  /// when they are. One all-gather of a hash and a length, read back, then
  /// (only where they differ) one all-gather of the bytes: every rank
  /// calls, and every rank gets the same answer.
  std::vector<std::string> values_where_they_differ(const std::string& value);
  at::Tensor all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kMean);
  /// Tensors of every rank stacked on a new dimension 0.
  at::Tensor all_gather(const at::Tensor& tensor);
  /// `all`: true when every rank decided true; otherwise true when any did.
  /// One all_reduce (none on one rank).
  bool reduce_boolean_decision(bool decision, bool all = true);

  /// One line per component, for Trainer::describe().
  std::string describe() const;

 protected:
  // ---- The Trainer's protocol. Subclasses override the virtual ones; the
  // Trainer, its loops, connectors and built-in callbacks call them through
  // detail::StrategyDriver (src/strategies/strategy_driver.h), which lists
  // them in the order a run calls them. They are not for a user's code.
  friend class detail::StrategyDriver;

  /// The strategy's own part of the configuration, called by the connector
  /// once every component is in place: a strategy that launches processes
  /// creates its launcher (set_launcher); it adds a note (as `fulgur
  /// resolve` and Trainer::describe() show them) for each default it
  /// resolves itself, and throws ConfigError for a choice of its own that
  /// cannot work with the resolved devices.
  virtual void configure(std::vector<std::string>& /*notes*/) {}
  void set_num_nodes(int num_nodes) { num_nodes_ = num_nodes; }
  void set_launcher(std::unique_ptr<Launcher> launcher);
  void set_traits(StrategyTraits traits) { traits_ = std::move(traits); }
  /// The group a parallel strategy's collectives run over.
  void set_group(std::shared_ptr<ProcessGroup> group) { group_ = std::move(group); }
  bool has_group() const { return group_ != nullptr; }

  /// Prepares the device and (parallel strategies) the process group.
  void setup_environment();
  /// Converts (precision), places and wraps the module.
  void setup(Module& module);
  /// Calls the module's configure_optimizers and checks the result.
  virtual OptimizerConfig setup_optimizers(Module& module);
  /// Releases what setup_environment/setup acquired. Safe to call twice.
  /// `completed`: false after a failed stage, when the peers may be gone:
  /// the strategy then runs no collective (fsdp leaves the parameters
  /// sharded instead of gathering them back).
  void teardown(bool completed = true);
  virtual void do_setup_environment() {}
  /// Default: moves the module to root_device().
  virtual void do_setup(Module& module);
  virtual void do_teardown() {}
  /// In do_teardown: whether the stage completed (teardown's argument).
  bool stage_completed() const { return stage_completed_; }

  // Steps.
  /// Moves (and for 64-true converts) every tensor of `batch`.
  virtual Batch batch_to_device(const Batch& batch) const;
  /// The precision's scope around a step (autocast); null when none.
  std::unique_ptr<PrecisionScope> step_scope();
  /// Calls the module's training_step (as Lightning's strategy does around
  /// its wrapped model): DDP first broadcasts rank 0's buffers.
  virtual at::Tensor training_step(Module& module, Batch& batch, int64_t batch_idx);
  /// Backward through the precision plugin (and gradient sync when wrapped).
  virtual void backward(const at::Tensor& loss, Module& module);
  /// Whether the optimizers step at a micro-batch where training_step
  /// returned no loss on this rank; `accumulated`: an earlier micro-batch
  /// of the accumulation window had one. A strategy that averages
  /// gradients joins the ranks that had a loss (so that their collectives
  /// stay paired) and says true when any rank has a gradient: every replica
  /// then takes the same step. Default: `accumulated` (step with what
  /// earlier micro-batches accumulated).
  virtual bool steps_without_loss(Module& /*module*/, bool accumulated) { return accumulated; }
  /// Unscales the optimizer's gradients before clipping (16-mixed).
  void unscale_gradients(torch::optim::Optimizer& optimizer);
  /// Scales the gradients of `parameters` so that their 2-norm is at most
  /// `max_norm` (gradient_clip_val with the norm algorithm). Default:
  /// torch::nn::utils::clip_grad_norm_'s arithmetic on the gradients'
  /// device, without its read-back of the norm (no host synchronisation);
  /// a strategy whose ranks each hold a shard of the gradients takes the
  /// norm over all of them.
  virtual void clip_gradients_norm(const std::vector<at::Tensor>& parameters, double max_norm);
  /// Steps the optimizer through the precision plugin; false if the host
  /// skipped it (Precision::optimizer_step).
  virtual bool optimizer_step(torch::optim::Optimizer& optimizer, Module& module);
  /// Off for the backward passes of micro-batches that do not step the
  /// optimizer (gradient accumulation): a strategy that syncs gradients
  /// reads gradient_sync() and skips the cross-rank sync.
  void set_gradient_sync(bool enabled) { gradient_sync_ = enabled; }
  bool gradient_sync() const { return gradient_sync_; }
  /// StrategyTraits::forward_is_collective.
  bool forward_is_collective() const { return traits_.forward_is_collective; }
  /// Whether saving a checkpoint runs collectives, so every rank must save
  /// at the same point: a sharded layout or a strategy whose saves gather
  /// (StrategyTraits::save_gathers), on several ranks.
  bool checkpoint_is_collective() const;
  /// Whether every rank gets here with the same `key` within `timeout`:
  /// bounded, and never a collective (a rank stuck in one elsewhere only
  /// makes it false). One rank: true.
  bool peers_arrive(const std::string& key, std::chrono::milliseconds timeout);
  /// Runs `body` with every parameter of the module whole on this rank
  /// (fsdp gathers the sharded ones first and shards them again after).
  /// Every rank calls it at the same point.
  virtual void with_full_parameters(Module& /*module*/, const std::function<void()>& body) {
    body();
  }
  /// Progress report to a supervising launcher (once per training batch),
  /// used to name a rank that hangs. No-op outside one of fulgur's launchers.
  void heartbeat(const char* what);

  // Stopping.
  /// Whether any rank asked to stop (Trainer::request_stop). Every rank
  /// calls it at the same points of the fit loop: after each training batch
  /// and, with `boundary`, before each epoch and after a validation. At a
  /// boundary the answer covers every request made so far; after a plain
  /// batch a strategy may answer from votes it already exchanged in that
  /// batch (DDP's ride in the gradient all-reduce), so a request made after
  /// the batch's backward is agreed at the next one. Default: a
  /// reduce_boolean_decision (any rank) when there are several ranks.
  virtual bool agree_to_stop(bool requested, bool boundary);
  /// This rank's stop request as the fit loop hands it down before each
  /// backward (automatic or manual) and each step without one, for a
  /// strategy that exchanges it with that step's collectives (DDP reads
  /// stop_vote()). The strategy never reads it back from the Trainer.
  void set_stop_vote(bool stop) { stop_vote_ = stop; }
  bool stop_vote() const { return stop_vote_; }

  // Checkpoints, as the checkpoint layout places them (every rank calls
  // each at the same point).
  /// Whether this rank writes checkpoint files (rank 0 by default).
  bool is_checkpoint_writer() const;
  /// This rank's part of the checkpoint at `path` (a no-op on a rank that
  /// writes nothing).
  void save_checkpoint(StateDict& checkpoint, const std::string& path);
  StateDict load_checkpoint(const std::string& path);
  void remove_checkpoint(const std::string& path);
  /// Empty when the checkpoint at `path`, as this strategy writes them (one
  /// file; a directory of shards under `manual`), is complete and verifies;
  /// otherwise what is wrong with it. Reads only.
  std::string verify_checkpoint(const std::string& path);
  /// The layout's fingerprint of the checkpoint at `path` (what tells it
  /// from another save's); CheckpointError when it cannot be read. Reads only.
  FileFingerprint checkpoint_fingerprint(const std::string& path);
  /// Removes what interrupted saves left in the checkpoint directory `dir`
  /// (never a live writer's file); on the ranks that write checkpoints.
  void remove_stale_checkpoint_files(const std::string& dir);
  /// Throws the error of a checkpoint that failed to write in the
  /// background (an asynchronous checkpoint IO); never blocks. The fit loop
  /// calls it at every step boundary.
  void raise_checkpoint_errors();
  /// Returns once every checkpoint handed to the checkpoint IO is durable;
  /// throws the error of one that failed. Fit calls it before returning.
  void wait_for_checkpoints();
  /// The module's parameters and buffers for a checkpoint, and back.
  /// Default: module_state_dict / load_module_state_dict (fulgur/nn/state_dict.h).
  virtual StateDict module_state(Module& module);
  virtual void load_module_state(Module& module, const StateDict& state);
  /// An optimizer's state for a checkpoint, and back. Default:
  /// optimizer_state_dict / load_optimizer_state_dict
  /// (fulgur/optim/state_dict.h); fsdp with state_dict_type "full" gathers
  /// the shards' state into whole tensors, and takes its shards back.
  virtual StateDict optimizer_state(torch::optim::Optimizer& optimizer);
  virtual void load_optimizer_state(torch::optim::Optimizer& optimizer, const StateDict& state);
  /// This rank's part of each parameter of `module` (in parameters()
  /// order), as its optimizers step it: a copy of the weights kept in this
  /// form and updated element by element (EMA's and SWA's averages) costs
  /// 1/N of the model per rank under a strategy that shards, and an update
  /// reads no peer. Default: the parameters; fsdp: the 1-D shard of each
  /// parameter an optimizer steps (the last ranks' padded with zeros), the
  /// others (frozen) whole. The same tensor objects for the whole stage.
  virtual std::vector<at::Tensor> local_parameters(Module& module);
  /// Sets each of those parts to values[i] (of local_parameters' shapes)
  /// and makes the module's parameters agree. Under fsdp a collective
  /// (every rank calls it at the same point): the parameters are gathered
  /// again as after an optimizer step.
  virtual void assign_local_parameters(Module& module, const std::vector<at::Tensor>& values);
  /// Whole values (of the parameters' shapes) from every rank's parts of
  /// them. Default: the values themselves; fsdp: one all-gather per
  /// sharded parameter, a collective.
  virtual std::vector<at::Tensor> whole_from_local(Module& module,
                                                   const std::vector<at::Tensor>& local);
  /// This rank's parts of whole values, on each parameter's device and of
  /// its dtype (no collective). ConfigError naming the parameter whose value
  /// has another shape, or when the count differs from the parameters'.
  virtual std::vector<at::Tensor> local_from_whole(Module& module,
                                                   const std::vector<at::Tensor>& whole);
  /// ConfigError unless `values` holds one tensor per parameter of
  /// `module`, value i of shape `shape_of(i)` (the checks of
  /// assign_local_parameters and local_from_whole).
  static void check_parameter_values(
      Module& module, const std::vector<at::Tensor>& values,
      const std::function<std::vector<int64_t>(size_t)>& shape_of);

 private:
  std::shared_ptr<Accelerator> accelerator_;
  std::shared_ptr<Precision> precision_;
  std::shared_ptr<CheckpointIO> checkpoint_io_;
  std::shared_ptr<CheckpointLayout> checkpoint_layout_;
  std::shared_ptr<ClusterEnvironment> cluster_environment_;
  std::unique_ptr<Launcher> launcher_;
  std::shared_ptr<ProcessGroup> group_;
  std::vector<c10::Device> parallel_devices_;
  StrategyTraits traits_;
  int num_nodes_ = 1;
  bool sync_batchnorm_ = false;
  bool environment_ready_ = false;
  bool torn_down_ = false;
  bool stage_completed_ = true;
  bool gradient_sync_ = true;
  bool stop_vote_ = false;
  // The components a Trainer filled in (the instance's slot was empty, or
  // a getter made its default): the next Trainer given this instance fills
  // them from its own flags (take_trainers_components), where they carried
  // over as the instance's own.
  struct Filled {
    bool accelerator = false, precision = false, checkpoint_io = false, cluster_environment = false,
         parallel_devices = false;
  } filled_;

  /// The connector's (through StrategyDriver): what an earlier Trainer
  /// filled in gives way, and the empty slots take this Trainer's
  /// components, remembered as filled in.
  void take_trainers_components(std::shared_ptr<Accelerator> accelerator,
                                std::shared_ptr<Precision> precision,
                                std::shared_ptr<CheckpointIO> checkpoint_io,
                                std::shared_ptr<ClusterEnvironment> environment,
                                std::vector<c10::Device> devices);

  /// A strategy of one process without a group: collectives return their input.
  bool runs_alone() const { return group_ == nullptr && traits_.max_processes == 1; }
};

using StrategyRegistry = Registry<Strategy>;
/// The global strategy registry, with the built-ins registered.
StrategyRegistry& strategy_registry();

}  // namespace fulgur
