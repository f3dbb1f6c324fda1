// Private: the Trainer's side of a Strategy. The Trainer, its loops and
// connectors and the built-in callbacks drive a strategy's protected protocol
// through this view; a user's code sees only the strategy's public functions
// (components, ranks, collectives). Each function is the strategy's own, as
// documented in fulgur/strategies/strategy.h. Not installed.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fulgur/core/module.h"
#include "fulgur/plugins/io/checkpoint_io.h"
#include "fulgur/strategies/strategy.h"

namespace fulgur::detail {

class StrategyDriver {
 public:
  explicit StrategyDriver(Strategy& strategy) : s_(strategy) {}

  // The connector.
  void set_num_nodes(int num_nodes) { s_.set_num_nodes(num_nodes); }
  void take_trainers_components(std::shared_ptr<Accelerator> accelerator,
                                std::shared_ptr<Precision> precision,
                                std::shared_ptr<CheckpointIO> checkpoint_io,
                                std::shared_ptr<ClusterEnvironment> environment,
                                std::vector<c10::Device> devices) {
    s_.take_trainers_components(std::move(accelerator), std::move(precision),
                                std::move(checkpoint_io), std::move(environment),
                                std::move(devices));
  }
  /// The components the strategy carries of its own (given to it, not
  /// filled in by an earlier Trainer's connector).
  bool carries_accelerator() const { return s_.has_accelerator() && !s_.filled_.accelerator; }
  bool carries_precision() const { return s_.has_precision() && !s_.filled_.precision; }
  bool carries_checkpoint_io() const { return s_.has_checkpoint_io() && !s_.filled_.checkpoint_io; }
  bool carries_cluster_environment() const {
    return s_.has_cluster_environment() && !s_.filled_.cluster_environment;
  }
  const std::vector<c10::Device>& carried_devices() const {
    static const std::vector<c10::Device> none;
    return s_.filled_.parallel_devices ? none : s_.parallel_devices();
  }
  void configure(std::vector<std::string>& notes) { s_.configure(notes); }

  // A stage's lifecycle.
  void setup_environment() { s_.setup_environment(); }
  void setup(Module& module) { s_.setup(module); }
  OptimizerConfig setup_optimizers(Module& module) { return s_.setup_optimizers(module); }
  void teardown(bool completed = true) { s_.teardown(completed); }

  // Steps.
  Batch batch_to_device(const Batch& batch) const { return s_.batch_to_device(batch); }
  std::unique_ptr<PrecisionScope> step_scope() { return s_.step_scope(); }
  at::Tensor training_step(Module& module, Batch& batch, int64_t batch_idx) {
    return s_.training_step(module, batch, batch_idx);
  }
  void backward(const at::Tensor& loss, Module& module) { s_.backward(loss, module); }
  bool steps_without_loss(Module& module, bool accumulated) {
    return s_.steps_without_loss(module, accumulated);
  }
  void unscale_gradients(torch::optim::Optimizer& optimizer) { s_.unscale_gradients(optimizer); }
  void clip_gradients_norm(const std::vector<at::Tensor>& parameters, double max_norm) {
    s_.clip_gradients_norm(parameters, max_norm);
  }
  bool optimizer_step(torch::optim::Optimizer& optimizer, Module& module) {
    return s_.optimizer_step(optimizer, module);
  }
  void set_gradient_sync(bool enabled) { s_.set_gradient_sync(enabled); }
  bool forward_is_collective() const { return s_.forward_is_collective(); }
  bool checkpoint_is_collective() const { return s_.checkpoint_is_collective(); }
  bool peers_arrive(const std::string& key, std::chrono::milliseconds timeout) {
    return s_.peers_arrive(key, timeout);
  }
  void with_full_parameters(Module& module, const std::function<void()>& body) {
    s_.with_full_parameters(module, body);
  }
  void heartbeat(const char* what) { s_.heartbeat(what); }
  /// ProcessGroup::announce_failure, where the group exists; before it
  /// does, announce_failure_before_joining (early_failure.h).
  void announce_failure(const std::string& what);

  // A copy of the weights kept as the optimizers step them (weight averages).
  std::vector<at::Tensor> local_parameters(Module& module) { return s_.local_parameters(module); }
  void assign_local_parameters(Module& module, const std::vector<at::Tensor>& values) {
    s_.assign_local_parameters(module, values);
  }
  std::vector<at::Tensor> whole_from_local(Module& module, const std::vector<at::Tensor>& local) {
    return s_.whole_from_local(module, local);
  }
  std::vector<at::Tensor> local_from_whole(Module& module, const std::vector<at::Tensor>& whole) {
    return s_.local_from_whole(module, whole);
  }
  static void check_parameter_values(
      Module& module, const std::vector<at::Tensor>& values,
      const std::function<std::vector<int64_t>(size_t)>& shape_of) {
    Strategy::check_parameter_values(module, values, shape_of);
  }

  // Stopping.
  bool agree_to_stop(bool requested, bool boundary) {
    return s_.agree_to_stop(requested, boundary);
  }
  void set_stop_vote(bool stop) { s_.set_stop_vote(stop); }

  // Checkpoints.
  bool is_checkpoint_writer() const { return s_.is_checkpoint_writer(); }
  void save_checkpoint(StateDict& checkpoint, const std::string& path) {
    s_.save_checkpoint(checkpoint, path);
  }
  StateDict load_checkpoint(const std::string& path) { return s_.load_checkpoint(path); }
  void remove_checkpoint(const std::string& path) { s_.remove_checkpoint(path); }
  std::string verify_checkpoint(const std::string& path) { return s_.verify_checkpoint(path); }
  FileFingerprint checkpoint_fingerprint(const std::string& path) {
    return s_.checkpoint_fingerprint(path);
  }
  void remove_stale_checkpoint_files(const std::string& dir) {
    s_.remove_stale_checkpoint_files(dir);
  }
  void raise_checkpoint_errors() { s_.raise_checkpoint_errors(); }
  void wait_for_checkpoints() { s_.wait_for_checkpoints(); }
  StateDict module_state(Module& module) { return s_.module_state(module); }
  void load_module_state(Module& module, const StateDict& state) {
    s_.load_module_state(module, state);
  }
  StateDict optimizer_state(torch::optim::Optimizer& optimizer) {
    return s_.optimizer_state(optimizer);
  }
  void load_optimizer_state(torch::optim::Optimizer& optimizer, const StateDict& state) {
    s_.load_optimizer_state(optimizer, state);
  }

 private:
  Strategy& s_;
};

/// The driver of `strategy`: `drive(*strategy).backward(loss, module)`.
inline StrategyDriver drive(Strategy& strategy) { return StrategyDriver(strategy); }

}  // namespace fulgur::detail
