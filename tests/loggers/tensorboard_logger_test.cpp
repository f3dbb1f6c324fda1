#include "fulgur/loggers/tensorboard_logger.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "fulgur/fulgur.h"
#include "support/tensorboard_events.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using fulgur::test::read_text;
using fulgur::test::TempDir;
using fulgur::test::tb::at;
using fulgur::test::tb::count;
using fulgur::test::tb::Decoder;
using fulgur::test::tb::has;
using fulgur::test::tb::number;
using fulgur::test::tb::number_at;
using fulgur::test::tb::read_records;
using fulgur::test::tb::sub;
using fulgur::test::tb::text;
namespace tb = fulgur::test::tb;

/// Every event of every event file in `dir`, files in name order (as
/// TensorBoard reads them).
struct Events {
  std::vector<std::string> files;
  std::vector<std::unique_ptr<tb::Message>> events;
  std::vector<size_t> first_of_file;  // index in `events` of each file's first
};
Events read_events(Decoder& decoder, const std::string& dir) {
  Events out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.find("tfevents") != std::string::npos) out.files.push_back(entry.path().string());
  }
  std::sort(out.files.begin(), out.files.end());
  for (const auto& file : out.files) {
    out.first_of_file.push_back(out.events.size());
    for (const auto& record : read_records(file)) out.events.push_back(decoder.parse("Event", record));
  }
  return out;
}

/// (step, tag, value) of every scalar, in file order.
struct Scalar {
  int64_t step;
  std::string tag;
  float value;
  bool operator==(const Scalar& o) const {
    return step == o.step && tag == o.tag && value == o.value;
  }
};
std::ostream& operator<<(std::ostream& os, const Scalar& s) {
  return os << "(" << s.step << ", " << s.tag << ", " << s.value << ")";
}
void add_scalars(const tb::Message& event, std::vector<Scalar>& out) {
  if (!has(event, "summary")) return;
  const auto& summary = sub(event, "summary");
  for (int i = 0; i < count(summary, "value"); ++i) {
    const auto& v = at(summary, "value", i);
    if (has(v, "simple_value")) {
      out.push_back({static_cast<int64_t>(number(event, "step")), text(v, "tag"),
                     static_cast<float>(number(v, "simple_value"))});
    }
  }
}
std::vector<Scalar> scalars(const Events& events) {
  std::vector<Scalar> out;
  for (const auto& e : events.events) add_scalars(*e, out);
  return out;
}

/// The HParamsPluginData of the value tagged `tag`, or null.
std::unique_ptr<tb::Message> hparams_data(Decoder& decoder, const Events& events,
                                          const std::string& tag) {
  for (const auto& e : events.events) {
    if (!has(*e, "summary")) continue;
    const auto& summary = sub(*e, "summary");
    for (int i = 0; i < count(summary, "value"); ++i) {
      const auto& v = at(summary, "value", i);
      if (text(v, "tag") != tag) continue;
      const auto& plugin = sub(sub(v, "metadata"), "plugin_data");
      EXPECT_EQ(text(plugin, "plugin_name"), "hparams");
      EXPECT_TRUE(has(v, "tensor")) << tag << " carries the null tensor TensorBoard expects";
      return decoder.parse("HParamsPluginData", text(plugin, "content"));
    }
  }
  return nullptr;
}

double now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

