// The connector's three phases. Phase 1 collects every problem before
// throwing; phase 2 records each default it picks as a note; phase 3 builds
// the strategy complete and lets the components reject what they cannot run.
#include "fulgur/trainer/connectors/accelerator_connector.h"

#include <torch/torch.h>

#include "fulgur/accelerators/accelerator.h"
#include "fulgur/core/errors.h"
#include "fulgur/plugins/environments/cluster_environment.h"
#include "fulgur/plugins/io/checkpoint_io.h"
#include "fulgur/plugins/precision/precision.h"
#include "fulgur/strategies/strategy.h"

namespace fulgur {

namespace {

class Problems {
 public:
  void add(std::string problem) { items_.push_back(std::move(problem)); }
  bool empty() const { return items_.empty(); }
  [[noreturn]] void raise() const {
    if (items_.size() == 1) throw ConfigError("Trainer: " + items_.front());
    throw ConfigError(str("Trainer: ", items_.size(), " problems with the flags:\n  - ",
                          join(items_, "\n  - ")));
  }
  void raise_if_any() const {
    if (!empty()) raise();
  }

 private:
  std::vector<std::string> items_;
};

// Legacy spellings accepted as PyTorch Lightning 2.x accepts them.
std::string canonical_precision(const std::string& p, std::vector<std::string>& notes) {
  if (p == "32") {
    notes.push_back("precision=\"32\" means \"32-true\"");
    return "32-true";
  }
  return p;
}

}  // namespace

ConnectorResult connect(const TrainerOptions& options, const EnvView& env) {
  ConnectorResult result;
  auto& notes = result.notes;
  Problems problems;

  // ---- Phase 1: check names and instances.
  std::string accelerator_name = options.accelerator == "gpu" ? "cuda" : options.accelerator;
  if (accelerator_name != "auto" && !accelerator_registry().contains(accelerator_name)) {
    problems.add(str("accelerator=\"", options.accelerator, "\": ",
                     accelerator_registry().unknown_name_message(accelerator_name),
                     " Or pass \"auto\"."));
  }
  std::string precision_name = canonical_precision(options.precision, notes);
  std::shared_ptr<Precision> precision_instance;
  std::shared_ptr<CheckpointIO> io_instance;
  std::shared_ptr<ClusterEnvironment> env_instance;
  // One slot per plugin type: a second plugin of a type is a conflict.
  auto take = [&](auto& slot, auto instance, size_t i, const char* what) {
    if (!instance) {
      problems.add(str("plugins[", i, "] is a null ", what, ": pass an instance."));
    } else if (slot) {
      problems.add(str("plugins[", i, "]: a second ", what, " (", instance->name(), ", after ",
                       slot->name(), "). Pass one."));
    } else {
      slot = std::move(instance);
    }
  };
  for (size_t i = 0; i < options.plugins.size(); ++i) {
    const auto& plugin = options.plugins[i];
    if (const auto* name = std::get_if<std::string>(&plugin)) {
      if (cluster_environment_registry().contains(*name)) {
        take(env_instance,
             std::shared_ptr<ClusterEnvironment>(cluster_environment_registry().create(*name, env)),
             i, "cluster environment");
      } else if (checkpoint_io_registry().contains(*name)) {
        take(io_instance, std::shared_ptr<CheckpointIO>(checkpoint_io_registry().create(*name)), i,
             "checkpoint IO");
      } else {
        std::vector<std::string> known = cluster_environment_registry().names();
        for (const auto& n : checkpoint_io_registry().names()) known.push_back(n);
        std::sort(known.begin(), known.end());
        auto guess = closest_match(*name, known);
        problems.add(str("plugins[", i, "]=\"", *name, "\": unknown plugin",
                         guess.empty() ? std::string() : str("; did you mean \"", guess, "\"?"),
                         guess.empty() ? ". " : " ", "Registered plugin names: ", join(known),
                         ". Precision is chosen with the precision flag."));
      }
    } else if (const auto* p = std::get_if<std::shared_ptr<Precision>>(&plugin)) {
      take(precision_instance, *p, i, "precision plugin");
    } else if (const auto* io = std::get_if<std::shared_ptr<CheckpointIO>>(&plugin)) {
      take(io_instance, *io, i, "checkpoint IO");
    } else if (const auto* ce = std::get_if<std::shared_ptr<ClusterEnvironment>>(&plugin)) {
      take(env_instance, *ce, i, "cluster environment");
    }
  }
  if (precision_instance) {
    if (options.precision != "32-true") {
      problems.add(str("precision=\"", options.precision, "\" and a precision plugin (",
                       precision_instance->name(), ") in plugins: choose one. Drop the plugin or "
                       "leave precision at its default."));
    }
  } else if (!precision_registry().contains(precision_name)) {
    problems.add(str("precision=\"", options.precision, "\": ",
                     precision_registry().unknown_name_message(precision_name)));
  }
  std::shared_ptr<Strategy> strategy_instance;
  std::string strategy_name = "auto";
  if (const auto* name = std::get_if<std::string>(&options.strategy)) {
    strategy_name = *name;
    if (strategy_name != "auto" && !strategy_registry().contains(strategy_name)) {
      problems.add(str("strategy=\"", strategy_name, "\": ",
                       strategy_registry().unknown_name_message(strategy_name),
                       " Or pass \"auto\"."));
    }
  } else {
    strategy_instance = std::get<std::shared_ptr<Strategy>>(options.strategy);
    if (!strategy_instance) problems.add("strategy is a null Strategy instance: pass an instance or a name.");
  }
  if (strategy_instance && strategy_instance->has_accelerator() && options.accelerator != "auto" &&
      strategy_instance->accelerator().name() != accelerator_name) {
    problems.add(str("accelerator=\"", options.accelerator, "\" but the strategy instance carries "
                     "accelerator \"", strategy_instance->accelerator().name(),
                     "\": set it in one place. Drop the accelerator flag or the strategy's "
                     "accelerator."));
  }
  if (options.num_nodes < 1) {
    problems.add(str("num_nodes=", options.num_nodes, ": must be >= 1."));
  }
  problems.raise_if_any();

  // ---- Phase 2: choose.
  std::shared_ptr<Accelerator> accelerator;
  if (strategy_instance && strategy_instance->has_accelerator()) {
    accelerator = std::shared_ptr<Accelerator>(strategy_instance, &strategy_instance->accelerator());
  } else if (accelerator_name == "auto") {
    auto cuda = accelerator_registry().create("cuda");
    if (cuda->is_available()) {
      accelerator = std::move(cuda);
      notes.push_back("accelerator=cuda because accelerator=auto and CUDA is available");
    } else {
      accelerator = accelerator_registry().create("cpu");
      notes.push_back("accelerator=cpu because accelerator=auto and CUDA is not available");
    }
  } else {
    accelerator = accelerator_registry().create(accelerator_name);
    if (!accelerator->is_available()) {
      throw ConfigError(str("Trainer: accelerator=\"", options.accelerator,
                            "\" is not available on this machine: ",
                            accelerator->unavailable_reason(), ". Pass accelerator=\"cpu\" or "
                            "\"auto\"."));
    }
  }
  std::vector<c10::Device> devices;
  try {
    devices = accelerator->parse_devices(options.devices);
  } catch (const ConfigError& e) {
    throw ConfigError(str("Trainer: ", e.what()));
  }
  if (options.devices.is_auto()) {
    notes.push_back(str("devices=", devices.size(), " because devices=auto on ",
                        accelerator->name()));
  }
  if (devices.empty()) {
    throw ConfigError(str("Trainer: devices=", options.devices.text(), " selects no ",
                          accelerator->name(), " device. Pass accelerator=\"cpu\" or a device "
                          "that exists."));
  }
  if (!env_instance) env_instance = detect_cluster_environment(env, &notes);
  // Processes someone else started must match devices x num_nodes; where
  // fulgur launches them, it starts exactly that many.
  if (env_instance->creates_processes_externally()) {
    try {
      env_instance->validate_settings(static_cast<int>(devices.size()), options.num_nodes);
    } catch (const ConfigError& e) {
      throw ConfigError(str("Trainer(devices=", options.devices.text(), ", num_nodes=",
                            options.num_nodes, ") under cluster environment \"",
                            env_instance->name(), "\": ", e.what()));
    }
  }
  if (strategy_name == "auto" && !strategy_instance) {
    if (devices.size() == 1 && options.num_nodes == 1) {
      strategy_name = "single_device";
      notes.push_back("strategy=single_device because one device on one node");
    } else if (strategy_registry().contains("ddp")) {
      strategy_name = "ddp";
      notes.push_back(str("strategy=ddp because devices=", devices.size(),
                          " and num_nodes=", options.num_nodes));
    } else {
      throw ConfigError(str("Trainer: devices=", options.devices.text(), ", num_nodes=",
                            options.num_nodes, " needs a multi-process strategy, and none is "
                            "registered in this build (registered: ",
                            join(strategy_registry().names()), "). Pass devices=1."));
    }
  }

  // ---- Phase 3: build, complete, then let the components check.
  auto strategy = strategy_instance ? strategy_instance
                                    : std::shared_ptr<Strategy>(strategy_registry().create(strategy_name));
  if (!strategy->has_accelerator()) strategy->set_accelerator(accelerator);
  if (!strategy->has_precision()) {
    strategy->set_precision(precision_instance ? precision_instance
                                               : std::shared_ptr<Precision>(
                                                     precision_registry().create(precision_name)));
  }
  if (io_instance) strategy->set_checkpoint_io(io_instance);
  if (!strategy->has_cluster_environment()) strategy->set_cluster_environment(env_instance);
  if (strategy->parallel_devices().empty()) strategy->set_parallel_devices(devices);
  strategy->set_num_nodes(options.num_nodes);
  strategy->precision().check_accelerator(strategy->accelerator());
  strategy->configure_launcher();
  result.strategy = std::move(strategy);
  return result;
}

}  // namespace fulgur
