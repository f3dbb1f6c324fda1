// File: fulgur/cli/cli.h
//
// The LightningCLI of C++: one object gives a program the subcommands fit,
// validate, test, predict, lr_find (the learning-rate finder on the fit's
// data: the suggestion printed, the curve drawn into lr_find.png under
// default_root_dir) and scale_batch_size (the largest training batch that
// fits in memory, on the DataModule's batch_size()), every Trainer flag (from trainer_flags()), the
// program's own options in a few lines, YAML config files and dotted
// overrides.
//
//   int main(int argc, char** argv) {
//     fulgur::CLI cli({.program = "train", .trainer_defaults = {.max_epochs = 3}});
//     double lr = 1e-3;
//     int64_t batch_size = 64;
//     cli.model().add("lr", lr, "learning rate");
//     cli.data().add("batch_size", batch_size, "samples per batch");
//     if (auto status = cli.parse(argc, argv)) return *status;  // --help, errors
//     fulgur::Trainer trainer(cli.trainer_options());
//     MyModel model(lr);
//     MyData data(batch_size);
//     cli.run(trainer, model, data);
//   }
//
//   train fit --config base.yaml --config fast.yaml --trainer.max_epochs 5 --lr 3e-4
//   train fit --print_config > run.yaml          # the complete config; re-run it with
//   train fit --config run.yaml                  #   exactly the same settings
//   train fit --ckpt_path runs/.../last.ckpt     # the checkpoint's config, then overrides
//   train --max_epochs 5                         # no subcommand: fit; flat names work
//   train lr_find --config run.yaml              # a learning rate to start from
//   train scale_batch_size --config run.yaml     # the largest batch that fits
//
// A config file has the sections `trainer:`, `model:` and `data:`, and the
// program's top-level keys (`ckpt_path:` and what program() adds):
//
//   trainer:
//     max_epochs: 5
//     devices: 2
//     logger: [csv, tensorboard]
//   model:
//     lr: 0.0003
//
// Precedence, lowest first: the program's defaults; the config saved in the
// checkpoint given as ckpt_path (a run resumes with its own settings); the
// --config files, in order; the command line. Every problem (an unknown key,
// with "did you mean"; a key given twice; a value that does not parse; an
// ambiguous flat name; what the Trainer's own checks refuse, such as
// `deterministic: maybe`) is reported at once, naming where the value came
// from: the file and line for a value from a file. All are counted; the
// first CLI::kMaxProblemsListed are listed.
//
// A --config path is opened once, checked as checkpoints are: it must be a
// regular file (a directory, FIFO, device or socket is refused by its type,
// never opened, so nothing blocks), readable, and at most
// CLI::kMaxConfigFileBytes (1 MiB; a config is a few KiB). YAML forbids a
// key twice in one mapping, and so does the CLI, at any depth, in block and
// flow style (yaml-cpp would keep one silently); so are two spellings of
// one key (max_epochs and max-epochs) in one file. Any of these is exit
// status 2 from parse(), naming the file, the line and what to do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fulgur/trainer/trainer.h"
#include "fulgur/trainer/trainer_options.h"
#include "fulgur/tuner/tuner.h"

namespace fulgur {

namespace detail {
/// What a config file wrote for a key: a scalar, a null (~, null, nothing
/// after the colon: the text "none") or a list (its items joined by commas).
enum class ConfigValueForm { kScalar, kNull, kList };
}  // namespace detail

/// A section of a program's own options: `model:`, `data:`, or the top level.
/// Each add() binds a variable; its value when added is the default, and
/// CLI::parse() writes the configured value into it.
class OptionGroup {
 public:
  /// `top_level`: the program's own options (`CLI::program()`), whose keys
  /// stand beside trainer:, model:, data: and ckpt_path.
  explicit OptionGroup(bool top_level = false) : top_level_(top_level) {}
  OptionGroup& add(const std::string& name, bool& value, std::string help);
  OptionGroup& add(const std::string& name, int& value, std::string help);
  OptionGroup& add(const std::string& name, int64_t& value, std::string help);
  OptionGroup& add(const std::string& name, double& value, std::string help);
  OptionGroup& add(const std::string& name, std::string& value, std::string help);

  struct Option {
    std::string name;
    std::string help;
    bool is_bool = false;
    std::function<std::string()> get;
    /// "" or what is wrong with the text.
    std::function<std::string(const std::string&)> set;
    /// Takes free text (a path, a name: a std::string option): a config's
    /// null or list for it is refused, not read as "none" or "a,b".
    bool is_text = false;
  };
  const std::vector<Option>& options() const { return options_; }

 private:
  OptionGroup& add_option(Option option);
  template <class Int>
  OptionGroup& add_integer(const std::string& name, Int& value, std::string help);
  std::vector<Option> options_;
  bool top_level_ = false;
};

struct CLIOptions {
  /// The program's name, for --help and messages.
  std::string program = "fulgur";
  /// One line for --help.
  std::string description = "";
  /// The Trainer's options before config files and the command line: the
  /// program's defaults for the flags, and the objects a flag cannot name
  /// (callbacks, loggers, plugins as instances) that trainer_options() keeps.
  TrainerOptions trainer_defaults = {};
  /// The subcommand when none is given.
  Stage default_subcommand = Stage::kFit;
  /// Config files are a program's, read for the Trainer's flags alone (fulgur
  /// resolve): the keys this CLI does not know outside trainer: (model:, data:,
  /// the program's own) are left out with one note; an unknown key under
  /// trainer: is still an error.
  bool trainer_flags_only = false;
};

class CLI {
 public:
  /// The largest --config file read (1 MiB); a larger one is an error.
  static constexpr uint64_t kMaxConfigFileBytes = uint64_t{1} << 20;
  /// How many problems an error lists; the rest are counted ("and N more").
  static constexpr size_t kMaxProblemsListed = 20;

