#include "fulgur/strategies/strategy.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <iostream>
#include <set>

#include "fulgur/accelerators/accelerator.h"
#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/distributed/launchers/launcher.h"
#include "fulgur/distributed/process_group.h"
#include "fulgur/nn/state_dict.h"
#include "fulgur/optim/lr_scheduler.h"
#include "fulgur/optim/state_dict.h"
#include "fulgur/plugins/environments/lightning.h"
#include "fulgur/plugins/io/torch_checkpoint_io.h"
#include "fulgur/plugins/precision/precision.h"
#include "fulgur/strategies/checkpoint_layout.h"
#include "distributed/launchers/heartbeat.h"
#include "strategies/clip_grad.h"
#include "strategies/early_failure.h"
#include "strategies/strategy_driver.h"

namespace fulgur {

Strategy::Strategy() : checkpoint_layout_(std::make_shared<SingleFileCheckpoint>()) {}
Strategy::~Strategy() = default;

void Strategy::set_accelerator(std::shared_ptr<Accelerator> accelerator) {
  accelerator_ = std::move(accelerator);
  filled_.accelerator = false;
}

Accelerator& Strategy::accelerator() const {
  if (!accelerator_) {
    throw ConfigError(str("strategy \"", name(),
                          "\" has no accelerator. Build it through the "
                          "Trainer, or call set_accelerator() first."));
  }
  return *accelerator_;
}

void Strategy::set_precision(std::shared_ptr<Precision> precision) {
  precision_ = std::move(precision);
  filled_.precision = false;
}

Precision& Strategy::precision() {
  if (!precision_) {
    precision_ = std::make_shared<Precision>();
    filled_.precision = true;
  }
  return *precision_;
}

void Strategy::set_checkpoint_io(std::shared_ptr<CheckpointIO> io) {
  checkpoint_io_ = std::move(io);
  filled_.checkpoint_io = false;
}

void Strategy::set_checkpoint_layout(std::shared_ptr<CheckpointLayout> layout) {
  if (!layout) {
    throw ConfigError(str("strategy \"", name(),
                          "\".set_checkpoint_layout(nullptr): pass a layout "
                          "(SingleFileCheckpoint, ShardedCheckpoint)."));
  }
  checkpoint_layout_ = std::move(layout);
}

CheckpointIO& Strategy::checkpoint_io() {
  if (!checkpoint_io_) {
    checkpoint_io_ = std::make_shared<TorchCheckpointIO>();
    filled_.checkpoint_io = true;
  }
  return *checkpoint_io_;
}

void Strategy::set_cluster_environment(std::shared_ptr<ClusterEnvironment> env) {
  cluster_environment_ = std::move(env);
  filled_.cluster_environment = false;
}

ClusterEnvironment& Strategy::cluster_environment() {
  if (!cluster_environment_) {
    cluster_environment_ = std::make_shared<LightningEnvironment>();
    filled_.cluster_environment = true;
  }
  return *cluster_environment_;
}

const ClusterEnvironment& Strategy::cluster_environment() const {
  return const_cast<Strategy*>(this)->cluster_environment();
}

void Strategy::set_parallel_devices(std::vector<c10::Device> devices) {
  parallel_devices_ = std::move(devices);
  filled_.parallel_devices = false;
}

void Strategy::take_trainers_components(std::shared_ptr<Accelerator> accelerator,
                                        std::shared_ptr<Precision> precision,
                                        std::shared_ptr<CheckpointIO> checkpoint_io,
                                        std::shared_ptr<ClusterEnvironment> environment,
                                        std::vector<c10::Device> devices) {
  if (filled_.accelerator) accelerator_.reset();
  if (filled_.precision) precision_.reset();
  if (filled_.checkpoint_io) checkpoint_io_.reset();
  if (filled_.cluster_environment) cluster_environment_.reset();
  if (filled_.parallel_devices) parallel_devices_.clear();
  filled_ = Filled{};
  if (!accelerator_) {
    accelerator_ = std::move(accelerator);
    filled_.accelerator = true;
  }
  if (!precision_) {
    precision_ = std::move(precision);
    filled_.precision = true;
  }
  // A plugin's (the connector names one beside the instance's own).
  if (checkpoint_io) {
    checkpoint_io_ = std::move(checkpoint_io);
    filled_.checkpoint_io = true;
  }
  if (!cluster_environment_) {
    cluster_environment_ = std::move(environment);
    filled_.cluster_environment = true;
  }
  if (parallel_devices_.empty()) {
    parallel_devices_ = std::move(devices);
    filled_.parallel_devices = true;
  }
}

void Strategy::set_launcher(std::unique_ptr<Launcher> launcher) { launcher_ = std::move(launcher); }

void Strategy::setup_environment() {
  if (has_accelerator()) accelerator().setup_device(root_device());
  do_setup_environment();
  environment_ready_ = true;
  torn_down_ = false;
  stage_completed_ = true;
}

void Strategy::setup(Module& module) {
  if (!environment_ready_) {
    throw InternalError(str("bug in fulgur: strategy \"", name(),
                            "\".setup(module) called before setup_environment()."));
  }
  precision().convert_module(module);
  do_setup(module);
}

void Strategy::do_setup(Module& module) { module.to(root_device()); }

bool Strategy::agree_to_stop(bool requested, bool /*boundary*/) {
  return world_size() > 1 ? reduce_boolean_decision(requested, /*all=*/false) : requested;
}

namespace {

// A note for each schedule that sets its optimizer's rates outright
// (LambdaLR, OneCycleLR, ...) beside another schedule of the same
// optimizer, whose changes it undoes at its next step.
void note_schedules_set_outright(const Module& module, const OptimizerConfig& config) {
  // Which optimizer a schedule moves: fulgur's say; LibTorch's own do not,
  // but with one optimizer it is that one.
  const auto optimizer_of = [&](const torch::optim::LRScheduler& s) -> const void* {
    if (const auto* ours = dynamic_cast<const Scheduler*>(&s)) return &ours->optimizer();
    return config.optimizers.size() == 1 ? config.optimizers.front().get() : nullptr;
  };
  const auto& all = config.schedulers;
  for (size_t i = 0; i < all.size(); ++i) {
    const auto* outright = dynamic_cast<const ClosedFormLR*>(all[i].scheduler.get());
    if (outright == nullptr || !outright->sets_rates_outright()) continue;
    const void* optimizer = optimizer_of(*outright);
    for (size_t j = 0; j < all.size(); ++j) {
      if (j == i || optimizer_of(*all[j].scheduler) != optimizer) continue;
      const torch::optim::LRScheduler& other = *all[j].scheduler;
      detail::print_note(str(
          module.name(), ".configure_optimizers(): scheduler ", i, " (",
          c10::demangle(typeid(*outright).name()),
          ") sets its optimizer's learning rates outright at its steps (from the initial rates), "
          "so what scheduler ",
          j, " (", c10::demangle(typeid(other).name()),
          ") does to the same optimizer lasts only until ", i,
          "'s next step, as in PyTorch. Chain them instead (a chained schedule scales the rate it "
          "finds: StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR, LinearLR, ConstantLR, "
          "PolynomialLR, ReduceLROnPlateau), run them in turn with SequentialLR, or give each "
          "optimizer one schedule."));
      break;
    }
  }
}

}  // namespace

OptimizerConfig Strategy::setup_optimizers(Module& module) {
  OptimizerConfig config = module.configure_optimizers();
  if (config.optimizers.empty() && module.automatic_optimization()) {
    throw ConfigError(str(module.name(),
                          ".configure_optimizers() returned no optimizer. Return "
                          "at least one, or call set_automatic_optimization(false) to step "
                          "yourself."));
  }
  // An optimizer of no parameters steps nothing (PyTorch refuses one), and
  // a tensor that is not one of the module's parameters trains, but no
  // checkpoint saves it (a resume starts it over) and no rank averages its
  // gradient with the others'.
  std::set<const c10::TensorImpl*> own;
  for (const auto& p : module.parameters()) own.insert(p.unsafeGetTensorImpl());
  for (size_t i = 0; i < config.optimizers.size(); ++i) {
    if (!config.optimizers[i]) {
      throw ConfigError(str(module.name(), ".configure_optimizers(): optimizer ", i,
                            " is null. Return std::make_shared<torch::optim::...>(...)."));
    }
    size_t count = 0;
    std::vector<std::string> foreign;
    for (const auto& group : config.optimizers[i]->param_groups()) {
      for (const auto& p : group.params()) {
        ++count;
        if (own.count(p.unsafeGetTensorImpl()) == 0) foreign.push_back(fulgur::str(p.sizes()));
      }
    }
    if (count == 0) {
      throw ConfigError(str(module.name(), ".configure_optimizers(): optimizer ", i,
                            " has no parameters, so it would step nothing. Build it on "
                            "parameters() (or on the parameters it should train)."));
    }
    if (!foreign.empty() && is_global_zero()) {
      const size_t n = foreign.size();
      if (n > 4) {
        foreign.resize(4);
        foreign.emplace_back("...");
      }
      detail::print_note(
          str(module.name(), ".configure_optimizers(): optimizer ", i, " steps ", n,
              " tensor(s) that are not parameters of the module (shapes ", join(foreign),
              "): no checkpoint saves them (a resume starts them over) and ranks do not "
              "average their gradients. Register them with register_parameter()."));
    }
  }
  for (size_t i = 0; i < config.schedulers.size(); ++i) {
    const auto& s = config.schedulers[i];
    if (!s.scheduler) {
      throw ConfigError(str(module.name(), ".configure_optimizers(): scheduler ", i,
                            " is null. Pass a torch::optim::LRScheduler or drop the entry."));
    }
    if (s.frequency < 1) {
      throw ConfigError(str(module.name(), ".configure_optimizers(): scheduler ", i,
                            " has frequency=", s.frequency, "; it must be >= 1."));
    }
    const bool monitored = dynamic_cast<MonitoredScheduler*>(s.scheduler.get()) != nullptr;
    if (monitored && s.monitor.empty()) {
      throw ConfigError(str(module.name(), ".configure_optimizers(): scheduler ", i,
                            " is stepped with a metric's value (ReduceLROnPlateau) but its "
                            "SchedulerConfig has no monitor. Pass .monitor = \"val_loss\" (or "
                            "another metric the module logs)."));
    }
    if (!monitored && !s.monitor.empty()) {
      throw ConfigError(str(module.name(), ".configure_optimizers(): scheduler ", i,
                            " has monitor=\"", s.monitor,
                            "\", but it is not stepped with a metric (it is not a "
                            "fulgur::MonitoredScheduler such as fulgur::ReduceLROnPlateau). "
                            "Drop the monitor, or use a scheduler that reads it."));
    }
    if (const auto* ours = dynamic_cast<const Scheduler*>(s.scheduler.get())) {
      const bool returned =
          std::any_of(config.optimizers.begin(), config.optimizers.end(),
                      [&](const auto& optimizer) { return optimizer.get() == &ours->optimizer(); });
      if (!returned) {
        throw ConfigError(str(module.name(), ".configure_optimizers(): scheduler ", i,
                              " schedules an optimizer that configure_optimizers did not return "
                              "(its rates would change, and nothing would train with them). "
                              "Build it on one of the ",
                              config.optimizers.size(), " optimizer(s) returned."));
      }
    }
    if (SequentialLR::in_sequence(*s.scheduler)) {
      throw ConfigError(str(module.name(), ".configure_optimizers(): scheduler ", i,
                            " is one of a SequentialLR's, which steps it; listed too, it would "
                            "be stepped twice a step. List only the SequentialLR."));
    }
    for (size_t j = 0; j < i; ++j) {
      if (config.schedulers[j].scheduler == s.scheduler) {
        throw ConfigError(str(module.name(), ".configure_optimizers(): schedulers ", j, " and ", i,
                              " are the same object; it would be stepped twice a step. List "
                              "it once."));
      }
    }
  }
  if (is_global_zero()) note_schedules_set_outright(module, config);
  return config;
}

void Strategy::teardown(bool completed) {
  if (torn_down_) return;
  torn_down_ = true;
  stage_completed_ = completed;
  // A save still being written in the background finishes first (after a
  // failed stage too: a checkpoint handed over is never dropped).
  if (checkpoint_io_) {
    try {
      checkpoint_io_->wait_until_durable();
    } catch (const std::exception& e) {
      detail::print_note(e.what());
    }
  }
  do_teardown();
  if (has_accelerator()) accelerator().teardown();
  environment_ready_ = false;
}

Batch Strategy::batch_to_device(const Batch& batch) const {
  auto device = root_device();
  const Precision* precision = precision_.get();
  return batch.map_tensors([&](const at::Tensor& t) {
    at::Tensor moved = t.device() == device ? t : t.to(device, /*non_blocking=*/device.is_cuda());
    return precision != nullptr ? precision->convert_input(moved) : moved;
  });
}

at::Tensor Strategy::training_step(Module& module, Batch& batch, int64_t batch_idx) {
  return module.training_step(batch, batch_idx);
}

std::unique_ptr<PrecisionScope> Strategy::step_scope() {
  return precision().forward_scope(root_device().type());
}

void Strategy::backward(const at::Tensor& loss, Module&) { precision().backward(loss); }

void detail::clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : parameters) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return;
  std::vector<at::Tensor> norms;
  norms.reserve(grads.size());
  for (const auto& g : grads) norms.push_back(g.norm(2));
  const at::Tensor total = norms.size() == 1 ? norms[0] : at::stack(norms).norm(2);
  const at::Tensor factor = (max_norm / (total + 1e-6)).clamp_max(1.0);
  for (auto& g : grads) g.mul_(factor);
}

