#include "fulgur/callbacks/progress_bar.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <pty.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <thread>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::TempDir;

TEST(ProgressBar, OneLinePerEpochWhenNotATerminal) {
  TempDir dir;
  auto path = dir.file("progress.txt");
  std::FILE* out = std::fopen(path.c_str(), "w");
  ASSERT_NE(out, nullptr);
  {
    LinearRegression model;
    auto options = fulgur::test::test_options(dir);
    options.max_epochs = 3;
    options.callbacks = {std::make_shared<fulgur::ProgressBar>(100, out)};
    fulgur::Trainer trainer(options);
    trainer.fit(model, fulgur::test::regression_loader(4));
  }
  std::fclose(out);
  auto lines = fulgur::test::read_lines(path);
  int64_t non_empty = 0;
  for (const auto& line : lines) non_empty += line.empty() ? 0 : 1;
  // A file is not a terminal: no redrawn lines, at least one line per epoch.
  EXPECT_GE(non_empty, 3);
  EXPECT_EQ(fulgur::test::read_text(path).find('\r'), std::string::npos);
}

// What a ProgressBar drawing on a pseudo-terminal shows while `run` uses
// it (it is given the bar's stream).
std::string on_a_terminal(const std::function<void(std::FILE*)>& run) {
  int master = -1, slave = -1;
  EXPECT_EQ(::openpty(&master, &slave, nullptr, nullptr, nullptr), 0);
  std::FILE* out = ::fdopen(slave, "w");
  std::string text;
  std::thread reader([&] {
    char buf[4096];
    ssize_t n;
    while ((n = ::read(master, buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(n));
  });
  run(out);
  std::fclose(out);
  reader.join();
  ::close(master);
  return text;
}

// What a ProgressBar draws on a pseudo-terminal during a fit with
// validation, a test and a standalone validate.
std::string drawn_on_a_terminal(int64_t epochs) {
  return on_a_terminal([epochs](std::FILE* out) {
    TempDir dir;
    LinearRegression model;
    model.train_hook = [](LinearRegression& m, fulgur::Batch&, int64_t) {
      m.log("shown", 0.25, {.prog_bar = true});
    };
    auto options = fulgur::test::test_options(dir);
    options.max_epochs = epochs;
    options.callbacks = {std::make_shared<fulgur::ProgressBar>(0, out)};
    fulgur::Trainer trainer(options);
    trainer.fit(model, fulgur::test::regression_loader(4), fulgur::test::regression_loader(3));
    trainer.test(model, fulgur::test::regression_loader(2));
    trainer.validate(model, fulgur::test::regression_loader(5));
  });
}

TEST(ProgressBar, OnATerminalABarPerStageWithCountRateTimesAndMetrics) {
  const std::string text = drawn_on_a_terminal(2);
  for (const std::string& part : std::vector<std::string>{
           "\r\033[K", "Epoch 0 [", "Epoch 1 [", "=====", "] 4/4 ", "it/s", "00:00<00:00",
        "Validation [", "] 3/3 ", "Sanity check [", "] 2/3 ", "Testing [", "] 2/2 ",
        "shown=0.25"}) {
    EXPECT_NE(text.find(part), std::string::npos) << "no \"" << part << "\" in:\n" << text;
  }
  // A standalone validate's bar stays, complete, on its own line.
  const std::string last = text.substr(text.rfind("\033[K") + 3);
  EXPECT_EQ(last.rfind("Validation [", 0), 0u) << text;
  EXPECT_NE(last.find("] 5/5 "), std::string::npos) << text;
  EXPECT_NE(last.find('\n'), std::string::npos) << text;
  // A half-done bar shows its head.
  EXPECT_NE(text.find("] 2/4 "), std::string::npos) << text;
  EXPECT_NE(text.find(">"), std::string::npos) << text;
}

// An epoch resumed mid-way counts on from the batch it resumed at: its line
// ends at the epoch's length (it read 2/4: the bar counted from 0), also
// where the checkpoint was the epoch's last batch and no batch is left.
TEST(ProgressBar, AnEpochResumedMidWayCountsFromItsBatch) {
  for (const int64_t stop : {2, 4}) {
    SCOPED_TRACE(stop);
    TempDir dir;
    auto options = fulgur::test::test_options(dir);
    options.enable_checkpointing = true;
    options.every_n_train_steps = 2;
    options.max_steps = stop;
    {
      LinearRegression model;
      fulgur::Trainer(options).fit(model, fulgur::test::regression_loader(4));
    }
    const std::string path = dir.file("progress.txt");
    std::FILE* out = std::fopen(path.c_str(), "w");
    ASSERT_NE(out, nullptr);
    {
      options.max_steps = -1;
      options.callbacks = {std::make_shared<fulgur::ProgressBar>(100, out)};
      LinearRegression model;
      fulgur::Trainer(options).fit(model, fulgur::test::regression_loader(4), nullptr,
                                   {.ckpt_path = "last"});
      EXPECT_EQ(model.training_steps, 4 - stop);
    }
    std::fclose(out);
    const std::string text = fulgur::test::read_text(path);
    EXPECT_NE(text.find("Epoch 0 4/4 "), std::string::npos) << text;
    EXPECT_EQ(text.find("Epoch 0 2/4 "), std::string::npos) << text;
    EXPECT_EQ(text.find("Epoch 0 0/4 "), std::string::npos) << text;
  }
}

// Each stage's bar starts at 0 and ends on its line: a predict of unknown
// length (its bar never reached a total) then a test of 2 batches (it drew
// 4/2, 5/2 on the predict's count).
TEST(ProgressBar, EachStagesBarStartsAfreshAfterAPredictOfUnknownLength) {
  const std::string text = on_a_terminal([](std::FILE* out) {
    TempDir dir;
    LinearRegression model;
    auto options = fulgur::test::test_options(dir);
    options.callbacks = {std::make_shared<fulgur::ProgressBar>(0, out)};
    fulgur::Trainer trainer(options);
    trainer.predict(model, fulgur::test::generator_loader(3));
    trainer.test(model, fulgur::test::regression_loader(2));
  });
  EXPECT_NE(text.find("Testing [====="), std::string::npos) << text;
  EXPECT_NE(text.find("] 2/2 "), std::string::npos) << text;
  EXPECT_EQ(text.find("4/2"), std::string::npos) << text;
  // The predict's line ends (complete) before the test's starts.
  const size_t predict_end = text.rfind("Predicting 3 ");
  ASSERT_NE(predict_end, std::string::npos) << text;
  const size_t newline = text.find('\n', predict_end);
  ASSERT_NE(newline, std::string::npos) << text;
  EXPECT_LT(newline, text.find("Testing")) << text;
}

TEST(ProgressBar, StateKey) {
  fulgur::ProgressBar bar;
  EXPECT_EQ(bar.state_key(), "ProgressBar");
}

// A null stream is named (it ended the process in fileno).
TEST(ProgressBar, ANullStreamIsRefused) {
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::ProgressBar(100, nullptr),
                     {"the output stream is null"});
}

// A ProgressBar given is the one shown: enable_progress_bar adds none
// beside it (two would share a checkpoint section).
TEST(ProgressBar, OneGivenIsTheOnlyOne) {
  fulgur::test::TempDir dir;
  auto options = fulgur::test::test_options(dir);
  options.enable_progress_bar = true;
  auto mine = std::make_shared<fulgur::ProgressBar>();
  options.callbacks = {mine};
  fulgur::Trainer trainer(options);
  int bars = 0;
  for (const auto& cb : trainer.callbacks())
    bars += dynamic_cast<fulgur::ProgressBar*>(cb.get()) != nullptr;
  EXPECT_EQ(bars, 1);
}

}  // namespace
