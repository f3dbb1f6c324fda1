// fulgur: the command-line companion of the library.
//
//   fulgur resolve [--FLAG VALUE ...]   how the Trainer would resolve these flags
//                                        in this environment, as JSON; starts nothing
//   fulgur list                          the registered strategies, accelerators,
//                                        precisions, cluster environments, checkpoint IO
//   fulgur checkpoint inspect PATH       what a checkpoint holds, and whether it
//                                        verifies (exit status 0, or 1 when corrupt)
//   fulgur checkpoint consolidate DIR OUT
//                                        a sharded fsdp checkpoint as one file
//   fulgur plot PATH [--out PNG]         a run's curves as a PNG (gnuplot)
//
// resolve reads what a program on fulgur::CLI reads: every Trainer flag
// (--trainer.devices 2, or --devices 2; snake_case or kebab-case) and YAML
// config files (--config a.yaml). Exit status: 0 resolved, 2 bad flags (JSON
// error on stdout), 1 anything else (message on stderr).
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint_inspect.h"
#include "fulgur/fulgur.h"

namespace {

constexpr const char* kUsage =
    "usage: fulgur resolve [--config FILE]... [--accelerator A] [--strategy S] [--devices D]\n"
    "                      [--num_nodes N] [--precision P] [--plugins a,b] [--KEY VALUE]...\n"
    "       fulgur list\n"
    "       fulgur checkpoint inspect PATH\n"
    "       fulgur checkpoint consolidate DIR OUT\n"
    "       fulgur plot PATH [--out PNG]\n"
    "resolve prints, as JSON, what fulgur::Trainer would choose for these flags in this\n"
    "environment (torchrun, SLURM, MPI, LSF or Kubeflow variables included), and starts\n"
    "nothing. Exit status 2 and a JSON error when the flags are wrong.\n"
    "checkpoint inspect prints what a checkpoint (a .ckpt file, or a directory of per-rank\n"
    "shards) holds and verifies its checksums: exit status 0 when it verifies, 1 when not.\n"
    "checkpoint consolidate writes a sharded fsdp checkpoint (a directory) as one file OUT,\n"
    "the file state_dict_type \"full\" writes: it loads on any world size and strategy.\n"
    "plot draws the curves of a run (a metrics.csv, its version directory, or the run's\n"
    "default_root_dir: the newest version) with gnuplot, into metrics.png next to the CSV\n"
    "unless --out says where; exit status 1 when it cannot.\n";

int resolve(int argc, char** argv) {
  // The same command line and config files as a program on fulgur::CLI.
  fulgur::CLI cli({.program = "fulgur resolve",
                   .description = "How fulgur::Trainer would resolve these flags here, as JSON.",
                   .trainer_flags_only = true});
  const std::vector<std::string> args(argv + 2, argv + argc);
  if (std::find(args.begin(), args.end(), "-h") != args.end() ||
      std::find(args.begin(), args.end(), "--help") != args.end()) {
    std::cout << kUsage << "\n" << cli.help();
    return 0;
  }
  try {
    try {
      if (!cli.parse_arguments(args, std::cout)) return 0;  // --print_config
    } catch (const fulgur::FlagError& e) {
      // One error lists the CLI's problems and the Trainer's (the
      // connector's included, each naming the file and line of its value):
      // all of them flag errors here.
      throw fulgur::FlagError(e.kind() == "invalid_config" ? "invalid_flags" : e.kind(),
                              e.problems());
    }
    fulgur::TrainerOptions options = cli.trainer_options();
    // A Trainer resolves exactly as it would in a program; it touches no
    // file and starts no process until fit().
    options.enable_checkpointing = false;
    options.logger = false;
    options.enable_progress_bar = false;
    options.callbacks.clear();
    fulgur::Trainer trainer(std::move(options));
    std::cout << trainer.describe();
    return 0;
  } catch (const fulgur::FlagError& e) {
    std::cout << fulgur::to_json(e);
    return 2;
  }
}

// Names in a column as wide as the longest, then the description and, on
// the next line, the default arguments.
template <class Registry>
void print_registry(const char* title, const Registry& registry) {
  size_t width = 0;
  for (const auto* entry : registry.entries()) width = std::max(width, entry->name.size());
  std::cout << title << ":\n";
  for (const auto* entry : registry.entries()) {
    std::cout << "  " << entry->name << std::string(width + 2 - entry->name.size(), ' ')
              << entry->description << "\n";
    if (!entry->defaults.empty()) {
      std::cout << std::string(width + 4, ' ') << "(" << entry->defaults << ")\n";
    }
  }
}

int list() {
  print_registry("strategies", fulgur::strategy_registry());
  print_registry("accelerators", fulgur::accelerator_registry());
  print_registry("precision", fulgur::precision_registry());
  print_registry("cluster environments (plugins)", fulgur::cluster_environment_registry());
  print_registry("checkpoint IO (plugins)", fulgur::checkpoint_io_registry());
  return 0;
}

int checkpoint(int argc, char** argv) {
  if (argc == 4 && std::strcmp(argv[2], "inspect") == 0) {
    return fulgur_cli::inspect_checkpoint(argv[3], std::cout);
  }
  if (argc == 5 && std::strcmp(argv[2], "consolidate") == 0) {
    try {
      fulgur::consolidate_sharded_checkpoint(argv[3], argv[4]);
    } catch (const fulgur::CheckpointError& e) {
      std::cerr << "fulgur checkpoint consolidate: " << e.what() << "\n";
      return 1;
    }
    std::cout << argv[4] << "\n";
    return 0;
  }
  std::cerr << "fulgur checkpoint: expected \"inspect PATH\" or \"consolidate DIR OUT\" (got "
            << (argc > 2 ? fulgur::str(argc - 2, " argument(s) starting with \"", argv[2], "\"")
                         : std::string("nothing"))
            << ").\n"
            << kUsage;
  return 2;
}

int plot(int argc, char** argv) {
  std::string path, out;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--out" || arg == "-o") && i + 1 < argc) {
      out = argv[++i];
    } else if (arg.rfind("--out=", 0) == 0) {
      out = arg.substr(6);
    } else if (path.empty() && arg.rfind("-", 0) != 0) {
      path = arg;
    } else {
      std::cerr << "fulgur plot: unexpected \"" << arg << "\".\n" << kUsage;
      return 2;
    }
  }
  if (path.empty()) {
    std::cerr << "fulgur plot: which run? Pass a metrics.csv or a run directory.\n" << kUsage;
    return 2;
  }
  const std::string csv = fulgur::find_metrics_csv(path);
  if (out.empty()) out = (std::filesystem::path(csv).parent_path() / "metrics.png").string();
  if (const std::string problem = fulgur::plot_metrics(csv, out); !problem.empty()) {
    std::cerr << "fulgur " << problem << "\n";
    return 1;
  }
  std::cout << out << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc >= 2 && std::strcmp(argv[1], "resolve") == 0) return resolve(argc, argv);
    if (argc >= 2 && std::strcmp(argv[1], "list") == 0) return list();
    if (argc >= 2 && std::strcmp(argv[1], "checkpoint") == 0) return checkpoint(argc, argv);
    if (argc >= 2 && std::strcmp(argv[1], "plot") == 0) return plot(argc, argv);
    if (argc >= 2 && (std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "--help") == 0)) {
      std::cout << kUsage;
      return 0;
    }
    std::cerr << kUsage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fulgur: " << fulgur::error_message(e) << "\n";
    return 1;
  }
}
