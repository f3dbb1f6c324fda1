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
//   strategy.setup_environment();         // device, process group
//   module.configure_model();
//   strategy.setup(module);               // dtype, placement, wrapping
//   auto batch = strategy.batch_to_device(raw);
//   auto loss = strategy.training_step(module, batch, batch_idx);
//   strategy.backward(loss, module);
//   strategy.optimizer_step(optimizer, module);
//   strategy.teardown();
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
#include "fulgur/data/batch.h"
#include "fulgur/distributed/types.h"
#include "fulgur/plugins/precision/precision.h"

namespace torch::optim {
class Optimizer;
}
namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace fulgur {

class Accelerator;
class CheckpointIO;
class CheckpointLayout;
class ClusterEnvironment;
class Launcher;
class Module;
class ProcessGroup;
struct OptimizerConfig;

class Strategy {
 public:
  Strategy();
  virtual ~Strategy();
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  /// The registered name ("single_device", "ddp").
  virtual std::string_view name() const = 0;

  // ---- Components. Setters share ownership (a plugin instance passed to the
  // Trainer stays valid in the caller); getters throw ConfigError on an
  // empty slot that has no default (the accelerator).
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
  void set_num_nodes(int num_nodes) { num_nodes_ = num_nodes; }
  int num_nodes() const { return num_nodes_; }
  /// Empty when this strategy synchronises BatchNorm statistics across
  /// ranks; otherwise why not ("one process has no peers"), for the
  /// connector's message rejecting sync_batchnorm=true.
  virtual std::string sync_batchnorm_unsupported_reason() const {
    return "a strategy that can says so with an empty sync_batchnorm_unsupported_reason()";
  }
  /// The most processes it runs (1: one device on one node); 0: no limit.
  virtual int max_processes() const { return 0; }
  void set_sync_batchnorm(bool enabled) { sync_batchnorm_ = enabled; }
  bool sync_batchnorm() const { return sync_batchnorm_; }
  /// The launcher that creates this strategy's processes; null when the
  /// current process simply runs (one process, or created externally).
  Launcher* launcher() const { return launcher_.get(); }
  /// Called by the connector once every component is in place; a strategy
  /// that launches processes creates its launcher here.
  virtual void configure_launcher() {}
  /// Called by the connector after configure_launcher(): adds a note (as
  /// `fulgur resolve` and Trainer::describe() show them) for each default
  /// the strategy resolves itself, and throws ConfigError for a choice of
  /// its own that cannot work with the resolved devices.
  virtual void explain_choices(std::vector<std::string>& /*notes*/) const {}

  // ---- Ranks.
  virtual int global_rank() const { return 0; }
  virtual int local_rank() const { return 0; }
  virtual int node_rank() const { return 0; }
  virtual int world_size() const { return 1; }
  bool is_global_zero() const { return global_rank() == 0; }
  /// The device this process computes on.
  virtual c10::Device root_device() const = 0;

  // ---- Lifecycle, called by the Trainer in this order on every rank.
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

  // ---- Steps.
  /// Moves (and for 64-true converts) every tensor of `batch`.
  virtual Batch batch_to_device(const Batch& batch) const;
  /// The precision's scope around a step (autocast); null when none.
  std::unique_ptr<PrecisionScope> step_scope();
  /// Calls the module's training_step (as Lightning's strategy does around
  /// its wrapped model): DDP first broadcasts rank 0's buffers.
  virtual at::Tensor training_step(Module& module, Batch& batch, int64_t batch_idx);
  /// Backward through the precision plugin (and gradient sync when wrapped).
  virtual void backward(const at::Tensor& loss, Module& module);
  /// training_step returned no loss on this rank at a micro-batch that
  /// steps the optimizers; `accumulated`: an earlier micro-batch of the
  /// accumulation window had one. Returns whether the optimizers step. A
  /// strategy that averages gradients joins the ranks that had a loss (so
  /// that their collectives stay paired) and says true when any rank has a
  /// gradient: every replica then takes the same step. Default:
  /// `accumulated` (step with what earlier micro-batches accumulated).
  virtual bool backward_skipped(Module& /*module*/, bool accumulated) { return accumulated; }
  /// Unscales the optimizer's gradients before clipping (16-mixed).
  void unscale_gradients(torch::optim::Optimizer& optimizer);
  /// Scales the gradients of `parameters` so that their 2-norm is at most
  /// `max_norm` (gradient_clip_val with the norm algorithm). Default:
  /// torch::nn::utils::clip_grad_norm_; a strategy whose ranks each hold a
  /// shard of the gradients takes the norm over all of them.
  virtual void clip_gradients_norm(const std::vector<at::Tensor>& parameters, double max_norm);
  /// Steps the optimizer through the precision plugin; false if skipped.
  virtual bool optimizer_step(torch::optim::Optimizer& optimizer, Module& module);
  /// Off for the backward passes of micro-batches that do not step the
  /// optimizer (gradient accumulation): no cross-rank gradient sync.
  virtual void set_gradient_sync(bool /*enabled*/) {}
  /// Whether the module's forward runs collectives (fsdp gathers its
  /// units' parameters there): every rank must then run as many forwards,
  /// so evaluation is sharded evenly, padded as training is.
  virtual bool forward_is_collective() const { return false; }
  /// Whether saving a checkpoint runs collectives, so every rank must save
  /// at the same point: a sharded layout (several ranks), or a strategy
  /// that gathers what it saves.
  virtual bool checkpoint_is_collective() const;
  /// Whether every rank gets here with the same `key` within `timeout`:
  /// bounded, and never a collective (a rank stuck in one elsewhere only
  /// makes it false). One rank: true.
  virtual bool peers_arrive(const std::string& /*key*/, std::chrono::milliseconds /*timeout*/) {
    return true;
  }
  /// Runs `body` with every parameter of the module whole on this rank
  /// (fsdp gathers the sharded ones first and shards them again after).
  /// Every rank calls it at the same point.
  virtual void with_full_parameters(Module& /*module*/, const std::function<void()>& body) {
    body();
  }
  /// Progress report to a supervising launcher (once per training batch),
  /// used to name a rank that hangs. No-op outside one of fulgur's launchers.
  void heartbeat(const char* what);

  /// The group of this strategy's ranks, for collectives of the module's
  /// own (Module::process_group()): null when it runs one process without
  /// one (single_device). A parallel strategy throws DistributedError before
  /// setup_environment() created it.
  virtual std::shared_ptr<ProcessGroup> module_process_group() const { return nullptr; }

  // ---- Collectives. On one process they return their input.
  virtual void barrier(std::string_view name = {}) = 0;
  virtual at::Tensor broadcast(const at::Tensor& tensor, int src = 0) = 0;
  /// Small serialised values (a path, a decision, an archive's bytes).
  virtual std::string broadcast_bytes(const std::string& value, int src = 0) = 0;
  virtual at::Tensor all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::Mean) = 0;
  /// Tensors of every rank stacked on a new dimension 0.
  virtual at::Tensor all_gather(const at::Tensor& tensor) = 0;
  /// `all`: true when every rank decided true; otherwise true when any did.
  /// One all_reduce (none on one rank).
  bool reduce_boolean_decision(bool decision, bool all = true);
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
  /// strategy that exchanges it with that step's collectives (DDP). The
  /// strategy never reads it back from the Trainer. Default: ignored.
  virtual void vote_to_stop(bool /*stop*/) {}

  // ---- Checkpoints, as the checkpoint layout places them (every rank
  // calls each at the same point).
  /// Whether this rank writes checkpoint files (rank 0 by default).
  bool is_checkpoint_writer() const;
  /// This rank's part of the checkpoint at `path` (a no-op on a rank that
  /// writes nothing).
  void save_checkpoint(torch::serialize::OutputArchive& checkpoint, const std::string& path);
  void load_checkpoint(const std::string& path, torch::serialize::InputArchive& checkpoint);
  void remove_checkpoint(const std::string& path);
  /// Empty when the checkpoint at `path`, as this strategy writes them (one
  /// file; a directory of shards under `manual`), is complete and verifies;
  /// otherwise what is wrong with it. Reads only.
  std::string verify_checkpoint(const std::string& path);
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
  /// The module's parameters and buffers into / out of a checkpoint.
  virtual void save_module_state(Module& module, torch::serialize::OutputArchive& archive);
  virtual void load_module_state(Module& module, torch::serialize::InputArchive& archive);
  /// An optimizer's state into / out of a checkpoint. Default: its own
  /// save and load (fsdp with state_dict_type "full" gathers the shards'
  /// state into whole tensors, and takes its shards of them back).
  virtual void save_optimizer_state(torch::optim::Optimizer& optimizer,
                                    torch::serialize::OutputArchive& archive);
  virtual void load_optimizer_state(torch::optim::Optimizer& optimizer,
                                    torch::serialize::InputArchive& archive);

  /// One line per component, for Trainer::describe().
  std::string describe() const;

 protected:
  virtual void do_setup_environment() {}
  /// Default: moves the module to root_device().
  virtual void do_setup(Module& module);
  virtual void do_teardown() {}
  /// In do_teardown: whether the stage completed (teardown's argument).
  bool stage_completed() const { return stage_completed_; }
  void set_launcher(std::unique_ptr<Launcher> launcher);

 private:
  std::shared_ptr<Accelerator> accelerator_;
  std::shared_ptr<Precision> precision_;
  std::shared_ptr<CheckpointIO> checkpoint_io_;
  std::shared_ptr<CheckpointLayout> checkpoint_layout_;
  std::shared_ptr<ClusterEnvironment> cluster_environment_;
  std::unique_ptr<Launcher> launcher_;
  std::vector<c10::Device> parallel_devices_;
  int num_nodes_ = 1;
  bool sync_batchnorm_ = false;
  bool environment_ready_ = false;
  bool torn_down_ = false;
  bool stage_completed_ = true;
};

using StrategyRegistry = Registry<Strategy>;
/// The global strategy registry, with the built-ins registered.
StrategyRegistry& strategy_registry();

}  // namespace fulgur
