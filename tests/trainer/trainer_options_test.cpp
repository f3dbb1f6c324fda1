#include "fulgur/trainer/trainer_options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::TempDir;
using fulgur::test::test_options;

// ---- BatchLimit.

TEST(BatchLimit, CountsAndFractions) {
  fulgur::BatchLimit ten = 10;
  fulgur::BatchLimit quarter = 0.25;
  EXPECT_FALSE(ten.is_fraction());
  EXPECT_EQ(ten.count(), 10);
  EXPECT_EQ(ten.text(), "10");
  EXPECT_TRUE(quarter.is_fraction());
  EXPECT_DOUBLE_EQ(quarter.fraction(), 0.25);
  EXPECT_EQ(quarter.text(), "0.25");
  EXPECT_EQ(fulgur::BatchLimit(1.0).text(), "1.0");
  EXPECT_EQ(fulgur::BatchLimit(1e-7).text(), "1e-07");
  EXPECT_FALSE(fulgur::BatchLimit(int64_t{3}).is_fraction());
  EXPECT_TRUE(fulgur::BatchLimit(1.0).is_fraction());
}

TEST(BatchLimit, ApplyToAKnownLength) {
  EXPECT_EQ(fulgur::BatchLimit(10).apply(40, "limit_train_batches"), std::optional<int64_t>(10));
  EXPECT_EQ(fulgur::BatchLimit(0.25).apply(40, "limit_train_batches"), std::optional<int64_t>(10));
  EXPECT_EQ(fulgur::BatchLimit(1.0).apply(40, "limit_train_batches"), std::optional<int64_t>(40));
  EXPECT_EQ(fulgur::BatchLimit(0.0).apply(40, "limit_train_batches"), std::optional<int64_t>(0));
  EXPECT_EQ(fulgur::BatchLimit(0).apply(40, "limit_train_batches"), std::optional<int64_t>(0));
  // A count larger than the loader is the whole loader.
  EXPECT_EQ(fulgur::BatchLimit(100).apply(40, "limit_train_batches"), std::optional<int64_t>(40));
}

TEST(BatchLimit, ApplyToAnUnknownLength) {
  EXPECT_EQ(fulgur::BatchLimit(1.0).apply(std::nullopt, "limit_train_batches"), std::nullopt);
  EXPECT_EQ(fulgur::BatchLimit(3).apply(std::nullopt, "limit_train_batches"),
            std::optional<int64_t>(3));
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::BatchLimit(0.5).apply(std::nullopt, "limit_train_batches"),
                     {"limit_train_batches", "0.5"});
}

TEST(BatchLimit, FractionRoundingToZeroIsAConfigError) {
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::BatchLimit(0.01).apply(40, "limit_val_batches"),
                     {"limit_val_batches", "0.01"});
}

TEST(GradientClipAlgorithm, ParseAndPrint) {
  using Algorithm = fulgur::Choice<fulgur::GradientClipAlgorithm>;
  EXPECT_TRUE(Algorithm("norm") == fulgur::GradientClipAlgorithm::kNorm);
  EXPECT_TRUE(Algorithm("value") == fulgur::GradientClipAlgorithm::kValue);
  EXPECT_FALSE(Algorithm("l2").is_valid());
  EXPECT_EQ(Algorithm(fulgur::GradientClipAlgorithm::kNorm).text(), "norm");
  EXPECT_EQ(Algorithm(fulgur::GradientClipAlgorithm::kValue).text(), "value");
  // An unknown spelling in the options is named when the Trainer is built.
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer({.gradient_clip_algorithm = "l2"}),
                     {"gradient_clip_algorithm=\"l2\"", "\"norm\" or \"value\""});
}

// ---- Flag validation in the Trainer's constructor.

TEST(TrainerFlags, NegativeMaxEpochsIsNamed) {
  TempDir dir;
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::Trainer trainer({.accelerator = "cpu",
                                              .max_epochs = -5,
                                              .default_root_dir = dir.path(),
                                              .enable_progress_bar = false,
                                              .logger = false}),
                     {"max_epochs=-5", ">= -1"});
}

TEST(TrainerFlags, EveryProblemIsListedInOneMessage) {
  TempDir dir;
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::Trainer trainer({.accelerator = "cpu",
                                              .max_epochs = -5,
                                              .accumulate_grad_batches = 0,
                                              .default_root_dir = dir.path(),
                                              .enable_progress_bar = false,
                                              .logger = false}),
                     {"2 problems with the flags", "max_epochs=-5", "accumulate_grad_batches=0"});
}