void Strategy::clip_gradients_norm(const std::vector<at::Tensor>& parameters, double max_norm) {
  detail::clip_grad_norm(parameters, max_norm);
}

void Strategy::unscale_gradients(torch::optim::Optimizer& optimizer) {
  precision().unscale_gradients(optimizer);
}

bool Strategy::optimizer_step(torch::optim::Optimizer& optimizer, Module&) {
  return precision().optimizer_step(optimizer);
}

void Strategy::heartbeat(const char* what) { detail::send_heartbeat(what); }

std::shared_ptr<ProcessGroup> Strategy::shared_process_group() const {
  if (!runs_alone()) process_group();  // throws, naming the strategy, before the group exists
  return group_;
}

ProcessGroup& Strategy::process_group() const {
  if (group_) return *group_;
  if (traits_.max_processes == 1) {
    throw DistributedError(str("strategy \"", name(),
                               "\" runs one process and has no process group. Use a parallel "
                               "strategy (\"ddp\", \"fsdp\", \"manual\") for collectives."));
  }
  throw DistributedError(str("strategy \"", name(),
                             "\": the process group exists once "
                             "setup_environment() ran (inside fit/validate/test/predict)."));
}

void Strategy::barrier(std::string_view /*name*/) {
  if (!runs_alone()) process_group().barrier();
}