  explicit CLI(CLIOptions options = {});

  /// The `model:` section.
  OptionGroup& model() { return model_; }
  /// The `data:` section.
  OptionGroup& data() { return data_; }
  /// The program's top-level keys (next to `ckpt_path`).
  OptionGroup& program() { return program_; }

  /// Parses the command line, reads the config files and the checkpoint's
  /// config, and sets every bound variable. Returns nothing when the program
  /// should go on; an exit status when it is done: 0 after --help or
  /// --print_config (printed on stdout), 2 after a bad configuration (every
  /// problem printed on stderr).
  std::optional<int> parse(int argc, const char* const* argv);
  /// parse() on the arguments after the program's name; throws FlagError
  /// (kind "invalid_config", or the kind of the Trainer's error when its
  /// checks found something) listing the problems: the first kMaxProblemsListed,
  /// then one entry "and N more (M problems in all)". Unless --print_config
  /// is given, the Trainer's checks of the configured flags run here too (a
  /// Trainer is created and dropped; only the connector's checks run when
  /// trainer_defaults holds a strategy, accelerator or plugin instance), so
  /// that their problems name the file and line of each value. Returns false
  /// after --help or --print_config (`out` got the text).
  bool parse_arguments(const std::vector<std::string>& args, std::ostream& out);

  /// The stage the subcommand runs (lr_find: kFit, whose data it sweeps).
  Stage subcommand() const { return subcommand_; }
  /// The subcommand is lr_find.
  bool is_lr_find() const { return lr_find_; }
  /// The subcommand is scale_batch_size.
  bool is_scale_batch_size() const { return scale_batch_size_; }
  /// The options scale_batch_size runs with (the program may set them after
  /// parse, e.g. host_memory_cap from an option of its own).
  BatchSizeFinderOptions& batch_size_finder() { return batch_size_finder_; }
  /// The checkpoint to start from ("" for none), as configured.
  const std::string& ckpt_path() const { return ckpt_path_; }
  /// trainer_defaults with the configured flags applied, plus a callback
  /// that writes config.yaml into the run's log directory at fit start and
  /// the config into every checkpoint.
  TrainerOptions trainer_options() const;
  /// The complete configuration as YAML: fed back with --config, it
  /// reproduces the run.
  std::string config_yaml() const;
  /// The configured value of a dotted key ("trainer.max_epochs", "model.lr",
  /// "ckpt_path"), as text; throws ConfigError for an unknown key.
  std::string value(const std::string& key) const;

  /// Runs the subcommand on `trainer` with ckpt_path: fit, validate, test or
  /// predict; lr_find runs the finder with the trainer's options (the
  /// module's weights put back), prints the suggestion on stdout and draws
  /// the curve into <default_root_dir>/lr_find.png; scale_batch_size runs
  /// the batch-size finder on the DataModule (its batch_size() and
  /// set_batch_size()) and prints each trial and the size found. The
  /// result of the one that ran is set. A finder that finds nothing (no
  /// suggested rate, no batch size that fit) throws ConfigError with its
  /// note after printing what it tried, so a program's exit status says so.
  struct Result {
    std::optional<FitResult> fit;
    std::optional<Metrics> metrics;
    std::optional<std::vector<Batch>> predictions;
    std::optional<LRFinderResult> lr_find;
    std::optional<BatchSizeFinderResult> scale_batch_size;
  };
  Result run(Trainer& trainer, Module& model, DataModule& data) const;

  /// --help's text.
  std::string help() const;

 private:
  struct Key {
    std::string section;  // "trainer", "model", "data", "" (top level)
    std::string name;
    std::string help;
    bool is_bool = false;
    std::string dotted() const { return section.empty() ? name : section + "." + name; }
  };
  struct Setting {
    std::string text;
    std::string source;  // "default", "a.yaml line 3", "the command line", ...
    detail::ConfigValueForm form = detail::ConfigValueForm::kScalar;
  };

  std::vector<Key> keys() const;
  // What the Trainer's checks (loop flags, connector) find in trainer_;
  // `kind` becomes their FlagError's kind when they find something.
  std::vector<std::string> trainer_problems(std::string& kind) const;
  // Sets the Trainer's options and the bound variables from `values`; a
  // problem per value that does not parse.
  void apply(std::map<std::string, Setting>& values, std::vector<std::string>& problems);

  CLIOptions options_;
  /// How many problems the last parse_arguments() found (its error lists
  /// at most kMaxProblemsListed of them).
  size_t problems_found_ = 0;
  OptionGroup model_, data_, program_{/*top_level=*/true};
  Stage subcommand_;
  bool lr_find_ = false;
  bool scale_batch_size_ = false;
  BatchSizeFinderOptions batch_size_finder_;
  std::string ckpt_path_;
  std::map<std::string, Setting> values_;
  TrainerOptions trainer_;
};

}  // namespace fulgur
