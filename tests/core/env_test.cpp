#include "fulgur/core/env.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "support/test_support.h"

namespace {

TEST(EnvView, FixedMapShowsOnlyItsVariables) {
  fulgur::EnvView env({{"RANK", "3"}, {"MASTER_ADDR", "node1"}});
  EXPECT_EQ(env.get("MASTER_ADDR"), std::optional<std::string>("node1"));
  EXPECT_TRUE(env.has("RANK"));
  EXPECT_FALSE(env.has("PATH"));  // the process environment is not visible
  EXPECT_EQ(env.get("WORLD_SIZE"), std::nullopt);
}

TEST(EnvView, GetIntParsesIntegers) {
  fulgur::EnvView env({{"RANK", "3"}, {"NEG", "-2"}});
  EXPECT_EQ(env.get_int("RANK"), std::optional<int64_t>(3));
  EXPECT_EQ(env.get_int("NEG"), std::optional<int64_t>(-2));
  EXPECT_EQ(env.get_int("MISSING"), std::nullopt);
}

TEST(EnvView, GetIntRejectsNonIntegersNamingTheVariable) {
  fulgur::EnvView env({{"WORLD_SIZE", "four"}, {"RANK", "3x"}});
  EXPECT_THROWS_WITH(fulgur::ConfigError, env.get_int("WORLD_SIZE"),
                     {"WORLD_SIZE", "four", "not an integer"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, env.get_int("RANK"), {"RANK", "3x"});
}

TEST(EnvView, DefaultReadsTheProcessEnvironment) {
  ::setenv("FULGUR_ENV_TEST_VARIABLE", "17", 1);
  fulgur::EnvView env;
  EXPECT_EQ(env.get_int("FULGUR_ENV_TEST_VARIABLE"), std::optional<int64_t>(17));
  ::unsetenv("FULGUR_ENV_TEST_VARIABLE");
  EXPECT_FALSE(env.has("FULGUR_ENV_TEST_VARIABLE"));
}

}  // namespace