at::Tensor Strategy::broadcast(const at::Tensor& tensor, int src) {
  if (runs_alone()) return tensor;
  at::Tensor out = tensor.clone();
  process_group().broadcast_(out, src);
  return out;
}

std::string Strategy::broadcast_bytes(const std::string& value, int src) {
  return runs_alone() ? value : process_group().broadcast_bytes(value, src);
}

std::vector<std::string> Strategy::values_where_they_differ(const std::string& value) {
  if (runs_alone()) return {};
  const auto hash = static_cast<int64_t>(std::hash<std::string>{}(value));
  const at::Tensor all =
      all_gather(torch::tensor({hash, static_cast<int64_t>(value.size())}, torch::kLong))
          .cpu()
          .contiguous();
  const int64_t* rows = all.data_ptr<int64_t>();
  const int world = world_size();
  bool same = true;
  int64_t longest = 0;
  for (int r = 0; r < world; ++r) {
    same = same && rows[2 * r] == hash && rows[2 * r + 1] == static_cast<int64_t>(value.size());
    longest = std::max(longest, rows[2 * r + 1]);
  }
  if (same) return {};
  // Every rank's bytes in one all-gather, each padded to the longest.
  at::Tensor mine = torch::zeros({std::max<int64_t>(longest, 1)}, torch::kUInt8);
  if (!value.empty()) std::memcpy(mine.data_ptr(), value.data(), value.size());
  const at::Tensor bytes = all_gather(mine).cpu().contiguous();
  std::vector<std::string> values;
  for (int r = 0; r < world; ++r) {
    const auto* row = static_cast<const char*>(bytes[r].data_ptr());
    values.emplace_back(row, static_cast<size_t>(rows[2 * r + 1]));
  }
  return values;
}

