#include "fulgur/loggers/csv_logger.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>

#include <yaml-cpp/yaml.h>

#include "fulgur/fulgur.h"
#include "support/run_in_child.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using fulgur::test::read_lines;
using fulgur::test::read_text;
using fulgur::test::split;
using fulgur::test::TempDir;
using ::testing::ElementsAre;

/// metrics.csv as rows of cells, header first.
std::vector<std::vector<std::string>> read_csv(const std::string& path) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& line : read_lines(path)) {
    if (!line.empty()) rows.push_back(split(line, ','));
  }
  return rows;
}

TEST(CSVLogger, LogDirIsNameThenNextFreeVersion) {
  TempDir dir;
  fulgur::CSVLogger first({.save_dir = dir.path()});
  EXPECT_EQ(first.name(), "fulgur_logs");
  EXPECT_EQ(fs::path(first.log_dir()).lexically_normal(),
            fs::path(dir.file("fulgur_logs/version_0")).lexically_normal());
  EXPECT_EQ(fs::path(first.log_dir()).filename().string(), "version_0");

  fs::create_directories(dir.file("fulgur_logs/version_0"));
  fs::create_directories(dir.file("fulgur_logs/version_1"));
  fulgur::CSVLogger next({.save_dir = dir.path()});
  EXPECT_EQ(fs::path(next.log_dir()).filename().string(), "version_2");
}

TEST(CSVLogger, ExplicitNameAndVersion) {
  TempDir dir;
  fulgur::CSVLogger logger({.save_dir = dir.path(), .name = "run", .version = 7});
  EXPECT_EQ(logger.name(), "run");
  EXPECT_EQ(fs::path(logger.log_dir()).lexically_normal(),
            fs::path(dir.file("run/version_7")).lexically_normal());
  EXPECT_EQ(fs::path(logger.metrics_file()).filename().string(), "metrics.csv");
  EXPECT_EQ(fs::path(logger.metrics_file()).parent_path().lexically_normal(),
            fs::path(logger.log_dir()).lexically_normal());
}

TEST(CSVLogger, WritesARectangularCsvWithStepFirst) {
  TempDir dir;
  fulgur::CSVLogger logger({.save_dir = dir.path()});
  logger.log_metrics({{"a", 1.0}}, 0);
  logger.log_metrics({{"a", 2.0}, {"b", 3.0}}, 1);
  logger.save();
  auto rows = read_csv(logger.metrics_file());
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_THAT(rows[0], ElementsAre("step", "a", "b"));
  ASSERT_EQ(rows[1].size(), 3u);
  EXPECT_EQ(std::stoll(rows[1][0]), 0);
  EXPECT_DOUBLE_EQ(std::stod(rows[1][1]), 1.0);
  EXPECT_EQ(rows[1][2], "");  // b was not logged at step 0
  ASSERT_EQ(rows[2].size(), 3u);
  EXPECT_EQ(std::stoll(rows[2][0]), 1);
  EXPECT_DOUBLE_EQ(std::stod(rows[2][1]), 2.0);
  EXPECT_DOUBLE_EQ(std::stod(rows[2][2]), 3.0);
}

TEST(CSVLogger, NewColumnAfterAFlushRewritesTheHeader) {
  TempDir dir;
  fulgur::CSVLogger logger({.save_dir = dir.path(), .flush_every = 1});
  logger.log_metrics({{"loss", 0.5}}, 0);
  logger.save();
  ASSERT_THAT(read_csv(logger.metrics_file())[0], ElementsAre("step", "loss"));
  logger.log_metrics({{"acc", 0.25}}, 1);
  logger.finalize();
  auto rows = read_csv(logger.metrics_file());
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_THAT(rows[0], ElementsAre("step", "loss", "acc"));
  for (const auto& row : rows) EXPECT_EQ(row.size(), 3u);
  EXPECT_DOUBLE_EQ(std::stod(rows[1][1]), 0.5);
  EXPECT_EQ(rows[1][2], "");
  EXPECT_EQ(rows[2][1], "");
  EXPECT_DOUBLE_EQ(std::stod(rows[2][2]), 0.25);
}