TEST(TensorBoardLogger, EventsDecodeToWhatWasLoggedWithValidCrcs) {
  if (!tb::available()) GTEST_SKIP() << tb::why_not();
  TempDir dir;
  const double before = now();
  std::vector<Scalar> logged;
  {
    fulgur::TensorBoardLogger logger({.save_dir = dir.path(), .flush_every = 7});
    logger.log_hyperparams({{"lr", 0.125}, {"layers", int64_t{3}}, {"arch", std::string("mlp")},
                            {"augment", true}});
    for (int64_t step = 1; step <= 25; ++step) {
      const float loss = 1.0f / static_cast<float>(step);
      logger.log_metrics({{"train_loss", loss}, {"epoch", static_cast<double>(step / 10)}}, step);
      logged.push_back({step, "epoch", static_cast<float>(step / 10)});
      logged.push_back({step, "train_loss", loss});
    }
    logger.log_run_status(fulgur::RunStatus::kSuccess);
    logger.finalize();
    EXPECT_EQ(fs::path(logger.event_file()).parent_path(), fs::path(logger.log_dir()));
  }
  const double after = now();

  Decoder decoder;
  const Events events = read_events(decoder, dir.file("fulgur_logs/version_0"));
  ASSERT_EQ(events.files.size(), 1u);
  const std::string name = fs::path(events.files[0]).filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  EXPECT_NE(name.find("." + fulgur::test::host_name() + "."), std::string::npos) << name;

  ASSERT_FALSE(events.events.empty());
  EXPECT_EQ(text(*events.events[0], "file_version"), "brain.Event:2");
  for (const auto& e : events.events) {
    EXPECT_GE(number(*e, "wall_time"), before - 1);
    EXPECT_LE(number(*e, "wall_time"), after + 1);
  }
  EXPECT_EQ(scalars(events), logged);

  auto start = hparams_data(decoder, events, "_hparams_/session_start_info");
  ASSERT_NE(start, nullptr);
  const auto& info = sub(*start, "session_start_info");
  std::map<std::string, std::string> hparams;
  for (int i = 0; i < count(info, "hparams"); ++i) {
    const auto& entry = at(info, "hparams", i);
    const auto& value = sub(entry, "value");
    std::string shown;
    if (has(value, "number_value")) shown = "number " + std::to_string(number(value, "number_value"));
    if (has(value, "string_value")) shown = "string " + text(value, "string_value");
    if (has(value, "bool_value")) shown = std::string("bool ") + (number(value, "bool_value") ? "true" : "false");
    hparams[text(entry, "key")] = shown;
  }
  EXPECT_EQ(hparams, (std::map<std::string, std::string>{{"arch", "string mlp"},
                                                         {"augment", "bool true"},
                                                         {"layers", "number 3.000000"},
                                                         {"lr", "number 0.125000"}}));
  EXPECT_GE(number(info, "start_time_secs"), before - 1);

  auto end = hparams_data(decoder, events, "_hparams_/session_end_info");
  ASSERT_NE(end, nullptr);
  EXPECT_EQ(number(sub(*end, "session_end_info"), "status"), 1);  // STATUS_SUCCESS
}

TEST(TensorBoardLogger, HistogramHoldsEveryFiniteValue) {
  if (!tb::available()) GTEST_SKIP() << tb::why_not();
  TempDir dir;
  fulgur::TensorBoardLogger logger({.save_dir = dir.path()});
  auto values = torch::tensor({-2.0, -1.0, 0.0, 0.5, 0.5, 3.0, std::nan(""), 1.0 / 0.0},
                              torch::kFloat32).reshape({2, 4});
  logger.log_histogram("weights", values, 7);
  logger.finalize();

  Decoder decoder;
  const Events events = read_events(decoder, logger.log_dir());
  ASSERT_EQ(events.events.size(), 2u);  // file version, histogram
  const auto& e = *events.events[1];
  EXPECT_EQ(number(e, "step"), 7);
  const auto& v = at(sub(e, "summary"), "value", 0);
  EXPECT_EQ(text(v, "tag"), "weights");
  const auto& h = sub(v, "histo");
  EXPECT_EQ(number(h, "min"), -2.0);
  EXPECT_EQ(number(h, "max"), 3.0);
  EXPECT_EQ(number(h, "num"), 6);
  EXPECT_DOUBLE_EQ(number(h, "sum"), 1.0);
  EXPECT_DOUBLE_EQ(number(h, "sum_squares"), 4 + 1 + 0.25 + 0.25 + 9);
  ASSERT_EQ(count(h, "bucket"), count(h, "bucket_limit"));
  double total = 0;
  for (int i = 0; i < count(h, "bucket"); ++i) {
    total += number_at(h, "bucket", i);
    if (i > 0) {
      EXPECT_GT(number_at(h, "bucket_limit", i), number_at(h, "bucket_limit", i - 1));
    }
  }
  EXPECT_EQ(total, 6);
  EXPECT_EQ(number_at(h, "bucket_limit", count(h, "bucket_limit") - 1), 3.0);

  EXPECT_THROW(logger.log_histogram("ids", torch::arange(3), 8), fulgur::ConfigError);
}

