#include "fulgur/cli/cli.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <sstream>

#include "fulgur/fulgur.h"
#include "support/run_in_child.h"
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
    cli.model()
        .add("lr", lr, "learning rate")
        .add("hidden", hidden, "units")
        .add("dropout", dropout, "on");
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

std::string str_of(const char* name) { return std::string("\"") + name + "\""; }

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(CLI, ConfigFilesAndOverridesGiveTheExpectedOptions) {
  TempDir dir;
  write_text(dir.file("base.yaml"),
             "trainer:\n"
             "  max_epochs: 7\n"
             "  devices: [2]\n"
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
  ASSERT_TRUE(
      p.parse({"fit", "--config", dir.file("base.yaml"), "--config=" + dir.file("fast.yaml"),
               "--trainer.max_epochs", "5", "--max-steps=100", "--lr", "0.003", "--model.dropout",
               "--data.data_dir", "/elsewhere", "--deterministic", "warn"}));
  const fulgur::TrainerOptions o = p.cli.trainer_options();
  EXPECT_EQ(p.cli.subcommand(), fulgur::Stage::kFit);
  EXPECT_EQ(o.max_epochs, 5);        // command line over both files
  EXPECT_EQ(o.max_steps, 100);       // flat, kebab-case, --key=value
  EXPECT_FALSE(o.seed.has_value());  // the later file's null over the default
  EXPECT_EQ(o.devices.text(), "2");  // a YAML list
  EXPECT_EQ(std::get<std::string>(o.accelerator), "cpu");
  EXPECT_EQ(o.logger.names(), (std::vector<std::string>{"csv", "tensorboard"}));
  EXPECT_EQ(o.gradient_clip_val, 0.5);
  EXPECT_TRUE(o.limit_val_batches.is_fraction());
  EXPECT_EQ(o.limit_val_batches.fraction(), 0.25);
  EXPECT_EQ(o.max_time, std::chrono::milliseconds(90000));
  EXPECT_EQ(o.deterministic.text(), "warn");
  EXPECT_EQ(o.default_root_dir, "runs");  // the program's default, untouched
  EXPECT_EQ(p.lr, 0.003);
  EXPECT_EQ(p.hidden, 64);  // the later file over the earlier
  EXPECT_TRUE(p.dropout);   // a bare boolean
  EXPECT_EQ(p.data_dir, "/elsewhere");
  EXPECT_EQ(p.batch_size, 8);
  EXPECT_EQ(p.min_acc, 0.5);
  EXPECT_EQ(p.cli.value("trainer.max_epochs"), "5");
  EXPECT_THROW(p.cli.value("trainer.max_epoch"), fulgur::ConfigError);
}

TEST(CLI, NoSubcommandIsFitAndSubcommandsAreRead) {
  Program fit;
  ASSERT_TRUE(fit.parse({"--max_epochs", "1"}));
  EXPECT_EQ(fit.cli.subcommand(), fulgur::Stage::kFit);
  for (auto [name, s] :
       {std::pair{"validate", fulgur::Stage::kValidate}, std::pair{"test", fulgur::Stage::kTest},
        std::pair{"predict", fulgur::Stage::kPredict}}) {
    Program p;
    ASSERT_TRUE(p.parse({name, "--ckpt_path", "x.ckpt"}));
    EXPECT_EQ(p.cli.subcommand(), s);
    EXPECT_EQ(p.cli.ckpt_path(), "x.ckpt");
  }
}

/// A DataModule whose training batch size the batch-size finder may set.
class ScalableData : public fulgur::DataModule {
 public:
  explicit ScalableData(int64_t samples) : data_(fulgur::test::regression_dataset(samples)) {}
  std::shared_ptr<fulgur::DataLoader> train_dataloader() override {
    return fulgur::make_data_loader(data_, {.batch_size = batch_size_});
  }
  std::optional<int64_t> batch_size() const override { return batch_size_; }
  void set_batch_size(int64_t batch_size) override { batch_size_ = batch_size; }

 private:
  std::shared_ptr<fulgur::TensorDataset> data_;
  int64_t batch_size_ = 4;
};

TEST(CLI, ScaleBatchSizePrintsEveryTrialAndLeavesTheDataModuleHoldingTheSizeFound) {
  TempDir dir;
  Program p;
  ASSERT_TRUE(p.parse({"scale_batch_size", "--default_root_dir", dir.path(), "--accelerator", "cpu",
                       "--enable_progress_bar", "false", "--logger", "false"}));
  EXPECT_TRUE(p.cli.is_scale_batch_size());
  EXPECT_FALSE(p.cli.is_lr_find());
  p.cli.batch_size_finder().steps_per_trial = 1;
  p.cli.batch_size_finder().host_memory_cap = int64_t{1} << 30;
  fulgur::test::LinearRegression model;
  ScalableData data(48);
  fulgur::Trainer trainer(p.cli.trainer_options());
  testing::internal::CaptureStdout();
  const auto result = p.cli.run(trainer, model, data);
  const std::string printed = testing::internal::GetCapturedStdout();
  ASSERT_TRUE(result.scale_batch_size.has_value());
  EXPECT_FALSE(result.fit.has_value());
  // A roomy cap: doubling until one batch holds all 48 samples.
  EXPECT_EQ(result.scale_batch_size->batch_size, 64);
  for (const char* line : {"prog scale_batch_size: batch_size=2 fits (peak ",
                           "prog scale_batch_size: batch_size=64 fits (peak ",
                           "prog scale_batch_size: the largest batch size that fit: 64\n",
                           "holds the whole training set"}) {
    EXPECT_TRUE(contains(printed, line)) << line << " in " << printed;
  }
  EXPECT_EQ(data.batch_size(), 64);
  EXPECT_FALSE(fs::exists(dir.file("checkpoints")));

  // Nothing fitting is an error (the exit status says it), after the trials.
  Program tight;
  ASSERT_TRUE(tight.parse({"scale_batch_size", "--default_root_dir", dir.path(), "--accelerator",
                           "cpu", "--enable_progress_bar", "false", "--logger", "false"}));
  tight.cli.batch_size_finder().steps_per_trial = 1;
  tight.cli.batch_size_finder().host_memory_cap = 1;
  fulgur::Trainer tight_trainer(tight.cli.trainer_options());
  testing::internal::CaptureStdout();
  EXPECT_THROWS_WITH(fulgur::ConfigError, tight.cli.run(tight_trainer, model, data),
                     {"prog scale_batch_size: no batch size fit; batch_size=1 ran out of memory"});
  EXPECT_TRUE(contains(testing::internal::GetCapturedStdout(),
                       "prog scale_batch_size: batch_size=1 ran out of memory"));

  // A DataModule without a batch size, and a checkpoint, are refused by name.
  fulgur::test::RecordingDataModule fixed(/*train_batches=*/4);
  EXPECT_THROWS_WITH(fulgur::ConfigError, p.cli.run(trainer, model, fixed),
                     {"has no batch size to scale", "set_batch_size"});
  Program resuming;
  ASSERT_TRUE(resuming.parse({"scale_batch_size", "--ckpt_path", "x.ckpt", "--logger", "false"}));
  fulgur::Trainer trainer2(resuming.cli.trainer_options());
  EXPECT_THROWS_WITH(fulgur::ConfigError, resuming.cli.run(trainer2, model, data),
                     {"scale_batch_size: ckpt_path=\"x.ckpt\"", "Drop ckpt_path"});
}

TEST(CLI, LrFindSweepsTheFitsDataPrintsASuggestionAndDrawsTheCurve) {
  TempDir dir;
  Program p;
  ASSERT_TRUE(p.parse({"lr_find", "--default_root_dir", dir.path(), "--accelerator", "cpu",
                       "--enable_progress_bar", "false", "--logger", "false"}));
  EXPECT_TRUE(p.cli.is_lr_find());
  EXPECT_EQ(p.cli.subcommand(), fulgur::Stage::kFit);  // the data of fit
  // Seeded, so that the start does not depend on what the tests before it
  // in this process drew (it varied under load): a start that fits the
  // first batch much better than the second reads as a divergence at step 2
  // (smoothed losses 0.086, then 0.36 > 4 x 0.086).
  torch::manual_seed(0);
  fulgur::test::LinearRegression model;
  const auto before = fulgur::test::clone_parameters(model);
  fulgur::test::RecordingDataModule data(/*train_batches=*/16);
  fulgur::Trainer trainer(p.cli.trainer_options());
  testing::internal::CaptureStdout();
  const auto result = p.cli.run(trainer, model, data);
  const std::string printed = testing::internal::GetCapturedStdout();
  ASSERT_TRUE(result.lr_find.has_value());
  EXPECT_FALSE(result.fit.has_value());
  std::ostringstream curve;
  for (size_t i = 0; i < result.lr_find->lrs.size(); ++i) {
    curve << " " << result.lr_find->lrs[i] << ":" << result.lr_find->losses[i];
  }
  EXPECT_GT(result.lr_find->lrs.size(), 10u)
      << "diverged=" << result.lr_find->diverged << " curve:" << curve.str() << "\n"
      << printed;
  EXPECT_TRUE(contains(printed, "prog lr_find: ")) << printed;
  ASSERT_TRUE(result.lr_find->suggestion.has_value()) << result.lr_find->note;
  EXPECT_TRUE(contains(printed, "suggested learning rate")) << printed;
  EXPECT_TRUE(fs::exists(dir.file("lr_find.png"))) << printed;
  EXPECT_TRUE(contains(printed, dir.file("lr_find.png"))) << printed;
  // The sweep left the module as it was; the checkpoints and logs of a fit
  // were not written.
  const auto after = fulgur::test::clone_parameters(model);
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i]));
  EXPECT_FALSE(fs::exists(dir.file("checkpoints")));
  EXPECT_FALSE(fs::exists(dir.file("fulgur_logs")));
  // It does not resume: a checkpoint is refused by name.
  Program resuming;
  ASSERT_TRUE(resuming.parse({"lr_find", "--default_root_dir", dir.path(), "--ckpt_path", "x.ckpt",
                              "--enable_progress_bar", "false", "--logger", "false"}));
  fulgur::Trainer trainer2(resuming.cli.trainer_options());
  EXPECT_THROWS_WITH(fulgur::ConfigError, resuming.cli.run(trainer2, model, data),
                     {"lr_find: ckpt_path=\"x.ckpt\"", "Drop ckpt_path"});
  // A program without it still takes fit as its first word.
  Program fit;
  ASSERT_TRUE(fit.parse({"fit"}));
  EXPECT_FALSE(fit.cli.is_lr_find());
}

