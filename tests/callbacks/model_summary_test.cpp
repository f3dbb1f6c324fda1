#include "fulgur/callbacks/model_summary.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
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
