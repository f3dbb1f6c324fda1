// fulgur::CLI: command lines and YAML config files (yaml-cpp) onto the
// Trainer's flag table and the program's own options.
#include "fulgur/cli/cli.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <sstream>
#include <string_view>
#include <unordered_map>
#include <tuple>
#include <unordered_set>
#include <variant>

#include "fulgur/callbacks/callback.h"
#include "fulgur/callbacks/model_checkpoint.h"
#include "fulgur/core/errors.h"
#include "fulgur/plugins/io/torch_checkpoint_io.h"
#include "fulgur/strategies/checkpoint_layout.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/connectors/accelerator_connector.h"
#include "fulgur/trainer/flags.h"
#include "strategies/early_failure.h"
#include "trainer/loop_flags.h"
#include "utilities/file_kind.h"
#include "utilities/small_file.h"

namespace fulgur {

namespace fs = std::filesystem;

namespace {

constexpr const char* kConfigStateKey = "fulgur.cli.config";
constexpr const char* kDefault = "default";
constexpr const char* kCommandLine = "the command line";
constexpr const char* kCkptPathHelp =
    "Checkpoint to start from: a file, \"last\" (the newest of this run that verifies), "
    "\"auto\" (the same, or a fresh start when there is none), \"best\" (the best by "
    "ModelCheckpoint's monitor)";

// "--name: unknown option; did you mean --x?" or "--name: unknown option."
std::string unknown(const std::string& what, const std::string& name,
                    const std::vector<std::string>& candidates, const char* prefix) {
  std::string text = str(what, did_you_mean(name, candidates, prefix, ""));
  while (!text.empty() && text.back() == ' ') text.pop_back();
  return text;
}

std::string in_quotes(const std::string& text) { return "\"" + text + "\""; }

std::string parse_integer(const std::string& text, long long min, long long max, long long& out) {
  const ParsedInt n = parse_int(text, min, max);
  if (!n.ok) return "not an integer.";
  if (n.out_of_range) return str("out of range (", min, " to ", max, ").");
  out = n.value;
  return "";
}

// Writes config.yaml next to the run's logs at fit start (global rank 0),
// and the config into every checkpoint, where CLI::parse finds it again.
class ConfigCallback : public Callback {
 public:
  explicit ConfigCallback(std::string yaml) : yaml_(std::move(yaml)) {}
  std::string state_key() const override { return kConfigStateKey; }
  void on_fit_start(Trainer& trainer, Module&) override {
    if (!trainer.strategy().is_global_zero()) return;
    std::string dir = trainer.log_dir();
    if (dir.empty()) dir = trainer.default_root_dir();
    std::error_code ec;
    fs::create_directories(dir, ec);
    const std::string path = (fs::path(dir) / "config.yaml").string();
    std::ofstream out(path);
    out << yaml_;
    out.flush();
    if (ec || !out) {
      throw ConfigError(str("CLI: cannot write the run's config \"", path,
                            "\": ", ec ? ec.message() : std::string(std::strerror(errno)),
                            ". Make the directory writable (trainer.default_root_dir)."));
    }
  }
  // yaml (string): the run's resolved config, which a resumed run's CLI reads
  // back (checkpoint_config).
  StateDict state_dict() const override {
    StateDict state;
    state.set("yaml", yaml_);
    return state;
  }

