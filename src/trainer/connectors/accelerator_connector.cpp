// The connector: resolve() checks and chooses against a context (phases 1
// and 2, one function per rule), build() assembles the strategy (phase 3).
// Every problem is collected before anything throws: phase 2's checks run
// whenever their own inputs are valid, even if phase 1 found problems with
// other flags.
#include "fulgur/trainer/connectors/accelerator_connector.h"

#include <ATen/Context.h>

#include <algorithm>
#include <cstdlib>
#include <limits>

#include "fulgur/core/errors.h"
#include "fulgur/distributed/launchers/launcher.h"
#include "fulgur/strategies/parallel.h"
#include "fulgur/strategies/single_device.h"
#include "strategies/strategy_driver.h"

namespace fulgur {

ConnectorContext::ConnectorContext() : ConnectorContext(EnvView()) {}

ConnectorContext::ConnectorContext(EnvView env_view)
    : env(std::move(env_view)),
      accelerators(&accelerator_registry()),
      strategies(&strategy_registry()),
      precisions(&precision_registry()),
      checkpoint_ios(&checkpoint_io_registry()),
      cluster_environments(&cluster_environment_registry()) {}

namespace {

// Every problem found, reported as one FlagError of the first problem's kind.
class ProblemList {
 public:
  explicit ProblemList(std::vector<std::string> initial) : items_(std::move(initial)) {}
  void add(std::string problem, const char* kind = "invalid_flags") {
    if (items_.empty()) kind_ = kind;
    items_.push_back(std::move(problem));
  }
  void add(const FlagError& error) {
    for (const auto& p : error.problems()) add(p, error.kind().c_str());
  }
  size_t size() const { return items_.size(); }
  void raise_if_any() const {
    if (!items_.empty()) throw FlagError(kind_, items_);
  }

 private:
  std::vector<std::string> items_;
  std::string kind_ = "invalid_flags";
};

// A ConfigError from a component, as the text of a problem.
std::string problem_text(const ConfigError& e) {
  std::string message = e.what();
  const std::string prefix = "Trainer: ";
  if (message.rfind(prefix, 0) == 0) message = message.substr(prefix.size());
  return message;
}

// A ConfigError from a component, reported as a FlagError of `kind`.
template <class Fn>
auto reported_as(const char* kind, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const FlagError&) {
    throw;
  } catch (const ConfigError& e) {
    throw FlagError(kind, {problem_text(e)});
  }
}

int device_count_of(const DevicesSpec& spec) {
  if (spec.is_index_list()) return static_cast<int>(spec.indices().size());
  return spec.count().value_or(1);
}

// One resolve() call: the options, the context, and what the rules found.
class ConnectorRun {
 public:
  ConnectorRun(const TrainerOptions& options, const ConnectorContext& context,
               std::vector<std::string> other_problems)
      : options_(options), context_(context), problems_(std::move(other_problems)) {}

  Connection resolve() {
    // ---- Phase 1: names, instances and values.
    read_accelerator_flag();
    read_precision_flag();
    read_plugins();
    check_precision_plugin_against_flag();
    read_strategy_flag();
    check_what_the_strategy_instance_carries();
    check_devices_and_num_nodes();
    check_one_process_strategy_gets_one_device();
    check_deterministic_and_benchmark();
    check_strategy_can_sync_batchnorm();
    parse_devices_of_an_explicit_accelerator();
    check_benchmark_has_an_autotuner();
    // ---- Phase 2: choose; each step runs when its inputs are valid.
    choose_accelerator();
    choose_devices();
    check_the_strategy_instances_devices();
    choose_cluster_environment();
    check_processes_started_elsewhere_match();
    check_ranks_in_range();
    check_nodes_can_find_each_other();
    choose_strategy();
    check_ranks_started_by_hand_have_a_port();
    problems_.raise_if_any();
    return finish();
  }