struct BadFlagCase {
  const char* name;
  std::function<void(fulgur::TrainerOptions&)> set;
  std::vector<std::string> expected;
};

// Test names and failure messages show the case's name, not its bytes.
void PrintTo(const BadFlagCase& c, std::ostream* os) { *os << c.name; }

class TrainerFlagsTest : public ::testing::TestWithParam<BadFlagCase> {};

TEST_P(TrainerFlagsTest, IsRejectedWithItsValue) {
  TempDir dir;
  auto options = test_options(dir);
  GetParam().set(options);
  EXPECT_TRUE(fulgur::test::throws_with<fulgur::ConfigError>(
      [&] { fulgur::Trainer trainer(options); }, GetParam().expected));
}

const BadFlagCase kBadFlags[] = {
    {"min_epochs", [](auto& o) { o.min_epochs = -1; }, {"min_epochs=-1"}},
    {"max_steps", [](auto& o) { o.max_steps = -2; }, {"max_steps=-2"}},
    {"min_steps", [](auto& o) { o.min_steps = -1; }, {"min_steps=-1"}},
    {"fast_dev_run", [](auto& o) { o.fast_dev_run = -1; }, {"fast_dev_run=-1"}},
    {"log_every_n_steps", [](auto& o) { o.log_every_n_steps = 0; }, {"log_every_n_steps=0"}},
    {"num_sanity_val_steps",
     [](auto& o) { o.num_sanity_val_steps = -2; },
     {"num_sanity_val_steps=-2"}},
    {"gradient_clip_val", [](auto& o) { o.gradient_clip_val = -1.0; }, {"gradient_clip_val=-1"}},
    {"gradient_clip_val_inf",
     [](auto& o) { o.gradient_clip_val = std::numeric_limits<double>::infinity(); },
     {"gradient_clip_val=inf", "must be finite"}},
    {"check_val_every_n_epoch",
     [](auto& o) { o.check_val_every_n_epoch = 0; },
     {"check_val_every_n_epoch=0"}},
    {"limit_train_fraction",
     [](auto& o) { o.limit_train_batches = 1.5; },
     {"limit_train_batches=1.5", "[0.0, 1.0]"}},
    {"limit_val_count", [](auto& o) { o.limit_val_batches = -3; }, {"limit_val_batches=-3"}},
    {"val_check_interval_zero",
     [](auto& o) { o.val_check_interval = 0; },
     {"val_check_interval=0"}},
    {"val_check_interval_fraction",
     [](auto& o) { o.val_check_interval = 1.5; },
     {"val_check_interval=1.5"}},
    {"min_above_max",
     [](auto& o) {
       o.max_epochs = 2;
       o.min_epochs = 3;
     },
     {"min_epochs=3", "max_epochs=2"}},
    {"min_steps_above_max",
     [](auto& o) {
       o.max_steps = 4;
       o.min_steps = 5;
     },
     {"min_steps=5 > max_steps=4", "Lower min_steps or raise max_steps"}},
    {"limit_fraction_just_above_one",
     [](auto& o) { o.limit_train_batches = 1.0000001; },
     {"limit_train_batches=1.0000001", "[0.0, 1.0]"}},
    {"null_callback", [](auto& o) { o.callbacks = {nullptr}; }, {"callbacks[0]", "null"}},
    {"num_nodes", [](auto& o) { o.num_nodes = 0; }, {"num_nodes=0"}},
    {"max_restarts", [](auto& o) { o.max_restarts = -1; }, {"max_restarts=-1", ">= 0"}},
    {"heartbeat_timeout",
     [](auto& o) { o.heartbeat_timeout = std::chrono::milliseconds(-5); },
     {"heartbeat_timeout=-5 ms", "0: off"}},
    {"every_n_train_steps",
     [](auto& o) { o.every_n_train_steps = -2; },
     {"every_n_train_steps=-2"}},
    {"every_n_train_steps_without_checkpointing",
     [](auto& o) {
       o.every_n_train_steps = 5;
       o.enable_checkpointing = false;
     },
     {"every_n_train_steps=5", "enable_checkpointing=false saves none"}},
    {"every_n_train_steps_with_own_checkpoint",
     [](auto& o) {
       o.every_n_train_steps = 5;
       o.enable_checkpointing = true;
       o.callbacks = {std::make_shared<fulgur::ModelCheckpoint>()};
     },
     {"every_n_train_steps=5", "callbacks[0] is a ModelCheckpoint of your own",
      "ModelCheckpointOptions::every_n_train_steps"}},
    {"overfit_batches_negative", [](auto& o) { o.overfit_batches = -1; }, {"overfit_batches=-1"}},
    {"overfit_batches_fraction",
     [](auto& o) { o.overfit_batches = 1.5; },
     {"overfit_batches=1.5", "[0.0, 1.0]"}},
    {"overfit_batches_with_limit_train_batches",
     [](auto& o) {
       o.overfit_batches = 4;
       o.limit_train_batches = 10;
     },
     {"overfit_batches=4 sets limit_train_batches", "(limit_train_batches=10)",
      "pass one of them"}},
    {"overfit_batches_with_limit_val_batches",
     [](auto& o) {
       o.overfit_batches = 0.1;
       o.limit_val_batches = 0.5;
     },
     {"overfit_batches=0.1 sets limit_val_batches", "(limit_val_batches=0.5)"}},
    {"overfit_batches_with_fast_dev_run",
     [](auto& o) {
       o.overfit_batches = 2;
       o.fast_dev_run = 1;
     },
     {"overfit_batches=2 and fast_dev_run=1", "pass one of them"}},
    {"detect_anomaly_with_cuda_graph",
     [](auto& o) {
       o.detect_anomaly = true;
       o.cuda_graph = true;
     },
     {"detect_anomaly=true with cuda_graph=true", "without cuda_graph"}},
    {"reload_dataloaders_negative",
     [](auto& o) { o.reload_dataloaders_every_n_epochs = -2; },
     {"reload_dataloaders_every_n_epochs=-2", "must be >= 0"}},
    {"fraction_counted_across_epochs",
     [](auto& o) {
       o.check_val_every_n_epoch = std::nullopt;
       o.val_check_interval = 0.5;
     },
     {"val_check_interval=0.5 with check_val_every_n_epoch unset", "Pass an int"}},
};

