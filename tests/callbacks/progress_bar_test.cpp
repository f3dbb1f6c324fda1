#include "fulgur/callbacks/progress_bar.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <pty.h>
#include <unistd.h>

#include <cstdio>
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

// What a ProgressBar draws on a pseudo-terminal during a fit with
// validation, a test and a standalone validate.
std::string drawn_on_a_terminal(int64_t epochs) {
  int master = -1, slave = -1;
  EXPECT_EQ(::openpty(&master, &slave, nullptr, nullptr, nullptr), 0);
  std::FILE* out = ::fdopen(slave, "w");
  std::string text;
  std::thread reader([&] {
    char buf[4096];
    ssize_t n;
    while ((n = ::read(master, buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(n));
  });
  {
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
  }
  std::fclose(out);
  reader.join();
  ::close(master);
  return text;
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