 private:
  // ---- Phase 1.
  void read_accelerator_flag() {
    if (const auto* name = std::get_if<std::string>(&options_.accelerator)) {
      accelerator_flag_ = *name;
      // Names match in any case ("CPU", "Auto"), as Lightning's do; "gpu" is
      // its alias of "cuda".
      const std::string lower = to_lower(accelerator_flag_);
      accelerator_name_ = lower == "gpu" ? "cuda" : lower;
      accelerator_valid_ =
          accelerator_name_ == "auto" || context_.accelerators->contains(accelerator_name_);
      if (!accelerator_valid_) {
        problems_.add(str("accelerator=\"", accelerator_flag_,
                          "\": ", context_.accelerators->unknown_name_message(accelerator_name_),
                          " Or pass \"auto\"."));
      }
      return;
    }
    accelerator_instance_ = std::get<std::shared_ptr<Accelerator>>(options_.accelerator);
    if (accelerator_instance_) {
      accelerator_flag_ = std::string(accelerator_instance_->name());
      accelerator_name_ = to_lower(accelerator_flag_);
      accelerator_valid_ = true;
    } else {
      accelerator_valid_ = false;
      problems_.add("accelerator is a null Accelerator instance: pass an instance or a name.");
    }
  }

  void read_precision_flag() {
    precision_name_ = options_.precision.canonical();
    if (options_.precision.is_legacy()) {
      notes_.push_back(str("precision=\"", precision_name_, "\" because precision=\"",
                           options_.precision.text(), "\" is its legacy spelling"));
    }
    precision_flag_set_ = options_.precision.text() != PrecisionFlag().text();
  }

  // One slot per plugin type: a second plugin of a type is a conflict.
  template <class Slot, class Instance>
  void take(Slot& slot, Instance instance, size_t i, const char* what) {
    if (!instance) {
      problems_.add(str("plugins[", i, "] is a null ", what, ": pass an instance."));
    } else if (slot) {
      problems_.add(str("plugins[", i, "]: a second ", what, " (", instance->name(), ", after ",
                        slot->name(), "). Pass one."));
    } else {
      slot = std::move(instance);
    }
  }

  void read_plugins() {
    const auto& environments = *context_.cluster_environments;
    const auto& ios = *context_.checkpoint_ios;
    const auto& precisions = *context_.precisions;
    for (size_t i = 0; i < options_.plugins.size(); ++i) {
      const auto& plugin = options_.plugins[i];
      const size_t before = problems_.size();
      if (const auto* name = std::get_if<std::string>(&plugin)) {
        if (environments.contains(*name)) {
          try {
            take(environment_,
                 std::shared_ptr<ClusterEnvironment>(environments.create(*name, context_.env)), i,
                 "cluster environment");
          } catch (const ConfigError& e) {  // its variables are missing or malformed
            problems_.add(str("plugins[", i, "]=\"", *name, "\": ", e.what()));
          }
          environment_plugin_failed_ |= problems_.size() != before;
        } else if (ios.contains(*name)) {
          take(io_, std::shared_ptr<CheckpointIO>(ios.create(*name)), i, "checkpoint IO");
        } else if (precisions.contains(PrecisionFlag(*name).canonical())) {
          take(precision_,
               std::shared_ptr<Precision>(precisions.create(PrecisionFlag(*name).canonical())), i,
               "precision plugin");
        } else {
          std::vector<std::string> known = environments.names();
          for (const auto& n : ios.names()) known.push_back(n);
          for (const auto& n : precisions.names()) known.push_back(n);
          std::sort(known.begin(), known.end());
          problems_.add(str("plugins[", i, "]=\"", *name, "\": unknown plugin",
                            did_you_mean(*name, known), "Registered plugin names: ", join(known),
                            "."));
        }
      } else if (const auto* p = std::get_if<std::shared_ptr<Precision>>(&plugin)) {
        take(precision_, *p, i, "precision plugin");
      } else if (const auto* io = std::get_if<std::shared_ptr<CheckpointIO>>(&plugin)) {
        take(io_, *io, i, "checkpoint IO");
      } else if (const auto* ce = std::get_if<std::shared_ptr<ClusterEnvironment>>(&plugin)) {
        take(environment_, *ce, i, "cluster environment");
        environment_plugin_failed_ |= problems_.size() != before;
      }
    }
  }

