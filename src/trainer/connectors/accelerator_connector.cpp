// The connector's three phases. Phase 1 collects every problem before
// throwing; phase 2 records each default it picks as a note; phase 3 builds
// the strategy complete and lets the components reject what they cannot run.
#include "fulgur/trainer/connectors/accelerator_connector.h"

#include <torch/torch.h>

#include <cstdlib>
#include <set>

#include "fulgur/accelerators/accelerator.h"
#include "fulgur/core/errors.h"
#include "fulgur/plugins/environments/cluster_environment.h"
#include "fulgur/plugins/io/checkpoint_io.h"
#include "fulgur/plugins/precision/precision.h"
#include "fulgur/strategies/launchers/launcher.h"
#include "fulgur/strategies/strategy.h"

namespace fulgur {

namespace {

class Problems {
 public:
  explicit Problems(std::vector<std::string> initial) : items_(std::move(initial)) {}
  void add(std::string problem) { items_.push_back(std::move(problem)); }
  void raise_if_any(const char* kind) const {
    if (!items_.empty()) throw FlagError(kind, items_);
  }

 private:
  std::vector<std::string> items_;
};

// A ConfigError from a component, reported as a FlagError of `kind`.
template <class Fn>
auto reported_as(const char* kind, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const FlagError&) {
    throw;
  } catch (const ConfigError& e) {
    std::string message = e.what();
    const std::string prefix = "Trainer: ";
    if (message.rfind(prefix, 0) == 0) message = message.substr(prefix.size());
    throw FlagError(kind, {message});
  }
}

int device_count_of(const DevicesSpec& spec) {
  if (spec.is_index_list()) return static_cast<int>(spec.indices().size());
  return spec.count().value_or(1);
}

// ---- JSON output (flat objects of strings, numbers, bools and lists).
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string list(const std::vector<std::string>& items) {
  if (items.empty()) return "[]";
  std::vector<std::string> quoted_items;
  for (const auto& item : items) quoted_items.push_back("    " + quoted(item));
  return "[\n" + join(quoted_items, ",\n") + "\n  ]";
}

std::string object(const std::vector<std::pair<std::string, std::string>>& fields) {
  std::vector<std::string> lines;
  for (const auto& [key, value] : fields) lines.push_back("  " + quoted(key) + ": " + value);
  return "{\n" + join(lines, ",\n") + "\n}\n";
}

}  // namespace

std::string Resolution::to_json() const {
  const std::string det = deterministic == "warn" ? quoted("warn") : deterministic;
  return object({{"accelerator", quoted(accelerator)},
                 {"strategy", quoted(strategy)},
                 {"launcher", launcher.empty() ? "null" : quoted(launcher)},
                 {"precision", quoted(precision)},
                 {"cluster_environment", quoted(cluster_environment)},
                 {"num_nodes", std::to_string(num_nodes)},
                 {"num_devices", std::to_string(num_devices)},
                 {"world_size", std::to_string(world_size)},
                 {"global_rank", std::to_string(global_rank)},
                 {"local_rank", std::to_string(local_rank)},
                 {"node_rank", std::to_string(node_rank)},
                 {"parallel_devices", list(parallel_devices)},
                 {"deterministic", det},
                 {"sync_batchnorm", sync_batchnorm ? "true" : "false"},
                 {"notes", list(notes)}});
}

std::string to_json(const FlagError& error) {
  return object({{"error", quoted(error.kind())},
                 {"problems", list(error.problems())},
                 {"message", quoted(error.what())}});
}