// A disk that fills up (a tmpfs): a rewrite of metrics.csv (a new column)
// that does not fit fails naming the reason and keeps the file as it was,
// rows and all; once there is room again the next save writes every row.
TEST(CSVLogger, ARewriteThatDoesNotFitKeepsTheFileAsItWas) {
  TempDir dir;
  const auto r = fulgur::test::run_on_tmpfs(dir.path(), "64k", [&] {
    fulgur::CSVLogger logger({.save_dir = dir.path(), .flush_every = 1000});
    for (int step = 0; step < 1000; ++step) logger.log_metrics({{"loss", 0.5}}, step);
    logger.save();
    const std::string before = read_text(logger.metrics_file());
    if (before.size() < 4000) return 10;
    // The rest of the disk filled by another file.
    const std::string filler = dir.file("filler");
    {
      std::ofstream out(filler);
      out << std::string(64 * 1024, 'x');
    }
    logger.log_metrics({{"acc", 0.25}}, 1000);
    try {
      logger.save();
      return 11;
    } catch (const fulgur::ConfigError& e) {
      if (!fulgur::test::message_contains(
              e.what(), {"metrics.csv", "No space left on device", "rows stay pending"})) {
        return 12;
      }
    }
    if (read_text(logger.metrics_file()) != before) return 13;
    fs::remove(filler);
    logger.save();
    const auto rows = read_csv(logger.metrics_file());
    if (rows.size() != 1002 || rows[0] != std::vector<std::string>{"step", "loss", "acc"})
      return 14;
    return 0;
  });
  if (r.exit_code == fulgur::test::kCannotMountTmpfs) GTEST_SKIP() << "cannot mount a tmpfs here";
  EXPECT_EQ(r.exit_code, 0) << r.describe()
                            << " (10: too small a file, 11: saved anyway, 12: wrong message, 13: "
                               "the file changed, 14: the rows are not all there after)";
}

// An append that fills the disk part-way through its rows: the next save,
// with room again, writes the file anew from what it held before that
// append (the rows are read back from it, not kept in memory), each row
// once.
TEST(CSVLogger, AnAppendCutByAFullDiskIsWrittenWholeByTheNextSave) {
  TempDir dir;
  const auto r = fulgur::test::run_on_tmpfs(dir.path(), "64k", [&] {
    fulgur::CSVLogger logger({.save_dir = dir.path(), .flush_every = 100000});
    for (int step = 0; step < 1000; ++step) logger.log_metrics({{"loss", 0.5}}, step);
    logger.save();
    const auto saved = fs::file_size(logger.metrics_file());
    // Another file takes the rest of the disk but a page.
    const std::string filler = dir.file("filler");
    {
      std::ofstream out(filler);
      out << std::string(64 * 1024, 'x');
    }
    fs::resize_file(filler, fs::file_size(filler) - 4096);
    for (int step = 1000; step < 3000; ++step) logger.log_metrics({{"loss", 0.25}}, step);
    try {
      logger.save();
      return 11;
    } catch (const fulgur::ConfigError& e) {
      if (!fulgur::test::message_contains(e.what(), {"cannot append", "rows stay pending"})) {
        return 12;
      }
    }
    if (fs::file_size(logger.metrics_file()) <= saved) return 13;  // part went in
    fs::remove(filler);
    logger.save();
    const auto rows = read_csv(logger.metrics_file());
    if (rows.size() != 3001) return 14;
    for (int step = 0; step < 3000; ++step) {
      if (rows[static_cast<size_t>(step) + 1] !=
          std::vector<std::string>{std::to_string(step), step < 1000 ? "0.5" : "0.25"})
        return 15;
    }
    return 0;
  });
  if (r.exit_code == fulgur::test::kCannotMountTmpfs) GTEST_SKIP() << "cannot mount a tmpfs here";
  EXPECT_EQ(r.exit_code, 0) << r.describe()
                            << " (11: saved anyway, 12: wrong message, 13: nothing of the append "
                               "went in, 14: not a row per step, 15: a row not as logged)";
}