  void check_precision_plugin_against_flag() {
    if (precision_) {
      if (precision_flag_set_ && precision_name_ != precision_->name()) {
        problems_.add(str("precision=\"", options_.precision.text(), "\" and a precision plugin (",
                          precision_->name(),
                          ") in plugins: choose one. Drop the plugin or "
                          "the precision flag."));
      }
    } else if (!context_.precisions->contains(precision_name_)) {
      problems_.add(str("precision=\"", options_.precision.text(),
                        "\": ", context_.precisions->unknown_name_message(precision_name_),
                        " Legacy spellings: 32, 64, 16, \"bf16\"."));
    }
  }

  void read_strategy_flag() {
    if (const auto* name = std::get_if<std::string>(&options_.strategy)) {
      strategy_flag_ = to_lower(*name) == "auto" ? std::string("auto") : *name;
      if (strategy_flag_ == "auto") return;
      if (context_.strategies->contains(strategy_flag_)) {
        try {
          strategy_ = std::shared_ptr<Strategy>(context_.strategies->create(strategy_flag_));
        } catch (const ConfigError& e) {
          // A name registered to say what to use instead ("fsdp").
          strategy_valid_ = false;
          problems_.add(e.what());
        }
      } else {
        strategy_valid_ = false;
        problems_.add(str("strategy=\"", strategy_flag_,
                          "\": ", context_.strategies->unknown_name_message(strategy_flag_),
                          " Or pass \"auto\"."));
      }
      return;
    }
    strategy_ = std::get<std::shared_ptr<Strategy>>(options_.strategy);
    strategy_is_instance_ = true;
    if (!strategy_) {
      strategy_valid_ = false;
      problems_.add("strategy is a null Strategy instance: pass an instance or a name.");
    }
  }

  // What the instance carries of its own: an instance given to an earlier
  // Trainer also holds what that Trainer filled in (its precision,
  // devices, ...), which this one's flags decide anew (build() replaces it).
  detail::StrategyDriver instance() const { return detail::StrategyDriver(*strategy_); }

  std::string carried_by_the_instance() const {
    return str("the strategy instance (", strategy_->name(), ") carries ");
  }

  // What the instance carries beats flags; naming something else is an error.
  void check_what_the_strategy_instance_carries() {
    if (!strategy_is_instance_ || !strategy_) return;
    const std::string carried = carried_by_the_instance();
    if (instance().carries_accelerator() && accelerator_name_ != "auto" &&
        (accelerator_instance_ ? accelerator_instance_.get() != &strategy_->accelerator()
                               : to_lower(strategy_->accelerator().name()) != accelerator_name_)) {
      problems_.add(str("accelerator=\"", accelerator_flag_, "\" but ", carried, "accelerator \"",
                        strategy_->accelerator().name(),
                        "\": set it in one place. Drop the "
                        "accelerator flag or the strategy's accelerator."));
    }
    if (instance().carries_precision()) {
      if (precision_) {
        problems_.add(str("plugins has a precision plugin (", precision_->name(), ") but ", carried,
                          "precision \"", strategy_->precision().name(),
                          "\": set it in one place. Drop the plugin."));
      } else if (precision_flag_set_ && precision_name_ != strategy_->precision().name()) {
        problems_.add(str("precision=\"", options_.precision.text(), "\" but ", carried,
                          "precision \"", strategy_->precision().name(),
                          "\": set it in one "
                          "place. Drop the precision flag or the strategy's precision."));
      }
    }
    if (instance().carries_cluster_environment() && environment_) {
      problems_.add(str("plugins has a cluster environment (", environment_->name(), ") but ",
                        carried, "cluster environment \"", strategy_->cluster_environment().name(),
                        "\": set it in one place. Drop the plugin."));
    }
    if (instance().carries_checkpoint_io() && io_) {
      problems_.add(str("plugins has a checkpoint IO (", io_->name(), ") but ", carried,
                        "checkpoint IO \"", strategy_->checkpoint_io().name(),
                        "\": set it in one "
                        "place. Drop the plugin."));
    }
  }

  void check_devices_and_num_nodes() {
    if (auto problem = options_.devices.problem(); !problem.empty()) {
      problems_.add(problem);
      devices_reported_ = true;
    }
    if (options_.num_nodes < 1) {
      problems_.add(
          str("num_nodes=", options_.num_nodes, ": must be >= 1 (the number of machines)."));
    }
  }