at::Tensor Strategy::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  if (runs_alone()) return tensor;
  at::Tensor out = tensor.clone();
  process_group().all_reduce_(out, op);
  return out;
}

at::Tensor Strategy::all_gather(const at::Tensor& tensor) {
  return runs_alone() ? tensor.unsqueeze(0) : process_group().all_gather(tensor);
}

bool Strategy::peers_arrive(const std::string& key, std::chrono::milliseconds timeout) {
  return world_size() <= 1 || process_group().ranks_arrive(key, timeout);
}

bool Strategy::reduce_boolean_decision(bool decision, bool all) {
  if (world_size() <= 1) return decision;
  at::Tensor t = torch::tensor({decision ? 1 : 0}, torch::kInt);
  t = all_reduce(t, all ? ReduceOp::kMin : ReduceOp::kMax);
  return t.item<int>() != 0;
}

bool Strategy::is_checkpoint_writer() const { return checkpoint_layout_->is_writer(*this); }

bool Strategy::checkpoint_is_collective() const {
  return world_size() > 1 && (traits_.save_gathers || checkpoint_layout_->name() == "sharded");
}

void Strategy::save_checkpoint(StateDict& checkpoint, const std::string& path) {
  checkpoint_layout_->save(*this, checkpoint, path);
}

StateDict Strategy::load_checkpoint(const std::string& path) {
  return checkpoint_layout_->load(*this, path);
}