ConnectorResult connect(const TrainerOptions& options, const EnvView& env,
                        const std::vector<std::string>& other_problems) {
  std::vector<std::string> notes;
  Problems problems(other_problems);

  // ---- Phase 1: names, instances and values, every problem collected.
  // The accelerator flag: a name, or an instance (named by its name() in
  // messages).
  std::shared_ptr<Accelerator> accelerator_instance;
  std::string accelerator_flag = "auto";
  if (const auto* name = std::get_if<std::string>(&options.accelerator)) {
    accelerator_flag = *name;
  } else {
    accelerator_instance = std::get<std::shared_ptr<Accelerator>>(options.accelerator);
    if (accelerator_instance) {
      accelerator_flag = std::string(accelerator_instance->name());
    } else {
      problems.add("accelerator is a null Accelerator instance: pass an instance or a name.");
    }
  }
  // Names match in any case ("CPU", "Auto"), as Lightning's do; "gpu" is its
  // alias of "cuda".
  const std::string accelerator_lower = to_lower(accelerator_flag);
  const std::string accelerator_name = accelerator_lower == "gpu" ? "cuda" : accelerator_lower;
  const bool accelerator_known = accelerator_instance || accelerator_name == "auto" ||
                                 accelerator_registry().contains(accelerator_name);
  if (!accelerator_known && !std::holds_alternative<std::shared_ptr<Accelerator>>(options.accelerator)) {
    problems.add(str("accelerator=\"", accelerator_flag, "\": ",
                     accelerator_registry().unknown_name_message(accelerator_name),
                     " Or pass \"auto\"."));
  }
  const std::string precision_name = options.precision.canonical();
  if (options.precision.is_legacy()) {
    notes.push_back(str("precision=\"", precision_name, "\" because precision=\"",
                        options.precision.text(), "\" is its legacy spelling"));
  }
  const bool precision_flag_set = options.precision.text() != PrecisionFlag().text();

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
        try {
          take(env_instance,
               std::shared_ptr<ClusterEnvironment>(cluster_environment_registry().create(*name, env)),
               i, "cluster environment");
        } catch (const ConfigError& e) {  // its variables are missing or malformed
          problems.add(str("plugins[", i, "]=\"", *name, "\": ", e.what()));
        }
      } else if (checkpoint_io_registry().contains(*name)) {
        take(io_instance, std::shared_ptr<CheckpointIO>(checkpoint_io_registry().create(*name)), i,
             "checkpoint IO");
      } else if (precision_registry().contains(PrecisionFlag(*name).canonical())) {
        take(precision_instance,
             std::shared_ptr<Precision>(precision_registry().create(PrecisionFlag(*name).canonical())),
             i, "precision plugin");
      } else {
        std::vector<std::string> known = cluster_environment_registry().names();
        for (const auto& n : checkpoint_io_registry().names()) known.push_back(n);
        for (const auto& n : precision_registry().names()) known.push_back(n);
        std::sort(known.begin(), known.end());
        problems.add(str("plugins[", i, "]=\"", *name, "\": unknown plugin",
                         did_you_mean(*name, known), "Registered plugin names: ", join(known),
                         "."));
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
    if (precision_flag_set && precision_name != precision_instance->name()) {
      problems.add(str("precision=\"", options.precision.text(), "\" and a precision plugin (",
                       precision_instance->name(), ") in plugins: choose one. Drop the plugin or "
                       "the precision flag."));
    }
  } else if (!precision_registry().contains(precision_name)) {
    problems.add(str("precision=\"", options.precision.text(), "\": ",
                     precision_registry().unknown_name_message(precision_name),
                     " Legacy spellings: 32, 64, 16, \"bf16\"."));
  }

  std::shared_ptr<Strategy> strategy;
  std::string strategy_name = "auto";
  bool strategy_is_instance = false;
  if (const auto* name = std::get_if<std::string>(&options.strategy)) {
    strategy_name = to_lower(*name) == "auto" ? std::string("auto") : *name;
    if (strategy_name != "auto") {
      if (strategy_registry().contains(strategy_name)) {
        strategy = std::shared_ptr<Strategy>(strategy_registry().create(strategy_name));
      } else {
        problems.add(str("strategy=\"", strategy_name, "\": ",
                         strategy_registry().unknown_name_message(strategy_name),
                         " Or pass \"auto\"."));
      }
    }
  } else {
    strategy = std::get<std::shared_ptr<Strategy>>(options.strategy);
    strategy_is_instance = true;
    if (!strategy) problems.add("strategy is a null Strategy instance: pass an instance or a name.");
  }
  if (strategy_is_instance && strategy) {
    // What the instance carries beats flags; naming something else is an error.
    const std::string carried = str("the strategy instance (", strategy->name(), ") carries ");
    if (strategy->has_accelerator() && accelerator_name != "auto" &&
        (accelerator_instance ? accelerator_instance.get() != &strategy->accelerator()
                              : to_lower(strategy->accelerator().name()) != accelerator_name)) {
      problems.add(str("accelerator=\"", accelerator_flag, "\" but ", carried, "accelerator \"",
                       strategy->accelerator().name(), "\": set it in one place. Drop the "
                       "accelerator flag or the strategy's accelerator."));
    }
    if (strategy->has_precision()) {
      if (precision_instance) {
        problems.add(str("plugins has a precision plugin (", precision_instance->name(), ") but ",
                         carried, "precision \"", strategy->precision().name(),
                         "\": set it in one place. Drop the plugin."));
      } else if (precision_flag_set && precision_name != strategy->precision().name()) {
        problems.add(str("precision=\"", options.precision.text(), "\" but ", carried,
                         "precision \"", strategy->precision().name(), "\": set it in one "
                         "place. Drop the precision flag or the strategy's precision."));
      }
    }
    if (strategy->has_cluster_environment() && env_instance) {
      problems.add(str("plugins has a cluster environment (", env_instance->name(), ") but ",
                       carried, "cluster environment \"", strategy->cluster_environment().name(),
                       "\": set it in one place. Drop the plugin."));
    }
    if (strategy->has_checkpoint_io() && io_instance) {
      problems.add(str("plugins has a checkpoint IO (", io_instance->name(), ") but ", carried,
                       "checkpoint IO \"", strategy->checkpoint_io().name(), "\": set it in one "
                       "place. Drop the plugin."));
    }
  }

  if (auto problem = options.devices.problem(); !problem.empty()) problems.add(problem);
  if (options.num_nodes < 1) {
    problems.add(str("num_nodes=", options.num_nodes, ": must be >= 1 (the number of machines)."));
  }
  if (strategy && strategy->max_processes() == 1 &&
      (options.num_nodes > 1 ||
       (options.devices.problem().empty() && !options.devices.is_auto() &&
        (device_count_of(options.devices) > 1 || device_count_of(options.devices) == -1)))) {
    problems.add(str("strategy=\"", strategy->name(),
                     "\" runs one process on one device, but devices=",
                     options.devices.text(), " and num_nodes=", options.num_nodes,
                     ". Pass strategy=\"ddp\" (or \"auto\") for several, or devices=1."));
  }
  if (!options.deterministic.is_valid()) {
    problems.add(str("deterministic=\"", options.deterministic.text(),
                     "\": pass true, false or \"warn\"."));
  } else if (options.deterministic.enabled() && options.benchmark) {
    problems.add(str("deterministic=", options.deterministic.text(),
                     " and benchmark=true: cuDNN's autotuner picks algorithms by timing, which "
                     "is not deterministic. Drop benchmark=true."));
  }
  if (options.sync_batchnorm && strategy && !strategy->supports_sync_batchnorm()) {
    const std::string why = strategy->sync_batchnorm_unsupported_reason();
    problems.add(str("sync_batchnorm=true with strategy=\"", strategy->name(),
                     "\", which cannot synchronise BatchNorm statistics",
                     why.empty() ? std::string() : str(" (", why, ")"),
                     ". Pass strategy=\"ddp\" with several devices, or drop sync_batchnorm."));
  }
  // An explicit, available accelerator parses devices now, so that its
  // complaint (device indices for the CPU) joins the others.
  std::shared_ptr<Accelerator> accelerator;
  if (strategy_is_instance && strategy && strategy->has_accelerator()) {
    accelerator = std::shared_ptr<Accelerator>(strategy, &strategy->accelerator());
  } else if (accelerator_instance) {
    accelerator = accelerator_instance;
  } else if (accelerator_known && accelerator_name != "auto") {
    accelerator = accelerator_registry().create(accelerator_name);
  }
  if (accelerator && accelerator->is_available() && options.devices.problem().empty()) {
    try {
      accelerator->parse_devices(options.devices);
    } catch (const ConfigError& e) {
      problems.add(e.what());
    }
  }
  if (options.benchmark && accelerator && !accelerator->has_cudnn_autotuner()) {
    problems.add(str("benchmark=true with accelerator=\"", accelerator->name(),
                     "\": benchmark turns on cuDNN's autotuner, which only CUDA has. Drop it."));
  }
  problems.raise_if_any("invalid_flags");

  // ---- Phase 2: choose.
  if (!accelerator) {
    auto cuda = accelerator_registry().create("cuda");
    if (cuda->is_available()) {
      accelerator = std::move(cuda);
      notes.push_back("accelerator=cuda because accelerator=auto and CUDA is available");
    } else {
      accelerator = accelerator_registry().create("cpu");
      notes.push_back("accelerator=cpu because accelerator=auto and CUDA is not available");
    }
    if (options.benchmark && !accelerator->has_cudnn_autotuner()) {
      throw FlagError("invalid_flags",
                      {str("benchmark=true, but accelerator=auto chose \"", accelerator->name(),
                           "\" (no CUDA here): benchmark tunes cuDNN, which only CUDA has. Drop "
                           "it.")});
    }
  } else if (!accelerator->is_available()) {
    throw FlagError("unavailable",
                    {str("accelerator=\"", accelerator_flag, "\" is not available on this "
                         "machine: ", accelerator->unavailable_reason(),
                         ". Pass accelerator=\"cpu\" or \"auto\".")});
  }
  const std::vector<c10::Device> devices =
      reported_as("invalid_flags", [&] { return accelerator->parse_devices(options.devices); });
  if (options.devices.is_auto()) {
    notes.push_back(str("devices=", devices.size(), " because devices=auto on ",
                        accelerator->name()));
  }
  if (devices.empty()) {
    throw FlagError("unavailable", {str("devices=", options.devices.text(), " selects no ",
                                        accelerator->name(), " device. Pass accelerator=\"cpu\" "
                                        "or a device that exists.")});
  }
  if (!env_instance && strategy_is_instance && strategy->has_cluster_environment()) {
    env_instance = std::shared_ptr<ClusterEnvironment>(strategy, &strategy->cluster_environment());
  }
  if (!env_instance) {
    env_instance = reported_as("invalid_environment",
                               [&] { return std::shared_ptr<ClusterEnvironment>(
                                         detect_cluster_environment(env, &notes)); });
  }
  // Processes someone else started must match devices x num_nodes; where
  // fulgur launches them, it starts exactly that many.
  if (env_instance->creates_processes_externally()) {
    reported_as("environment_mismatch", [&] {
      try {
        env_instance->validate_settings(static_cast<int>(devices.size()), options.num_nodes);
      } catch (const ConfigError& e) {
        throw ConfigError(str("devices=", options.devices.text(), ", num_nodes=",
                              options.num_nodes, " under cluster environment \"",
                              env_instance->name(), "\": ", e.what()));
      }
    });
  }
  // Ranks out of range would otherwise surface as a process group that never
  // forms, with a message that cannot name the variable.
  {
    auto rank_problems =
        env_instance->rank_problems(static_cast<int>(devices.size()), options.num_nodes);
    if (options.num_nodes > 1 && env.has("MASTER_ADDR") && env_instance->main_address().empty()) {
      rank_problems.push_back(str("MASTER_ADDR is set but empty, with num_nodes=",
                                  options.num_nodes, ": every node reaches node 0 at this "
                                  "address. Set it to node 0's host name or IP address."));
    }
    if (!rank_problems.empty()) throw FlagError("invalid_environment", rank_problems);
  }
  if (!env_instance->creates_processes_externally() && options.num_nodes > 1) {
    // fulgur's own launcher starts one node's ranks; the nodes find each
    // other only through these.
    std::vector<std::string> missing;
    for (const char* var : {"MASTER_ADDR", "MASTER_PORT"}) {
      if (!env.has(var)) missing.push_back(var);
    }
    if (!env.has("NODE_RANK") && !env.has("GROUP_RANK")) missing.push_back("NODE_RANK");
    if (!missing.empty()) {
      throw FlagError("invalid_environment",
                      {str("num_nodes=", options.num_nodes, " with cluster environment \"",
                           env_instance->name(), "\" (fulgur starts the processes): start the "
                           "program once per node with MASTER_ADDR (node 0's address), "
                           "MASTER_PORT (one free port, the same everywhere) and NODE_RANK (0..",
                           options.num_nodes - 1, ") set; missing: ", join(missing),
                           ". Or run under torchrun, srun or mpirun, which set them.")});
    }
  }
  if (!strategy) {
    if (devices.size() == 1 && options.num_nodes == 1) {
      strategy_name = "single_device";
      notes.push_back("strategy=single_device because one device on one node");
    } else if (strategy_registry().contains("ddp")) {
      strategy_name = "ddp";
      notes.push_back(str("strategy=ddp because devices=", devices.size(),
                          " and num_nodes=", options.num_nodes));
    } else {
      throw FlagError("invalid_flags",
                      {str("devices=", options.devices.text(), ", num_nodes=", options.num_nodes,
                           " needs a multi-process strategy, and none is registered in this "
                           "build (registered: ", join(strategy_registry().names()),
                           "). Pass devices=1.")});
    }
    strategy = std::shared_ptr<Strategy>(strategy_registry().create(strategy_name));
    if (options.sync_batchnorm && !strategy->supports_sync_batchnorm()) {
      throw FlagError("invalid_flags",
                      {str("sync_batchnorm=true, but strategy=auto chose \"", strategy->name(),
                           "\" (one device on one node), which has no peers to synchronise "
                           "with. Drop sync_batchnorm, or pass devices >= 2.")});
    }
  }

  // ---- Phase 3: build, complete, then let the components check.
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
  strategy->set_sync_batchnorm(options.sync_batchnorm);
  reported_as("unavailable", [&] { strategy->precision().check_accelerator(strategy->accelerator()); });
  reported_as("invalid_flags", [&] { strategy->configure_launcher(); });
  if (strategy->launcher() != nullptr) {
    notes.push_back(str("launcher=", strategy->launcher()->name(), " because strategy=",
                        strategy->name(), " under cluster environment \"",
                        strategy->cluster_environment().name(), "\" starts its own processes"));
  }
  reported_as("invalid_flags", [&] { strategy->explain_choices(notes); });

  ConnectorResult result;
  Resolution& r = result.resolution;
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
  r.deterministic = options.deterministic.text();
  r.sync_batchnorm = options.sync_batchnorm;
  r.benchmark = options.benchmark;
  r.notes = std::move(notes);
  result.strategy = std::move(strategy);
  return result;
}