  void check_one_process_strategy_gets_one_device() {
    const auto& devices = options_.devices;
    if (strategy_ && strategy_->traits().max_processes == 1 &&
        (options_.num_nodes > 1 ||
         (devices.problem().empty() && !devices.is_auto() &&
          (device_count_of(devices) > 1 || device_count_of(devices) == -1)))) {
      problems_.add(str("strategy=\"", strategy_->name(),
                        "\" runs one process on one device, but devices=", devices.text(),
                        " and num_nodes=", options_.num_nodes,
                        ". Pass strategy=\"ddp\" (or \"auto\") for several, or devices=1."));
    }
  }

  // Devices a strategy instance carries (set_parallel_devices, or the
  // device of a SingleDeviceStrategy) against the ones resolved here: they
  // silently won over the devices flag (3 ranks for devices=2, or a GPU
  // device on a CPU-only run that failed inside LibTorch).
  void check_the_strategy_instances_devices() {
    if (!strategy_is_instance_ || !strategy_ || !devices_known_) return;
    const std::string carried = carried_by_the_instance();
    const auto& preset = instance().carried_devices();
    if (!preset.empty() && !options_.devices.is_auto() && preset != devices_) {
      std::vector<std::string> names;
      for (const auto& d : preset) names.push_back(d.str());
      problems_.add(str("devices=", options_.devices.text(), " but ", carried, "parallel_devices [",
                        join(names),
                        "]: set them in one place (drop the devices flag, or call "
                        "set_parallel_devices with the ones you mean)."));
    }
    const auto* single = dynamic_cast<const SingleDeviceStrategy*>(strategy_.get());
    if (single != nullptr && single->device() &&
        single->device()->type() != devices_.front().type()) {
      problems_.add(str(carried, "device ", single->device()->str(), ", but accelerator=\"",
                        accelerator_flag_, "\" runs on ", devices_.front().str(),
                        ": set the device in one place (the accelerator flag that runs it, or a "
                        "SingleDeviceStrategy of this device)."),
                    "unavailable");
    }
  }

  void check_deterministic_and_benchmark() {
    if (!options_.deterministic.is_valid()) {
      problems_.add(str("deterministic=\"", options_.deterministic.text(),
                        "\": pass true, false or \"warn\"."));
    } else if (options_.deterministic.enabled() && options_.benchmark) {
      problems_.add(str("deterministic=", options_.deterministic.text(),
                        " and benchmark=true: cuDNN's autotuner picks algorithms by timing, which "
                        "is not deterministic. Drop benchmark=true."));
    }
  }

  void check_strategy_can_sync_batchnorm() {
    if (!options_.sync_batchnorm || !strategy_) return;
    const std::string why = strategy_->traits().sync_batchnorm_unsupported_reason;
    if (why.empty()) return;
    problems_.add(str("sync_batchnorm=true with strategy=\"", strategy_->name(),
                      "\", which cannot synchronise BatchNorm statistics (", why, ")",
                      ". Pass strategy=\"ddp\" with several devices, or drop sync_batchnorm."));
  }

  // An explicit, available accelerator parses devices now, so that its
  // complaint (device indices for the CPU) joins the others.
  void parse_devices_of_an_explicit_accelerator() {
    if (strategy_is_instance_ && strategy_ && instance().carries_accelerator()) {
      accelerator_ = std::shared_ptr<Accelerator>(strategy_, &strategy_->accelerator());
    } else if (accelerator_instance_) {
      accelerator_ = accelerator_instance_;
    } else if (accelerator_valid_ && accelerator_name_ != "auto") {
      accelerator_ = context_.accelerators->create(accelerator_name_);
    }
    if (accelerator_ && accelerator_->is_available() && !devices_reported_) {
      try {
        accelerator_->parse_devices(options_.devices);
      } catch (const ConfigError& e) {
        problems_.add(e.what());
        devices_reported_ = true;
      }
    }
  }

  void check_benchmark_has_an_autotuner() {
    if (options_.benchmark && accelerator_ && !accelerator_->has_cudnn_autotuner()) {
      problems_.add(str("benchmark=true with accelerator=\"", accelerator_->name(),
                        "\": benchmark turns on cuDNN's autotuner, which only CUDA has. Drop it."));
    }
  }

