// `fulgur plot`, run as a child process: a run directory in, its curves
// out as a PNG next to the metrics; errors name what was passed.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

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
  write_text(dir.file("nan_step.csv"), "step,train_loss\n1,2.0\nnan,1.5\n");
  auto nan_step = run_process({FULGUR_CLI, "plot", dir.file("nan_step.csv")}, {}, 60s);
  EXPECT_EQ(nan_step.exit_code, 1) << nan_step.output;
  EXPECT_NE(nan_step.output.find("line 3: the step \"nan\" is not a number"), std::string::npos)
      << nan_step.output;
  auto usage = run_process({FULGUR_CLI, "plot"}, {}, 60s);
  EXPECT_EQ(usage.exit_code, 2);
  EXPECT_NE(usage.output.find("which run?"), std::string::npos) << usage.output;
}

// A run that logs a metric per layer: 400 panels are more than one picture
// holds (Cairo's 32767 pixels: gnuplot failed from 173 on); the first 344
// are drawn, in 4 columns.
TEST(FulgurPlot, ARunWithHundredsOfMetricsIsDrawn) {
  TempDir dir;
  std::string csv = "step";
  for (int m = 0; m < 400; ++m) csv += ",layer" + std::to_string(m) + "_grad_norm";
  for (int step = 1; step <= 3; ++step) {
    csv += "\n" + std::to_string(step);
    for (int m = 0; m < 400; ++m) csv += "," + std::to_string(step * 0.5 + m);
  }
  write_text(dir.file("metrics.csv"), csv + "\n");
  auto r = run_process({FULGUR_CLI, "plot", dir.file("metrics.csv")}, {}, 120s);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir.file("metrics.png"))) << r.output;
}

// --out names where the picture goes: what is there is replaced only when it
// is a picture (or an empty file). The run's own metrics.csv, another file,
// a FIFO or a directory is left as it is, with exit status 1.
TEST(FulgurPlot, AnOutputPathHoldingSomethingElseIsLeftAsItIs) {
  TempDir dir;
  const std::string csv = dir.file("metrics.csv");
  const std::string metrics = "step,train_loss\n1,2.0\n2,1.5\n";
  write_text(csv, metrics);
  auto over_input = run_process({FULGUR_CLI, "plot", csv, "--out", csv}, {}, 60s);
  EXPECT_EQ(over_input.exit_code, 1) << over_input.output;
  EXPECT_NE(over_input.output.find("\"" + csv + "\" holds " + std::to_string(metrics.size()) +
                                   " bytes that are no PNG picture, and is left as it is"),
            std::string::npos)
      << over_input.output;
  EXPECT_EQ(fulgur::test::read_text(csv), metrics);
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  auto fifo = run_process({FULGUR_CLI, "plot", csv, "--out", dir.file("fifo")}, {}, 60s);
  EXPECT_EQ(fifo.exit_code, 1) << fifo.output;
  EXPECT_NE(fifo.output.find("is a FIFO (named pipe), and is left as it is"), std::string::npos)
      << fifo.output;
  EXPECT_TRUE(std::filesystem::is_fifo(dir.file("fifo")));
  std::filesystem::create_directories(dir.file("a_directory"));
  auto directory =
      run_process({FULGUR_CLI, "plot", csv, "--out", dir.file("a_directory")}, {}, 60s);
  EXPECT_EQ(directory.exit_code, 1) << directory.output;
  EXPECT_NE(directory.output.find("is a directory, and is left as it is"), std::string::npos)
      << directory.output;
  EXPECT_TRUE(std::filesystem::is_directory(dir.file("a_directory")));
  // A device node (one like /dev/null, made here: root only) was replaced
  // by the picture.
  if (::mknod(dir.file("null").c_str(), S_IFCHR | 0666, ::makedev(1, 3)) == 0) {
    auto device = run_process({FULGUR_CLI, "plot", csv, "--out", dir.file("null")}, {}, 60s);
    EXPECT_EQ(device.exit_code, 1) << device.output;
    EXPECT_NE(device.output.find("is a character device, and is left as it is"), std::string::npos)
        << device.output;
    EXPECT_TRUE(std::filesystem::is_character_file(dir.file("null")));
  }
  // A picture, and an empty file, are replaced.
  const std::string png = dir.file("curves.png");
  ASSERT_EQ(run_process({FULGUR_CLI, "plot", csv, "--out", png}, {}, 60s).exit_code, 0);
  write_text(csv, metrics + "3,1.0\n");
  auto again = run_process({FULGUR_CLI, "plot", csv, "--out", png}, {}, 60s);
  EXPECT_EQ(again.exit_code, 0) << again.output;
  write_text(dir.file("empty.png"), "");
  auto empty = run_process({FULGUR_CLI, "plot", csv, "--out", dir.file("empty.png")}, {}, 60s);
  EXPECT_EQ(empty.exit_code, 0) << empty.output;
  EXPECT_GT(std::filesystem::file_size(dir.file("empty.png")), 0u);
}

}  // namespace
