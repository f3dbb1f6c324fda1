// fulgur::CLI: command lines and YAML config files (yaml-cpp) onto the
// Trainer's flag table and the program's own options.
#include "fulgur/cli/cli.h"

#include <torch/serialize/archive.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <sstream>

#include "fulgur/callbacks/callback.h"
#include "fulgur/core/errors.h"
#include "fulgur/plugins/io/torch_checkpoint_io.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/flags.h"

namespace fulgur {

namespace fs = std::filesystem;

const char* to_string(Subcommand subcommand) {
  switch (subcommand) {
    case Subcommand::Fit: return "fit";
    case Subcommand::Validate: return "validate";
    case Subcommand::Test: return "test";
    case Subcommand::Predict: return "predict";
  }
  return "fit";
}

namespace {

constexpr const char* kConfigStateKey = "fulgur.cli.config";
constexpr const char* kDefault = "default";
constexpr const char* kCkptPathHelp =
    "Checkpoint to start from: a file, \"last\" (the newest of this run that verifies), "
    "\"auto\" (the same, or a fresh start when there is none)";

// "--name: unknown option; did you mean --x?" or "--name: unknown option."
std::string unknown(const std::string& what, const std::string& name,
                    const std::vector<std::string>& candidates, const char* prefix) {
  std::string text = str(what, did_you_mean(name, candidates, prefix, ""));
  while (!text.empty() && text.back() == ' ') text.pop_back();
  return text;
}

std::string in_quotes(const std::string& text) { return "\"" + text + "\""; }

std::string parse_integer(const std::string& text, long long min, long long max,
                          long long& out) {
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
      throw ConfigError(str("CLI: cannot write the run's config \"", path, "\": ",
                            ec ? ec.message() : std::string(std::strerror(errno)),
                            ". Make the directory writable (trainer.default_root_dir)."));
    }
  }
  void save_state(torch::serialize::OutputArchive& archive) const override {
    archive.write("yaml", c10::IValue(yaml_));
  }

 private:
  std::string yaml_;
};

// The config a checkpoint holds ("" when none, or when it cannot be read:
// the Trainer reports an unreadable checkpoint when it loads it).
std::string checkpoint_config(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return "";
  try {
    TorchCheckpointIO io;
    torch::serialize::InputArchive archive;
    io.load_checkpoint(path, archive);
    torch::serialize::InputArchive callbacks, config;
    c10::IValue yaml;
    if (archive.try_read("callbacks", callbacks) && callbacks.try_read(kConfigStateKey, config) &&
        config.try_read("yaml", yaml) && yaml.isString()) {
      return yaml.toStringRef();
    }
  } catch (const std::exception&) {
  }
  return "";
}

// A value from a file, the checkpoint or the command line.
struct Item {
  std::string key;  // dotted
  std::string text;
  std::string source;
};

// The text of a YAML value: a scalar as written, a list joined by commas,
// null as "none".
std::optional<std::string> node_text(const YAML::Node& node) {
  if (node.IsNull()) return std::string("none");
  if (node.IsScalar()) return node.Scalar();
  if (node.IsSequence()) {
    std::vector<std::string> parts;
    for (const auto& item : node) {
      if (!item.IsScalar()) return std::nullopt;
      parts.push_back(item.Scalar());
    }
    return join(parts, ",");
  }
  return std::nullopt;
}