// Names that would break the file (it reads no quoting) are refused, naming
// the metric, and nothing of the call is kept.
TEST(CSVLogger, NamesTheFileCannotHoldAreRefused) {
  TempDir dir;
  fulgur::CSVLogger logger({.save_dir = dir.path()});
  for (const std::string name : {"a,b", "q\"", "line\nbreak", "step", ""}) {
    SCOPED_TRACE(name);
    EXPECT_THROWS_WITH(fulgur::ConfigError, logger.log_metrics({{"ok", 1.0}, {name, 2.0}}, 1),
                       {fulgur::str("a metric named \"", name, "\" cannot be a column")});
  }
  logger.log_metrics({{"ok", 1.0}}, 2);
  logger.save();
  EXPECT_THAT(read_csv(logger.metrics_file()),
              ElementsAre(ElementsAre("step", "ok"), ElementsAre("2", "1")));
}

TEST(CSVLogger, WritesHyperparametersAsYaml) {
  TempDir dir;
  fulgur::CSVLogger logger({.save_dir = dir.path()});
  logger.log_hyperparams({{"lr", 0.5}, {"layers", int64_t{3}}, {"optimizer", std::string("sgd")}});
  logger.save();
  auto path = (fs::path(logger.log_dir()) / "hparams.yaml").string();
  ASSERT_TRUE(fs::exists(path));
  auto text = read_text(path);
  EXPECT_TRUE(fulgur::test::message_contains(text, {"lr: 0.5", "layers: 3", "optimizer:", "sgd"}));
}

// hparams.yaml reads back as logged: doubles exactly and as floats (6
// digits were written: 0.00012345678 read 0.000123457, 0.9999999 read the
// int 1, 1e-05 a string to PyYAML), infinities and NaN as YAML's, keys and
// strings that YAML would misread (a ": " or " #" in a key, a newline, a
// control character) quoted and escaped.
TEST(CSVLogger, HyperparametersReadBackAsLogged) {
  TempDir dir;
  fulgur::CSVLogger logger({.save_dir = dir.path()});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  logger.log_hyperparams({{"lr", 0.00012345678},
                          {"almost_one", 0.9999999},
                          {"one", 1.0},
                          {"eps", 1e-05},
                          {"big", 12345678.9},
                          {"inf", inf},
                          {"nan", nan},
                          {"steps", int64_t{12345678901}},
                          {"flag", true},
                          {"key: colon", std::string("v")},
                          {"# hash", std::string("w")},
                          {"number_like", std::string("1e-05")},
                          {"lines", std::string("a\nb\x01c \"quoted\"")}});
  const std::string text = read_text((fs::path(logger.log_dir()) / "hparams.yaml").string());
  EXPECT_THAT(text, ::testing::HasSubstr("eps: 1.0e-05\n")) << text;
  EXPECT_THAT(text, ::testing::HasSubstr("one: 1.0\n")) << text;
  const YAML::Node yaml = YAML::Load(text);
  ASSERT_TRUE(yaml.IsMap()) << text;
  EXPECT_EQ(yaml["lr"].as<double>(), 0.00012345678);
  EXPECT_EQ(yaml["almost_one"].as<double>(), 0.9999999);
  EXPECT_EQ(yaml["almost_one"].Scalar(), "0.9999999");
  EXPECT_EQ(yaml["eps"].as<double>(), 1e-05);
  EXPECT_EQ(yaml["big"].as<double>(), 12345678.9);
  EXPECT_EQ(yaml["inf"].Scalar(), ".inf");
  EXPECT_EQ(yaml["nan"].Scalar(), ".nan");
  EXPECT_EQ(yaml["steps"].as<int64_t>(), 12345678901);
  EXPECT_EQ(yaml["flag"].as<bool>(), true);
  EXPECT_EQ(yaml["key: colon"].as<std::string>(), "v");
  EXPECT_EQ(yaml["# hash"].as<std::string>(), "w");
  EXPECT_EQ(yaml["number_like"].Tag(), "!");  // quoted: a string, not a number
  EXPECT_EQ(yaml["number_like"].as<std::string>(), "1e-05");
  EXPECT_EQ(yaml["lines"].as<std::string>(), "a\nb\x01c \"quoted\"");
}