 private:
  std::string yaml_;
};

// The file of checkpoint `path` that holds its run's config: the path, or
// rank 0's shard of a directory of per-rank shards; "" when there is none.
std::string config_file_of(const std::string& path) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return path;
  if (!fs::is_directory(path, ec)) return "";
  try {
    const auto manifest = ShardedCheckpoint::read_manifest(path);
    if (manifest.shards.empty()) return "";
    return (fs::path(path) / manifest.shards.front()).string();
  } catch (const std::exception&) {
    return "";
  }
}

// The config checkpoint `path` holds ("" when none), or nullopt when it
// cannot be loaded (the Trainer then reports it, or passes it over for an
// older one).
std::optional<std::string> checkpoint_config(const std::string& path) {
  const std::string file = config_file_of(path);
  if (file.empty()) return std::nullopt;
  try {
    TorchCheckpointIO io;
    StateDict checkpoint = io.load_checkpoint(file);
    const StateDict* callbacks = checkpoint.find_section("callbacks");
    const StateDict* config = callbacks ? callbacks->find_section(kConfigStateKey) : nullptr;
    const c10::IValue* yaml = config ? config->find("yaml") : nullptr;
    return yaml != nullptr && yaml->isString() ? yaml->toStringRef() : std::string();
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

using Form = detail::ConfigValueForm;

// A value from a file, the checkpoint or the command line.
struct Item {
  std::string key;  // dotted
  std::string text;
  std::string source;
  Form form = Form::kScalar;
};

struct NodeText {
  std::string text;
  Form form = Form::kScalar;
};

// The text of a YAML value: a scalar as written, a list joined by commas,
// null as "none".
std::optional<NodeText> node_text(const YAML::Node& node) {
  if (node.IsNull()) return NodeText{"none", Form::kNull};
  if (node.IsScalar()) return NodeText{node.Scalar(), Form::kScalar};
  if (node.IsSequence()) {
    std::vector<std::string> parts;
    for (const auto& item : node) {
      if (!item.IsScalar()) return std::nullopt;
      parts.push_back(item.Scalar());
    }
    return NodeText{join(parts, ","), Form::kList};
  }
  return std::nullopt;
}

// "" or why a config's null or list cannot be the value of a key that
// takes free text (a path, a name).
std::string text_form_problem(Form form) {
  switch (form) {
    case Form::kNull:
      return "a null (~, null, or nothing after the colon), and this key takes text (a path or "
             "a name), which null would make the word \"none\". Write the value (\"\" for an "
             "empty one), or leave the key out for its default.";
    case Form::kList:
      return "a list, and this key takes one value. Write it without brackets (in quotes if "
             "it holds a comma).";
    case Form::kScalar: break;
  }
  return "";
}

std::string line_of(const YAML::Node& node) {
  const YAML::Mark mark = node.Mark();
  return mark.line >= 0 ? str(" line ", mark.line + 1) : std::string();
}

// The "did you mean" of unknown(), skipped for a name far longer than any
// candidate (no candidate is within a third of it, and the edit distance
// would cost its length times theirs).
std::string unknown_name(const std::string& what, const std::string& name,
                         const std::vector<std::string>& candidates, const char* prefix) {
  if (name.size() > 200) return str(what, ".");
  return unknown(what, name, candidates, prefix);
}

// The text of the --config file at `path`, through one checked open
// (detail::read_small_file: nothing that could block is opened, at most
// CLI::kMaxConfigFileBytes are read). "" with `text` set, or the problem:
// the path, what is wrong and what to do.
std::string read_config_file(const std::string& path, std::string& text) {
  constexpr uint64_t kMax = CLI::kMaxConfigFileBytes;
  const std::string what = str("--config ", path);
  using Problem = detail::SmallFileRead::Problem;
  detail::SmallFileRead read = detail::read_small_file(path, kMax);
  switch (read.problem) {
    case Problem::kNone: text = std::move(read.text); return "";
    case Problem::kMissing:
      return str(what, ": cannot read it: ",
                 read.error == ENOENT ? std::string("it does not exist. Check the path")
                                      : std::string(std::strerror(read.error)),
                 ". Pass the path of a YAML file.");
    case Problem::kNotRegular:
      return str(what, " is ", detail::file_kind(read.mode),
                 ", not a config file. Pass the path of a YAML file (--print_config writes one).");
    case Problem::kTooLarge:
      return str(what, " is ", detail::size_text(read.size),
                 "; a config file may be at most 1 MiB (", kMax,
                 " bytes). Pass the YAML file of the run's settings (a few KiB), not data.");
    case Problem::kCannotOpen:
      return str(what, ": cannot open it for reading: ", std::strerror(read.error),
                 read.error == EACCES ? ". Give this user read permission on it (and search "
                                        "permission on its directories)."
                                      : ".");
    case Problem::kCannotRead:
      return str(what, ": cannot read it: ", std::strerror(read.error), ".");
  }
  return str(what, ": cannot read it.");
}

// Where `text` holds a byte YAML never allows (a control character other
// than tab, newline and carriage return: a NUL, say, in a binary file or
// one cut by a crash): "line N holds byte 0x00", or "" when there is none.
std::string control_byte(const std::string& text) {
  int line = 1;
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte == '\n') ++line;
    if ((byte < 0x20 && byte != '\t' && byte != '\n' && byte != '\r') || byte == 0x7f) {
      char hex[5];
      std::snprintf(hex, sizeof(hex), "0x%02x", byte);
      return str("line ", line, " holds byte ", hex, byte == 0 ? " (a NUL)" : "");
    }
  }
  return {};
}

// How many YAML documents with content `text` holds, from its document
// markers ("---" and "..." at the start of a line; they end any scalar
// there): YAML::Load reads the first and silently drops the rest. A linear
// scan (yaml-cpp's LoadAll does not return on some broken inputs).
int yaml_documents(const std::string& text) {
  int documents = 0;
  bool content = false;  // in the document being read
  auto marker = [](std::string_view line, const char* mark) {
    return line.substr(0, 3) == mark &&
           (line.size() == 3 || line[3] == ' ' || line[3] == '\t' || line[3] == '\r');
  };
  auto has_content = [](std::string_view rest) {
    const size_t at = rest.find_first_not_of(" \t\r");
    return at != std::string_view::npos && rest[at] != '#';
  };
  std::string_view all(text);
  for (size_t begin = 0; begin < all.size();) {
    size_t end = all.find('\n', begin);
    if (end == std::string_view::npos) end = all.size();
    const std::string_view line = all.substr(begin, end - begin);
    begin = end + 1;
    if (marker(line, "---") || marker(line, "...")) {
      if (content) ++documents;
      content = line[0] == '-' && has_content(line.substr(3));
    } else if (!line.empty() && line[0] == '%') {
      continue;  // a directive
    } else if (has_content(line)) {
      content = true;
    }
  }
  return documents + (content ? 1 : 0);
}

// "line 3", or "line 3 column 7" where `other` is on the same line (two
// keys of one flow mapping).
std::string mark_text(const YAML::Mark& mark, const YAML::Mark& other) {
  if (mark.line < 0) return "an unknown line";
  return mark.line == other.line ? str("line ", mark.line + 1, " column ", mark.column + 1)
                                 : str("line ", mark.line + 1);
}

std::string duplicate_key(const std::string& source, const std::string& key,
                          const YAML::Mark& first, const YAML::Mark& again) {
  return str(source, " ", mark_text(again, first), ": duplicate key ", shortened(key),
             ", first at ", mark_text(first, again),
             ". YAML allows each key once in a mapping (one value would win silently); keep one.");
}

// Every key given twice in one mapping anywhere under `root`, block or flow
// style (yaml-cpp keeps both). A hash set per mapping keeps 10 000 keys
// linear; each collection of a file is visited once (`visited`: by position
// and kind, shared by the calls for one file), so that aliases (*a) cannot
// make the walk exponential, and the walk is iterative (no recursion).
void find_duplicate_keys(const YAML::Node& root, const std::string& path, const std::string& source,
                         std::unordered_set<long long>& visited,
                         std::vector<std::string>& problems) {
  std::vector<std::pair<YAML::Node, std::string>> todo{{root, path}};
  while (!todo.empty()) {
    auto [node, prefix] = std::move(todo.back());
    todo.pop_back();
    if (!node.IsMap() && !node.IsSequence()) continue;
    const YAML::Mark mark = node.Mark();
    if (mark.pos >= 0 && !visited.insert(2LL * mark.pos + (node.IsMap() ? 1 : 0)).second) continue;
    if (node.IsSequence()) {
      for (const auto& item : node) todo.emplace_back(item, prefix + "[]");
      continue;
    }
    std::unordered_map<std::string, YAML::Mark> seen;
    for (const auto& entry : node) {
      const YAML::Node& key = entry.first;
      if (key.IsScalar()) {
        const std::string& name = key.Scalar();
        // The path for messages (shortened: each entry below keeps a copy).
        const std::string dotted = shortened(prefix.empty() ? name : prefix + "." + name);
        const auto [it, fresh] = seen.emplace(name, key.Mark());
        if (!fresh) problems.push_back(duplicate_key(source, dotted, it->second, key.Mark()));
        todo.emplace_back(entry.second, dotted);
      } else {
        todo.emplace_back(key, prefix);
        todo.emplace_back(entry.second, prefix);
      }
    }
  }
}

// `problem`, found by the Trainer's checks, prefixed with where the values
// it names came from when that is a file (or a checkpoint's config):
// "a.yaml line 4: deterministic=\"maybe\": pass true, false or \"warn\"."
// The flags are looked for in the problem's head (up to its first ": " or
// ". "), as name=..., name[...] or, failing those, "name ".
template <class Setting>
std::string with_origin(const std::string& problem, const std::map<std::string, Setting>& values,
                        const char* default_source, const char* command_line) {
  size_t end = std::min(problem.find(": "), problem.find(". "));
  const std::string head = problem.substr(0, end == std::string::npos ? problem.size() : end);
  // Where `name` followed by `after` first stands as a word in the head, or npos.
  auto named = [&](const std::string& name, const std::string& after) {
    for (size_t at = head.find(name + after); at != std::string::npos;
         at = head.find(name + after, at + 1)) {
      const char before = at == 0 ? ' ' : head[at - 1];
      if (!std::isalnum(static_cast<unsigned char>(before)) && before != '_' && before != '.') {
        return at;
      }
    }
    return std::string::npos;
  };
  std::vector<std::tuple<size_t, std::string, std::string>> origins;  // at, flag, source
  for (const std::vector<std::string>& afters :
       {std::vector<std::string>{"=", "["}, std::vector<std::string>{" "}}) {
    bool any_named = false;
    for (const auto& flag : trainer_flags()) {
      size_t at = std::string::npos;
      for (const auto& after : afters) at = std::min(at, named(flag.name, after));
      if (at == std::string::npos) continue;
      any_named = true;
      const auto it = values.find("trainer." + flag.name);
      if (it == values.end() || it->second.source == default_source ||
          it->second.source == command_line) {
        continue;
      }
      origins.emplace_back(at, "trainer." + flag.name, it->second.source);
    }
    if (any_named) break;
  }
  std::sort(origins.begin(), origins.end());
  if (origins.empty()) return problem;
  if (origins.size() == 1) return str(std::get<2>(origins[0]), ": ", problem);
  std::vector<std::string> parts;
  for (const auto& [at, flag, source] : origins) parts.push_back(str(source, " (", flag, ")"));
  return str(join(parts, ", "), ": ", problem);
}

}  // namespace

