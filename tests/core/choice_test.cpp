// Choice<E>: spellings parse to the enum and print back, an unknown one is
// kept for the error that names it, and the sets fulgur uses list their
// spellings once.
#include "fulgur/core/choice.h"

#include <gtest/gtest.h>

#include <stdexcept>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

enum class Colour { kRed, kGreen, kBlue };

}  // namespace

template <>
struct fulgur::ChoiceNames<Colour> {
  static constexpr std::pair<Colour, const char*> kNames[] = {
      {Colour::kRed, "red"}, {Colour::kGreen, "green"}, {Colour::kBlue, "blue"}};
};

namespace {

TEST(Choice, ParsesAndPrintsBothWays) {
  fulgur::Choice<Colour> spelled = "green";
  EXPECT_TRUE(spelled.is_valid());
  EXPECT_EQ(spelled.value(), Colour::kGreen);
  EXPECT_TRUE(spelled == Colour::kGreen);
  fulgur::Choice<Colour> given = Colour::kBlue;
  EXPECT_EQ(given.text(), "blue");
  EXPECT_EQ(fulgur::Choice<Colour>::spellings(), "\"red\", \"green\" or \"blue\"");
}

TEST(Choice, KeepsAnUnknownSpellingForTheErrorThatNamesIt) {
  fulgur::Choice<Colour> typo = std::string("gren");
  EXPECT_FALSE(typo.is_valid());
  EXPECT_EQ(typo.text(), "gren");
  EXPECT_FALSE(typo == Colour::kGreen);
  EXPECT_THROW((void)typo.value(), std::logic_error);
}

TEST(Choice, FulgursSetsKeepTheirSpellings) {
  EXPECT_EQ(fulgur::Choice<fulgur::CheckpointMode>::spellings(), "\"min\" or \"max\"");
  EXPECT_EQ(fulgur::Choice<fulgur::StartMethod>::spellings(), "\"popen\" or \"fork\"");
  EXPECT_EQ(fulgur::Choice<fulgur::Determinism>::spellings(), "\"false\", \"true\" or \"warn\"");
  fulgur::DeterministicFlag on = true, warn = "warn", off = false;
  EXPECT_TRUE(on.enabled() && !on.warn_only());
  EXPECT_TRUE(warn.enabled() && warn.warn_only());
  EXPECT_FALSE(off.enabled());
  EXPECT_EQ(on.text(), "true");
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::ModelCheckpoint(fulgur::ModelCheckpointOptions{.mode = "avg"}),
                     {"mode=\"avg\": pass \"min\" or \"max\""});
}

}  // namespace
