#include "fulgur/accelerators/accelerator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>

#include "fulgur/accelerators/cpu.h"
#include "fulgur/core/errors.h"
#include "support/test_support.h"

namespace {

using ::testing::ElementsAre;

// ---- DevicesSpec.

TEST(DevicesSpec, DefaultIsAuto) {
  fulgur::DevicesSpec spec;
  EXPECT_TRUE(spec.is_auto());
  EXPECT_FALSE(spec.is_index_list());
  EXPECT_EQ(spec.count(), std::nullopt);
  EXPECT_EQ(spec.text(), "auto");
  EXPECT_TRUE(fulgur::DevicesSpec("auto").is_auto());
  EXPECT_TRUE(fulgur::DevicesSpec(" auto ").is_auto());
}

TEST(DevicesSpec, IntIsACount) {
  fulgur::DevicesSpec spec(2);
  EXPECT_FALSE(spec.is_auto());  // a count is not "auto"
  EXPECT_FALSE(spec.is_index_list());
  EXPECT_EQ(spec.count(), std::optional<int>(2));
  EXPECT_EQ(spec.text(), "2");
  fulgur::DevicesSpec all(-1);
  EXPECT_FALSE(all.is_auto());
  EXPECT_EQ(all.count(), std::optional<int>(-1));
}

TEST(DevicesSpec, StringCountAndIndexLists) {
  fulgur::DevicesSpec two("2");
  EXPECT_FALSE(two.is_auto());
  EXPECT_EQ(two.count(), std::optional<int>(2));

  fulgur::DevicesSpec list("0,2");
  EXPECT_TRUE(list.is_index_list());
  EXPECT_EQ(list.count(), std::nullopt);
  EXPECT_THAT(list.indices(), ElementsAre(0, 2));
  EXPECT_EQ(list.text(), "0,2");

  fulgur::DevicesSpec trailing("0,");  // Lightning's "the device with index 0"
  EXPECT_TRUE(trailing.is_index_list());
  EXPECT_THAT(trailing.indices(), ElementsAre(0));

  fulgur::DevicesSpec vec(std::vector<int>{1, 3});
  EXPECT_TRUE(vec.is_index_list());
  EXPECT_FALSE(vec.is_auto());
  EXPECT_THAT(vec.indices(), ElementsAre(1, 3));
  EXPECT_EQ(vec.text(), "[1, 3]");

  EXPECT_EQ(fulgur::DevicesSpec(std::string("-1")).count(), std::optional<int>(-1));
}

TEST(DevicesSpec, MalformedSpecsEchoTheTextInTheirProblem) {
  auto problem = [](fulgur::DevicesSpec spec) { return spec.problem(); };
  EXPECT_TRUE(fulgur::test::message_contains(problem("two"), {"devices=\"two\"", "\"0,2\""}));
  EXPECT_TRUE(fulgur::test::message_contains(problem("0,,2"), {"devices=\"0,,2\""}));
  EXPECT_TRUE(fulgur::test::message_contains(problem(""), {"devices=\"\""}));
  EXPECT_TRUE(fulgur::test::message_contains(problem("1.5"), {"devices=\"1.5\""}));
  EXPECT_TRUE(fulgur::test::message_contains(problem(std::vector<int>{}), {"devices=[]"}));
  EXPECT_TRUE(fulgur::test::message_contains(problem(0), {"devices=0", "selects no device"}));
  EXPECT_TRUE(fulgur::test::message_contains(problem(-3), {"devices=-3", ">= 1, or -1"}));
  EXPECT_TRUE(fulgur::test::message_contains(problem("0,-1"), {"index -1 is negative"}));
  EXPECT_EQ(problem("2"), "");
  EXPECT_EQ(problem("0,"), "");
  EXPECT_EQ(problem(-1), "");
  // An accelerator asked to parse a malformed spec throws that problem.
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::CPUAccelerator().parse_devices("two"),
                     {"devices=\"two\""});
}

// ---- Capabilities.

// deterministic=true asks the accelerator for its own part (the connector
// does not compare names): a user's accelerator is asked too, once.
TEST(Accelerator, DeterministicAsksTheAcceleratorToPrepare) {
  struct Counting : fulgur::CPUAccelerator {
    std::string_view name() const override { return "counting_cpu"; }
    void prepare_determinism() override { ++prepared; }
    int prepared = 0;
  };
  fulgur::test::TempDir dir;
  for (bool deterministic : {true, false}) {
    auto accelerator = std::make_shared<Counting>();
    auto options = fulgur::test::test_options(dir);
    options.accelerator = accelerator;
    options.deterministic = deterministic;
    fulgur::Trainer trainer(options);
    EXPECT_EQ(accelerator->prepared, deterministic ? 1 : 0) << deterministic;
  }
  at::globalContext().setDeterministicAlgorithms(false, false);
}

}  // namespace