// ---- OptionGroup.

OptionGroup& OptionGroup::add_option(Option option) {
  for (const auto& o : options_) {
    if (o.name == option.name) {
      throw ConfigError(str("CLI: option \"", option.name,
                            "\" is added twice to one section. Give each a name of its own."));
    }
  }
  if (option.name.empty() || option.name.find_first_of(". =") != std::string::npos) {
    throw ConfigError(str("CLI: option name \"", option.name,
                          "\" is empty or holds '.', ' ' or '='. Use a snake_case name."));
  }
  // The CLI's own flags and, beside the program's own options, the
  // sections: an option of such a name could not be set (--config reads a
  // file) or would make the flag ambiguous (--ckpt_path, in any section;
  // --model.config is the model's option).
  const std::string& n = option.name;
  const bool section = n == "trainer" || n == "model" || n == "data";
  const bool flag = n == "config" || n == "print_config" || n == "help";
  if (n == "ckpt_path" || (top_level_ && (section || flag))) {
    throw ConfigError(str("CLI: option name \"", n, "\" is the CLI's own (",
                          section ? "a section of the config" : str("--", n),
                          "). Give the option another name."));
  }
  options_.push_back(std::move(option));
  return *this;
}

OptionGroup& OptionGroup::add(const std::string& name, bool& value, std::string help) {
  return add_option({flag_key(name), std::move(help), true,
                     [&value] { return std::string(value ? "true" : "false"); },
                     [&value](const std::string& t) -> std::string {
                       const auto v = parse_bool(t);
                       if (!v) return "pass true or false.";
                       value = *v;
                       return "";
                     }});
}

template <class Int>
OptionGroup& OptionGroup::add_integer(const std::string& name, Int& value, std::string help) {
  return add_option(
      {flag_key(name), std::move(help), false, [&value] { return std::to_string(value); },
       [&value](const std::string& t) -> std::string {
         long long v = 0;
         auto problem =
             parse_integer(t, std::numeric_limits<Int>::min(), std::numeric_limits<Int>::max(), v);
         if (problem.empty()) value = static_cast<Int>(v);
         return problem;
       }});
}

OptionGroup& OptionGroup::add(const std::string& name, int& value, std::string help) {
  return add_integer(name, value, std::move(help));
}

OptionGroup& OptionGroup::add(const std::string& name, int64_t& value, std::string help) {
  return add_integer(name, value, std::move(help));
}

