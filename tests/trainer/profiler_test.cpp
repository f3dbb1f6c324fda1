// Trainer option profiler = "simple": the table global rank 0 prints at the
// end of fit, with each phase's calls counted exactly (a real fit of known
// length), nothing printed when off, and bad values refused by name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <sstream>
#include <string>
#include <thread>

#include "fulgur/fulgur.h"
#include "support/test_support.h"
#include "trainer/profiler.h"

namespace profiler_test {

using fulgur::detail::SimpleProfiler;
using fulgur::test::LinearRegression;
using fulgur::test::regression_dataset;
using fulgur::test::TempDir;
using fulgur::test::test_options;

/// The calls column of each phase row of a printed table.
std::map<std::string, int64_t> calls_by_phase(const std::string& printed) {
  std::map<std::string, int64_t> calls;
  std::istringstream in(printed);
  std::string line;
  bool in_table = false;
  while (std::getline(in, line)) {
    if (line.rfind("profiler (simple)", 0) == 0) {
      in_table = true;
      continue;
    }
    if (!in_table || line.rfind("  ", 0) != 0) continue;
    // "  <phase name, up to 20 columns> <calls> ...": the name may hold a space.
    const std::string name = line.substr(2, 20);
    std::istringstream rest(line.substr(22));
    int64_t n = 0;
    if (rest >> n) calls[name.substr(0, name.find_last_not_of(' ') + 1)] = n;
  }
  return calls;
}

TEST(Profiler, SimplePrintsEveryPhaseWithItsCallsAtTheEndOfFit) {
  TempDir dir;
  LinearRegression model;
  auto options = test_options(dir);
  options.profiler = "simple";
  options.max_epochs = 2;
  options.num_sanity_val_steps = 2;
  fulgur::Trainer trainer(options);
  testing::internal::CaptureStdout();
  trainer.fit(model, fulgur::make_data_loader(regression_dataset(48), {.batch_size = 4}),
              fulgur::make_data_loader(regression_dataset(8), {.batch_size = 4}));
  const std::string printed = testing::internal::GetCapturedStdout();
  ASSERT_THAT(printed, testing::HasSubstr("profiler (simple): where the fit loop's time went"));
  const auto calls = calls_by_phase(printed);
  // 12 batches an epoch, 2 epochs; a validation per epoch (the sanity check
  // is not counted); the loader asked once per batch.
  EXPECT_EQ(calls.at("training_step"), 24) << printed;
  EXPECT_EQ(calls.at("backward"), 24) << printed;
  EXPECT_EQ(calls.at("optimizer step"), 24) << printed;
  // Twice a batch: the values on_train_batch_end reads, then the row after it.
  EXPECT_EQ(calls.at("logging"), 2 * 24) << printed;
  EXPECT_EQ(calls.at("on_train_batch_end"), 24) << printed;
  EXPECT_EQ(calls.at("validation"), 2) << printed;
  EXPECT_EQ(calls.at("epoch end"), 2) << printed;
  EXPECT_EQ(calls.at("fetch batch"), 24) << printed;
  EXPECT_EQ(calls.count("CUDA-graph step"), 0u) << printed;
  EXPECT_THAT(printed, testing::HasSubstr("  other "));
  EXPECT_THAT(printed, testing::HasSubstr("  fit loop "));
}

TEST(Profiler, OffByDefaultPrintsNothing) {
  TempDir dir;
  LinearRegression model;
  EXPECT_EQ(fulgur::TrainerOptions{}.profiler, fulgur::ProfilerKind::kNone);
  fulgur::Trainer trainer(test_options(dir));
  testing::internal::CaptureStdout();
  trainer.fit(model, fulgur::make_data_loader(regression_dataset(16), {.batch_size = 4}));
  EXPECT_THAT(testing::internal::GetCapturedStdout(),
              testing::Not(testing::HasSubstr("profiler (simple)")));
}

TEST(Profiler, AnUnknownProfilerIsRefusedByName) {
  TempDir dir;
  auto options = test_options(dir);
  options.profiler = "fancy";
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer{options},
                     {"profiler=\"fancy\"", "\"simple\"", "\"none\""});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer{options}, {"\"pytorch\""});
  options.profiler = "";
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer{options}, {"profiler=\"\"", "\"none\""});
  EXPECT_EQ(fulgur::options_from_flags({{"profiler", "simple"}}).profiler,
            fulgur::ProfilerKind::kSimple);
  EXPECT_EQ(fulgur::options_from_flags({{"--profiler", "none"}}).profiler,
            fulgur::ProfilerKind::kNone);
  EXPECT_EQ(fulgur::options_from_flags({{"profiler", "pytorch"}}).profiler,
            fulgur::ProfilerKind::kPyTorch);
  EXPECT_THROWS_WITH(fulgur::FlagError, fulgur::options_from_flags({{"profiler", "fancy"}}),
                     {"profiler", "fancy", "\"simple\"", "\"pytorch\""});
}

TEST(Profiler, SimpleProfilerSumsCallsAndTimePerPhase) {
  SimpleProfiler profiler;
  profiler.start();
  profiler.add(SimpleProfiler::Phase::kBackward, std::chrono::milliseconds(3));
  profiler.add(SimpleProfiler::Phase::kBackward, std::chrono::milliseconds(5));
  {
    SimpleProfiler::Scope timed(&profiler, SimpleProfiler::Phase::kFetch);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  {
    SimpleProfiler::Scope off(nullptr, SimpleProfiler::Phase::kFetch);  // no profiler: nothing
  }
  EXPECT_EQ(profiler.calls(SimpleProfiler::Phase::kBackward), 2);
  EXPECT_DOUBLE_EQ(profiler.seconds(SimpleProfiler::Phase::kBackward), 0.008);
  EXPECT_EQ(profiler.calls(SimpleProfiler::Phase::kFetch), 1);
  EXPECT_GE(profiler.seconds(SimpleProfiler::Phase::kFetch), 0.002);
  EXPECT_EQ(profiler.calls(SimpleProfiler::Phase::kValidation), 0);
  const auto calls = calls_by_phase(profiler.table());
  EXPECT_EQ(calls.at("backward"), 2);
  EXPECT_EQ(calls.at("fetch batch"), 1);
  EXPECT_EQ(calls.count("validation"), 0u) << "phases never entered are left out";
}

}  // namespace profiler_test