void Strategy::remove_checkpoint(const std::string& path) {
  checkpoint_layout_->remove(*this, path);
}

void Strategy::raise_checkpoint_errors() {
  if (checkpoint_io_) checkpoint_io_->raise_pending_error();
}

void Strategy::wait_for_checkpoints() {
  if (checkpoint_io_) checkpoint_io_->wait_until_durable();
}

std::string Strategy::verify_checkpoint(const std::string& path) {
  return checkpoint_layout_->verify(*this, path);
}

FileFingerprint Strategy::checkpoint_fingerprint(const std::string& path) {
  return checkpoint_layout_->fingerprint(*this, path);
}

void Strategy::remove_stale_checkpoint_files(const std::string& dir) {
  checkpoint_layout_->remove_stale_files(*this, dir);
}

StateDict Strategy::module_state(Module& module) { return module_state_dict(module); }

void Strategy::load_module_state(Module& module, const StateDict& state) {
  load_module_state_dict(module, state);
}

StateDict Strategy::optimizer_state(torch::optim::Optimizer& optimizer) {
  return optimizer_state_dict(optimizer);
}

void Strategy::load_optimizer_state(torch::optim::Optimizer& optimizer, const StateDict& state) {
  load_optimizer_state_dict(optimizer, state);
}

std::vector<at::Tensor> Strategy::local_parameters(Module& module) { return module.parameters(); }

void Strategy::check_parameter_values(
    Module& module, const std::vector<at::Tensor>& values,
    const std::function<std::vector<int64_t>(size_t)>& shape_of) {
  const auto named = module.named_parameters(/*recurse=*/true);
  if (values.size() != named.size()) {
    throw ConfigError(str(values.size(), " values for the module's ", named.size(),
                          " parameters: they are of another model"));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    const std::vector<int64_t> shape = shape_of(i);
    if (!values[i].defined() || values[i].sizes() != c10::IntArrayRef(shape)) {
      const std::string given =
          values[i].defined() ? fulgur::str(values[i].sizes()) : std::string("(none)");
      throw ConfigError(fulgur::str("parameter \"", named[i].key(), "\" is of shape ",
                                    c10::IntArrayRef(shape), ", its value of shape ", given,
                                    ": the values are of another model"));
    }
  }
}

void Strategy::assign_local_parameters(Module& module, const std::vector<at::Tensor>& values) {
  const auto parameters = module.parameters();
  check_parameter_values(module, values, [&](size_t i) { return parameters[i].sizes().vec(); });
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < parameters.size(); ++i) parameters[i].copy_(values[i]);
}

std::vector<at::Tensor> Strategy::whole_from_local(Module& /*module*/,
                                                   const std::vector<at::Tensor>& local) {
  return local;
}

std::vector<at::Tensor> Strategy::local_from_whole(Module& module,
                                                   const std::vector<at::Tensor>& whole) {
  const auto parameters = module.parameters();
  check_parameter_values(module, whole, [&](size_t i) { return parameters[i].sizes().vec(); });
  std::vector<at::Tensor> local;
  for (size_t i = 0; i < parameters.size(); ++i) {
    local.push_back(whole[i].to(parameters[i].device(), parameters[i].scalar_type()));
  }
  return local;
}

std::string Strategy::describe() const {
  auto* self = const_cast<Strategy*>(this);
  std::vector<std::string> devices;
  for (const auto& d : parallel_devices_) devices.push_back(d.str());
  return str("strategy: ", name(), "\n",
             "accelerator: ", has_accelerator() ? std::string(accelerator().name()) : "none", "\n",
             "precision: ", self->precision().name(), "\n",
             "checkpoint_io: ", self->checkpoint_io().name(), "\n",
             "checkpoint_layout: ", checkpoint_layout_->name(), "\n",
             "cluster_environment: ", self->cluster_environment().name(), "\n",
             "launcher: ", launcher_ ? std::string(launcher_->name()) : "none", "\n",
             "num_nodes: ", num_nodes_, "\n", "parallel_devices: [", join(devices), "]\n",
             "world_size: ", world_size(), "\n", "global_rank: ", global_rank(), "\n",
             "root_device: ", root_device().str(), "\n");
}

namespace detail {

void StrategyDriver::announce_failure(const std::string& what) {
  if (s_.has_group()) {
    s_.process_group().announce_failure(what);
  } else if (s_.world_size() > 1 && s_.has_cluster_environment()) {
    announce_failure_before_joining(s_.cluster_environment(), what);
  }
}

}  // namespace detail

}  // namespace fulgur