TEST(TensorBoardLogger, RotatesFilesThatTensorBoardReadsInOrder) {
  if (!tb::available()) GTEST_SKIP() << tb::why_not();
  TempDir dir;
  std::vector<Scalar> logged;
  {
    fulgur::TensorBoardLogger logger(
        {.save_dir = dir.path(), .flush_every = 1, .max_file_bytes = 200});
    for (int64_t step = 0; step < 40; ++step) {
      logger.log_metrics({{"loss", static_cast<double>(step)}}, step);
      logged.push_back({step, "loss", static_cast<float>(step)});
    }
  }  // the destructor writes what is left
  Decoder decoder;
  const Events events = read_events(decoder, dir.file("fulgur_logs/version_0"));
  EXPECT_GT(events.files.size(), 3u);
  for (size_t first : events.first_of_file) {
    EXPECT_EQ(text(*events.events[first], "file_version"), "brain.Event:2");
  }
  EXPECT_EQ(scalars(events), logged);
}

TEST(TensorBoardLogger, RejectsOptionsThatCannotWork) {
  EXPECT_THROW(fulgur::TensorBoardLogger({.flush_every = 0}), fulgur::ConfigError);
  EXPECT_THROW(fulgur::TensorBoardLogger({.max_file_bytes = 0}), fulgur::ConfigError);
  EXPECT_THROW(fulgur::TensorBoardLogger({.version = -1}), fulgur::ConfigError);
}

TEST(TensorBoardLogger, UnwritableDirectoryIsNamed) {
  TempDir dir;
  fulgur::test::write_text(dir.file("file"), "x");
  fulgur::TensorBoardLogger logger({.save_dir = dir.file("file")});
  try {
    logger.log_metrics({{"loss", 1.0}}, 1);
    FAIL() << "no error";
  } catch (const fulgur::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("file")), std::string::npos) << e.what();
  }
}

// ---- Through the Trainer: both loggers in one version directory, and a
// resumed run continuing it.

/// Saves a checkpoint at optimizer step `at`.
class SaveAt : public fulgur::Callback {
 public:
  SaveAt(int64_t at, std::string path) : at_(at), path_(std::move(path)) {}
  std::string state_key() const override { return "SaveAt"; }
  void on_train_batch_end(fulgur::Trainer& trainer, fulgur::Module&, const at::Tensor&,
                          const fulgur::Batch&, int64_t) override {
    if (trainer.global_step() == at_) trainer.save_checkpoint(path_);
  }

 private:
  int64_t at_;
  std::string path_;
};

fulgur::TrainerOptions logged(const TempDir& dir, std::vector<std::shared_ptr<fulgur::Logger>> loggers) {
  auto options = fulgur::test::test_options(dir);
  options.max_epochs = 2;
  options.logger = true;
  options.loggers = std::move(loggers);
  options.log_every_n_steps = 1;
  return options;
}