TEST(CSVLogger, TrainerWritesMetricsAndHyperparameters) {
  TempDir dir;
  fulgur::test::LinearRegression model;
  model.save_hyperparameters({{"lr", 0.05}, {"hidden", int64_t{4}}});
  auto options = fulgur::test::test_options(dir);
  options.max_epochs = 2;
  options.logger = true;
  options.log_every_n_steps = 1;
  fulgur::Trainer trainer(options);
  ASSERT_EQ(trainer.loggers().size(), 1u);
  auto* csv = dynamic_cast<fulgur::CSVLogger*>(trainer.loggers()[0].get());
  ASSERT_NE(csv, nullptr) << "logger=true without loggers adds a CSVLogger";
  trainer.fit(model, fulgur::test::regression_loader(3), fulgur::test::regression_loader(2));

  // Under default_root_dir.
  EXPECT_EQ(fs::path(trainer.log_dir()).lexically_normal(),
            fs::path(dir.file("fulgur_logs/version_0")).lexically_normal());
  ASSERT_TRUE(fs::exists(csv->metrics_file()));
  auto rows = read_csv(csv->metrics_file());
  ASSERT_GE(rows.size(), 2u);
  const auto& header = rows[0];
  EXPECT_EQ(header[0], "step");
  EXPECT_THAT(header, ::testing::Contains("train_loss"));
  EXPECT_THAT(header, ::testing::Contains("val_loss"));
  for (const auto& row : rows) EXPECT_EQ(row.size(), header.size());

  auto yaml = (fs::path(trainer.log_dir()) / "hparams.yaml").string();
  ASSERT_TRUE(fs::exists(yaml));
  EXPECT_TRUE(fulgur::test::message_contains(read_text(yaml), {"lr", "hidden: 4"}));
}

// A resumed run drops the rows of metrics.csv that the run it resumes
// logged after its checkpoint (it logs those steps again) and a row cut
// short by that run's end, and says so.
TEST(CSVLogger, AResumeSaysWhichRowsItDrops) {
  TempDir dir;
  fulgur::StateDict state;
  std::string file;
  {
    fulgur::CSVLogger first({.save_dir = dir.path()});
    for (int64_t step = 1; step <= 6; ++step) first.log_metrics({{"loss", 1.0 / step}}, step);
    first.save();
    state = first.state_dict();
    file = first.metrics_file();
  }
  std::ofstream(file, std::ios::app) << "7,0.";  // as a crash leaves it
  fulgur::CSVLogger resumed({.save_dir = dir.path()});
  resumed.load_state_dict(state, 4);
  resumed.log_metrics({{"loss", 0.5}}, 5);
  testing::internal::CaptureStderr();
  resumed.save();
  EXPECT_THAT(testing::internal::GetCapturedStderr(),
              ::testing::HasSubstr(fulgur::str(
                  "CSVLogger: resumed at step 4: in \"", file,
                  "\", 2 rows after that step (logged by the run resumed from after its "
                  "checkpoint) are dropped: this run logs those steps again; 1 row cut short by "
                  "its interruption is dropped.")));
  const auto rows = read_csv(file);
  ASSERT_EQ(rows.size(), 6u);  // the header, steps 1 to 4, the resumed run's 5
  EXPECT_EQ(rows[4][0], "4");
  EXPECT_THAT(rows[5], ElementsAre("5", "0.5"));
  // A resume with nothing to drop says nothing.
  fulgur::CSVLogger again({.save_dir = dir.path()});
  again.load_state_dict(resumed.state_dict(), 5);
  again.log_metrics({{"loss", 0.25}}, 6);
  testing::internal::CaptureStderr();
  again.save();
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

// A resume of another run (a checkpoint without this logger's state) by
// the same logger, with an explicit version: that run's steps replace the
// file's rows, as a new logger's would, with the note (they were appended
// after an earlier fit's, steps 1-6 then 4).
TEST(CSVLogger, AResumeOfAnotherRunInAnExplicitVersionStartsTheFileAnew) {
  TempDir dir;
  fulgur::CSVLogger logger({.save_dir = dir.path(), .version = 0});
  for (int64_t step = 1; step <= 6; ++step) logger.log_metrics({{"loss", 1.0 / step}}, step);
  logger.finalize();
  logger.resume_without_state(3);
  logger.log_metrics({{"acc", 0.5}}, 4);
  testing::internal::CaptureStderr();
  logger.save();
  EXPECT_THAT(testing::internal::GetCapturedStderr(),
              ::testing::HasSubstr("holds the rows of an earlier run of this version"));
  EXPECT_THAT(read_lines(logger.metrics_file()), ElementsAre("step,acc", "4,0.5"));
}

// A checkpoint records its logger's directory whole: resumed from another
// working directory, a relative save_dir names another run's directory,
// whose rows the resume dropped and replaced (its own "version_0"). Now the
// resume logs to a new version there, and that run's file is left as it was.
TEST(CSVLogger, AResumeFromAnotherWorkingDirectoryLeavesThatDirectorysRunAlone) {
  TempDir first, second;
  const fs::path was = fs::current_path();
  struct BackTo {
    fs::path dir;
    ~BackTo() { fs::current_path(dir); }
  } back{was};
  fulgur::StateDict state;
  fs::current_path(first.path());
  {
    fulgur::CSVLogger a({.save_dir = "runs"});
    for (int64_t step = 1; step <= 6; ++step) a.log_metrics({{"loss", 1.0 / step}}, step);
    a.save();
    state = a.state_dict();
  }
  fs::current_path(second.path());
  std::string others;
  {
    fulgur::CSVLogger b({.save_dir = "runs"});
    for (int64_t step = 1; step <= 6; ++step) b.log_metrics({{"loss", 2.0 / step}}, step);
    b.save();
    others = read_text(b.metrics_file());
  }
  fulgur::CSVLogger resumed({.save_dir = "runs"});
  testing::internal::CaptureStderr();
  resumed.load_state_dict(state, 3);
  resumed.log_metrics({{"loss", 0.5}}, 4);
  resumed.save();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, ::testing::HasSubstr("which is not a version directory under"));
  EXPECT_EQ(fs::path(resumed.log_dir()).filename(), "version_1");
  EXPECT_EQ(read_text(second.file("runs/fulgur_logs/version_0/metrics.csv")), others);
}

