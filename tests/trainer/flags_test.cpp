// The connector's flags from text: every problem listed, a flag with a
// problem left at its default, integers checked for range.
#include "fulgur/trainer/flags.h"

#include <gtest/gtest.h>

#include <climits>

#include "fulgur/core/errors.h"
#include "support/test_support.h"

namespace {

TEST(ParseInt, AcceptsIntegersInRangeOnly) {
  auto ok = [](const std::string& text, long long min, long long max) {
    auto r = fulgur::parse_int(text, min, max);
    return r.ok && !r.out_of_range;
  };
  EXPECT_EQ(fulgur::parse_int("42", 0, 100).value, 42);
  EXPECT_EQ(fulgur::parse_int("-7", -10, 10).value, -7);
  EXPECT_EQ(fulgur::parse_int("+7", -10, 10).value, 7);
  EXPECT_EQ(fulgur::parse_int("9223372036854775807", LLONG_MIN, LLONG_MAX).value, LLONG_MAX);
  EXPECT_EQ(fulgur::parse_int("-9223372036854775808", LLONG_MIN, LLONG_MAX).value, LLONG_MIN);
  for (const char* junk : {"", "-", "+", "1.5", "1e3", " 1", "1 ", "0x10", "one", "--1"}) {
    auto r = fulgur::parse_int(junk, LLONG_MIN, LLONG_MAX);
    EXPECT_FALSE(r.ok) << "\"" << junk << "\"";
  }
  // Too large for any integer type, or for the range asked: out of range,
  // never clamped to the nearest bound.
  for (const char* big : {"9223372036854775808", "99999999999999999999", "-9223372036854775809",
                          "-99999999999999999999", "123456789012345678901234567890"}) {
    auto r = fulgur::parse_int(big, LLONG_MIN, LLONG_MAX);
    EXPECT_TRUE(r.ok && r.out_of_range) << big;
  }
  EXPECT_FALSE(ok("2147483648", INT_MIN, INT_MAX));
  EXPECT_TRUE(ok("2147483647", INT_MIN, INT_MAX));
  EXPECT_FALSE(ok("-1", 0, 10));
  EXPECT_TRUE(ok("0", 0, 10));
}

// A number beyond a double's range is named as such, not as "not a
// number", in every flag that takes a real number.
TEST(ParseDouble, ANumberBeyondADoublesRangeIsNamedAsSuch) {
  EXPECT_EQ(fulgur::parse_double("2.5e-3"), 2.5e-3);
  for (const char* text : {"1e999", "-1e999", "1e-400"}) {
    EXPECT_FALSE(fulgur::parse_double(text)) << text;
  }
  EXPECT_EQ(fulgur::not_a_double("1e999"),
            "a number too large for a double (at most about 1.8e308)");
  EXPECT_EQ(fulgur::not_a_double("-1e999"),
            "a number too large for a double (at most about 1.8e308)");
  EXPECT_TRUE(fulgur::test::message_contains(fulgur::not_a_double("1e-400"),
                                             {"a number too close to 0 for a double"}));
  for (const char* junk : {"", "x", "1e", "nan", " 1", "1.5.2"}) {
    EXPECT_EQ(fulgur::not_a_double(junk), "not a number") << "\"" << junk << "\"";
  }
  auto parsed = fulgur::parse_flags(
      {{"max_time", "1e999"}, {"gradient_clip_val", "1e-400"}, {"limit_val_batches", "2e400"}});
  ASSERT_EQ(parsed.problems.size(), 3u) << fulgur::join(parsed.problems, "\n");
  EXPECT_TRUE(fulgur::test::message_contains(
      parsed.problems[0], {"--max_time 1e999: a number too large for a double", "or none"}));
  EXPECT_TRUE(fulgur::test::message_contains(
      parsed.problems[1], {"--gradient_clip_val 1e-400: a number too close to 0 for a double"}));
  EXPECT_TRUE(fulgur::test::message_contains(
      parsed.problems[2], {"--limit_val_batches 2e400: a number too large for a double"}));
  parsed = fulgur::parse_flags({{"max_time", "1e13"}});
  ASSERT_EQ(parsed.problems.size(), 1u);
  EXPECT_TRUE(
      fulgur::test::message_contains(parsed.problems[0], {"--max_time 1e13", "at most 1e12"}));
  // Under a millisecond rounded to 0 ms, which the Trainer then refused as
  // "max_time=0 ms" though the value passed was above 0.
  parsed = fulgur::parse_flags({{"max_time", "1e-4"}});
  ASSERT_EQ(parsed.problems.size(), 1u);
  EXPECT_TRUE(fulgur::test::message_contains(parsed.problems[0],
                                             {"--max_time 1e-4", "under a millisecond"}));
  // deterministic: null is unset (LibTorch's flag as it is), false is off.
  parsed = fulgur::parse_flags({{"deterministic", "null"}});
  EXPECT_TRUE(parsed.problems.empty()) << fulgur::join(parsed.problems, "\n");
  EXPECT_FALSE(parsed.options.deterministic.given());
  parsed = fulgur::parse_flags({{"deterministic", "false"}});
  EXPECT_TRUE(parsed.options.deterministic.given());
  EXPECT_FALSE(fulgur::TrainerOptions{}.deterministic.given());
  parsed = fulgur::parse_flags({{"max_time", "0.001"}});
  EXPECT_TRUE(parsed.problems.empty()) << fulgur::join(parsed.problems, "\n");
  EXPECT_EQ(parsed.options.max_time, std::chrono::milliseconds(1));
}

TEST(ParseFlags, ListsEveryProblemAndKeepsDefaultsForThem) {
  auto parsed = fulgur::parse_flags({{"--devices", "2"},
                                     {"num-nodes", "99999999999999999999"},
                                     {"sync_batchnorm", "-1"},
                                     {"benchmark", "maybe"},
                                     {"devcies", "3"},
                                     {"devices", "4"}});
  ASSERT_EQ(parsed.problems.size(), 5u) << fulgur::join(parsed.problems, "\n");
  EXPECT_TRUE(fulgur::test::message_contains(
      parsed.problems[0],
      {"--num_nodes 99999999999999999999: out of range (at most 2147483647)", "--num_nodes 2"}));
  EXPECT_TRUE(fulgur::test::message_contains(parsed.problems[1],
                                             {"--sync_batchnorm -1: pass true or false"}));
  EXPECT_TRUE(fulgur::test::message_contains(parsed.problems[2], {"--benchmark maybe"}));
  EXPECT_TRUE(fulgur::test::message_contains(
      parsed.problems[3], {"--devcies: unknown flag", "did you mean --devices"}));
  EXPECT_TRUE(fulgur::test::message_contains(parsed.problems[4], {"--devices is given twice"}));
  // What parsed is kept; what did not stays at its default.
  EXPECT_EQ(parsed.options.devices.text(), "2");
  EXPECT_EQ(parsed.options.num_nodes, 1);
  EXPECT_FALSE(parsed.options.sync_batchnorm);
  EXPECT_FALSE(parsed.options.benchmark);
}

TEST(ParseFlags, OptionsFromFlagsThrowsTheSameProblems) {
  EXPECT_THROWS_WITH(fulgur::FlagError,
                     fulgur::options_from_flags({{"num_nodes", "x"}, {"colour", "red"}}),
                     {"--num_nodes x: not an integer", "--colour: unknown flag"});
  auto options = fulgur::options_from_flags(
      {{"plugins", "slurm,,torch"}, {"num_nodes", "-3"}, {"sync-batchnorm", "1"}});
  EXPECT_EQ(options.plugins.size(), 2u);
  EXPECT_EQ(options.num_nodes, -3);  // in range for an int: the connector rejects it
  EXPECT_TRUE(options.sync_batchnorm);
}

}  // namespace
