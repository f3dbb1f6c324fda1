#include "fulgur/callbacks/progress_bar.h"

#include <gtest/gtest.h>

#include <cstdio>

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

TEST(ProgressBar, StateKey) {
  fulgur::ProgressBar bar;
  EXPECT_EQ(bar.state_key(), "ProgressBar");
}

}  // namespace