  // ---- Phase 2.
  void choose_accelerator() {
    if (accelerator_) {
      if (!accelerator_->is_available()) {
        problems_.add(
            str("accelerator=\"", accelerator_flag_,
                "\" is not available on this "
                "machine: ",
                accelerator_->unavailable_reason(), ". Pass accelerator=\"cpu\" or \"auto\"."),
            "unavailable");
        accelerator_.reset();
      }
      return;
    }
    if (!accelerator_valid_) return;  // reported in phase 1
    const auto& accelerators = *context_.accelerators;
    std::shared_ptr<Accelerator> cuda;
    if (accelerators.contains("cuda")) cuda = accelerators.create("cuda");
    if (cuda && cuda->is_available()) {
      accelerator_ = std::move(cuda);
      notes_.push_back("accelerator=cuda because accelerator=auto and CUDA is available");
    } else {
      accelerator_ = accelerators.create("cpu");
      notes_.push_back("accelerator=cpu because accelerator=auto and CUDA is not available");
    }
    if (options_.benchmark && !accelerator_->has_cudnn_autotuner()) {
      problems_.add(str("benchmark=true, but accelerator=auto chose \"", accelerator_->name(),
                        "\" (no CUDA here): benchmark tunes cuDNN, which only CUDA has. Drop "
                        "it."));
    }
  }

  void choose_devices() {
    if (!accelerator_ || devices_reported_) return;
    try {
      devices_ = accelerator_->parse_devices(options_.devices);
    } catch (const ConfigError& e) {
      problems_.add(problem_text(e));
      return;
    }
    if (devices_.empty()) {
      problems_.add(str("devices=", options_.devices.text(), " selects no ", accelerator_->name(),
                        " device. Pass accelerator=\"cpu\" or a device that exists."),
                    "unavailable");
      return;
    }
    // Ranks are 32-bit numbers (c10d's, the environments' variables).
    const int64_t processes =
        static_cast<int64_t>(devices_.size()) * std::max(options_.num_nodes, 1);
    if (processes > std::numeric_limits<int>::max()) {
      problems_.add(str("devices=", options_.devices.text(), " x num_nodes=", options_.num_nodes,
                        " = ", processes,
                        " processes: ranks are 32-bit numbers, so at most 2147483647 processes "
                        "take part. Pass fewer devices or num_nodes."));
      return;
    }
    devices_known_ = true;
    if (options_.devices.is_auto()) {
      notes_.push_back(
          str("devices=", devices_.size(), " because devices=auto on ", accelerator_->name()));
    }
  }

  void choose_cluster_environment() {
    if (environment_plugin_failed_) return;
    if (!environment_ && strategy_is_instance_ && strategy_ &&
        instance().carries_cluster_environment()) {
      environment_ =
          std::shared_ptr<ClusterEnvironment>(strategy_, &strategy_->cluster_environment());
    }
    if (environment_) return;
    try {
      environment_ = std::shared_ptr<ClusterEnvironment>(
          context_.cluster_environments->detect(context_.env, &notes_));
    } catch (const ConfigError& e) {
      problems_.add(problem_text(e), "invalid_environment");
    }
  }

  bool nodes_valid() const { return options_.num_nodes >= 1; }

  // The ranks of the run: devices x num_nodes, or the cluster's count where
  // it says more (the mismatch is its own problem). Once the environment and
  // the devices are known.
  int64_t world_size() const {
    return std::max<int64_t>(static_cast<int64_t>(devices_.size()) * options_.num_nodes,
                             environment_->world_size());
  }

