#include "fulgur/core/registry.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "fulgur/accelerators/accelerator.h"
#include "fulgur/plugins/environments/cluster_environment.h"
#include "fulgur/plugins/io/checkpoint_io.h"
#include "fulgur/plugins/precision/precision.h"
#include "fulgur/strategies/single_device.h"
#include "fulgur/strategies/strategy.h"
#include "support/test_support.h"

namespace {

using ::testing::ElementsAre;

struct Widget {
  virtual ~Widget() = default;
  virtual std::string label() const = 0;
};

struct NamedWidget : Widget {
  explicit NamedWidget(std::string l) : l_(std::move(l)) {}
  std::string label() const override { return l_; }
  std::string l_;
};

using WidgetRegistry = fulgur::Registry<Widget>;

WidgetRegistry::Factory make(std::string label) {
  return [label] { return std::make_unique<NamedWidget>(label); };
}

TEST(Registry, NamesMatchInAnyCaseAndMayNotDifferOnlyInCase) {
  WidgetRegistry registry("widget");
  registry.add("my_Widget", "mixed case", make("M"));
  EXPECT_TRUE(registry.contains("MY_WIDGET"));
  EXPECT_TRUE(registry.contains("my_widget"));
  EXPECT_EQ(registry.create("My_Widget")->label(), "M");
  EXPECT_EQ(registry.entry("my_widget").name, "my_Widget");
  EXPECT_THROWS_WITH(fulgur::ConfigError, registry.add("MY_widget", "again", make("X")),
                     {"register widget \"MY_widget\"", "(in another case) is already registered"});
  registry.replace("MY_WIDGET", "replaced", make("R"));
  EXPECT_EQ(registry.names(), std::vector<std::string>{"MY_WIDGET"});
  EXPECT_EQ(registry.create("my_widget")->label(), "R");
}

TEST(Registry, CreateBuildsTheRegisteredEntry) {
  WidgetRegistry registry("widget");
  registry.add("alpha", "the first", make("A"));
  registry.add("beta", "the second", make("B"));
  EXPECT_TRUE(registry.contains("alpha"));
  EXPECT_FALSE(registry.contains("gamma"));
  EXPECT_EQ(registry.create("alpha")->label(), "A");
  EXPECT_EQ(registry.create("beta")->label(), "B");
  EXPECT_EQ(registry.entry("beta").description, "the second");
  EXPECT_EQ(registry.kind(), "widget");
}

TEST(Registry, DuplicateNameIsAnErrorNamingTheEntryAndReplace) {
  WidgetRegistry registry("widget");
  registry.add("alpha", "the first alpha", make("A"));
  EXPECT_THROWS_WITH(fulgur::ConfigError, registry.add("alpha", "another", make("A2")),
                     {"widget", "\"alpha\"", "already registered", "the first alpha", "replace()"});
  // The original entry is untouched.
  EXPECT_EQ(registry.create("alpha")->label(), "A");
}

TEST(Registry, EmptyNameIsAnError) {
  WidgetRegistry registry("widget");
  EXPECT_THROWS_WITH(fulgur::ConfigError, registry.add("", "nameless", make("X")),
                     {"widget", "non-empty"});
}

TEST(Registry, ReplaceOverridesOnPurpose) {
  WidgetRegistry registry("widget");
  registry.add("alpha", "old", make("old"));
  registry.replace("alpha", "new", make("new"));
  registry.replace("beta", "added by replace", make("b"));
  EXPECT_EQ(registry.create("alpha")->label(), "new");
  EXPECT_EQ(registry.entry("alpha").description, "new");
  EXPECT_TRUE(registry.contains("beta"));
}

TEST(Registry, UnknownNameSuggestsTheClosestAndListsAll) {
  WidgetRegistry registry("widget");
  registry.add("beta", "", make("B"));
  registry.add("alpha", "", make("A"));
  EXPECT_THROWS_WITH(
      fulgur::ConfigError, registry.create("alpho"),
      {"unknown widget \"alpho\"", "did you mean \"alpha\"?", "Registered: alpha, beta."});
  EXPECT_THROWS_WITH(fulgur::ConfigError, registry.entry("alpho"), {"did you mean \"alpha\"?"});
}

TEST(Registry, UnknownNameWithoutAPlausibleTypoHasNoSuggestion) {
  WidgetRegistry registry("widget");
  registry.add("alpha", "", make("A"));
  auto result = fulgur::test::throws_with<fulgur::ConfigError>(
      [&] { registry.create("zzzzzzzzzz"); },
      {"unknown widget \"zzzzzzzzzz\"", "Registered: alpha."});
  EXPECT_TRUE(result);
  try {
    registry.create("zzzzzzzzzz");
  } catch (const fulgur::ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).find("did you mean"), std::string::npos) << e.what();
  }
}

TEST(Registry, NamesAndEntriesAreSorted) {
  WidgetRegistry registry("widget");
  registry.add("gamma", "g", make("G"));
  registry.add("alpha", "a", make("A"));
  registry.add("beta", "b", make("B"));
  EXPECT_THAT(registry.names(), ElementsAre("alpha", "beta", "gamma"));
  auto entries = registry.entries();
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[0]->name, "alpha");
  EXPECT_EQ(entries[1]->name, "beta");
  EXPECT_EQ(entries[2]->description, "g");
}

TEST(Registry, FactoriesReceiveArguments) {
  fulgur::Registry<Widget, int> registry("widget");
  registry.add("numbered", "label from an int", [](int n) -> std::unique_ptr<Widget> {
    return std::make_unique<NamedWidget>(std::to_string(n));
  });
  EXPECT_EQ(registry.create("numbered", 7)->label(), "7");
}

TEST(Registry, NullFromAFactoryIsABugInFulgur) {
  WidgetRegistry registry("widget");
  registry.add("broken", "returns null", [] { return std::unique_ptr<Widget>(); });
  EXPECT_THROWS_WITH(fulgur::InternalError, registry.create("broken"),
                     {"bug in fulgur", "broken", "returned null"});
}

TEST(Registry, BuiltInRegistriesHoldTheBuiltIns) {
  EXPECT_TRUE(fulgur::strategy_registry().contains("single_device"));
  EXPECT_EQ(fulgur::strategy_registry().create("single_device")->name(), "single_device");
  EXPECT_TRUE(fulgur::accelerator_registry().contains("cpu"));
  EXPECT_TRUE(fulgur::accelerator_registry().contains("cuda"));
  EXPECT_TRUE(fulgur::precision_registry().contains("32-true"));
  EXPECT_TRUE(fulgur::checkpoint_io_registry().contains("torch"));
  EXPECT_TRUE(fulgur::cluster_environment_registry().contains("lightning"));
}

TEST(Registry, BuiltInRegistriesAreSortedAndSuggest) {
  auto names = fulgur::strategy_registry().names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::strategy_registry().create("singel_device"),
                     {"unknown strategy \"singel_device\"", "did you mean \"single_device\"?"});
}

TEST(Registry, UsersRegisterTheirOwnStrategies) {
  // A registry local to the test: the global one is shared by every test.
  fulgur::StrategyRegistry registry("strategy");
  fulgur::SingleDeviceStrategy::register_strategies(registry);
  registry.add("my_single", "a user's variant",
               [] { return std::make_unique<fulgur::SingleDeviceStrategy>(); });
  EXPECT_THAT(registry.names(), ElementsAre("my_single", "single_device"));
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::SingleDeviceStrategy::register_strategies(registry),
                     {"\"single_device\"", "already registered"});
}

}  // namespace
