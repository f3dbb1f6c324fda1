// `fulgur plot`, run as a child process: a run directory in, its curves
// out as a PNG next to the metrics; errors name what was passed.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>

#include "support/process.h"
#include "support/test_support.h"

namespace {

using fulgur::test::run_process;
using fulgur::test::TempDir;
using fulgur::test::write_text;
using namespace std::chrono_literals;

TEST(FulgurPlot, DrawsTheNewestRunOfADirectory) {
  TempDir dir;
  std::filesystem::create_directories(dir.file("fulgur_logs/version_1"));
  write_text(dir.file("fulgur_logs/version_1/metrics.csv"),
             "step,train_loss,val_loss\n1,2.0,\n2,1.5,\n2,,1.7\n3,1.1,\n");
  auto r = run_process({FULGUR_CLI, "plot", dir.path()}, {}, 60s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir.file("fulgur_logs/version_1/metrics.png"))) << r.output;
  auto out =
      run_process({FULGUR_CLI, "plot", dir.path(), "--out", dir.file("elsewhere.png")}, {}, 60s);
  ASSERT_EQ(out.exit_code, 0) << out.output;
  EXPECT_TRUE(std::filesystem::exists(dir.file("elsewhere.png")));
}

TEST(FulgurPlot, WhatCannotBeDrawnIsNamed) {
  TempDir dir;
  auto missing = run_process({FULGUR_CLI, "plot", dir.file("nowhere")}, {}, 60s);
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find(dir.file("nowhere") + "\" does not exist"), std::string::npos)
      << missing.output;
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  auto fifo = run_process({FULGUR_CLI, "plot", dir.file("fifo")}, {}, 60s);
  EXPECT_EQ(fifo.exit_code, 1);
  EXPECT_NE(fifo.output.find("is a FIFO (named pipe), neither a metrics.csv nor a directory"),
            std::string::npos)
      << fifo.output;
  auto empty = run_process({FULGUR_CLI, "plot", dir.path()}, {}, 60s);
  EXPECT_EQ(empty.exit_code, 1);
  EXPECT_NE(empty.output.find("no metrics.csv in"), std::string::npos) << empty.output;
  auto usage = run_process({FULGUR_CLI, "plot"}, {}, 60s);
  EXPECT_EQ(usage.exit_code, 2);
  EXPECT_NE(usage.output.find("which run?"), std::string::npos) << usage.output;
}

}  // namespace