std::string line_of(const YAML::Node& node) {
  const YAML::Mark mark = node.Mark();
  return mark.line >= 0 ? str(" line ", mark.line + 1) : std::string();
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
  return add_option({flag_key(name), std::move(help), false, [&value] { return std::to_string(value); },
                     [&value](const std::string& t) -> std::string {
                       long long v = 0;
                       auto problem = parse_integer(t, std::numeric_limits<Int>::min(),
                                                    std::numeric_limits<Int>::max(), v);
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
  return add_option({flag_key(name), std::move(help), false, [&value] { return number_text(value); },
                     [&value](const std::string& t) -> std::string {
                       const auto v = parse_double(t);
                       if (!v) return "not a number.";
                       value = *v;
                       return "";
                     }});
}

OptionGroup& OptionGroup::add(const std::string& name, std::string& value, std::string help) {
  return add_option({flag_key(name), std::move(help), false, [&value] { return value; },
                     [&value](const std::string& t) -> std::string {
                       value = t;
                       return "";
                     }});
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
  try {
    return parse_arguments(args, std::cout) ? std::nullopt : std::optional<int>(0);
  } catch (const FlagError& e) {
    const auto& problems = e.problems();
    std::cerr << options_.program << ": "
              << (problems.size() == 1
                      ? problems.front()
                      : str(problems.size(), " problems with the configuration:\n  - ",
                            join(problems, "\n  - ")))
              << "\n"
              << options_.program << " --help lists every option." << std::endl;
    return 2;
  } catch (const ConfigError& e) {
    std::cerr << options_.program << ": " << e.what() << std::endl;
    return 2;
  }
}

bool CLI::parse_arguments(const std::vector<std::string>& args, std::ostream& out) {
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
  if (!args.empty()) {
    for (auto s : {Subcommand::Fit, Subcommand::Validate, Subcommand::Test, Subcommand::Predict}) {
      if (args[0] == to_string(s)) {
        subcommand_ = s;
        i = 1;
      }
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
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      problems.push_back(str(in_quotes(arg), ": expected a flag such as --devices 2 (--KEY VALUE or "
                             "--KEY=VALUE)",
                             i == 0 ? ", or a subcommand: fit, validate, test, predict." : "."));
      continue;
    }
    std::string name = arg.substr(2);
    std::optional<std::string> value;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    name = flag_key(name);
    if (name == "print_config") {
      print_config = true;
      continue;
    }
    // Which key a name means: dotted, or a flat name that is unique.
    std::string key;
    if (name == "config") {
      key = "config";
    } else if (name.find('.') != std::string::npos) {
      if (find_key(name) == nullptr) {
        problems.push_back(unknown(str("--", name, ": unknown flag"), name, dotted, "--"));
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
        problems.push_back(unknown(str("--", name, ": unknown flag"), name,
                                   closest_match(name, flat).empty() ? dotted : flat, "--"));
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
      command_line.push_back({key, *value, "the command line"});
    }
  }
  if (help_wanted) {
    out << help();
    return false;
  }

  // ---- Config files.
  auto read_config = [&](const YAML::Node& root, const std::string& source, bool from_checkpoint,
                         std::vector<Item>& items) {
    if (!root || root.IsNull()) return;
    if (!root.IsMap()) {
      problems.push_back(str(source, ": the top level is not a mapping. Write sections "
                                     "(trainer:, model:, data:) and top-level keys."));
      return;
    }
    auto add = [&](const std::string& key, const YAML::Node& value) {
      if (find_key(key) == nullptr) {
        if (from_checkpoint) {
          std::cerr << options_.program << ": note: " << source << " has \"" << key
                    << "\", which this program does not know; it is left out." << std::endl;
        } else {
          problems.push_back(
              unknown(str(source, line_of(value), ": unknown key ", key), key, dotted, ""));
        }
        return;
      }
      if (from_checkpoint && key == "ckpt_path") return;  // where that run started from
      const auto text = node_text(value);
      if (!text) {
        problems.push_back(str(source, line_of(value), ": ", key,
                               " is a mapping or a nested list; write a value (or a list of "
                               "values)."));
        return;
      }
      items.push_back({key, *text, source + line_of(value)});
    };
    for (const auto& entry : root) {
      const std::string section = flag_key(entry.first.as<std::string>());
      const YAML::Node& value = entry.second;
      if (section == "trainer" || section == "model" || section == "data") {
        if (value.IsNull()) continue;
        if (!value.IsMap()) {
          problems.push_back(str(source, line_of(value), ": ", section,
                                 " is not a mapping; write its keys below it, indented."));
          continue;
        }
        for (const auto& sub : value) {
          add(section + "." + flag_key(sub.first.as<std::string>()), sub.second);
        }
      } else {
        add(section, value);
      }
    }
  };
  std::vector<Item> from_files;
  for (const auto& file : config_files) {
    std::ifstream in(file);
    if (!in) {
      problems.push_back(str("--config ", file, ": cannot read it: ", std::strerror(errno),
                             ". Pass the path of a YAML file."));
      continue;
    }
    try {
      read_config(YAML::LoadFile(file), file, false, from_files);
    } catch (const YAML::Exception& e) {
      problems.push_back(str("--config ", file, ": not valid YAML: ", e.what(), "."));
    }
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
  std::vector<Item> from_checkpoint;
  if (ckpt == "last" || ckpt == "auto") {
    // The run's own last.ckpt, under the default_root_dir configured so far.
    const std::string root =
        configured("trainer.default_root_dir", options_.trainer_defaults.default_root_dir);
    ckpt = (fs::path(root.empty() ? "." : root) / "checkpoints" / "last.ckpt").string();
  }
  if (!ckpt.empty()) {
    if (const std::string yaml = checkpoint_config(ckpt); !yaml.empty()) {
      try {
        read_config(YAML::Load(yaml), str("the config in checkpoint \"", ckpt, "\""), true,
                    from_checkpoint);
      } catch (const YAML::Exception& e) {
        std::cerr << options_.program << ": note: the config in checkpoint \"" << ckpt
                  << "\" is not valid YAML (" << e.what() << "); it is left out." << std::endl;
      }
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
    for (const auto& item : *items) values[item.key] = {item.text, item.source};
  }
  apply(values, problems);
  if (!problems.empty()) throw FlagError("invalid_config", problems);
  values_ = std::move(values);
  ckpt_path_ = values_.at("ckpt_path").text;
  if (ckpt_path_ == "none") ckpt_path_.clear();
  if (print_config) {
    out << config_yaml();
    return false;
  }
  return true;
}

void CLI::apply(std::map<std::string, Setting>& values, std::vector<std::string>& problems) {
  auto report = [&](const std::string& key, const Setting& s, const std::string& problem) {
    problems.push_back(str(key, ": ", in_quotes(s.text), " (from ", s.source, "): ", problem));
  };
  // Defaults stay as the program set them (objects included): only what a
  // checkpoint, a file or the command line gave is applied.
  TrainerOptions trainer = options_.trainer_defaults;
  for (const auto& f : trainer_flags()) {
    const Setting& s = values.at("trainer." + f.name);
    if (s.source == kDefault) continue;
    if (std::string problem = f.set(trainer, s.text); !problem.empty()) {
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
      if (std::string problem = o.set(s.text); !problem.empty()) report(prefix + o.name, s, problem);
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
      out << YAML::Key << n << YAML::Value << (it == values_.end() ? std::string() : it->second.text);
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
      << " [fit|validate|test|predict] [--config FILE]... [--print_config] [--KEY VALUE]...\n";
  if (!options_.description.empty()) out << "\n" << options_.description << "\n";
  out << "\nSubcommands: fit, validate, test, predict (default: "
      << to_string(options_.default_subcommand) << ").\n"
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
  switch (subcommand_) {
    case Subcommand::Fit: result.fit = trainer.fit(model, data, {.ckpt_path = ckpt_path_}); break;
    case Subcommand::Validate: result.metrics = trainer.validate(model, data, ckpt_path_); break;
    case Subcommand::Test: result.metrics = trainer.test(model, data, ckpt_path_); break;
    case Subcommand::Predict: result.predictions = trainer.predict(model, data, ckpt_path_); break;
  }
  return result;
}

}  // namespace fulgur
