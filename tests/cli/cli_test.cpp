#include "fulgur/cli/cli.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using fulgur::test::TempDir;
using fulgur::test::write_text;

// A program's options, bound to a CLI as a program would.
struct Program {
  double lr = 0.1;
  int64_t hidden = 16;
  bool dropout = false;
  std::string data_dir = "/data";
  int64_t batch_size = 4;
  double min_acc = 0.0;
  fulgur::CLI cli;

  explicit Program(fulgur::TrainerOptions defaults = {})
      : cli({.program = "prog", .trainer_defaults = std::move(defaults)}) {
    cli.model().add("lr", lr, "learning rate").add("hidden", hidden, "units").add("dropout", dropout, "on");
    cli.data().add("data_dir", data_dir, "where").add("batch_size", batch_size, "samples");
    cli.program().add("min_acc", min_acc, "threshold");
  }
  // parse_arguments; false after --help/--print_config.
  bool parse(const std::vector<std::string>& args, std::string* out = nullptr) {
    std::ostringstream text;
    const bool go_on = cli.parse_arguments(args, text);
    if (out) *out = text.str();
    return go_on;
  }
};

std::vector<std::string> problems_of(Program& p, const std::vector<std::string>& args) {
  try {
    p.parse(args);
  } catch (const fulgur::FlagError& e) {
    return e.problems();
  }
  ADD_FAILURE() << "no error";
  return {};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(CLI, ConfigFilesAndOverridesGiveTheExpectedOptions) {
  TempDir dir;
  write_text(dir.file("base.yaml"),
             "trainer:\n"
             "  max_epochs: 7\n"
             "  devices: [0, 1]\n"
             "  accelerator: cpu\n"
             "  logger: [csv, tensorboard]\n"
             "  gradient_clip_val: 0.5\n"
             "  limit_val_batches: 0.25\n"
             "  max_time: 90\n"
             "model:\n"
             "  lr: 0.01\n"
             "  hidden: 32\n"
             "data:\n"
             "  batch_size: 8\n"
             "min_acc: 0.5\n");
  write_text(dir.file("fast.yaml"),
             "trainer:\n"
             "  max_epochs: 2\n"
             "  seed: ~\n"
             "model:\n"
             "  hidden: 64\n");
  Program p({.max_epochs = 3, .seed = 42, .default_root_dir = "runs"});
  ASSERT_TRUE(p.parse({"fit", "--config", dir.file("base.yaml"), "--config=" + dir.file("fast.yaml"),
                       "--trainer.max_epochs", "5", "--max-steps=100", "--lr", "0.003",
                       "--model.dropout", "--data.data_dir", "/elsewhere", "--deterministic", "warn"}));
  const fulgur::TrainerOptions o = p.cli.trainer_options();
  EXPECT_EQ(p.cli.subcommand(), fulgur::Subcommand::Fit);
  EXPECT_EQ(o.max_epochs, 5);                   // command line over both files
  EXPECT_EQ(o.max_steps, 100);                  // flat, kebab-case, --key=value
  EXPECT_FALSE(o.seed.has_value());             // the later file's null over the default
  EXPECT_EQ(o.devices.text(), "0,1");           // a YAML list
  EXPECT_EQ(std::get<std::string>(o.accelerator), "cpu");
  EXPECT_EQ(o.logger.names(), (std::vector<std::string>{"csv", "tensorboard"}));
  EXPECT_EQ(o.gradient_clip_val, 0.5);
  EXPECT_TRUE(o.limit_val_batches.is_fraction());
  EXPECT_EQ(o.limit_val_batches.fraction(), 0.25);
  EXPECT_EQ(o.max_time, std::chrono::milliseconds(90000));
  EXPECT_EQ(o.deterministic.text(), "warn");
  EXPECT_EQ(o.default_root_dir, "runs");        // the program's default, untouched
  EXPECT_EQ(p.lr, 0.003);
  EXPECT_EQ(p.hidden, 64);                      // the later file over the earlier
  EXPECT_TRUE(p.dropout);                       // a bare boolean
  EXPECT_EQ(p.data_dir, "/elsewhere");
  EXPECT_EQ(p.batch_size, 8);
  EXPECT_EQ(p.min_acc, 0.5);
  EXPECT_EQ(p.cli.value("trainer.max_epochs"), "5");
  EXPECT_THROW(p.cli.value("trainer.max_epoch"), fulgur::ConfigError);
}

TEST(CLI, NoSubcommandIsFitAndSubcommandsAreRead) {
  Program fit;
  ASSERT_TRUE(fit.parse({"--max_epochs", "1"}));
  EXPECT_EQ(fit.cli.subcommand(), fulgur::Subcommand::Fit);
  for (auto [name, s] : {std::pair{"validate", fulgur::Subcommand::Validate},
                         std::pair{"test", fulgur::Subcommand::Test},
                         std::pair{"predict", fulgur::Subcommand::Predict}}) {
    Program p;
    ASSERT_TRUE(p.parse({name, "--ckpt_path", "x.ckpt"}));
    EXPECT_EQ(p.cli.subcommand(), s);
    EXPECT_EQ(p.cli.ckpt_path(), "x.ckpt");
  }
}

TEST(CLI, PrintConfigFedBackGivesTheSameConfig) {
  TempDir dir;
  Program first({.max_epochs = 3});
  std::string yaml;
  ASSERT_FALSE(first.parse({"--print_config", "--max_epochs", "9", "--devices", "0,2", "--lr",
                            "0.25", "--plugins", "slurm", "--gradient_clip_val", "1.5",
                            "--default_root_dir", "", "--min_acc", "0.125"},
                           &yaml));
  EXPECT_TRUE(contains(yaml, "max_epochs: 9")) << yaml;
  write_text(dir.file("run.yaml"), yaml);

  Program second;  // other defaults: the file alone reproduces the run
  std::string again;
  ASSERT_FALSE(second.parse({"--config", dir.file("run.yaml"), "--print_config"}, &again));
  EXPECT_EQ(again, yaml);
  ASSERT_TRUE(second.parse({"--config", dir.file("run.yaml")}));
  EXPECT_EQ(second.lr, 0.25);
  EXPECT_EQ(second.min_acc, 0.125);
  const auto a = first.cli.trainer_options(), b = second.cli.trainer_options();
  for (const auto& flag : fulgur::trainer_flags()) {
    EXPECT_EQ(flag.get(a), flag.get(b)) << flag.name;
  }
}

TEST(CLI, EveryProblemIsListedWithWhereItCameFrom) {
  TempDir dir;
  write_text(dir.file("bad.yaml"),
             "trainer:\n"
             "  max_epoch: 3\n"
             "  log_every_n_steps: often\n"
             "model:\n"
             "  lr: [1, 2]\n"
             "  hiden: 3\n"
             "colour: red\n");
  Program p;
  auto problems = problems_of(p, {"--config", dir.file("bad.yaml"), "--config", dir.file("none.yaml"),
                                  "--trainer.precison", "16", "--batch_size", "x", "stray",
                                  "--seed"});
  const std::string all = fulgur::join(problems, "\n");
  for (const std::string& part : std::vector<std::string>{
           "bad.yaml line 2: unknown key trainer.max_epoch; did you mean trainer.max_epochs?",
        "bad.yaml line 6: unknown key model.hiden; did you mean model.hidden?",
        "bad.yaml line 7: unknown key colour",
        "--config " + dir.file("none.yaml") + ": cannot read it",
        "--trainer.precison: unknown flag; did you mean --trainer.precision?",
        "\"stray\": expected a flag", "--seed has no value",
        "trainer.log_every_n_steps: \"often\" (from " + dir.file("bad.yaml") + " line 3): not an integer",
        "model.lr: \"1,2\" (from " + dir.file("bad.yaml") + " line 5): not a number",
        "data.batch_size: \"x\" (from the command line): not an integer"}) {
    EXPECT_TRUE(contains(all, part)) << "missing: " << part << "\nin:\n" << all;
  }
  EXPECT_EQ(problems.size(), 10u) << all;
}

TEST(CLI, AmbiguousFlatNamesAndBrokenYamlAreErrors) {
  fulgur::CLI cli({.program = "prog"});
  int64_t a = 1, b = 2;
  cli.model().add("size", a, "model size");
  cli.data().add("size", b, "data size");
  std::ostringstream out;
  try {
    cli.parse_arguments({"--size", "3"}, out);
    FAIL() << "no error";
  } catch (const fulgur::FlagError& e) {
    EXPECT_TRUE(contains(e.what(), "--size is ambiguous: it names model.size and data.size"))
        << e.what();
  }
  EXPECT_TRUE(cli.parse_arguments({"--data.size", "3"}, out));
  EXPECT_EQ(b, 3);

  TempDir dir;
  write_text(dir.file("broken.yaml"), "trainer: [unclosed\n");
  Program p;
  auto problems = problems_of(p, {"--config", dir.file("broken.yaml")});
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_TRUE(contains(problems[0], "not valid YAML")) << problems[0];
  write_text(dir.file("list.yaml"), "- 1\n- 2\n");
  problems = problems_of(p, {"--config", dir.file("list.yaml")});
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_TRUE(contains(problems[0], "the top level is not a mapping")) << problems[0];
}

TEST(CLI, HelpListsEveryTrainerFlagAndTheProgramsOptions) {
  Program p;
  std::string help;
  ASSERT_FALSE(p.parse({"--help"}, &help));
  for (const auto& flag : fulgur::trainer_flags()) {
    EXPECT_TRUE(contains(help, "--trainer." + flag.name + " (")) << flag.name;
  }
  for (const std::string& key : std::vector<std::string>{"--model.lr (0.1)", "--data.batch_size (4)", "--min_acc (0)",
                                "--ckpt_path", "--config FILE", "--print_config"}) {
    EXPECT_TRUE(contains(help, key)) << key;
  }
}

TEST(CLI, TheConfigGoesToTheRunDirectoryAndIntoCheckpointsAndBackFirst) {
  TempDir dir;
  const std::string root = dir.file("run");
  std::string ckpt;
  {
    fulgur::TrainerOptions defaults = fulgur::test::test_options(dir);
    Program p(defaults);
    ASSERT_TRUE(p.parse({"--default_root_dir", root, "--max_epochs", "2", "--lr", "0.05",
                         "--logger", "csv", "--enable_checkpointing", "true", "--min_acc", "0.25"}));
    fulgur::Trainer trainer(p.cli.trainer_options());
    fulgur::test::LinearRegression model({.lr = p.lr});
    auto result = trainer.fit(model, fulgur::test::regression_loader(3));
    ckpt = result.last_model_path;
    ASSERT_FALSE(ckpt.empty());
    const std::string saved = fulgur::test::read_text(trainer.log_dir() + "/config.yaml");
    EXPECT_EQ(saved, p.cli.config_yaml());
    EXPECT_TRUE(contains(saved, "lr: 0.05")) << saved;
  }
  // Only the checkpoint: its config comes back; the command line wins.
  Program resumed;
  ASSERT_TRUE(resumed.parse({"--ckpt_path", ckpt, "--max_epochs", "4"}));
  EXPECT_EQ(resumed.lr, 0.05);
  EXPECT_EQ(resumed.min_acc, 0.25);
  const auto o = resumed.cli.trainer_options();
  EXPECT_EQ(o.default_root_dir, root);
  EXPECT_EQ(o.max_epochs, 4);
  EXPECT_EQ(resumed.cli.ckpt_path(), ckpt);
  // A config file sits between the checkpoint's config and the command line.
  write_text(dir.file("lr.yaml"), "model:\n  lr: 0.5\ntrainer:\n  max_epochs: 6\n");
  Program with_file;
  ASSERT_TRUE(with_file.parse({"--ckpt_path", ckpt, "--config", dir.file("lr.yaml"), "--max_epochs", "8"}));
  EXPECT_EQ(with_file.lr, 0.5);
  EXPECT_EQ(with_file.cli.trainer_options().max_epochs, 8);
  EXPECT_EQ(with_file.cli.trainer_options().default_root_dir, root);

  // The resumed run continues from the checkpoint's step to the new end.
  fulgur::Trainer trainer(resumed.cli.trainer_options());
  fulgur::test::LinearRegression model({.lr = resumed.lr});
  auto result = trainer.fit(model, fulgur::test::regression_loader(3), nullptr,
                            {.ckpt_path = resumed.cli.ckpt_path()});
  EXPECT_EQ(result.global_step, 4 * 3);
  EXPECT_TRUE(contains(fulgur::test::read_text(trainer.log_dir() + "/config.yaml"), "max_epochs: 4"));
}

}  // namespace

