// The connector's report as JSON (`fulgur resolve`, Trainer::describe()):
// flat objects of strings, numbers, booleans and lists of strings.
#include "fulgur/trainer/connectors/resolution.h"

#include "fulgur/core/errors.h"
#include "utilities/json_text.h"

namespace fulgur {

namespace {

using detail::json_string;

std::string list(const std::vector<std::string>& items) {
  if (items.empty()) return "[]";
  std::vector<std::string> quoted_items;
  for (const auto& item : items) quoted_items.push_back("    " + json_string(item));
  return "[\n" + join(quoted_items, ",\n") + "\n  ]";
}

std::string object(const std::vector<std::pair<std::string, std::string>>& fields) {
  std::vector<std::string> lines;
  for (const auto& [key, value] : fields) lines.push_back("  " + json_string(key) + ": " + value);
  return "{\n" + join(lines, ",\n") + "\n}\n";
}

}  // namespace

std::string Resolution::to_json() const {
  const std::string spelled = Choice<Determinism>::name_of(deterministic);
  const std::string det = deterministic == Determinism::kWarn ? json_string(spelled) : spelled;
  return object({{"accelerator", json_string(accelerator)},
                 {"strategy", json_string(strategy)},
                 {"launcher", launcher.empty() ? "null" : json_string(launcher)},
                 {"precision", json_string(precision)},
                 {"cluster_environment", json_string(cluster_environment)},
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
  return object({{"error", json_string(error.kind())},
                 {"problems", list(error.problems())},
                 {"message", json_string(error.what())}});
}

std::string Resolution::to_text() const {
  std::string out = str("fulgur: strategy ", strategy, ", ", num_devices, " ", accelerator,
                        num_devices == 1 ? " device" : " devices", " on ", num_nodes,
                        num_nodes == 1 ? " node" : " nodes", " (world size ", world_size,
                        "), precision ", precision, ", cluster environment ", cluster_environment,
                        launcher.empty() ? std::string() : ", launcher " + launcher);
  if (deterministic != Determinism::kOff) {
    out += str(", deterministic ", Choice<Determinism>::name_of(deterministic));
  }
  if (sync_batchnorm) out += ", sync_batchnorm";
  out += "\n";
  for (const auto& note : notes) out += "  " + note + "\n";
  return out;
}

}  // namespace fulgur