OptionGroup& OptionGroup::add(const std::string& name, double& value, std::string help) {
  return add_option({flag_key(name), std::move(help), false,
                     [&value] { return number_text(value); },
                     [&value](const std::string& t) -> std::string {
                       const auto v = parse_double(t);
                       if (!v) return not_a_double(t) + ".";
                       value = *v;
                       return "";
                     }});
}

OptionGroup& OptionGroup::add(const std::string& name, std::string& value, std::string help) {
  return add_option({flag_key(name), std::move(help), false, [&value] { return value; },
                     [&value](const std::string& t) -> std::string {
                       value = t;
                       return "";
                     },
                     /*is_text=*/true});
}

// ---- CLI.

CLI::CLI(CLIOptions options)
    : options_(std::move(options)),
      subcommand_(options_.default_subcommand),
      trainer_(options_.trainer_defaults) {}

std::vector<CLI::Key> CLI::keys() const {
  std::vector<Key> out;
  for (const auto& f : trainer_flags()) out.push_back({"trainer", f.name, f.help, false});
  // Flags a bare --trainer.flag turns on.
  for (auto& k : out) {
    const std::string d = find_trainer_flag(k.name)->get(TrainerOptions());
    k.is_bool = d == "true" || d == "false" || k.name == "fast_dev_run";
  }
  for (const auto& o : model_.options()) out.push_back({"model", o.name, o.help, o.is_bool});
  for (const auto& o : data_.options()) out.push_back({"data", o.name, o.help, o.is_bool});
  out.push_back({"", "ckpt_path", kCkptPathHelp, false});
  for (const auto& o : program_.options()) out.push_back({"", o.name, o.help, o.is_bool});
  return out;
}

std::optional<int> CLI::parse(int argc, const char* const* argv) {
  std::vector<std::string> args(argv + std::min(argc, 1), argv + argc);
  std::string failure;  // its first line tells the other ranks
  try {
    return parse_arguments(args, std::cout) ? std::nullopt : std::optional<int>(0);
  } catch (const FlagError& e) {
    const auto& problems = e.problems();
    const size_t count = std::max(problems_found_, problems.size());
    std::cerr << options_.program << ": "
              << (count == 1 ? problems.front()
                             : str(count, " problems with the configuration:\n  - ",
                                   join(problems, "\n  - ")))
              << "\n"
              << options_.program << " --help lists every option." << std::endl;
    failure = count == 1 ? problems.front()
                         : str(problems.front(), " (and ", count - 1, " more problems)");
  } catch (const std::exception& e) {
    // ConfigError, and whatever else reading the configuration raised: a
    // message and status 2, never an abort.
    failure = error_message(e);
    std::cerr << options_.program << ": " << failure << std::endl;
  }
  // Where this is one rank of several that srun (or the like) started and
  // the configuration fails on this one only (a file missing on its
  // machine), the others would wait for it at the rendezvous.
  detail::announce_failure_before_joining(str(options_.program, ": ", failure));
  return 2;
}