INSTANTIATE_TEST_SUITE_P(BadFlags, TrainerFlagsTest, ::testing::ValuesIn(kBadFlags),
                         [](const ::testing::TestParamInfo<BadFlagCase>& info) {
                           return std::string(info.param.name);
                         });

TEST(TrainerFlags, ValidFlagsConstruct) {
  TempDir dir;
  auto options = test_options(dir);
  options.max_epochs = -1;
  options.max_steps = 10;
  options.limit_train_batches = 0.5;
  options.limit_val_batches = 3;
  options.val_check_interval = 0.25;
  options.accumulate_grad_batches = 4;
  options.gradient_clip_val = 0.0;
  EXPECT_NO_THROW(fulgur::Trainer trainer(options));
}

// ---- Resolved defaults.

TEST(TrainerDefaults, MaxRestartsWithoutALauncherSaysItHasNoEffect) {
  TempDir dir;
  auto options = test_options(dir);
  options.max_restarts = 2;
  fulgur::Trainer trainer(options);
  EXPECT_TRUE(fulgur::test::message_contains(
      trainer.describe(), {"max_restarts=2 has no effect", "torchrun --max-restarts"}));
}

// A rank as fulgur's launcher starts it (FULGUR_RESTART_COUNT among its
// variables), and one that another launcher started with the same ranks.
std::string describe_rank_one(bool started_by_fulgur) {
  std::map<std::string, std::string> vars = {{"RANK", "1"},
                                             {"LOCAL_RANK", "1"},
                                             {"WORLD_SIZE", "2"},
                                             {"LOCAL_WORLD_SIZE", "2"},
                                             {"MASTER_ADDR", "127.0.0.1"},
                                             {"MASTER_PORT", "29500"}};
  if (started_by_fulgur) vars["FULGUR_RESTART_COUNT"] = "0";
  TempDir dir;
  auto options = test_options(dir);
  options.strategy = std::string("ddp");
  options.devices = 2;
  options.max_restarts = 2;
  options.plugins = {
      std::make_shared<fulgur::LightningEnvironment>(fulgur::EnvView(std::move(vars)))};
  fulgur::Trainer trainer(options);
  return trainer.describe();
}

TEST(TrainerDefaults, MaxRestartsInARankOfFulgursLauncherPrintsNoNote) {
  EXPECT_EQ(describe_rank_one(/*started_by_fulgur=*/true).find("max_restarts=2"), std::string::npos)
      << describe_rank_one(true);
  EXPECT_TRUE(fulgur::test::message_contains(describe_rank_one(/*started_by_fulgur=*/false),
                                             {"max_restarts=2 has no effect"}));
}