  // Where fulgur starts the processes itself, it gives this one local rank 0
  // of its node: a WORLD_SIZE above what it starts, or on one machine a
  // RANK other than 0 (ranks started by hand without LOCAL_RANK), would have
  // two processes both be rank 0, one waiting for peers that never come.
  void check_rank_variables_of_processes_started_here() {
    const int64_t devices = static_cast<int64_t>(devices_.size());
    const int64_t processes = devices * options_.num_nodes;
    const std::string& world_var = environment_->world_size_variable();
    const std::string& rank_var = environment_->global_rank_variable();
    const char* started_here =
        "fulgur starts the processes itself here (LOCAL_RANK is not set, so no launcher started "
        "this one)";
    // More than it starts waits forever; fewer (Lightning's older cluster
    // recipe sets WORLD_SIZE to the node count) is left as it was.
    if (!world_var.empty() && environment_->world_size() > processes) {
      problems_.add(
          str(world_var, "=", environment_->world_size(), " is set, but devices=", devices,
              " x num_nodes=", options_.num_nodes, " = ", processes, " process(es), and ",
              started_here, ". Pass the devices and num_nodes that make it, or unset ", world_var,
              "; a launcher that starts every rank (torchrun) sets LOCAL_RANK too."),
          "environment_mismatch");
      counts_mismatch_ = true;
    }
    // On one machine (a RANK on several may count nodes, as NODE_RANK does).
    const int64_t here = int64_t{environment_->node_rank()} * devices;
    if (options_.num_nodes == 1 && !rank_var.empty() && environment_->global_rank() != here) {
      problems_.add(
          str(rank_var, "=", environment_->global_rank(), " is set, but ", started_here,
              " and this one is rank node_rank x devices = ", here,
              ". Set LOCAL_RANK too where a launcher started each rank (torchrun "
              "sets both), or unset ",
              rank_var, " and place each machine's processes with NODE_RANK and num_nodes."),
          "environment_mismatch");
    }
  }

  // Processes someone else started must match devices x num_nodes; where
  // fulgur launches them, it starts exactly that many.
  void check_processes_started_elsewhere_match() {
    if (!environment_ || !devices_known_ || !nodes_valid()) return;
    if (!environment_->creates_processes_externally()) {
      check_rank_variables_of_processes_started_here();
      return;
    }
    try {
      environment_->validate_settings(static_cast<int>(devices_.size()), options_.num_nodes);
    } catch (const ConfigError& e) {
      problems_.add(
          str("devices=", options_.devices.text(), ", num_nodes=", options_.num_nodes,
              " under cluster environment \"", environment_->name(), "\": ", problem_text(e)),
          "environment_mismatch");
      counts_mismatch_ = true;
    }
  }

  // Ranks out of range would otherwise surface as a process group that never
  // forms, with a message that cannot name the variable.
  // (Not after a mismatch of the counts: a rank outside the wrong count is
  // the same problem again.)
  void check_ranks_in_range() {
    if (!environment_ || !devices_known_ || !nodes_valid() || counts_mismatch_) return;
    for (auto& problem :
         environment_->rank_problems(static_cast<int>(devices_.size()), options_.num_nodes)) {
      problems_.add(std::move(problem), "invalid_environment");
    }
    const int64_t world = world_size();
    if (world > 1 && context_.env.has("MASTER_ADDR") && environment_->main_address().empty()) {
      problems_.add(
          options_.num_nodes > 1
              ? str("MASTER_ADDR is set but empty, with num_nodes=", options_.num_nodes,
                    ": every node reaches node 0 at this address. Set it to node 0's host "
                    "name or IP address.")
              : str("MASTER_ADDR is set but empty, with ", world,
                    " ranks: every rank reaches rank 0's store at this address. Set it to "
                    "rank 0's host name or IP address (127.0.0.1 on one machine), or unset it."),
          "invalid_environment");
    }
  }

  // fulgur's own launcher starts one node's ranks; the nodes find each other
  // only through these.
  void check_nodes_can_find_each_other() {
    if (!environment_ || environment_->creates_processes_externally() || options_.num_nodes <= 1) {
      return;
    }
    const EnvView& env = context_.env;
    std::vector<std::string> missing;
    for (const char* var : {"MASTER_ADDR", "MASTER_PORT"}) {
      if (!env.has(var)) missing.push_back(var);
    }
    if (!env.has("NODE_RANK") && !env.has("GROUP_RANK")) missing.push_back("NODE_RANK");
    if (missing.empty()) return;
    problems_.add(
        str("num_nodes=", options_.num_nodes, " with cluster environment \"", environment_->name(),
            "\" (fulgur starts the processes): start the program "
            "once per node with MASTER_ADDR (node 0's address), MASTER_PORT (one free "
            "port, the same everywhere) and NODE_RANK (0..",
            options_.num_nodes - 1, ") set; missing: ", join(missing),
            ". Or run under torchrun, srun or mpirun, which set them."),
        "invalid_environment");
  }