bool CLI::parse_arguments(const std::vector<std::string>& args, std::ostream& out) {
  problems_found_ = 0;
  const std::vector<Key> all = keys();
  std::vector<std::string> problems;
  std::vector<std::string> dotted;
  for (const auto& k : all) dotted.push_back(k.dotted());
  auto find_key = [&](const std::string& key) -> const Key* {
    for (const auto& k : all) {
      if (k.dotted() == key) return &k;
    }
    return nullptr;
  };

  // ---- The command line.
  size_t i = 0;
  subcommand_ = options_.default_subcommand;
  lr_find_ = false;
  scale_batch_size_ = false;
  // The stage a subcommand runs: the stages by name, and the two tuners
  // (on fit's data); nothing for a word that is none.
  auto stage_of = [](const std::string& word) -> std::optional<Stage> {
    for (auto s : {Stage::kFit, Stage::kValidate, Stage::kTest, Stage::kPredict}) {
      if (word == to_string(s)) return s;
    }
    if (word == "lr_find" || word == "scale_batch_size") return Stage::kFit;
    return std::nullopt;
  };
  if (!args.empty()) {
    if (const auto stage = stage_of(args[0])) {
      subcommand_ = *stage;
      lr_find_ = args[0] == "lr_find";
      scale_batch_size_ = args[0] == "scale_batch_size";
      i = 1;
    }
  }
  bool help_wanted = false, print_config = false;
  std::vector<std::string> config_files;
  std::vector<Item> command_line;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "-h" || arg == "--help") {
      help_wanted = true;
      continue;
    }
    if (i > 0 && stage_of(arg)) {
      problems.push_back(str(in_quotes(arg), ": a subcommand comes first, before every flag (",
                             options_.program, " ", arg, " --KEY VALUE ...), and only one."));
      continue;
    }
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      problems.push_back(str(in_quotes(arg),
                             ": expected a flag such as --devices 2 (--KEY VALUE or "
                             "--KEY=VALUE)",
                             i == 0 ? ", or a subcommand: fit, validate, test, predict, lr_find, "
                                      "scale_batch_size."
                                    : "."));
      continue;
    }
    std::string name = arg.substr(2);
    std::optional<std::string> value;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    name = flag_key(name);
    if (name == "print_config" || name == "help") {
      // --print_config[=true|false]; --help takes none.
      const std::optional<bool> on = value ? parse_bool(*value) : std::optional<bool>(true);
      if (!on || (name == "help" && value)) {
        problems.push_back(str("--", name, "=", shortened(*value), ": ",
                               name == "help" ? "--help takes no value. Pass --help alone."
                                              : "pass --print_config alone (or =true, =false)."));
      } else {
        (name == "help" ? help_wanted : print_config) = *on;
      }
      continue;
    }
    // Which key a name means: dotted, or a flat name that is unique.
    std::string key;
    if (name == "config") {
      key = "config";
    } else if (name.find('.') != std::string::npos) {
      if (find_key(name) == nullptr) {
        problems.push_back(
            unknown_name(str("--", shortened(name), ": unknown flag"), name, dotted, "--"));
      } else {
        key = name;
      }
    } else {
      std::vector<std::string> matches;
      for (const auto& k : all) {
        if (k.name == name) matches.push_back(k.dotted());
      }
      if (matches.size() > 1) {
        problems.push_back(str("--", name, " is ambiguous: it names ", join(matches, " and "),
                               ". Write the dotted form, e.g. --", matches[0], "."));
      } else if (matches.empty()) {
        std::vector<std::string> flat;
        for (const auto& k : all) flat.push_back(k.name);
        problems.push_back(unknown_name(
            str("--", shortened(name), ": unknown flag"), name,
            name.size() > 200 || closest_match(name, flat).empty() ? dotted : flat, "--"));
      } else {
        key = matches[0];
      }
    }
    if (!value) {
      const Key* k = key.empty() || key == "config" ? nullptr : find_key(key);
      const bool next_is_value = i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0;
      if (next_is_value) {
        value = args[++i];
      } else if (k != nullptr && k->is_bool) {
        value = "true";
      } else if (!key.empty()) {
        problems.push_back(str("--", name, " has no value: pass --", name, " VALUE."));
        continue;
      }
    }
    if (key.empty()) continue;
    if (key == "config") {
      config_files.push_back(*value);
    } else {
      command_line.push_back({key, *value, kCommandLine});
    }
  }
  if (help_wanted) {
    out << help();
    return false;
  }

  // ---- Config files.
  std::vector<std::string> programs_keys;  // left out under trainer_flags_only
  auto read_config = [&](const YAML::Node& root, const std::string& source, bool from_checkpoint,
                         std::vector<Item>& items) {
    if (!root || root.IsNull()) return;
    if (!root.IsMap()) {
      problems.push_back(str(source, line_of(root),
                             ": the top level is not a mapping. Write sections (trainer:, model:, "
                             "data:) and top-level keys."));
      return;
    }
    // Where each key was set in this file: a key given twice (in one
    // mapping, in a section given twice, or spelled max-epochs and
    // max_epochs) is an error, not "the last one wins".
    std::unordered_map<std::string, YAML::Mark> set_at;
    std::unordered_set<long long> visited;
    auto once = [&](const std::string& key, const YAML::Node& key_node) {
      if (from_checkpoint) return true;
      const auto [it, fresh] = set_at.emplace(key, key_node.Mark());
      if (!fresh) problems.push_back(duplicate_key(source, key, it->second, key_node.Mark()));
      return fresh;
    };
    // The name of a key, or nothing (and a problem) for a key that is a
    // list, a mapping or null.
    auto name_of = [&](const YAML::Node& key_node) -> std::optional<std::string> {
      if (key_node.IsScalar()) return flag_key(key_node.Scalar());
      problems.push_back(str(source, line_of(key_node),
                             ": a key that is not a name (a list, a mapping or null). Write "
                             "name: value."));
      return std::nullopt;
    };
    auto add = [&](const std::string& key, const YAML::Node& key_node, const YAML::Node& value) {
      if (!from_checkpoint) find_duplicate_keys(value, key, source, visited, problems);
      if (!once(key, key_node)) return;
      if (find_key(key) == nullptr) {
        const bool merge_key =
            key == "<<" || (key.size() > 3 && key.compare(key.size() - 3, 3, ".<<") == 0);
        if (merge_key && !from_checkpoint) {
          const std::string under = key.size() > 2 ? key.substr(0, key.size() - 3) : "";
          problems.push_back(str(source, line_of(key_node),
                                 ": a YAML merge key (<<", under.empty() ? "" : " under ",
                                 shortened(under),
                                 "): this reader does not merge mappings. Write the keys out ",
                                 under.empty() ? "at the top level" : "under " + shortened(under),
                                 ", or pass the shared ones in a --config of their own."));
          return;
        }
        if (options_.trainer_flags_only && !from_checkpoint && key.rfind("trainer.", 0) != 0) {
          programs_keys.push_back(shortened(key));
        } else if (from_checkpoint) {
          std::cerr << options_.program << ": note: " << source << " has \"" << shortened(key)
                    << "\", which this program does not know; it is left out." << std::endl;
        } else if (problems.size() < CLI::kMaxProblemsListed) {
          problems.push_back(unknown_name(
              str(source, line_of(key_node), ": unknown key ", shortened(key)), key, dotted, ""));
        } else {  // counted, not listed: no suggestion to compute
          problems.push_back(str(source, line_of(key_node), ": unknown key ", shortened(key), "."));
        }
        return;
      }
      if (from_checkpoint && key == "ckpt_path") return;  // where that run started from
      const auto text = node_text(value);
      if (!text) {
        problems.push_back(str(source, line_of(key_node), ": ", shortened(key),
                               " is a mapping or a nested list; write a value (or a list of "
                               "values)."));
        return;
      }
      items.push_back({key, text->text, source + line_of(key_node), text->form});
    };
    for (const auto& entry : root) {
      const auto section = name_of(entry.first);
      if (!section) continue;
      const YAML::Node& value = entry.second;
      if (*section == "trainer" || *section == "model" || *section == "data") {
        // A section given twice is reported; its keys are still read, so
        // that a key set in both is named too.
        once(*section, entry.first);
        if (value.IsNull()) continue;
        if (!value.IsMap()) {
          problems.push_back(str(source, line_of(entry.first), ": ", *section,
                                 " is not a mapping; write its keys below it, indented."));
          continue;
        }
        for (const auto& sub : value) {
          if (const auto name = name_of(sub.first)) {
            add(*section + "." + *name, sub.first, sub.second);
          } else if (!from_checkpoint) {
            find_duplicate_keys(sub.second, *section, source, visited, problems);
          }
        }
      } else {
        add(*section, entry.first, value);
      }
    }
  };
  std::vector<Item> from_files;
  for (const auto& file : config_files) {
    std::string text;
    if (std::string problem = read_config_file(file, text); !problem.empty()) {
      problems.push_back(std::move(problem));
      continue;
    }
    if (const std::string where = control_byte(text); !where.empty()) {
      problems.push_back(str("--config ", file, ": ", where,
                             ", which YAML text never holds: it is not a config file, or it "
                             "was damaged. Pass the YAML file you meant."));
      continue;
    }
    try {
      if (const int documents = yaml_documents(text); documents > 1) {
        problems.push_back(str("--config ", file, " holds ", documents,
                               " YAML documents (separated by \"---\"); a config file is one. "
                               "Merge them into one, or pass each with its own --config (the "
                               "later one wins)."));
        continue;
      }
      read_config(YAML::Load(text), file, false, from_files);
    } catch (const YAML::DeepRecursion& e) {
      // yaml-cpp's own message for this is "bad file".
      problems.push_back(str("--config ", file,
                             ": nested too deeply for the YAML parser (it gave up at line ",
                             e.mark.line + 1,
                             ", hundreds of levels in); a config nests a few levels "
                             "(trainer: then max_epochs: 3). Pass the YAML file you meant."));
    } catch (const YAML::Exception& e) {
      problems.push_back(str("--config ", file, ": not valid YAML: ", e.what(), "."));
    }
  }

  if (!programs_keys.empty()) {
    const size_t shown = std::min<size_t>(programs_keys.size(), 5);
    std::cerr << options_.program << ": note: the config sets keys of a program ("
              << join(std::vector<std::string>(programs_keys.begin(),
                                               programs_keys.begin() + static_cast<long>(shown)),
                      ", ")
              << (programs_keys.size() > shown ? str(" and ", programs_keys.size() - shown, " more")
                                               : std::string())
              << "), which " << options_.program
              << " does not read: they are left out. Its trainer: keys are read." << std::endl;
  }

  // ---- The checkpoint's config: under the files and the command line.
  // What the files and the command line set `key` to (the last one wins).
  auto configured = [&](const std::string& key, std::string fallback) {
    for (const auto* items : {&from_files, &command_line}) {
      for (const auto& item : *items) {
        if (item.key == key) fallback = item.text;
      }
    }
    return fallback;
  };
  std::string ckpt = configured("ckpt_path", "");
  std::string ckpt_yaml;  // the config it holds
  std::vector<Item> from_checkpoint;
  if (ckpt == "last" || ckpt == "auto" || ckpt == "best") {
    // The checkpoint the Trainer will start from, in the directory its
    // ModelCheckpoint writes to: the program's own one's dirpath, else
    // <default_root_dir>/checkpoints under the root configured so far.
    std::string dir;
    for (const auto& cb : options_.trainer_defaults.callbacks) {
      if (const auto* checkpoint = dynamic_cast<const ModelCheckpoint*>(cb.get())) {
        dir = checkpoint->options().dirpath;
        break;
      }
    }
    if (dir.empty()) {
      const std::string root =
          configured("trainer.default_root_dir", options_.trainer_defaults.default_root_dir);
      dir = (fs::path(root.empty() ? "." : root) / "checkpoints").string();
    }
    // The newest that loads, as CheckpointConnector::newest_checkpoint picks
    // the newest that verifies (a damaged last.ckpt is passed over); "best"
    // is a checkpoint of the same run, whose config the newest one holds.
    ckpt.clear();
    for (const auto& candidate : checkpoints_newest_first(dir)) {
      if (auto yaml = checkpoint_config(candidate)) {
        ckpt = candidate;
        ckpt_yaml = std::move(*yaml);
        break;
      }
    }
  } else if (!ckpt.empty()) {
    ckpt_yaml = checkpoint_config(ckpt).value_or("");
  }
  if (!ckpt_yaml.empty()) {
    try {
      read_config(YAML::Load(ckpt_yaml), str("the config in checkpoint \"", ckpt, "\""), true,
                  from_checkpoint);
    } catch (const YAML::Exception& e) {
      std::cerr << options_.program << ": note: the config in checkpoint \"" << ckpt
                << "\" is not valid YAML (" << e.what() << "); it is left out." << std::endl;
    }
  }

  // ---- Everything, in order of precedence.
  std::map<std::string, Setting> values;
  {
    const TrainerOptions& d = options_.trainer_defaults;
    for (const auto& f : trainer_flags()) values["trainer." + f.name] = {f.get(d), kDefault};
    for (const auto& o : model_.options()) values["model." + o.name] = {o.get(), kDefault};
    for (const auto& o : data_.options()) values["data." + o.name] = {o.get(), kDefault};
    for (const auto& o : program_.options()) values[o.name] = {o.get(), kDefault};
    values["ckpt_path"] = {"", kDefault};
  }
  for (const auto* items : {&from_checkpoint, &from_files, &command_line}) {
    for (const auto& item : *items) {
      // A checkpoint's or a file's value that reads as the program's default
      // is that default: the program's own objects (a strategy, loggers)
      // print as their names, which would replace them (a config the CLI
      // wrote, fed back or resumed from, names them all).
      auto at = values.find(item.key);
      if (items != &command_line && at != values.end() && at->second.source == kDefault &&
          at->second.text == item.text) {
        continue;
      }
      values[item.key] = {item.text, item.source, item.form};
    }
  }
  apply(values, problems);
  // The Trainer's own checks of these values (ranges, conflicts, names the
  // connector judges), here, where each value's file and line are known.
  // --print_config prints a config for any machine: not judged against this one.
  std::string kind = "invalid_config";
  if (!print_config) {
    for (const auto& problem : trainer_problems(kind)) {
      // A value as long as the file is not quoted whole.
      constexpr size_t kLongest = 2000;
      problems.push_back(
          with_origin(problem.size() <= kLongest
                          ? problem
                          : str(problem.substr(0, kLongest), "... (", problem.size(), " bytes)"),
                      values, kDefault, kCommandLine));
    }
  }
  problems_found_ = problems.size();
  if (!problems.empty()) {
    if (problems.size() > CLI::kMaxProblemsListed) {
      const size_t more = problems.size() - CLI::kMaxProblemsListed;
      problems.resize(CLI::kMaxProblemsListed);
      problems.push_back(str("and ", more, " more (", problems_found_,
                             " problems in all); fix these and run again to see the rest."));
    }
    throw FlagError(kind, problems);
  }
  values_ = std::move(values);
  ckpt_path_ = values_.at("ckpt_path").text;
  if (ckpt_path_ == "none") ckpt_path_.clear();
  if (print_config) {
    out << config_yaml();
    return false;
  }
  return true;
}