// Under gradient accumulation the step values go to the loggers every
// log_every_n_steps optimizer steps, once: the micro-batches after a
// stepping batch (the same count of batches that stepped) logged it again,
// one row each.
TEST(CSVLogger, UnderAccumulationEachLoggedStepIsOneRow) {
  TempDir dir;
  fulgur::test::LinearRegression model;
  auto options = fulgur::test::test_options(dir);
  options.logger = true;
  options.accumulate_grad_batches = 4;
  options.log_every_n_steps = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, fulgur::test::regression_loader(16));
  auto* csv = dynamic_cast<fulgur::CSVLogger*>(trainer.loggers().at(0).get());
  ASSERT_NE(csv, nullptr);
  std::vector<std::string> steps;
  const auto rows = read_csv(csv->metrics_file());
  const auto column = std::find(rows.at(0).begin(), rows.at(0).end(), "train_loss");
  ASSERT_NE(column, rows[0].end());
  for (size_t i = 1; i < rows.size(); ++i) {
    if (!rows[i][static_cast<size_t>(column - rows[0].begin())].empty())
      steps.push_back(rows[i][0]);
  }
  EXPECT_THAT(steps, ElementsAre("2", "4"));
}

// A value the module logs as "epoch" is the row's epoch (as Lightning's): it
// was replaced by the loop's epoch.
TEST(CSVLogger, AnEpochTheModuleLogsIsKept) {
  TempDir dir;
  fulgur::test::LinearRegression model;
  model.train_hook = [](fulgur::test::LinearRegression& m, fulgur::Batch&, int64_t) {
    m.log("epoch", 7.0, {.on_step = true, .on_epoch = false});
  };
  auto options = fulgur::test::test_options(dir);
  options.logger = true;
  options.log_every_n_steps = 1;
  fulgur::Trainer trainer(options);
  trainer.fit(model, fulgur::test::regression_loader(2));
  auto* csv = dynamic_cast<fulgur::CSVLogger*>(trainer.loggers().at(0).get());
  ASSERT_NE(csv, nullptr);
  const auto rows = read_csv(csv->metrics_file());
  const auto column = std::find(rows.at(0).begin(), rows.at(0).end(), "epoch");
  ASSERT_NE(column, rows[0].end());
  ASSERT_EQ(rows.size(), 3u);  // the header and steps 1, 2
  for (size_t i = 1; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i][static_cast<size_t>(column - rows[0].begin())], "7") << i;
  }
}