  // Ranks another program started by hand (LOCAL_RANK set, no launcher's
  // variables): only MASTER_PORT tells them where rank 0's store listens
  // (the other environments require it or derive one; fulgur's launcher
  // sets it). The MPI backend connects without a store.
  void check_ranks_started_by_hand_have_a_port() {
    if (!environment_ || !devices_known_ || !nodes_valid() || counts_mismatch_) return;
    if (environment_->name() != "lightning" || !environment_->creates_processes_externally() ||
        environment_->main_port() != 0) {
      return;
    }
    const auto* parallel = dynamic_cast<const ParallelStrategy*>(strategy_.get());
    if (parallel != nullptr && parallel->parallel_options().process_group_backend == "mpi") return;
    const int64_t world = world_size();
    if (world <= 1) return;
    problems_.add(str("LOCAL_RANK=", environment_->local_rank(),
                      " says another program started this process, one of ", world,
                      " ranks, but MASTER_PORT is not set: the ranks meet at rank 0's store "
                      "on MASTER_ADDR:MASTER_PORT. Set MASTER_PORT (one free port, the same "
                      "on every rank), or unset LOCAL_RANK and let fulgur's launcher start "
                      "the ranks."),
                  "invalid_environment");
  }

  void choose_strategy() {
    if (strategy_ || !strategy_valid_ || !devices_known_ || !nodes_valid()) return;
    const auto& strategies = *context_.strategies;
    std::string name;
    if (devices_.size() == 1 && options_.num_nodes == 1) {
      name = "single_device";
      notes_.push_back("strategy=single_device because one device on one node");
    } else if (strategies.contains("ddp")) {
      name = "ddp";
      notes_.push_back(str("strategy=ddp because devices=", devices_.size(),
                           " and num_nodes=", options_.num_nodes));
    } else {
      problems_.add(str("devices=", options_.devices.text(), ", num_nodes=", options_.num_nodes,
                        " needs a multi-process strategy, and none is registered in this "
                        "build (registered: ",
                        join(strategies.names()), "). Pass devices=1."));
      return;
    }
    strategy_ = std::shared_ptr<Strategy>(strategies.create(name));
    if (options_.sync_batchnorm && !strategy_->traits().sync_batchnorm_unsupported_reason.empty()) {
      problems_.add(str("sync_batchnorm=true, but strategy=auto chose \"", strategy_->name(),
                        "\" (one device on one node), which has no peers to synchronise "
                        "with. Drop sync_batchnorm, or pass devices >= 2."));
    }
  }

  Connection finish() {
    Connection c;
    c.strategy = std::move(strategy_);
    c.accelerator = std::move(accelerator_);
    c.devices = std::move(devices_);
    if (!detail::StrategyDriver(*c.strategy).carries_precision()) {
      c.precision = precision_
                        ? std::move(precision_)
                        : std::shared_ptr<Precision>(context_.precisions->create(precision_name_));
    }
    c.checkpoint_io = std::move(io_);
    c.cluster_environment = std::move(environment_);
    Resolution& r = c.resolution;
    r.num_nodes = options_.num_nodes;
    r.sync_batchnorm = options_.sync_batchnorm;
    r.deterministic =
        options_.deterministic.is_valid() ? options_.deterministic.value() : Determinism::kOff;
    r.deterministic_given = options_.deterministic.given();
    r.benchmark = options_.benchmark;
    r.notes = std::move(notes_);
    return c;
  }

  const TrainerOptions& options_;
  const ConnectorContext& context_;
  ProblemList problems_;
  std::vector<std::string> notes_;

  std::string accelerator_flag_ = "auto";  // as written, for messages
  std::string accelerator_name_ = "auto";  // lower case, "gpu" -> "cuda"
  bool accelerator_valid_ = true;          // known name, "auto" or an instance
  std::shared_ptr<Accelerator> accelerator_instance_;
  std::shared_ptr<Accelerator> accelerator_;

