#include "fulgur/callbacks/model_summary.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::logged_options;
using fulgur::test::RecordingLogger;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using ::testing::HasSubstr;

TEST(ModelSummary, ListsLayersParametersAndFrozenOnes) {
  struct Net : torch::nn::Module {
    torch::nn::Linear encoder{nullptr}, head{nullptr};
    Net() {
      encoder = register_module("encoder", torch::nn::Linear(100, 20));
      head = register_module("head", torch::nn::Linear(20, 3));
      for (auto& p : encoder->parameters()) p.requires_grad_(false);
    }
  } net;
  const std::string table = fulgur::ModelSummary::summarize(net);
  EXPECT_THAT(table, HasSubstr("encoder"));
  EXPECT_THAT(table, HasSubstr("Linear"));
  EXPECT_THAT(table, HasSubstr("2.0 K"));  // 100 * 20 + 20
  EXPECT_THAT(table, HasSubstr("frozen"));
  EXPECT_THAT(table, HasSubstr("trainable"));
  EXPECT_THAT(table, HasSubstr("63 trainable params, 2.0 K frozen params, 2.1 K total params"));
  EXPECT_THAT(fulgur::ModelSummary::summarize(net, 0), ::testing::Not(HasSubstr("encoder")));
}

// A layer registered twice (tied weights) is listed twice but its
// parameters count once in the totals, as Lightning's.
TEST(ModelSummary, ASharedLayerCountsOnceInTheTotals) {
  struct Net : torch::nn::Module {
    torch::nn::Linear shared{nullptr};
    Net() {
      shared = torch::nn::Linear(100, 100);
      register_module("a", shared);
      register_module("b", shared);
    }
  } net;
  const std::string table = fulgur::ModelSummary::summarize(net);
  EXPECT_THAT(table, HasSubstr("10.1 K trainable params, 0 frozen params, 10.1 K total params"));
}

// Rows of long names (nested submodules of long names) are written whole,
// each on its line (a row past 512 characters lost its line break, and the
// table ran into one line).
TEST(ModelSummary, LongNamesKeepEveryRowOnItsLine) {
  const std::string long_name(120, 'n');
  struct Nested : torch::nn::Module {
    Nested(const std::string& name, int depth) {
      if (depth > 0) {
        register_module(name, std::make_shared<Nested>(name, depth - 1));
      } else {
        register_module(name, torch::nn::Linear(2, 2));
      }
    }
  } net(long_name, 4);
  const std::string table = fulgur::ModelSummary::summarize(net, 6);
  std::vector<std::string> lines;
  std::stringstream in(table);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  // The header, five rows and the totals.
  ASSERT_EQ(lines.size(), 7u) << table;
  const std::string deepest = fulgur::join(std::vector<std::string>(5, long_name), ".");
  EXPECT_THAT(lines[5], HasSubstr(deepest + " | Linear"));
  EXPECT_THAT(lines[6], HasSubstr("6 trainable params, 0 frozen params, 6 total params"));
}

TEST(ModelSummary, PrintsAtFitStart) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.callbacks = {std::make_shared<fulgur::ModelSummary>()};
  fulgur::Trainer trainer(options);
  testing::internal::CaptureStdout();
  trainer.fit(model, regression_loader(1));
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_THAT(out, HasSubstr("fc"));
  EXPECT_THAT(out, HasSubstr("4 trainable params"));
}

}  // namespace