// A test stage that fails after its values were published (here in
// on_test_end) still writes them: they reached no file.
TEST(CSVLogger, AFailedTestStageWritesWhatItPublished) {
  TempDir dir;
  struct FailsAtTheEnd : fulgur::Callback {
    std::string state_key() const override { return "FailsAtTheEnd"; }
    void on_test_end(fulgur::Trainer&, fulgur::Module&) override {
      throw std::runtime_error("a bug at the test's end");
    }
  };
  auto options = fulgur::test::test_options(dir);
  options.logger = true;
  options.callbacks = {std::make_shared<FailsAtTheEnd>()};
  fulgur::Trainer trainer(options);
  fulgur::test::LinearRegression model;
  EXPECT_THROW(trainer.test(model, fulgur::test::regression_loader(2)), std::runtime_error);
  auto* csv = dynamic_cast<fulgur::CSVLogger*>(trainer.loggers().at(0).get());
  ASSERT_NE(csv, nullptr);
  ASSERT_TRUE(fs::exists(csv->metrics_file()));
  EXPECT_THAT(read_text(csv->metrics_file()), ::testing::HasSubstr("test_loss"));
}

// A value that a float holds is written with 9 digits (they read back as
// that float); any other double (a byte count, a large counter) with the
// digits it needs to read back (it had 9: 1.23456789e+10).
TEST(CSVLogger, ValuesReadBackAsLogged) {
  TempDir dir;
  fulgur::CSVLogger logger({.save_dir = dir.path()});
  logger.log_metrics(
      {{"bytes", 12345678901.0}, {"loss", static_cast<double>(0.1f)}, {"third", 1.0 / 3.0}}, 1);
  logger.save();
  const auto rows = read_csv(logger.metrics_file());
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_THAT(rows[0], ElementsAre("step", "bytes", "loss", "third"));
  EXPECT_EQ(rows[1][1], "12345678901");
  EXPECT_EQ(rows[1][2], "0.100000001");
  EXPECT_EQ(std::strtod(rows[1][3].c_str(), nullptr), 1.0 / 3.0);
}

TEST(CSVLogger, ExplicitLoggersReplaceTheDefault) {
  TempDir dir;
  auto mine = std::make_shared<fulgur::CSVLogger>(
      fulgur::CSVLoggerOptions{.save_dir = dir.file("mine"), .name = "exp"});
  auto options = fulgur::test::test_options(dir);
  options.logger = true;
  options.loggers = {mine};
  fulgur::Trainer trainer(options);
  ASSERT_EQ(trainer.loggers().size(), 1u);
  EXPECT_EQ(trainer.loggers()[0], mine);
  EXPECT_EQ(trainer.log_dir(), mine->log_dir());
}

TEST(CSVLogger, NoLoggerMeansNoLogDir) {
  TempDir dir;
  fulgur::Trainer trainer(fulgur::test::test_options(dir));
  EXPECT_TRUE(trainer.loggers().empty());
  EXPECT_EQ(trainer.log_dir(), "");
  fulgur::test::LinearRegression model;
  trainer.fit(model, fulgur::test::regression_loader(2));
  EXPECT_THAT(fulgur::test::list_files(dir.path()), ::testing::IsEmpty());
}

// A log directory that cannot be created (a file stands where a parent
// should be): a ConfigError naming it and the file in the way, and the rows stay
// pending for a later save.
TEST(CSVLogger, AnUncreatableLogDirectoryIsAClearError) {
  TempDir dir;
  fulgur::test::write_text(dir.file("taken"), "a file, not a directory\n");
  fulgur::CSVLogger logger({.save_dir = dir.file("taken"), .name = "run"});
  logger.log_metrics({{"loss", 1.0}}, 0);
  EXPECT_THROWS_WITH(fulgur::ConfigError, logger.save(),
                     {"cannot create the log directory", dir.file("taken/run/version_0"),
                      "\"" + dir.file("taken") + "\" is a file", "Move it away", "save_dir"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, logger.log_hyperparams({{"lr", 0.1}}),
                     {"cannot create the log directory", "is a file"});
  // Once the way is clear, the pending row is written.
  fs::remove(dir.file("taken"));
  logger.save();
  EXPECT_EQ(read_csv(logger.metrics_file()).size(), 2u);
}

}  // namespace