  std::string precision_name_;
  bool precision_flag_set_ = false;
  std::shared_ptr<Precision> precision_;
  std::shared_ptr<CheckpointIO> io_;
  std::shared_ptr<ClusterEnvironment> environment_;
  bool environment_plugin_failed_ = false;

  std::string strategy_flag_ = "auto";
  bool strategy_valid_ = true;  // not an unknown name or a null instance
  bool strategy_is_instance_ = false;
  std::shared_ptr<Strategy> strategy_;

  bool devices_reported_ = false;  // a problem with the devices is already listed
  bool devices_known_ = false;
  bool counts_mismatch_ = false;  // devices x num_nodes disagree with the cluster's
  std::vector<c10::Device> devices_;
};

}  // namespace

Connection resolve(const TrainerOptions& options, const ConnectorContext& context,
                   const std::vector<std::string>& other_problems) {
  return ConnectorRun(options, context, other_problems).resolve();
}

Connection build(Connection connection) {
  auto& strategy = connection.strategy;
  FULGUR_ASSERT(!connection.built, "build() of a connection it has already built");
  FULGUR_ASSERT(strategy && connection.cluster_environment && connection.accelerator,
                "build() needs the strategy, cluster environment and accelerator of resolve()");
  Resolution& r = connection.resolution;
  detail::StrategyDriver driver(*strategy);
  // An earlier Trainer's components (a reused instance) give way to this one's.
  driver.take_trainers_components(connection.accelerator, connection.precision,
                                  connection.checkpoint_io, connection.cluster_environment,
                                  connection.devices);
  driver.set_num_nodes(r.num_nodes);
  strategy->set_sync_batchnorm(r.sync_batchnorm);
  reported_as("unavailable",
              [&] { strategy->precision().check_accelerator(strategy->accelerator()); });
  std::vector<std::string> strategy_notes;
  reported_as("invalid_flags", [&] { driver.configure(strategy_notes); });
  if (strategy->launcher() != nullptr) {
    r.notes.push_back(str("launcher=", strategy->launcher()->name(),
                          " because strategy=", strategy->name(), " under cluster environment \"",
                          strategy->cluster_environment().name(), "\" starts its own processes"));
  }
  r.notes.insert(r.notes.end(), strategy_notes.begin(), strategy_notes.end());

  r.accelerator = std::string(strategy->accelerator().name());
  r.strategy = std::string(strategy->name());
  r.launcher = strategy->launcher() ? std::string(strategy->launcher()->name()) : std::string();
  r.precision = std::string(strategy->precision().name());
  r.cluster_environment = std::string(strategy->cluster_environment().name());
  r.num_nodes = strategy->num_nodes();
  r.num_devices = static_cast<int>(strategy->parallel_devices().size());
  r.world_size = strategy->world_size();
  r.global_rank = strategy->global_rank();
  r.local_rank = strategy->local_rank();
  r.node_rank = strategy->node_rank();
  for (const auto& d : strategy->parallel_devices()) r.parallel_devices.push_back(d.str());
  connection.built = true;
  return connection;
}

Connection connect(const TrainerOptions& options, const ConnectorContext& context,
                   const std::vector<std::string>& other_problems) {
  return build(resolve(options, context, other_problems));
}

Connection connect(const TrainerOptions& options, const EnvView& env,
                   const std::vector<std::string>& other_problems) {
  return connect(options, ConnectorContext(env), other_problems);
}

void apply_torch_flags(const Resolution& resolution, Accelerator& accelerator) {
  auto& context = at::globalContext();
  if (resolution.deterministic != Determinism::kOff) {
    const bool warn_only = resolution.deterministic == Determinism::kWarn;
    // The device's own part (cuBLAS's workspace), before its first kernel.
    accelerator.prepare_determinism();
    context.setDeterministicAlgorithms(true, warn_only);
    context.setDeterministicCuDNN(true);
    context.setBenchmarkCuDNN(false);
    return;
  }
  // Unset leaves LibTorch's flag as it is (Lightning's None): a Trainer
  // made only to validate no longer turns off a program's own setting.
  if (resolution.deterministic_given) {
    context.setDeterministicAlgorithms(false, false);
    context.setDeterministicCuDNN(false);
  }
  context.setBenchmarkCuDNN(resolution.benchmark);
}

}  // namespace fulgur
