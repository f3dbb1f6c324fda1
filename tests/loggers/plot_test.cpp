#include "fulgur/loggers/plot.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "fulgur/fulgur.h"
#include "support/run_in_child.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using fulgur::test::write_text;
using ::testing::HasSubstr;

// A CSVLogger's file: loss per step, val_loss and acc per epoch.
const char* kMetrics =
    "step,epoch,train_loss_step,val_loss,val_acc,train_loss_epoch\n"
    "1,0,2.3,,,\n2,0,1.9,,,\n3,0,1.2,,,\n3,0,,1.1,0.61,1.8\n"
    "4,1,0.9,,,\n5,1,0.7,,,\n6,1,0.6,,,\n6,1,,0.65,0.78,0.73\n";

// Width and height from a PNG's IHDR chunk (0 when not a PNG).
std::pair<uint32_t, uint32_t> png_size(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  unsigned char h[24] = {};
  in.read(reinterpret_cast<char*>(h), sizeof h);
  const unsigned char signature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (!in || std::memcmp(h, signature, 8) != 0 || std::memcmp(h + 12, "IHDR", 4) != 0) {
    return {0, 0};
  }
  auto be = [&](int at) {
    return (uint32_t{h[at]} << 24) | (uint32_t{h[at + 1]} << 16) | (uint32_t{h[at + 2]} << 8) |
           uint32_t{h[at + 3]};
  };
  return {be(16), be(20)};
}

TEST(Plot, MetricsShareAPanelByTheirBaseName) {
  EXPECT_EQ(fulgur::metric_panel("train_loss_step"), "loss");
  EXPECT_EQ(fulgur::metric_panel("val_loss"), "loss");
  EXPECT_EQ(fulgur::metric_panel("train_loss_epoch"), "loss");
  EXPECT_EQ(fulgur::metric_panel("val_acc"), "acc");
  EXPECT_EQ(fulgur::metric_panel("lr-SGD"), "lr-SGD");
  EXPECT_EQ(fulgur::metric_panel("train_"), "train_");
}

TEST(Plot, TheScriptHasOnePanelPerMetricWithLabelledAxes) {
  TempDir dir;
  write_text(dir.file("metrics.csv"), kMetrics);
  const std::string script = fulgur::gnuplot_script(dir.file("metrics.csv"), "out.png", "run");
  EXPECT_THAT(script, HasSubstr("set multiplot layout 1,2"));  // loss, acc
  EXPECT_THAT(script, HasSubstr("set xlabel \"optimizer step\""));
  EXPECT_THAT(script, HasSubstr("set title \"loss\""));
  EXPECT_THAT(script, HasSubstr("title \"train\\\\_loss\\\\_step\""));
  EXPECT_THAT(script, HasSubstr("title \"val\\\\_acc\""));
  // Only the points a metric has: val_loss at steps 3 and 6.
  EXPECT_THAT(script, HasSubstr("$m3 << EOD\n3 1.1\n6 0.65\nEOD"));
  EXPECT_THAT(script, ::testing::Not(HasSubstr("title \"epoch\"")));
}

// Values gnuplot cannot draw (nan, infinities, magnitudes past DBL_MAX/4:
// it takes those past DBL_MAX/2 as undefined, and a range from -DBL_MAX/2
// to DBL_MAX/2 overflows) are left out and counted in their series'
// key; a metric of only those is named in the title; a file of only those
// says so. A panel of values near 1e308 made gnuplot fail.
TEST(Plot, ValuesGnuplotCannotDrawAreLeftOutAndCounted) {
  TempDir dir;
  write_text(dir.file("metrics.csv"),
             "step,epoch,train_loss,grad_norm,val_acc\n"
             "1,0,2.5,1e308,0.5\n2,0,1e308,-1.7e308,0.6\n3,0,inf,nan,0.7\n4,0,4e307,-5e307,\n"
             "5,0,-4e307,,\n");
  const std::string script = fulgur::gnuplot_script(dir.file("metrics.csv"), "out.png", "run");
  EXPECT_THAT(script, HasSubstr("$m2 << EOD\n1 2.5\n4 4e+307\n5 -4e+307\nEOD"));
  EXPECT_THAT(script,
              HasSubstr("title \"train\\\\_loss (2 not drawn: nan, inf or past +-4.4e307)\""));
  EXPECT_THAT(script, HasSubstr("title \"val\\\\_acc\""));
  EXPECT_THAT(script, HasSubstr("(no value to draw: grad\\\\_norm)"));
  EXPECT_THAT(script, ::testing::Not(HasSubstr("$m3 << EOD")));
  const std::string png = dir.file("metrics.png");
  EXPECT_EQ(fulgur::plot_metrics(dir.file("metrics.csv"), png), "");
  EXPECT_EQ(png_size(png), (std::pair<uint32_t, uint32_t>{1120, 380}));

  write_text(dir.file("huge.csv"), "step,epoch,loss\n1,0,1e308\n2,0,-inf\n");
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::gnuplot_script(dir.file("huge.csv"), "out.png", "run"),
                     {"holds no metric value to draw (loss holds only nan, infinities or values "
                      "past +-4.4e307)."});
}