TEST(CLI, PrintConfigFedBackGivesTheSameConfig) {
  TempDir dir;
  Program first({.max_epochs = 3});
  std::string yaml;
  ASSERT_FALSE(first.parse(
      {"--print_config", "--max_epochs", "9", "--devices", "3", "--lr", "0.25", "--plugins",
       "async", "--gradient_clip_val", "1.5", "--default_root_dir", "", "--min_acc", "0.125"},
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
  auto problems =
      problems_of(p, {"--config", dir.file("bad.yaml"), "--config", dir.file("none.yaml"),
                      "--trainer.precison", "16", "--batch_size", "x", "stray", "--seed"});
  const std::string all = fulgur::join(problems, "\n");
  for (const std::string& part : std::vector<std::string>{
           "bad.yaml line 2: unknown key trainer.max_epoch; did you mean trainer.max_epochs?",
           "bad.yaml line 6: unknown key model.hiden; did you mean model.hidden?",
           "bad.yaml line 7: unknown key colour",
           "--config " + dir.file("none.yaml") + ": cannot read it",
           "--trainer.precison: unknown flag; did you mean --trainer.precision?",
           "\"stray\": expected a flag", "--seed has no value",
           "trainer.log_every_n_steps: \"often\" (from " + dir.file("bad.yaml") +
               " line 3): not an integer",
           "model.lr: \"1,2\" (from " + dir.file("bad.yaml") + " line 5): not a number",
           "data.batch_size: \"x\" (from the command line): not an integer"}) {
    EXPECT_TRUE(contains(all, part)) << "missing: " << part << "\nin:\n" << all;
  }
  EXPECT_EQ(problems.size(), 10u) << all;
}

// A program's real-valued option beyond a double's range says so.
TEST(CLI, ANumberBeyondADoublesRangeIsNamedAsSuch) {
  Program p;
  const std::string all = fulgur::join(problems_of(p, {"--lr", "1e999"}), "\n");
  EXPECT_TRUE(contains(all,
                       "model.lr: \"1e999\" (from the command line): a number too large for "
                       "a double (at most about 1.8e308)"))
      << all;
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
  // Two documents: the second would be dropped without a word.
  write_text(dir.file("two.yaml"), "trainer: {max_epochs: 1}\n---\ntrainer: {max_epochs: 2}\n");
  problems = problems_of(p, {"--config", dir.file("two.yaml")});
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_TRUE(contains(problems[0], "holds 2 YAML documents (separated by \"---\")"))
      << problems[0];
  EXPECT_TRUE(contains(problems[0], "pass each with its own --config")) << problems[0];
  // A merge key is named as one (not a typo of a flag), under a section and
  // at the top level.
  write_text(dir.file("merge.yaml"),
             "trainer:\n  <<: {max_epochs: 1}\n  seed: 3\n<<: {trainer: {seed: 4}}\n");
  problems = problems_of(p, {"--config", dir.file("merge.yaml")});
  const std::string merge = fulgur::join(problems, "\n");
  EXPECT_EQ(problems.size(), 2u) << merge;
  EXPECT_TRUE(contains(merge,
                       "merge.yaml line 2: a YAML merge key (<< under trainer): this "
                       "reader does not merge mappings. Write the keys out under trainer"))
      << merge;
  EXPECT_TRUE(contains(merge, "merge.yaml line 4: a YAML merge key (<<)")) << merge;
  EXPECT_FALSE(contains(merge, "did you mean")) << merge;
  // A byte YAML never holds is named with its line, before yaml-cpp reads it.
  write_text(dir.file("nul.yaml"), std::string("trainer:\n  max_epochs: 1\0\n", 26));
  EXPECT_EQ(problems_of(p, {"--config", dir.file("nul.yaml")}),
            std::vector<std::string>{"--config " + dir.file("nul.yaml") +
                                     ": line 2 holds byte 0x00 (a NUL), which YAML text never "
                                     "holds: it is not a config file, or it was damaged. Pass "
                                     "the YAML file you meant."});
}

// A subcommand after a flag is named as one.
TEST(CLI, ASubcommandComesFirst) {
  Program p;
  auto problems = problems_of(p, {"--max_epochs", "1", "fit"});
  ASSERT_EQ(problems.size(), 1u) << fulgur::join(problems, "\n");
  EXPECT_TRUE(contains(problems[0], "\"fit\": a subcommand comes first, before every flag ("))
      << problems[0];
  EXPECT_TRUE(contains(problems[0], " fit --KEY VALUE ...), and only one.")) << problems[0];
  problems = problems_of(p, {"test", "--max_epochs", "1", "validate"});
  ASSERT_EQ(problems.size(), 1u) << fulgur::join(problems, "\n");
  EXPECT_TRUE(contains(problems[0], "\"validate\": a subcommand comes first")) << problems[0];
}

TEST(CLI, HelpListsEveryTrainerFlagAndTheProgramsOptions) {
  Program p;
  std::string help;
  ASSERT_FALSE(p.parse({"--help"}, &help));
  for (const auto& flag : fulgur::trainer_flags()) {
    EXPECT_TRUE(contains(help, "--trainer." + flag.name + " (")) << flag.name;
  }
  for (const std::string& key :
       std::vector<std::string>{"--model.lr (0.1)", "--data.batch_size (4)", "--min_acc (0)",
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
    ASSERT_TRUE(
        p.parse({"--default_root_dir", root, "--max_epochs", "2", "--lr", "0.05", "--logger", "csv",
                 "--enable_checkpointing", "true", "--min_acc", "0.25"}));
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
  ASSERT_TRUE(
      with_file.parse({"--ckpt_path", ckpt, "--config", dir.file("lr.yaml"), "--max_epochs", "8"}));
  EXPECT_EQ(with_file.lr, 0.5);
  EXPECT_EQ(with_file.cli.trainer_options().max_epochs, 8);
  EXPECT_EQ(with_file.cli.trainer_options().default_root_dir, root);

  // The resumed run continues from the checkpoint's step to the new end.
  fulgur::Trainer trainer(resumed.cli.trainer_options());
  fulgur::test::LinearRegression model({.lr = resumed.lr});
  auto result = trainer.fit(model, fulgur::test::regression_loader(3), nullptr,
                            {.ckpt_path = resumed.cli.ckpt_path()});
  EXPECT_EQ(result.global_step, 4 * 3);
  EXPECT_TRUE(
      contains(fulgur::test::read_text(trainer.log_dir() + "/config.yaml"), "max_epochs: 4"));
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
  EXPECT_FALSE(shared->has_accelerator());  // parse() hands it to no Trainer
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
    ASSERT_TRUE(
        p.parse({"--default_root_dir", root, "--lr", "0.0625", "--enable_checkpointing", "true"}));
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

// The config of the checkpoint the Trainer will start from: a damaged
// last.ckpt is passed over for the newest one that verifies, and a
// ModelCheckpoint's own dirpath (without last.ckpt) is where they are (the
// CLI read <root>/checkpoints/last.ckpt only, and without its config ran
// the resumed run with other settings, saying nothing).
TEST(CLI, LastReadsTheConfigOfTheCheckpointTheTrainerStartsFrom) {
  TempDir dir;
  const std::string root = dir.file("run");
  auto fit = [&](fulgur::TrainerOptions defaults, double lr) {
    Program p(std::move(defaults));
    ASSERT_TRUE(p.parse({"--default_root_dir", root, "--lr", std::to_string(lr), "--max_epochs",
                         "2", "--enable_checkpointing", "true"}));
    fulgur::Trainer trainer(p.cli.trainer_options());
    fulgur::test::LinearRegression model;
    trainer.fit(model, fulgur::test::regression_loader(2));
  };
  {  // last.ckpt cut short: the epoch checkpoint before it.
    fit(fulgur::test::checkpointed_options(dir, {.save_top_k = -1, .save_last = true}), 0.0625);
    const std::string last = root + "/checkpoints/last.ckpt";
    ASSERT_TRUE(fs::exists(last));
    fs::resize_file(last, 100);
    Program resumed;
    ASSERT_TRUE(resumed.parse({"--default_root_dir", root, "--ckpt_path", "last"}));
    EXPECT_EQ(resumed.lr, 0.0625);
  }
  {  // The program's ModelCheckpoint writes elsewhere, with no last.ckpt.
    const std::string elsewhere = dir.file("elsewhere");
    auto defaults = fulgur::test::checkpointed_options(
        dir, {.dirpath = elsewhere, .save_top_k = -1, .save_last = false});
    fit(defaults, 0.25);
    ASSERT_FALSE(fs::exists(elsewhere + "/last.ckpt"));
    Program resumed(defaults);
    ASSERT_TRUE(resumed.parse({"--default_root_dir", root, "--ckpt_path", "auto"}));
    EXPECT_EQ(resumed.lr, 0.25);
  }
}

// A resume (and a config the CLI printed, fed back) keeps the objects the
// program passes: its strategy and its loggers print as their names, which
// replaced the strategy by the registered one of that name (or failed on a
// name nobody registered) and refused the loggers ("passes its own
// loggers") for a key the user never wrote.
TEST(CLI, AResumeOrAPrintedConfigKeepsTheProgramsOwnObjects) {
  TempDir dir;
  const std::string root = dir.file("run");
  auto defaults = fulgur::test::test_options(dir);
  auto strategy = std::make_shared<fulgur::DDPStrategy>(fulgur::DDPOptions{}, "my_ddp");
  defaults.strategy = strategy;
  defaults.loggers = {
      std::make_shared<fulgur::CSVLogger>(fulgur::CSVLoggerOptions{.save_dir = dir.file("logs")})};
  auto keeps_the_objects = [&](const Program& p, const std::string& how) {
    const auto o = p.cli.trainer_options();
    ASSERT_TRUE(std::holds_alternative<std::shared_ptr<fulgur::Strategy>>(o.strategy)) << how;
    EXPECT_EQ(std::get<std::shared_ptr<fulgur::Strategy>>(o.strategy), strategy) << how;
    EXPECT_EQ(o.loggers, defaults.loggers) << how;
    EXPECT_EQ(p.lr, 0.0625) << how;
  };
  std::string printed;
  {
    Program p(defaults);
    ASSERT_TRUE(
        p.parse({"--default_root_dir", root, "--lr", "0.0625", "--enable_checkpointing", "true"}));
    auto options = p.cli.trainer_options();
    options.strategy = "auto";  // one process here; the config names "my_ddp"
    fulgur::Trainer trainer(std::move(options));
    fulgur::test::LinearRegression model;
    trainer.fit(model, fulgur::test::regression_loader(2));
    EXPECT_FALSE(
        p.parse({"--default_root_dir", root, "--lr", "0.0625", "--print_config"}, &printed));
  }
  {
    Program resumed(defaults);
    ASSERT_TRUE(resumed.parse({"--default_root_dir", root, "--ckpt_path", "last"}));
    keeps_the_objects(resumed, "resumed");
  }
  {
    ASSERT_TRUE(contains(printed, "my_ddp")) << printed;
    write_text(dir.file("printed.yaml"), printed);
    Program again(defaults);
    ASSERT_TRUE(again.parse({"--config", dir.file("printed.yaml")}));
    keeps_the_objects(again, "printed config");
  }
}

// Found by a probe of the command line: each problem said once, of the
// value given; switches spelled as every other; the CLI's own names kept.
TEST(CLI, CommandLineCornersAreNamedOnce) {
  {  // An empty logger list: once, as given (it also read logger="false").
    Program p;
    const auto problems = problems_of(p, {"--logger", ""});
    ASSERT_EQ(problems.size(), 1u) << fulgur::join(problems, "\n");
    EXPECT_TRUE(contains(problems[0], "trainer.logger: \"\"")) << problems[0];
    EXPECT_TRUE(contains(problems[0], "a logger name is empty")) << problems[0];
  }
  {  // Under a millisecond would be 0, which turns the watch off.
    Program p;
    const auto problems = problems_of(p, {"--heartbeat_timeout", "0.0004"});
    ASSERT_EQ(problems.size(), 1u);
    EXPECT_TRUE(contains(problems[0], "under a millisecond")) << problems[0];
    Program off;
    ASSERT_TRUE(off.parse({"--heartbeat_timeout", "0"}));
  }
  {  // --print_config=false does not print; --help takes no value.
    Program p;
    std::string out;
    EXPECT_TRUE(p.parse({"--print_config=false", "--max_epochs", "3"}, &out));
    EXPECT_TRUE(out.empty()) << out;
    Program printed;
    EXPECT_FALSE(printed.parse({"--print_config=true"}, &out));
    EXPECT_TRUE(contains(out, "max_epochs")) << out;
    Program q;
    const auto problems = problems_of(q, {"--help=0"});
    ASSERT_EQ(problems.size(), 1u);
    EXPECT_TRUE(contains(problems[0], "--help takes no value")) << problems[0];
    Program r;
    EXPECT_TRUE(contains(problems_of(r, {"--print_config=maybe"}).at(0),
                         "--print_config=maybe: pass --print_config alone"));
  }
  {  // deterministic takes the spellings of every other switch.
    Program p;
    ASSERT_TRUE(p.parse({"--deterministic", "True"}));
    EXPECT_TRUE(p.cli.trainer_options().deterministic.enabled());
  }
  {  // A seed past int64's range says so (it said "not an integer >= 0").
    Program p;
    const auto problems = problems_of(p, {"--seed", "18446744073709551615"});
    ASSERT_EQ(problems.size(), 1u);
    EXPECT_TRUE(contains(problems[0], "out of range: a seed is from 0 to 9223372036854775807"))
        << problems[0];
  }
  {  // An unknown flag as long as a file: named shortened.
    Program p;
    const auto problems = problems_of(p, {"--" + std::string(100000, 'x'), "1"});
    ASSERT_EQ(problems.size(), 1u);
    EXPECT_TRUE(contains(problems[0], "unknown flag")) << problems[0].substr(0, 300);
    EXPECT_LT(problems[0].size(), 1000u);
  }
  // A program option of the CLI's own name could not be set (--config reads
  // a file): refused when added; ckpt_path in any section (a flat
  // --ckpt_path would be ambiguous).
  for (const char* name : {"config", "print_config", "help", "ckpt_path"}) {
    fulgur::CLI cli({.program = "prog"});
    double value = 0;
    EXPECT_THROWS_WITH(fulgur::ConfigError, cli.program().add(name, value, "x"),
                       {str_of(name), "is the CLI's own"});
  }
  {
    fulgur::CLI cli({.program = "prog"});
    double value = 0;
    EXPECT_THROWS_WITH(fulgur::ConfigError, cli.model().add("ckpt_path", value, "x"),
                       {"is the CLI's own"});
  }
  {  // --model.config is the model's option.
    fulgur::CLI cli({.program = "prog"});
    double value = 0;
    cli.model().add("config", value, "x");
    std::ostringstream out;
    ASSERT_TRUE(cli.parse_arguments({"--model.config", "2.5"}, out));
    EXPECT_EQ(value, 2.5);
  }
  for (const char* name : {"trainer", "model", "data"}) {
    fulgur::CLI cli({.program = "prog"});
    double value = 0;
    EXPECT_THROWS_WITH(fulgur::ConfigError, cli.program().add(name, value, "x"),
                       {"a section of the config"});
    cli.model().add(name, value, "x");  // --model.data is no section
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
  // An empty name is said with the list as given (it was said of the list
  // without it, "csv", which has none).
  options.logger = "csv,";
  try {
    fulgur::Trainer trainer(options);
    ADD_FAILURE() << "an empty logger name was accepted";
  } catch (const fulgur::ConfigError& e) {
    const std::string what = e.what();
    EXPECT_TRUE(fulgur::test::message_contains(what, {"logger=\"csv,\": a logger name is empty"}));
    EXPECT_EQ(what.find("logger=\"csv\""), std::string::npos) << what;
  }
}

// A logger list as long as a config file can hold: each problem said once,
// the list shortened in each (every name was once checked against the
// whole list and the list quoted whole in each problem: minutes for a
// 1 MiB file).
TEST(CLI, ALongLoggerListNamesEachProblemOnceWithTheListShortened) {
  TempDir dir;
  auto options = fulgur::test::test_options(dir);
  options.logger = fulgur::join(std::vector<std::string>(20000, "csv")) + ",nope,nope";
  try {
    fulgur::Trainer trainer(options);
    ADD_FAILURE() << "no error";
  } catch (const fulgur::ConfigError& e) {
    const std::string message = e.what();
    EXPECT_TRUE(fulgur::test::message_contains(
        message, {"\"csv\" is given twice", "unknown logger \"nope\"", "... (", " bytes)"}))
        << message.substr(0, 2000);
    EXPECT_LT(message.size(), 2000u);
    size_t twice = 0;
    for (auto at = message.find("given twice"); at != std::string::npos;
         at = message.find("given twice", at + 1)) {
      ++twice;
    }
    EXPECT_EQ(twice, 1u) << "each name's problem once";
  }
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

// ---- Bad config files (issue 35): every one is exit status 2 from parse(),
// with a message naming the file and what to do; nothing aborts or hangs.
namespace {

// parse() as a program calls it: the exit status (0 to go on), stderr in `err`.
int parse_status(Program& p, std::vector<std::string> args, std::string* err = nullptr) {
  args.insert(args.begin(), "prog");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  testing::internal::CaptureStderr();
  const auto status = p.cli.parse(static_cast<int>(argv.size()), argv.data());
  const std::string text = testing::internal::GetCapturedStderr();
  if (err) *err = text;
  return status.value_or(0);
}

// parse() in a child process, bounded in time: what a user's program does
// with --config `path` (0 to go on, 2 after an error), or how it ended.
fulgur::test::ChildResult parse_in_child(const std::string& path) {
  return fulgur::test::run_in_child([&] {
    Program p;
    std::vector<std::string> args{"prog", "fit", "--config", path};
    std::vector<const char*> argv;
    for (const auto& a : args) argv.push_back(a.c_str());
    return p.cli.parse(static_cast<int>(argv.size()), argv.data()).value_or(0);
  });
}

std::string only_problem(Program& p, const std::vector<std::string>& args) {
  const auto problems = problems_of(p, args);
  EXPECT_EQ(problems.size(), 1u) << fulgur::join(problems, "\n");
  return problems.empty() ? std::string() : problems.front();
}

// Issue 35, rows 1 and 2: refused by their type before any open (a FIFO
// would block the open; a directory aborted the program).
TEST(CLIConfigFile, ADirectoryAFifoADeviceAndASocketAreRefusedByTheirType) {
  TempDir dir;
  const std::string folder = dir.file("configs");
  fs::create_directories(folder);
  const std::string fifo = dir.file("config.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string socket_path = dir.file("config.sock");
  const int sock = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(sock, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  ASSERT_LT(socket_path.size(), sizeof(address.sun_path));
  std::copy(socket_path.begin(), socket_path.end(), address.sun_path);
  ASSERT_EQ(::bind(sock, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  const std::string link = dir.file("link-to-fifo.yaml");
  fs::create_symlink(fifo, link);

  for (const auto& [path, kind] :
       std::vector<std::pair<std::string, std::string>>{{folder, "a directory"},
                                                        {fifo, "a FIFO (named pipe)"},
                                                        {link, "a FIFO (named pipe)"},
                                                        {"/dev/null", "a character device"},
                                                        {socket_path, "a socket"}}) {
    // In a child first: a regression hangs (the FIFO) or aborts (the directory) there.
    const auto r = parse_in_child(path);
    EXPECT_EQ(r.exit_code, 2) << path << ": " << r.describe();
    Program p;
    EXPECT_EQ(only_problem(p, {"--config", path}),
              "--config " + path + " is " + kind +
                  ", not a config file. Pass the path of a YAML file (--print_config writes one).");
    std::string err;
    Program q;
    EXPECT_EQ(parse_status(q, {"fit", "--config", path}, &err), 2);
    EXPECT_TRUE(contains(err, path + " is " + kind)) << err;
  }
  ::close(sock);
}

TEST(CLIConfigFile, AMissingFileNamesThePathAndWhatToDo) {
  TempDir dir;
  Program p;
  EXPECT_EQ(only_problem(p, {"--config", dir.file("none.yaml")}),
            "--config " + dir.file("none.yaml") +
                ": cannot read it: it does not exist. Check the path. Pass the path of a YAML "
                "file.");
}

TEST(CLIConfigFile, AnUnreadableFileNamesThePathAndWhatToDo) {
  TempDir dir;
  const std::string path = dir.file("secret.yaml");
  write_text(path, "trainer:\n  max_epochs: 1\n");
  fs::permissions(path, fs::perms::none);
  auto refused = [&] {
    Program p;
    const auto problem = only_problem(p, {"--config", path});
    return fulgur::test::message_contains(
        problem, {"--config " + path +
                  ": cannot open it for reading: Permission denied. Give "
                  "this user read permission on it (and search permission on its directories)."});
  };
  if (::geteuid() != 0) {
    EXPECT_TRUE(refused());
    return;
  }
  // Root reads it anyway: as another user, in a child process.
  fs::permissions(dir.path(), fs::perms::owner_all | fs::perms::others_exec);
  const auto r = fulgur::test::run_in_child([&] {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) return 3;
    return refused() ? 0 : 1;
  });
  EXPECT_EQ(r.exit_code, 0) << r.describe() << " (3: cannot become nobody; 1: another message)";
}

// Issue 35, row 3: one 20 MB string value hung the parse. Past the cap (1 MiB)
// a file is refused before it is read; just under it, one huge scalar parses.
TEST(CLIConfigFile, AFileOverTheSizeCapIsRefusedAndAHugeScalarUnderItParses) {
  TempDir dir;
  write_text(dir.file("huge.yaml"), "data:\n  data_dir: " + std::string(20u << 20, 'x') + "\n");
  Program p;
  EXPECT_EQ(only_problem(p, {"--config", dir.file("huge.yaml")}),
            "--config " + dir.file("huge.yaml") +
                " is 20.0 MiB; a config file may be at most 1 MiB (1048576 bytes). Pass the YAML "
                "file of the run's settings (a few KiB), not data.");
  EXPECT_EQ(parse_in_child(dir.file("huge.yaml")).exit_code, 2);

  const std::string value(fulgur::CLI::kMaxConfigFileBytes - 100, 'y');
  write_text(dir.file("big.yaml"), "data:\n  data_dir: " + value + "\n");
  Program q;
  ASSERT_TRUE(q.parse({"--config", dir.file("big.yaml")}));
  EXPECT_EQ(q.data_dir, value);
  // A long unknown key (YAML's limit for a plain key is 1024 characters):
  // the message shows its start and its length.
  write_text(dir.file("key.yaml"), std::string(1000, 'k') + ": 1\n");
  Program r;
  EXPECT_EQ(
      only_problem(r, {"--config", dir.file("key.yaml")}),
      dir.file("key.yaml") + " line 1: unknown key " + std::string(80, 'k') + "... (1000 bytes).");
}

// YAML nested past what the parser takes (yaml-cpp stops at a depth of
// recursion, and calls it "bad file") is named as nesting, with its line.
TEST(CLIConfigFile, NestingPastTheParsersDepthIsNamedAsSuch) {
  TempDir dir;
  write_text(dir.file("flow.yaml"),
             "trainer:\n  max_epochs: " + std::string(3000, '[') + std::string(3000, ']') + "\n");
  std::string block = "a:\n";
  for (int i = 1; i <= 700; ++i) block += std::string(2 * i, ' ') + "b:\n";  // 490 KiB
  write_text(dir.file("block.yaml"), block);
  Program p;
  for (const auto& [name, line] : {std::pair{"flow.yaml", 2}, std::pair{"block.yaml", 0}}) {
    const auto problems = problems_of(p, {"--config", dir.file(name)});
    ASSERT_EQ(problems.size(), 1u) << name;
    EXPECT_TRUE(contains(problems[0], "--config " + dir.file(name) +
                                          ": nested too deeply for the YAML parser (it gave up "
                                          "at line " +
                                          (line > 0 ? std::to_string(line) : std::string())))
        << problems[0];
    EXPECT_FALSE(contains(problems[0], "bad file")) << problems[0];
  }
}

// Issue 35, row 4: YAML forbids a key twice in a mapping; yaml-cpp keeps both.
TEST(CLIConfigFile, DuplicateKeysAreErrorsNamingTheKeyAndBothLines) {
  TempDir dir;
  const std::string tail =
      ". YAML allows each key once in a mapping (one value would win silently); keep one.";
  auto one = [&](const std::string& name, const std::string& yaml) {
    write_text(dir.file(name), yaml);
    Program p;
    return only_problem(p, {"--config", dir.file(name)});
  };
  EXPECT_EQ(
      one("twice.yaml", "trainer:\n  max_epochs: 1\n  max_epochs: 2\n"),
      dir.file("twice.yaml") + " line 3: duplicate key trainer.max_epochs, first at line 2" + tail);
  EXPECT_EQ(one("spelled.yaml", "trainer:\n  max-epochs: 1\n  max_epochs: 2\n"),
            dir.file("spelled.yaml") +
                " line 3: duplicate key trainer.max_epochs, first at line 2" + tail);
  EXPECT_EQ(one("flow.yaml", "model: {lr: 0.1, lr: 0.2}\n"),
            dir.file("flow.yaml") +
                " line 1 column 18: duplicate key model.lr, first at line 1 column 9" + tail);
  EXPECT_EQ(one("top.yaml", "{min_acc: 0.1, min_acc: 0.2}\n"),
            dir.file("top.yaml") +
                " line 1 column 16: duplicate key min_acc, first at line 1 column 2" + tail);
  EXPECT_EQ(one("dotted.yaml", "trainer:\n  max_epochs: 1\ntrainer.max_epochs: 2\n"),
            dir.file("dotted.yaml") + " line 3: duplicate key trainer.max_epochs, first at line 2" +
                tail);

  // A section given twice, with a key in both: both are named.
  write_text(dir.file("sections.yaml"),
             "trainer:\n  max_epochs: 1\nmodel:\n  lr: 0.5\ntrainer:\n  max_epochs: 2\n");
  Program p;
  EXPECT_EQ(
      problems_of(p, {"--config", dir.file("sections.yaml")}),
      (std::vector<std::string>{
          dir.file("sections.yaml") + " line 5: duplicate key trainer, first at line 1" + tail,
          dir.file("sections.yaml") + " line 6: duplicate key trainer.max_epochs, first at line 2" +
              tail}));

  // Deeper: inside a value the CLI rejects anyway, still named by its path.
  write_text(dir.file("deep.yaml"), "extra:\n  a:\n    b: 1\n    b: 2\n");
  Program q;
  const auto deep = fulgur::join(problems_of(q, {"--config", dir.file("deep.yaml")}), "\n");
  EXPECT_TRUE(contains(
      deep, dir.file("deep.yaml") + " line 4: duplicate key extra.a.b, first at line 3" + tail))
      << deep;

  // 10 000 duplicates: all counted, 20 listed.
  std::string many = "trainer:\n";
  for (int i = 0; i <= 10000; ++i) many += "  max_epochs: " + std::to_string(i) + "\n";
  write_text(dir.file("many.yaml"), many);
  Program r;
  const auto problems = problems_of(r, {"--config", dir.file("many.yaml")});
  ASSERT_EQ(problems.size(), fulgur::CLI::kMaxProblemsListed + 1);
  EXPECT_EQ(problems[0], dir.file("many.yaml") +
                             " line 3: duplicate key trainer.max_epochs, first at line 2" + tail);
  EXPECT_EQ(problems.back(),
            "and 9980 more (10000 problems in all); fix these and run again to see the rest.");
}

// Issue 35, row 5: 10 000 unknown keys printed 800 KB.
TEST(CLIConfigFile, ProblemsAreAllCountedAndTheFirst20Listed) {
  TempDir dir;
  std::string yaml = "model:\n";
  for (int i = 0; i < 10000; ++i) yaml += "  unknown_" + std::to_string(i) + ": 1\n";
  write_text(dir.file("unknown.yaml"), yaml);
  Program p;
  const auto problems = problems_of(p, {"--config", dir.file("unknown.yaml")});
  ASSERT_EQ(problems.size(), 21u);
  EXPECT_EQ(problems[0], dir.file("unknown.yaml") + " line 2: unknown key model.unknown_0.");
  EXPECT_EQ(problems[19], dir.file("unknown.yaml") + " line 21: unknown key model.unknown_19.");
  EXPECT_EQ(problems[20],
            "and 9980 more (10000 problems in all); fix these and run again to see the rest.");
  std::string err;
  Program q;
  EXPECT_EQ(parse_status(q, {"--config", dir.file("unknown.yaml")}, &err), 2);
  EXPECT_TRUE(fulgur::test::message_contains(
      err, {"prog: 10000 problems with the configuration:\n  - " + dir.file("unknown.yaml") +
                " line 2: unknown key model.unknown_0.",
            "unknown_19", "  - and 9980 more (10000 problems in all)", "prog --help"}));
  EXPECT_FALSE(contains(err, "unknown_20")) << err.size();
  EXPECT_LT(err.size(), 4000u);
}

// Issue 35, row 6: what the Trainer's own checks refuse names the file and
// line of the value, as the CLI's own problems do.
TEST(CLIConfigFile, TheTrainersChecksNameTheFileAndLineOfTheValue) {
  TempDir dir;
  write_text(dir.file("run.yaml"), "trainer:\n  max_epochs: 2\n  deterministic: maybe\n");
  Program p;
  EXPECT_EQ(
      only_problem(p, {"--config", dir.file("run.yaml")}),
      dir.file("run.yaml") + " line 3: deterministic=\"maybe\": pass true, false or \"warn\".");
  std::string err;
  Program q;
  EXPECT_EQ(parse_status(q, {"fit", "--config", dir.file("run.yaml")}, &err), 2);
  EXPECT_TRUE(contains(err, dir.file("run.yaml") + " line 3: deterministic=\"maybe\"")) << err;

  // The loop flags' checks; a value from each of two files.
  write_text(dir.file("min.yaml"), "trainer:\n  min_epochs: 5\n");
  const std::vector<std::string> two_files = {"--config",        dir.file("run.yaml"),
                                              "--config",        dir.file("min.yaml"),
                                              "--deterministic", "true"};
  const std::string min_over_max =
      dir.file("min.yaml") + " line 2 (trainer.min_epochs), " + dir.file("run.yaml") +
      " line 2 (trainer.max_epochs): min_epochs=5 > max_epochs=2: lower min_epochs or "
      "raise max_epochs.";
  Program r;
  EXPECT_EQ(only_problem(r, two_files), min_over_max);
  // From the command line: the problem as the Trainer words it.
  Program s;
  EXPECT_EQ(only_problem(s, {"--deterministic", "maybe"}),
            "deterministic=\"maybe\": pass true, false or \"warn\".");
  // With a strategy instance in the program's defaults: the connector's checks.
  std::shared_ptr<fulgur::Strategy> strategy(fulgur::strategy_registry().create("single_device"));
  Program t({.strategy = strategy});
  EXPECT_EQ(
      only_problem(t, {"--config", dir.file("run.yaml")}),
      dir.file("run.yaml") + " line 3: deterministic=\"maybe\": pass true, false or \"warn\".");
  EXPECT_FALSE(strategy->has_accelerator());  // the program's instance is left as it was
  // ... and the Trainer's checks of its loop flags.
  Program t2({.strategy = strategy});
  EXPECT_EQ(only_problem(t2, two_files), min_over_max);
  // --print_config prints without judging the values against this machine.
  Program u;
  std::string yaml;
  EXPECT_FALSE(u.parse({"--config", dir.file("run.yaml"), "--print_config"}, &yaml));
  EXPECT_TRUE(contains(yaml, "deterministic: maybe")) << yaml;
}

// The odd files the issue found handled sensibly stay so.
// A config's null or list for a key that takes text (a path, a name) is
// refused with its file and line, where it became the word "none" (a
// directory named none) or "a,b"; keys whose values may be none or lists
// still take them, and "" is an empty text.
TEST(CLIConfigFile, ANullOrAListForAKeyThatTakesTextIsRefused) {
  TempDir dir;
  write_text(dir.file("c.yaml"),
             "trainer:\n  default_root_dir: ~\n  max_time: null\n  logger: [csv]\n"
             "data:\n  data_dir: [/x, /y]\n");
  Program p;
  const auto problems = problems_of(p, {"--config", dir.file("c.yaml")});
  ASSERT_EQ(problems.size(), 2u) << fulgur::join(problems, "\n");
  EXPECT_TRUE(fulgur::test::message_contains(
      problems[0],
      {"trainer.default_root_dir", "c.yaml line 2", "a null", "\"none\"", "leave the key out"}))
      << problems[0];
  EXPECT_TRUE(fulgur::test::message_contains(
      problems[1], {"data.data_dir", "c.yaml line 6", "a list", "takes one value"}))
      << problems[1];
  write_text(dir.file("ok.yaml"),
             "trainer:\n  default_root_dir: \"\"\n  max_time: null\n  logger: [csv]\n"
             "data:\n  data_dir: \"/x,/y\"\n");
  Program q;
  ASSERT_TRUE(q.parse({"--config", dir.file("ok.yaml")}));
  EXPECT_EQ(q.cli.trainer_options().default_root_dir, "");
  EXPECT_EQ(q.data_dir, "/x,/y");
}

TEST(CLIConfigFile, EmptyCommentOnlyBomCrlfAndTaggedFilesAreRead) {
  TempDir dir;
  for (const auto& [name, yaml, epochs] : std::vector<std::tuple<std::string, std::string, int>>{
           {"empty.yaml", "", 3},
           {"comments.yaml", "# nothing\n# here\n", 3},
           {"bom.yaml", "\xEF\xBB\xBFtrainer:\n  max_epochs: 4\n", 4},
           {"crlf.yaml", "trainer:\r\n  max_epochs: 5\r\n", 5},
           {"tagged.yaml", "trainer:\n  max_epochs: !!str 6\n", 6}}) {
    write_text(dir.file(name), yaml);
    Program p({.max_epochs = 3});
    ASSERT_TRUE(p.parse({"--config", dir.file(name)})) << name;
    EXPECT_EQ(p.cli.trainer_options().max_epochs, epochs) << name;
  }
}

// Random bytes, and truncated and mutated valid configs, parsed as a
// program parses them: exit status 0 or 2, never a signal or a hang. Every
// sixth case runs in a child process under a timeout; the others run here
// (parse() lets no exception out, so only a crash or a hang could stop them,
// and either fails the test binary). Seeded: the same cases on every run.
TEST(CLIConfigFile, FuzzedConfigsEndInStatus0Or2) {
  TempDir dir;
  std::vector<std::string> valid(2);
  {
    Program p({.max_epochs = 3});
    ASSERT_FALSE(p.parse({"--print_config", "--devices", "1", "--lr", "0.25"}, &valid[0]));
  }
  valid[1] =
      "# flow style, an anchor, lists\n"
      "trainer: {max_epochs: &e 2, devices: [1], logger: [csv], deterministic: warn}\n"
      "model:\n"
      "  lr: 0.01\n"
      "  hidden: *e\n"
      "data: {data_dir: \"/tmp/x\", batch_size: 8}\n"
      "min_acc: 0.5\n";
  const std::string yaml_chars = ":-[]{},#&*!|>'\"%@`?~ \n\t\r\\abc019.";
  std::mt19937 rng(35);
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  auto byte = [&] { return static_cast<char>(pick(256)); };
  auto yaml_char = [&] { return yaml_chars[pick(yaml_chars.size())]; };
  std::vector<std::string> cases;
  for (int i = 0; i < 60; ++i) {  // random bytes
    std::string s(pick(400), '\0');
    for (auto& c : s) c = byte();
    cases.push_back(s);
  }
  for (int i = 0; i < 60; ++i) {  // YAML's punctuation at random
    std::string s(pick(200), '\0');
    for (auto& c : s) c = yaml_char();
    cases.push_back(s);
  }
  for (int i = 0; i < 80; ++i) {  // a valid config cut short
    const std::string& v = valid[pick(2)];
    cases.push_back(v.substr(0, pick(v.size() + 1)));
  }
  for (int i = 0; i < 150; ++i) {  // a few edits of a valid config
    std::string s = valid[pick(2)];
    for (size_t edits = 1 + pick(6); edits > 0 && !s.empty(); --edits) {
      const size_t at = pick(s.size());
      switch (pick(5)) {
        case 0: s[at] = byte(); break;
        case 1: s[at] = yaml_char(); break;
        case 2: s.insert(at, 1, yaml_char()); break;
        case 3: s.erase(at, 1 + pick(20)); break;
        case 4: s.insert(at, s.substr(pick(s.size()), pick(60))); break;  // a repeated piece
      }
    }
    cases.push_back(s);
  }
  const std::string path = dir.file("fuzz.yaml");
  std::ostringstream discarded;  // the messages of the cases run here
  int statuses[3] = {0, 0, 0};
  for (size_t i = 0; i < cases.size(); ++i) {
    write_text(path, cases[i]);
    fulgur::test::ChildResult r;
    if (i % 6 == 0) {
      r = parse_in_child(path);
    } else {
      Program p;
      const std::vector<const char*> argv{"prog", "fit", "--config", path.c_str()};
      auto* const cerr = std::cerr.rdbuf(discarded.rdbuf());
      r.exit_code = p.cli.parse(static_cast<int>(argv.size()), argv.data()).value_or(0);
      std::cerr.rdbuf(cerr);
      discarded.str("");
    }
    const bool ok = r.exit_code == 0 || r.exit_code == 2;
    EXPECT_TRUE(ok) << "case " << i << ": " << r.describe() << "; the config, escaped:\n"
                    << ::testing::PrintToString(cases[i]);
    if (ok) ++statuses[r.exit_code];
  }
  // Both outcomes occur (a fuzzer that only makes errors tests little).
  EXPECT_GT(statuses[0], 10);
  EXPECT_GT(statuses[2], 10);
}

}  // namespace