TEST(TensorBoardLogger, ResumedRunAppendsToItsVersionAndSupersedesLaterSteps) {
  if (!tb::available()) GTEST_SKIP() << tb::why_not();
  TempDir dir;
  const std::string ckpt = dir.file("step4.ckpt");
  const std::string logs = dir.file("logs.v1");  // a dot in the state's key
  {
    auto tb = std::make_shared<fulgur::TensorBoardLogger>(
        fulgur::TensorBoardLoggerOptions{.save_dir = logs, .log_histograms = true});
    auto csv = std::make_shared<fulgur::CSVLogger>(fulgur::CSVLoggerOptions{.save_dir = logs});
    auto options = logged(dir, {csv, tb});
    options.callbacks = {std::make_shared<SaveAt>(4, ckpt)};
    fulgur::Trainer trainer(options);
    fulgur::test::LinearRegression model;
    trainer.fit(model, fulgur::test::regression_loader(3));  // 6 steps over 2 epochs
    EXPECT_EQ(tb->log_dir(), csv->log_dir());
  }
  const std::string run = logs + "/fulgur_logs/version_0";
  Decoder decoder;
  const Events first = read_events(decoder, run);
  ASSERT_EQ(first.files.size(), 1u);
  const std::vector<Scalar> first_scalars = scalars(first);
  // Histograms at each epoch end.
  int histograms = 0;
  for (const auto& e : first.events) {
    if (has(*e, "summary") && has(at(sub(*e, "summary"), "value", 0), "histo")) ++histograms;
  }
  EXPECT_EQ(histograms, 2 * 2);  // fc.weight and fc.bias, two epochs

  {
    auto tb = std::make_shared<fulgur::TensorBoardLogger>(
        fulgur::TensorBoardLoggerOptions{.save_dir = logs});
    auto csv = std::make_shared<fulgur::CSVLogger>(fulgur::CSVLoggerOptions{.save_dir = logs});
    auto options = logged(dir, {csv, tb});
    options.max_epochs = 3;
    fulgur::Trainer trainer(options);
    fulgur::test::LinearRegression model;
    trainer.fit(model, fulgur::test::regression_loader(3), nullptr, {.ckpt_path = ckpt});
    EXPECT_EQ(tb->log_dir(), run);
    EXPECT_EQ(csv->log_dir(), run);
  }
  EXPECT_FALSE(fs::exists(logs + "/fulgur_logs/version_1"));
  const Events both = read_events(decoder, run);
  ASSERT_EQ(both.files.size(), 2u);
  // The resumed file: its version, then the start that drops steps after 4.
  const auto& resumed = both.events;
  const size_t second = both.first_of_file[1];
  EXPECT_EQ(text(*resumed[second], "file_version"), "brain.Event:2");
  ASSERT_TRUE(has(*resumed[second + 1], "session_log"));
  EXPECT_EQ(number(sub(*resumed[second + 1], "session_log"), "status"), 1);  // START
  EXPECT_EQ(number(*resumed[second + 1], "step"), 5);
  // What the resumed run logged starts after step 4.
  for (size_t i = second; i < resumed.size(); ++i) {
    if (has(*resumed[i], "summary")) {
      const auto& summary = sub(*resumed[i], "summary");
      for (int k = 0; k < count(summary, "value"); ++k) {
        const auto& v = at(summary, "value", k);
        if (has(v, "simple_value")) {
          EXPECT_GT(number(*resumed[i], "step"), 4) << text(v, "tag");
        }
      }
    }
  }
  EXPECT_EQ(first_scalars.back().step, 6);

  // The CSV: the first run's rows up to step 4, then the resumed run's.
  std::vector<int64_t> steps;
  for (const auto& line : fulgur::test::read_lines(run + "/metrics.csv")) {
    if (!line.empty() && line.rfind("step", 0) != 0) steps.push_back(std::stoll(line.substr(0, line.find(','))));
  }
  ASSERT_FALSE(steps.empty());
  EXPECT_TRUE(std::is_sorted(steps.begin(), steps.end())) << "rows after step 4 were dropped";
  EXPECT_EQ(steps.front(), 1);
  EXPECT_EQ(steps.back(), 9);
  EXPECT_NE(std::find(steps.begin(), steps.end(), 4), steps.end());
}

/// The scalars TensorBoard shows: a SessionLog START at step s drops what
/// came before it at steps >= s (its orphaned-data purge).
std::vector<Scalar> shown_scalars(const Events& events) {
  std::vector<Scalar> out;
  for (const auto& e : events.events) {
    if (has(*e, "session_log") && number(sub(*e, "session_log"), "status") == 1) {
      const auto from = static_cast<int64_t>(number(*e, "step"));
      out.erase(std::remove_if(out.begin(), out.end(),
                               [from](const Scalar& s) { return s.step >= from; }),
                out.end());
    }
    add_scalars(*e, out);
  }
  return out;
}