TEST(Plot, GnuplotDrawsAPngOfTheExpectedSize) {
  TempDir dir;
  write_text(dir.file("metrics.csv"), kMetrics);
  const std::string png = dir.file("metrics.png");
  ASSERT_EQ(fulgur::plot_metrics(dir.file("metrics.csv"), png), "");
  EXPECT_EQ(png_size(png), (std::pair<uint32_t, uint32_t>{1120, 380}));
  EXPECT_GT(std::filesystem::file_size(png), 10000u);  // curves and text, not a blank image
}

// Paths and metric names are gnuplot text, never gnuplot code: a directory
// and a metric named with a backquote (gnuplot runs `command` inside double
// quotes) and a newline (which would start another command) draw where
// they say, and nothing runs.
TEST(Plot, PathsAndNamesNeverBecomeGnuplotCommands) {
  TempDir dir;
  const std::string marker = dir.file("ran");
  const std::string odd =
      dir.file("a`touch " + marker + "`\nsystem('touch " + marker + "')\nb \"q\" \\ 'c'");
  std::filesystem::create_directories(odd);
  write_text(odd + "/metrics.csv", "step,epoch,val_`touch " + marker + "`\n1,0,0.5\n2,0,0.25\n");
  const std::string png = odd + "/metrics.png";
  ASSERT_EQ(fulgur::plot_metrics(odd + "/metrics.csv", png), "");
  EXPECT_GT(std::filesystem::file_size(png), 1000u);
  EXPECT_FALSE(std::filesystem::exists(marker));
}

// Where the picture cannot be written, the message says why before gnuplot
// runs (gnuplot would write the PNG's bytes to its output instead).
TEST(Plot, AnOutputThatCannotBeWrittenIsNamedWithoutThePicturesBytes) {
  TempDir dir;
  write_text(dir.file("metrics.csv"), kMetrics);
  const std::string missing = fulgur::plot_metrics(dir.file("metrics.csv"), dir.file("no/m.png"));
  EXPECT_THAT(missing, HasSubstr("cannot write \"" + dir.file("no/m.png") + "\": its directory"));
  EXPECT_THAT(missing, HasSubstr("does not exist"));
  const std::string directory = fulgur::plot_metrics(dir.file("metrics.csv"), dir.path());
  EXPECT_THAT(directory, HasSubstr("\"" + dir.path() + "\" is a directory, and is left as it is"));
  EXPECT_LT(missing.size() + directory.size(), 600u);
}