TEST(TrainerDefaults, EveryNTrainStepsSetsTheCadenceOfTheTrainersCheckpoint) {
  TempDir dir;
  auto options = test_options(dir);
  options.enable_checkpointing = true;
  options.every_n_train_steps = 7;
  fulgur::Trainer trainer(options);
  const fulgur::ModelCheckpoint* checkpoint = nullptr;
  for (const auto& cb : trainer.callbacks()) {
    if (auto* c = dynamic_cast<const fulgur::ModelCheckpoint*>(cb.get())) checkpoint = c;
  }
  ASSERT_NE(checkpoint, nullptr);
  EXPECT_EQ(checkpoint->options().every_n_train_steps, 7);
}

TEST(TrainerDefaults, MaxEpochsDefaultIsStatedInDescribe) {
  TempDir dir;
  auto options = test_options(dir);
  options.max_epochs = std::nullopt;
  fulgur::Trainer trainer(options);
  EXPECT_TRUE(fulgur::test::message_contains(
      trainer.describe(), {"\"strategy\": \"single_device\"", "\"accelerator\": \"cpu\"",
                           "max_epochs=1000 because neither max_epochs nor max_steps is set"}));
}

TEST(TrainerDefaults, MaxStepsAloneMeansUnlimitedEpochs) {
  TempDir dir;
  auto options = test_options(dir);
  options.max_epochs = std::nullopt;
  options.max_steps = 5;
  fulgur::Trainer trainer(options);
  EXPECT_TRUE(fulgur::test::message_contains(trainer.describe(),
                                             {"max_epochs=-1 because max_steps is set"}));
}

TEST(TrainerDefaults, FastDevRunIsStated) {
  TempDir dir;
  auto options = test_options(dir);
  options.fast_dev_run = 3;
  fulgur::Trainer trainer(options);
  EXPECT_TRUE(fulgur::test::message_contains(trainer.describe(), {"fast_dev_run=3"}));
}

TEST(TrainerDefaults, CheckpointingAddsAModelCheckpointUnlessOneIsGiven) {
  TempDir dir;
  {
    auto options = test_options(dir);
    options.enable_checkpointing = true;
    fulgur::Trainer trainer(options);
    ASSERT_NE(trainer.checkpoint_callback(), nullptr);
  }
  {
    auto options = test_options(dir);
    fulgur::Trainer trainer(options);  // enable_checkpointing = false
    EXPECT_EQ(trainer.checkpoint_callback(), nullptr);
  }
  {
    auto mine = std::make_shared<fulgur::ModelCheckpoint>(
        fulgur::ModelCheckpointOptions{.dirpath = dir.file("mine")});
    auto options = test_options(dir);
    options.enable_checkpointing = true;
    options.callbacks = {mine};
    fulgur::Trainer trainer(options);
    EXPECT_EQ(trainer.checkpoint_callback(), mine.get());
    int checkpoints = 0;
    for (const auto& cb : trainer.callbacks()) {
      if (dynamic_cast<fulgur::ModelCheckpoint*>(cb.get()) != nullptr) ++checkpoints;
    }
    EXPECT_EQ(checkpoints, 1);
  }
}

TEST(TrainerDefaults, ProgressBarIsACallback) {
  TempDir dir;
  auto with_bar = test_options(dir);
  with_bar.enable_progress_bar = true;
  auto has_bar = [](const fulgur::Trainer& trainer) {
    for (const auto& cb : trainer.callbacks()) {
      if (dynamic_cast<fulgur::ProgressBar*>(cb.get()) != nullptr) return true;
    }
    return false;
  };
  fulgur::Trainer bar(with_bar);
  EXPECT_TRUE(has_bar(bar));
  fulgur::Trainer quiet(test_options(dir));
  EXPECT_FALSE(has_bar(quiet));
}

TEST(TrainerDefaults, DefaultRootDirIsReported) {
  TempDir dir;
  fulgur::Trainer trainer(test_options(dir));
  EXPECT_EQ(trainer.default_root_dir(), dir.path());
  EXPECT_EQ(trainer.strategy().name(), "single_device");
  EXPECT_EQ(trainer.strategy().root_device(), c10::Device(c10::kCPU));
}

TEST(TrainerDefaults, UnknownAcceleratorSuggestsAName) {
  TempDir dir;
  auto options = test_options(dir);
  options.accelerator = "cpuu";
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer trainer(options), {"cpuu", "cpu"});
}

}  // namespace