std::vector<std::string> CLI::trainer_problems(std::string& kind) const {
  // parse() reports (and tells the other ranks of) what the checks find.
  const detail::NoFailureAnnouncement quiet;
  try {
    detail::check_trainer_options(trainer_);
  } catch (const FlagError& e) {
    kind = e.kind();
    return e.problems();
  } catch (const ConfigError& e) {
    return {e.what()};
  }
  return {};
}

void CLI::apply(std::map<std::string, Setting>& values, std::vector<std::string>& problems) {
  auto report = [&](const std::string& key, const Setting& s, const std::string& problem) {
    problems.push_back(
        str(key, ": ", in_quotes(shortened(s.text)), " (from ", s.source, "): ", problem));
  };
  // Defaults stay as the program set them (objects included): only what a
  // checkpoint, a file or the command line gave is applied.
  TrainerOptions trainer = options_.trainer_defaults;
  for (const auto& f : trainer_flags()) {
    const Setting& s = values.at("trainer." + f.name);
    if (s.source == kDefault) continue;
    if (const std::string problem = f.is_text ? text_form_problem(s.form) : ""; !problem.empty()) {
      report("trainer." + f.name, s, problem);
    } else if (std::string problem = f.set(trainer, s.text); !problem.empty()) {
      report("trainer." + f.name, s, problem);
    }
  }
  if (const Setting& s = values.at("trainer.logger");
      s.source != kDefault && !options_.trainer_defaults.loggers.empty()) {
    report("trainer.logger", s,
           str("this program passes its own loggers (", options_.trainer_defaults.loggers.size(),
               "), which the logger flag does not replace. Leave it out."));
  }
  auto apply_group = [&](const OptionGroup& group, const std::string& prefix) {
    for (const auto& o : group.options()) {
      const Setting& s = values.at(prefix + o.name);
      if (s.source == kDefault) continue;
      if (const std::string problem = o.is_text ? text_form_problem(s.form) : "";
          !problem.empty()) {
        report(prefix + o.name, s, problem);
      } else if (std::string problem = o.set(s.text); !problem.empty()) {
        report(prefix + o.name, s, problem);
      }
    }
  };
  apply_group(model_, "model.");
  apply_group(data_, "data.");
  apply_group(program_, "");
  trainer_ = std::move(trainer);
}