void apply_torch_flags(const Resolution& resolution) {
  auto& context = at::globalContext();
  if (resolution.deterministic != "false") {
    const bool warn_only = resolution.deterministic == "warn";
    if (resolution.accelerator == "cuda") {
      // cuBLAS is deterministic only with a fixed workspace; it reads this
      // when its first handle is created, so it must be set before that.
      ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
    }
    context.setDeterministicAlgorithms(true, warn_only);
    context.setDeterministicCuDNN(true);
    context.setBenchmarkCuDNN(false);
  } else {
    context.setDeterministicAlgorithms(false, false);
    context.setBenchmarkCuDNN(resolution.benchmark);
  }
}

TrainerOptions options_from_flags(const std::vector<std::pair<std::string, std::string>>& flags) {
  static const std::vector<std::string> known = {
      "accelerator", "benchmark", "deterministic", "devices", "num_nodes",
      "plugins",     "precision", "strategy",      "sync_batchnorm"};
  TrainerOptions options;
  std::vector<std::string> problems;
  std::set<std::string> seen;
  auto parse_bool = [&](const std::string& flag, const std::string& value) {
    if (value == "true" || value == "1") return true;
    if (value == "false" || value == "0") return false;
    problems.push_back(str("--", flag, " ", value, ": pass true or false."));
    return false;
  };
  for (const auto& [raw, value] : flags) {
    std::string flag = raw;
    while (!flag.empty() && flag.front() == '-') flag.erase(flag.begin());
    std::replace(flag.begin(), flag.end(), '-', '_');
    if (!seen.insert(flag).second) {
      problems.push_back(str("--", flag, " is given twice: pass it once."));
      continue;
    }
    if (flag == "accelerator") {
      options.accelerator = value;
    } else if (flag == "strategy") {
      options.strategy = value;
    } else if (flag == "devices") {
      options.devices = DevicesSpec(value);
    } else if (flag == "num_nodes") {
      try {
        size_t used = 0;
        options.num_nodes = std::stoi(value, &used);
        if (used != value.size()) throw std::invalid_argument(value);
      } catch (const std::exception&) {
        problems.push_back(str("--num_nodes ", value, ": not an integer. Pass the number of "
                               "machines, e.g. --num_nodes 2."));
      }
    } else if (flag == "precision") {
      options.precision = value;
    } else if (flag == "plugins") {
      size_t start = 0;
      while (start <= value.size()) {
        size_t comma = value.find(',', start);
        std::string name = value.substr(start, comma == std::string::npos ? std::string::npos
                                                                          : comma - start);
        if (!name.empty()) options.plugins.emplace_back(name);
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    } else if (flag == "sync_batchnorm") {
      options.sync_batchnorm = parse_bool(flag, value);
    } else if (flag == "deterministic") {
      options.deterministic = value;
    } else if (flag == "benchmark") {
      options.benchmark = parse_bool(flag, value);
    } else {
      problems.push_back(str("--", flag, ": unknown flag", did_you_mean(flag, known, "--", ""),
                             "Flags: --", join(known, ", --"), "."));
    }
  }
  if (!problems.empty()) throw FlagError("invalid_flags", problems);
  return options;
}

}  // namespace fulgur