// The same Trainer and loggers fitting again from a checkpoint of the first
// fit: its rows after the checkpoint's step are superseded as a new
// Trainer's resume does (the first fit's rows were put back, and TensorBoard
// had no SessionLog START: steps 5 and 6 twice).
TEST(TensorBoardLogger, ASecondFitResumingTheFirstsCheckpointLogsEachStepOnce) {
  if (!tb::available()) GTEST_SKIP() << tb::why_not();
  TempDir dir;
  const std::string ckpt = dir.file("step4.ckpt");
  auto tb = std::make_shared<fulgur::TensorBoardLogger>(
      fulgur::TensorBoardLoggerOptions{.save_dir = dir.path()});
  auto csv = std::make_shared<fulgur::CSVLogger>(fulgur::CSVLoggerOptions{.save_dir = dir.path()});
  auto options = logged(dir, {csv, tb});
  options.callbacks = {std::make_shared<SaveAt>(4, ckpt)};
  fulgur::Trainer trainer(options);
  fulgur::test::LinearRegression model;
  trainer.fit(model, fulgur::test::regression_loader(3));  // 6 steps over 2 epochs
  testing::internal::CaptureStderr();
  trainer.fit(model, fulgur::test::regression_loader(3), nullptr, {.ckpt_path = ckpt});
  EXPECT_THAT(testing::internal::GetCapturedStderr(),
              ::testing::HasSubstr("CSVLogger: resumed at step 4"));
  EXPECT_EQ(tb->log_dir(), csv->log_dir());

  std::vector<std::string> steps;
  for (const auto& line : fulgur::test::read_lines(csv->metrics_file())) {
    if (!line.empty() && line.rfind("step", 0) != 0)
      steps.push_back(line.substr(0, line.find(',')));
  }
  EXPECT_THAT(steps, ::testing::ElementsAre("1", "2", "3", "4", "5", "6"));

  Decoder decoder;
  std::map<std::pair<int64_t, std::string>, int> seen;
  for (const auto& s : shown_scalars(read_events(decoder, tb->log_dir()))) ++seen[{s.step, s.tag}];
  ASSERT_TRUE(seen.count({6, "train_loss"}));
  for (const auto& [key, n] : seen) {
    EXPECT_EQ(n, 1) << key.second << " at step " << key.first;
  }
}

TEST(TensorBoardLogger, CheckpointFromAnotherPlaceLogsToANewVersion) {
  TempDir first_dir, second_dir;
  const std::string ckpt = first_dir.file("step2.ckpt");
  {
    auto options = logged(first_dir, {std::make_shared<fulgur::TensorBoardLogger>(
                                         fulgur::TensorBoardLoggerOptions{.save_dir = first_dir.path()})});
    options.max_epochs = 1;
    options.callbacks = {std::make_shared<SaveAt>(2, ckpt)};
    fulgur::Trainer trainer(options);
    fulgur::test::LinearRegression model;
    trainer.fit(model, fulgur::test::regression_loader(3));
  }
  const auto before = fulgur::test::list_files(first_dir.path());
  auto tb = std::make_shared<fulgur::TensorBoardLogger>(
      fulgur::TensorBoardLoggerOptions{.save_dir = second_dir.path()});
  auto options = logged(second_dir, {tb});
  fulgur::Trainer trainer(options);
  fulgur::test::LinearRegression model;
  trainer.fit(model, fulgur::test::regression_loader(3), nullptr, {.ckpt_path = ckpt});
  EXPECT_EQ(tb->log_dir(), second_dir.file("fulgur_logs/version_0"));
  EXPECT_EQ(fulgur::test::list_files(first_dir.path()), before);
}

// A second fit of the same Trainer from a checkpoint of a run that logged
// elsewhere logs to a new version, as a new Trainer's fit does: it
// appended that run's steps to the first fit's file.
TEST(TensorBoardLogger, ASecondFitFromAnotherPlacesCheckpointLogsToANewVersion) {
  TempDir other, dir;
  const std::string ckpt = other.file("step2.ckpt");
  {
    auto options = logged(
        other,
        {std::make_shared<fulgur::CSVLogger>(fulgur::CSVLoggerOptions{.save_dir = other.path()})});
    options.max_epochs = 1;
    options.callbacks = {std::make_shared<SaveAt>(2, ckpt)};
    fulgur::Trainer trainer(options);
    fulgur::test::LinearRegression model;
    trainer.fit(model, fulgur::test::regression_loader(3));
  }
  auto csv = std::make_shared<fulgur::CSVLogger>(fulgur::CSVLoggerOptions{.save_dir = dir.path()});
  auto tb = std::make_shared<fulgur::TensorBoardLogger>(
      fulgur::TensorBoardLoggerOptions{.save_dir = dir.path()});
  fulgur::Trainer trainer(logged(dir, {csv, tb}));
  fulgur::test::LinearRegression model;
  trainer.fit(model, fulgur::test::regression_loader(3));
  const std::string first = read_text(csv->metrics_file());
  const auto first_files = fulgur::test::list_files(tb->log_dir());
  trainer.fit(model, fulgur::test::regression_loader(3), nullptr, {.ckpt_path = ckpt});
  EXPECT_EQ(csv->log_dir(), dir.file("fulgur_logs/version_1"));
  EXPECT_EQ(tb->log_dir(), dir.file("fulgur_logs/version_1"));
  EXPECT_EQ(read_text(dir.file("fulgur_logs/version_0/metrics.csv")), first);
  EXPECT_EQ(fulgur::test::list_files(dir.file("fulgur_logs/version_0")), first_files);
  EXPECT_TRUE(fs::exists(dir.file("fulgur_logs/version_1/metrics.csv")));
}

