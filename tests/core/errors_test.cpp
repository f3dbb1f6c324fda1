#include "fulgur/core/errors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "support/test_support.h"

namespace {

static_assert(std::is_base_of_v<std::invalid_argument, fulgur::ConfigError>);
static_assert(std::is_base_of_v<std::runtime_error, fulgur::DistributedError>);
static_assert(std::is_base_of_v<std::runtime_error, fulgur::CheckpointError>);
static_assert(std::is_base_of_v<std::logic_error, fulgur::InternalError>);

TEST(Errors, StrConcatenatesStreamableArguments) {
  EXPECT_EQ(fulgur::str("a", 1, '-', 2.5, std::string("z")), "a1-2.5z");
  EXPECT_EQ(fulgur::str(), "");
}

TEST(Errors, JoinUsesTheSeparator) {
  EXPECT_EQ(fulgur::join({"a", "b", "c"}), "a, b, c");
  EXPECT_EQ(fulgur::join({"a", "b"}, "|"), "a|b");
  EXPECT_EQ(fulgur::join({"only"}), "only");
  EXPECT_EQ(fulgur::join({}), "");
}

TEST(Errors, SplitListTrimsItemsAndKeepsEmptyOnes) {
  using List = std::vector<std::string>;
  EXPECT_EQ(fulgur::split_list("a, b,,\tc "), (List{"a", "b", "", "c"}));
  EXPECT_EQ(fulgur::split_list(""), (List{""}));
  EXPECT_EQ(fulgur::split_list("x=1:y:,z", ':'), (List{"x=1", "y", ",z"}));
}

TEST(Errors, ByRankGroupsTheRanksOfEachValueInTheOrderValuesFirstAppear) {
  EXPECT_EQ(fulgur::by_rank({"6 batches", "4 batches", "6 batches", "5 batches"}, ": "),
            "ranks 0, 2: 6 batches; rank 1: 4 batches; rank 3: 5 batches");
  EXPECT_EQ(fulgur::by_rank({"a, b", "none"}, " logged "),
            "rank 0 logged a, b; rank 1 logged none");
  EXPECT_EQ(fulgur::by_rank({"x", "x"}, ": "), "ranks 0, 1: x");
  EXPECT_EQ(fulgur::by_rank({}, ": "), "");
}

TEST(Errors, ClosestMatchFindsAPlausibleTypo) {
  EXPECT_EQ(fulgur::closest_match("dpp", {"ddp", "ddp_spawn", "single_device"}), "ddp");
  EXPECT_EQ(fulgur::closest_match("singel_device", {"ddp", "single_device"}), "single_device");
  EXPECT_EQ(fulgur::closest_match("cpu", {"cpu", "cuda"}), "cpu");
}

TEST(Errors, ClosestMatchIsEmptyWhenNothingIsClose) {
  EXPECT_EQ(fulgur::closest_match("tensorflow", {"ddp", "cpu"}), "");
  EXPECT_EQ(fulgur::closest_match("ddp", {}), "");
}

TEST(Errors, DidYouMeanWordsTheSuggestionOrEndsTheSentence) {
  EXPECT_EQ(fulgur::did_you_mean("dpp", {"ddp", "manual"}), "; did you mean \"ddp\"? ");
  EXPECT_EQ(fulgur::did_you_mean("xyzzy", {"ddp", "manual"}), ". ");
  EXPECT_EQ(fulgur::did_you_mean("max_step", {"max_steps", "seed"}, "--", ""),
            "; did you mean --max_steps? ");
}

// LibTorch's errors are shown without the C++ stack frames LibTorch adds to
// what() (unless TORCH_SHOW_CPP_STACKTRACES=1); the message stays whole.
TEST(Errors, ErrorMessageLeavesOutLibTorchsStackFrames) {
  try {
    torch::optim::SGD sgd(std::vector<at::Tensor>{torch::zeros({1}, torch::requires_grad())},
                          torch::optim::SGDOptions(-1.0));
    FAIL() << "LibTorch took a negative learning rate";
  } catch (const c10::Error& e) {
    ASSERT_NE(std::string(e.what()).find("Exception raised from"), std::string::npos);
    const std::string shown = fulgur::error_message(e);
    EXPECT_NE(shown.find("Invalid learning rate: -1"), std::string::npos) << shown;
    EXPECT_EQ(shown.find("Exception raised from"), std::string::npos) << shown;
    const char* before = std::getenv("TORCH_SHOW_CPP_STACKTRACES");
    const std::string saved = before ? before : "";
    ::setenv("TORCH_SHOW_CPP_STACKTRACES", "1", 1);
    EXPECT_EQ(fulgur::error_message(e), e.what());
    if (before) {
      ::setenv("TORCH_SHOW_CPP_STACKTRACES", saved.c_str(), 1);
    } else {
      ::unsetenv("TORCH_SHOW_CPP_STACKTRACES");
    }
  }
  EXPECT_EQ(fulgur::error_message(std::runtime_error("as it is")), "as it is");
  EXPECT_EQ(fulgur::error_message(fulgur::ConfigError("a config error")), "a config error");
}

TEST(Errors, AssertThrowsInternalErrorWithContext) {
  EXPECT_THROWS_WITH(fulgur::InternalError, FULGUR_ASSERT(1 + 1 == 3, "context ", 42),
                     {"bug in fulgur", "1 + 1 == 3", "context 42"});
  EXPECT_THROWS_WITH(fulgur::InternalError, FULGUR_ASSERT(false), {"bug in fulgur"});
  EXPECT_NO_THROW(FULGUR_ASSERT(true, "never shown"));
}

// The helper itself: wrong type, missing substring and no throw all fail.
TEST(Errors, ThrowsWithRejectsWrongTypeMissingTextAndNoThrow) {
  auto wrong_type = fulgur::test::throws_with<fulgur::ConfigError>(
      [] { throw fulgur::CheckpointError("x"); }, {"x"});
  EXPECT_FALSE(wrong_type);
  auto missing = fulgur::test::throws_with<fulgur::ConfigError>(
      [] { throw fulgur::ConfigError("abc"); }, {"abc", "xyz"});
  EXPECT_FALSE(missing);
  auto nothing = fulgur::test::throws_with<fulgur::ConfigError>([] {}, {});
  EXPECT_FALSE(nothing);
  auto ok = fulgur::test::throws_with<std::invalid_argument>(
      [] { throw fulgur::ConfigError("abc def"); }, {"abc", "def"});
  EXPECT_TRUE(ok);
}

}  // namespace