TrainerOptions CLI::trainer_options() const {
  TrainerOptions options = trainer_;
  options.callbacks.push_back(std::make_shared<ConfigCallback>(config_yaml()));
  return options;
}

std::string CLI::value(const std::string& key) const {
  auto it = values_.find(key);
  if (it == values_.end()) {
    std::vector<std::string> known;
    for (const auto& [k, _] : values_) known.push_back(k);
    throw ConfigError(str("CLI.value(\"", key, "\"): no such key", did_you_mean(key, known),
                          "Call it after parse() with a dotted key (trainer.max_epochs)."));
  }
  return it->second.text;
}

std::string CLI::config_yaml() const {
  YAML::Emitter out;
  out << YAML::Comment(str(options_.program, " ", to_string(subcommand_),
                           ": the complete configuration. Run it again with --config FILE."));
  out << YAML::BeginMap;
  auto section = [&](const std::string& name, const std::vector<std::string>& names) {
    out << YAML::Key << name << YAML::Value;
    if (names.empty()) {
      out << YAML::Flow << YAML::BeginMap << YAML::EndMap;
      return;
    }
    out << YAML::BeginMap;
    for (const auto& n : names) {
      auto it = values_.find(name + "." + n);
      out << YAML::Key << n << YAML::Value
          << (it == values_.end() ? std::string() : it->second.text);
    }
    out << YAML::EndMap;
  };
  std::vector<std::string> names;
  for (const auto& f : trainer_flags()) names.push_back(f.name);
  section("trainer", names);
  names.clear();
  for (const auto& o : model_.options()) names.push_back(o.name);
  section("model", names);
  names.clear();
  for (const auto& o : data_.options()) names.push_back(o.name);
  section("data", names);
  out << YAML::Key << "ckpt_path" << YAML::Value << ckpt_path_;
  for (const auto& o : program_.options()) {
    auto it = values_.find(o.name);
    out << YAML::Key << o.name << YAML::Value << (it == values_.end() ? o.get() : it->second.text);
  }
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string CLI::help() const {
  std::ostringstream out;
  out << "usage: " << options_.program
      << " [fit|validate|test|predict|lr_find|scale_batch_size] [--config FILE]... [--print_config] [--KEY "
         "VALUE]...\n";
  if (!options_.description.empty()) out << "\n" << options_.description << "\n";
  out << "\nSubcommands: fit, validate, test, predict (default: "
      << to_string(options_.default_subcommand)
      << "); lr_find: the learning-rate finder on the fit's data (prints a suggested rate, draws "
         "lr_find.png under default_root_dir); scale_batch_size: the largest training batch "
         "that fits in memory (prints each trial and the size found).\n"
      << "Values come from, lowest first: the defaults below; the config saved in the checkpoint\n"
         "given as ckpt_path; each --config file in turn; the command line. A key is written\n"
         "--section.key (--trainer.max_epochs 5), or by its name alone where that is unique\n"
         "(--max_epochs 5); kebab-case works too (--max-epochs).\n\n"
      << "  --config FILE        a YAML file with sections trainer:, model:, data: and top-level "
         "keys\n"
      << "  --print_config       print the complete configuration as YAML and exit\n";
  const TrainerOptions& d = options_.trainer_defaults;
  auto line = [&](const std::string& key, const std::string& dflt, const std::string& help) {
    out << "  --" << key << " (" << (dflt.empty() ? "\"\"" : dflt) << ")\n      " << help << "\n";
  };
  std::string group;
  for (const auto& f : trainer_flags()) {
    if (f.group != group) {
      group = f.group;
      out << "\ntrainer: " << group << "\n";
    }
    line("trainer." + f.name, f.get(d), f.help);
  }
  auto section = [&](const char* title, const OptionGroup& g, const std::string& prefix) {
    if (g.options().empty()) return;
    out << "\n" << title << "\n";
    for (const auto& o : g.options()) {
      auto it = values_.find(prefix + o.name);
      line(prefix + o.name, it == values_.end() ? o.get() : it->second.text, o.help);
    }
  };
  section("model:", model_, "model.");
  section("data:", data_, "data.");
  out << "\n" << options_.program << ":\n";
  line("ckpt_path", "", kCkptPathHelp);
  for (const auto& o : program_.options()) line(o.name, o.get(), o.help);
  return out.str();
}

CLI::Result CLI::run(Trainer& trainer, Module& model, DataModule& data) const {
  Result result;
  if (lr_find_) {
    if (!ckpt_path_.empty()) {
      throw ConfigError(str(options_.program, " lr_find: ckpt_path=\"", ckpt_path_,
                            "\": the finder sweeps the module as the program builds it and puts "
                            "it back; it does not resume a run. Drop ckpt_path, or load the "
                            "weights in configure_model()."));
    }
    Tuner tuner(trainer.options());
    LRFinderOptions sweep;
    sweep.plot_path = (fs::path(trainer.default_root_dir()) / "lr_find.png").string();
    std::error_code ec;
    fs::create_directories(trainer.default_root_dir(), ec);
    result.lr_find = tuner.lr_find(model, data, sweep);
    const LRFinderResult& found = *result.lr_find;
    // Every rank that swept in step (under torchrun) has the same result:
    // global rank 0 says it.
    const bool says = trainer.strategy().is_global_zero();
    if (found.skipped) {
      if (says) std::cout << found.note << "\n";
      return result;
    }
    if (!says) {
      if (!found.suggestion) throw ConfigError(str(options_.program, " ", found.note));
      return result;
    }
    std::cout << options_.program << " lr_find: " << found.lrs.size() << " steps from "
              << (found.lrs.empty() ? 0.0 : found.lrs.front()) << " to "
              << (found.lrs.empty() ? 0.0 : found.lrs.back())
              << (found.diverged ? " (stopped: the loss diverged)" : "") << "\n";
    if (found.suggestion) {
      std::cout << options_.program << " lr_find: suggested learning rate " << *found.suggestion
                << "\n";
    }
    if (fs::exists(sweep.plot_path, ec)) std::cout << "curve: " << sweep.plot_path << "\n";
    // Found nothing: an error, so that a script sees it in the exit status.
    if (!found.suggestion) throw ConfigError(str(options_.program, " ", found.note));
    if (!found.note.empty()) std::cout << found.note << "\n";
    return result;
  }
  if (scale_batch_size_) {
    if (!ckpt_path_.empty()) {
      throw ConfigError(str(options_.program, " scale_batch_size: ckpt_path=\"", ckpt_path_,
                            "\": the finder tries the module as the program builds it and puts "
                            "it back; it does not resume a run. Drop ckpt_path."));
    }
    Tuner tuner(trainer.options());
    result.scale_batch_size = tuner.scale_batch_size(model, data, batch_size_finder_);
    const BatchSizeFinderResult& found = *result.scale_batch_size;
    if (found.skipped) {
      std::cout << found.note << "\n";
      return result;
    }
    for (const auto& t : found.trials) {
      std::cout << options_.program << " scale_batch_size: batch_size=" << t.batch_size
                << (t.fits ? " fits" : " ran out of memory");
      if (t.peak_bytes >= 0) std::cout << " (peak " << t.peak_bytes << " bytes of tensors)";
      std::cout << "\n";
    }
    if (found.batch_size == 0) throw ConfigError(str(options_.program, " ", found.note));
    std::cout << options_.program
              << " scale_batch_size: the largest batch size that fit: " << found.batch_size << "\n";
    if (!found.note.empty()) std::cout << found.note << "\n";
    return result;
  }
  if (subcommand_ != Stage::kFit && ckpt_path_.empty() && trainer.strategy().is_global_zero()) {
    // What Lightning's CLI does too, said: the weights are the model's own.
    detail::print_note(
        str(options_.program, " ", to_string(subcommand_),
            ": no ckpt_path, so the model runs with the weights it was built "
            "with (untrained, unless the program loads some). Pass --ckpt_path "
            "last (the newest checkpoint of this run's directory) or a checkpoint file."));
  }
  switch (subcommand_) {
    case Stage::kFit: result.fit = trainer.fit(model, data, {.ckpt_path = ckpt_path_}); break;
    case Stage::kValidate: result.metrics = trainer.validate(model, data, ckpt_path_); break;
    case Stage::kTest: result.metrics = trainer.test(model, data, ckpt_path_); break;
    case Stage::kPredict: result.predictions = trainer.predict(model, data, ckpt_path_); break;
  }
  return result;
}

}  // namespace fulgur