// Also under two spellings of one directory (they passed: the check
// compared the state_key() strings).
TEST(TensorBoardLogger, TwoLoggersWritingTheSameFilesAreRefused) {
  TempDir dir;
  fs::create_directory_symlink(dir.path(), dir.file("link"));
  for (const std::string& other : {dir.path(), dir.path() + "/.", dir.file("link")}) {
    auto options = logged(dir, {std::make_shared<fulgur::TensorBoardLogger>(
                                    fulgur::TensorBoardLoggerOptions{.save_dir = dir.path()}),
                                std::make_shared<fulgur::TensorBoardLogger>(
                                    fulgur::TensorBoardLoggerOptions{.save_dir = other})});
    EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer trainer(options),
                       {"loggers[0] and loggers[1] both write to TensorBoardLogger{",
                        "their files would mix. Give one of them another save_dir or name."})
        << other;
  }
  // A CSVLogger beside it writes other files of the same directory.
  fulgur::Trainer both(logged(dir, {std::make_shared<fulgur::TensorBoardLogger>(
                                        fulgur::TensorBoardLoggerOptions{.save_dir = dir.path()}),
                                    std::make_shared<fulgur::CSVLogger>(
                                        fulgur::CSVLoggerOptions{.save_dir = dir.file("link")})}));
}

// A checkpoint is written after the loggers flushed: a run killed right
// after it loses no logged row that its resume would not log again.
TEST(TensorBoardLogger, LoggersFlushBeforeEveryCheckpoint) {
  if (!tb::available()) GTEST_SKIP() << tb::why_not();
  TempDir dir;
  const std::string ckpt = dir.file("step3.ckpt");
  auto tb = std::make_shared<fulgur::TensorBoardLogger>(
      fulgur::TensorBoardLoggerOptions{.save_dir = dir.path(), .flush_every = 1000});
  auto csv = std::make_shared<fulgur::CSVLogger>(
      fulgur::CSVLoggerOptions{.save_dir = dir.path(), .flush_every = 1000});
  struct Check : fulgur::Callback {
    std::string state_key() const override { return "Check"; }
    void on_train_batch_end(fulgur::Trainer& trainer, fulgur::Module&, const at::Tensor&,
                            const fulgur::Batch&, int64_t) override {
      if (trainer.global_step() != 3) return;
      trainer.save_checkpoint(path);
      csv_lines = fulgur::test::read_lines(csv->metrics_file()).size();
      Decoder decoder;
      tb_scalars = scalars(read_events(decoder, tb->log_dir())).size();
    }
    std::string path;
    std::shared_ptr<fulgur::CSVLogger> csv;
    std::shared_ptr<fulgur::TensorBoardLogger> tb;
    size_t csv_lines = 0, tb_scalars = 0;
  };
  auto check = std::make_shared<Check>();
  check->path = ckpt;
  check->csv = csv;
  check->tb = tb;
  auto options = logged(dir, {csv, tb});
  options.max_epochs = 1;
  options.callbacks = {check};
  fulgur::Trainer trainer(options);
  fulgur::test::LinearRegression model;
  trainer.fit(model, fulgur::test::regression_loader(4));
  EXPECT_EQ(check->csv_lines, 1u + 3u);   // header, steps 1-3
  EXPECT_EQ(check->tb_scalars, 3u * 2u);  // train_loss and epoch at steps 1-3
}

}  // namespace