// The picture is drawn beside its path and put there once whole: on a disk
// that is full (a tmpfs), the PNG gnuplot cut short (and exited 0 for) is
// refused naming the cause, the picture that was there stays byte for byte,
// and nothing is left beside it.
TEST(Plot, AFullDiskKeepsThePictureThatWasThere) {
  TempDir dir;
  const auto r = fulgur::test::run_on_tmpfs(dir.path(), "128k", [&] {
    write_text(dir.file("metrics.csv"), kMetrics);
    const std::string png = dir.file("metrics.png");
    if (!fulgur::plot_metrics(dir.file("metrics.csv"), png).empty()) return 10;
    const std::string before = fulgur::test::read_text(png);
    {
      std::ofstream filler(dir.file("filler"));
      filler << std::string(128 * 1024, 'x');  // fails part way: the disk is full
    }
    const std::string problem = fulgur::plot_metrics(dir.file("metrics.csv"), png);
    if (problem.find(png) == std::string::npos ||
        (problem.find("ends before its last chunk") == std::string::npos &&
         problem.find("no PNG") == std::string::npos &&
         problem.find("gnuplot failed") == std::string::npos)) {
      return 11;
    }
    if (fulgur::test::read_text(png) != before) return 12;
    for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
      if (entry.path().filename().string().find(".tmp.") != std::string::npos) return 13;
    }
    return 0;
  });
  if (r.exit_code == fulgur::test::kCannotMountTmpfs) GTEST_SKIP() << "cannot mount a tmpfs here";
  EXPECT_EQ(r.exit_code, 0) << r.describe()
                            << " (10: the first picture failed, 11: no or another problem, 12: "
                               "the picture changed, 13: a file left behind)";
}

TEST(Plot, WithoutGnuplotTheMessageSaysWhatToInstall) {
  TempDir dir, empty;
  write_text(dir.file("metrics.csv"), kMetrics);
  const std::string saved = std::getenv("PATH") ? std::getenv("PATH") : "";
  ::setenv("PATH", empty.path().c_str(), 1);
  const std::string problem = fulgur::plot_metrics(dir.file("metrics.csv"), dir.file("m.png"));
  ::setenv("PATH", saved.c_str(), 1);
  EXPECT_THAT(problem, HasSubstr("gnuplot is not installed"));
  EXPECT_THAT(problem, HasSubstr("apt install gnuplot-nox"));
  EXPECT_FALSE(std::filesystem::exists(dir.file("m.png")));
}

TEST(Plot, FilesThatAreNotMetricsAreNamed) {
  TempDir dir;
  write_text(dir.file("other.csv"), "time,value\n1,2\n");
  EXPECT_THAT(fulgur::plot_metrics(dir.file("other.csv"), dir.file("m.png")),
              HasSubstr("is not a CSVLogger's metrics.csv"));
  EXPECT_THAT(fulgur::plot_metrics(dir.file("missing.csv"), dir.file("m.png")),
              HasSubstr("cannot read"));
  write_text(dir.file("empty.csv"), "step,loss\n");
  EXPECT_THAT(fulgur::plot_metrics(dir.file("empty.csv"), dir.file("m.png")),
              HasSubstr("holds no metric value"));
}

TEST(Plot, FindsTheNewestVersionOfARun) {
  TempDir dir;
  for (const char* v : {"version_0", "version_3", "version_12"}) {
    std::filesystem::create_directories(dir.file(std::string("fulgur_logs/") + v));
  }
  write_text(dir.file("fulgur_logs/version_0/metrics.csv"), kMetrics);
  write_text(dir.file("fulgur_logs/version_3/metrics.csv"), kMetrics);
  // version_12 has no metrics.csv (a run that logged nothing).
  EXPECT_EQ(fulgur::find_metrics_csv(dir.path()), dir.file("fulgur_logs/version_3/metrics.csv"));
  EXPECT_EQ(fulgur::find_metrics_csv(dir.file("fulgur_logs/version_0")),
            dir.file("fulgur_logs/version_0/metrics.csv"));
  EXPECT_THROW(fulgur::find_metrics_csv(dir.file("fulgur_logs/version_12")), fulgur::ConfigError);
}

// The CSVLogger draws metrics.png next to metrics.csv at the end of fit.
TEST(Plot, FitDrawsTheCurvesNextToTheMetrics) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.logger = true;
  options.log_every_n_steps = 1;
  options.max_epochs = 2;
  fulgur::Trainer trainer(options);
  trainer.fit(model, regression_loader(4), regression_loader(2));
  const std::string png = trainer.log_dir() + "/metrics.png";
  ASSERT_TRUE(std::filesystem::exists(png)) << trainer.log_dir();
  EXPECT_GT(png_size(png).first, 0u);
}

}  // namespace
