#include "fulgur/callbacks/on_exception_checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "fulgur/fulgur.h"
#include "support/test_support.h"
#include "strategies/strategy_driver.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::regression_loader;
using fulgur::test::TempDir;
using fulgur::test::test_options;

// A step that throws: the state the run reached is saved before the error
// reaches the caller, and it verifies.
TEST(OnExceptionCheckpoint, SavesTheReachedStateBeforeTheErrorPropagates) {
  TempDir dir;
  LinearRegression model;
  model.train_hook = [](LinearRegression&, fulgur::Batch&, int64_t idx) {
    if (idx == 3) throw std::runtime_error("a bug in step 3");
  };
  auto callback = std::make_shared<fulgur::OnExceptionCheckpoint>();
  auto options = test_options(dir);
  options.callbacks = {callback};
  fulgur::Trainer trainer(options);
  EXPECT_THROW(trainer.fit(model, regression_loader(5)), std::runtime_error);
  const std::string path = dir.file("checkpoints/on_exception.ckpt");
  EXPECT_EQ(callback->saved_path(), path);
  ASSERT_TRUE(std::filesystem::exists(path));
  EXPECT_EQ(fulgur::detail::drive(trainer.strategy()).verify_checkpoint(path), "");
  // It resumes at the step the run had reached.
  LinearRegression again;
  auto resume = test_options(dir);
  fulgur::Trainer second(resume);
  auto result = second.fit(again, regression_loader(5), nullptr, {.ckpt_path = path});
  EXPECT_EQ(result.global_step, 5);
  EXPECT_EQ(again.training_steps, 2);
}

TEST(OnExceptionCheckpoint, AnErrorBeforeFitStartsSavesNothing) {
  TempDir dir;
  LinearRegression model;
  auto callback = std::make_shared<fulgur::OnExceptionCheckpoint>();
  auto options = test_options(dir);
  options.callbacks = {callback};
  fulgur::Trainer trainer(options);
  EXPECT_THROW(trainer.fit(model, regression_loader(2), nullptr, {.ckpt_path = "/no/such.ckpt"}),
               std::exception);
  EXPECT_EQ(callback->saved_path(), "");
}

}  // namespace
