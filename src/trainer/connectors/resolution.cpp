// The connector's report as JSON (`fulgur resolve`, Trainer::describe()):
// flat objects of strings, numbers, booleans and lists of strings.
#include "fulgur/trainer/connectors/resolution.h"

#include <cstdio>

#include "fulgur/core/errors.h"

namespace fulgur {

namespace {

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
  const std::string spelled = Choice<Determinism>::name_of(deterministic);
  const std::string det = deterministic == Determinism::kWarn ? quoted(spelled) : spelled;
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