namespace {

// The README's table of Trainer flags follows trainer_flags(): a flag added
// to the table in the code and not to the docs fails here.
TEST(CLI, TheReadmeDocumentsEveryFlagOfTheTable) {
  const std::string readme = fulgur::test::read_text(FULGUR_SOURCE_DIR "/README.md");
  for (const auto& flag : fulgur::trainer_flags()) {
    EXPECT_NE(readme.find("| `" + flag.name + "` |"), std::string::npos)
        << "README.md's \"Trainer flags\" table has no row for " << flag.name;
  }
}

}  // namespace

namespace {

// Objects a program passes in trainer_defaults (a strategy, a plugin)
// stay objects: only configured values are applied from text.
TEST(CLI, ObjectsInTheProgramsDefaultsAreKept) {
  auto strategy = fulgur::strategy_registry().create("single_device");
  std::shared_ptr<fulgur::Strategy> shared(std::move(strategy));
  fulgur::CLI cli({.program = "prog", .trainer_defaults = {.strategy = shared, .max_epochs = 2}});
  std::ostringstream out;
  ASSERT_TRUE(cli.parse_arguments({"--max_epochs", "4"}, out));
  const auto o = cli.trainer_options();
  ASSERT_TRUE(std::holds_alternative<std::shared_ptr<fulgur::Strategy>>(o.strategy));
  EXPECT_EQ(std::get<std::shared_ptr<fulgur::Strategy>>(o.strategy), shared);
  EXPECT_EQ(o.max_epochs, 4);
}

TEST(CLI, TheLoggerFlagIsRefusedWhenTheProgramPassesItsOwnLoggers) {
  TempDir dir;
  fulgur::CLI cli({.program = "prog",
                   .trainer_defaults = {.loggers = {std::make_shared<fulgur::CSVLogger>(
                                            fulgur::CSVLoggerOptions{.save_dir = dir.path()})}}});
  std::ostringstream out;
  try {
    cli.parse_arguments({"--logger", "tensorboard"}, out);
    FAIL() << "no error";
  } catch (const fulgur::FlagError& e) {
    EXPECT_TRUE(contains(e.what(), "passes its own loggers")) << e.what();
  }
}

// --ckpt_path last/auto: the config of the run's own last.ckpt.
TEST(CLI, LastAndAutoReadTheConfigOfTheRunsLastCheckpoint) {
  TempDir dir;
  const std::string root = dir.file("run");
  {
    Program p(fulgur::test::test_options(dir));
    ASSERT_TRUE(p.parse({"--default_root_dir", root, "--lr", "0.0625", "--enable_checkpointing", "true"}));
    fulgur::Trainer trainer(p.cli.trainer_options());
    fulgur::test::LinearRegression model;
    trainer.fit(model, fulgur::test::regression_loader(2));
  }
  ASSERT_TRUE(fs::exists(root + "/checkpoints/last.ckpt"));
  for (const char* which : {"last", "auto"}) {
    Program resumed;
    ASSERT_TRUE(resumed.parse({"--default_root_dir", root, "--ckpt_path", which}));
    EXPECT_EQ(resumed.lr, 0.0625) << which;
    EXPECT_EQ(resumed.cli.ckpt_path(), which);
  }
}

TEST(CLI, ALoggerNamedTwiceIsRefused) {
  TempDir dir;
  auto options = fulgur::test::test_options(dir);
  options.logger = "csv, csv";
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer trainer(options),
                     {"logger=\"csv,csv\"", "\"csv\" is given twice"});
  options.logger = "csv,tensorbord";
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer trainer(options),
                     {"unknown logger \"tensorbord\"", "did you mean \"tensorboard\""});
}

}  // namespace

namespace {

TEST(CLI, AConfigThatCannotBeWrittenNamesThePath) {
  TempDir dir;
  fulgur::test::write_text(dir.file("file"), "x");
  Program p(fulgur::test::test_options(dir));
  ASSERT_TRUE(p.parse({"--default_root_dir", dir.file("file") + "/run"}));
  fulgur::Trainer trainer(p.cli.trainer_options());
  fulgur::test::LinearRegression model;
  EXPECT_THROWS_WITH(fulgur::ConfigError, trainer.fit(model, fulgur::test::regression_loader(2)),
                     {"cannot write the run's config", dir.file("file") + "/run/config.yaml"});
}

}  // namespace
