// Trainer option prefetch_to_device: each batch is moved to the device one
// batch ahead of the step that takes it. On the CPU the move is the plain
// one, made early, so these tests check what must not change (the batches,
// their order, the weights, a mid-epoch resume) and that the move really is
// made ahead. The _CUDA tests (skipped without a GPU) check the side-stream
// copy against the plain one, and that batches are pinned there by default.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using fulgur::test::LinearRegression;
using fulgur::test::parameters_equal;
using fulgur::test::regression_dataset;
using fulgur::test::TempDir;
using fulgur::test::test_options;
using ::testing::ElementsAre;

/// The first sample of a batch, which names it in these tests' data.
std::string batch_name(const fulgur::Batch& batch) {
  const auto& x = batch.pair().first;
  return std::to_string(x.index({0, 0}).item<float>());
}

/// A single-device strategy that records every batch it moves.
class RecordingStrategy : public fulgur::SingleDeviceStrategy {
 public:
  explicit RecordingStrategy(std::shared_ptr<std::vector<std::string>> events)
      : events_(std::move(events)) {}
  fulgur::Batch batch_to_device(const fulgur::Batch& batch) const override {
    events_->push_back("move " + batch_name(batch));
    return fulgur::SingleDeviceStrategy::batch_to_device(batch);
  }

 private:
  std::shared_ptr<std::vector<std::string>> events_;
};

/// What a run's steps saw, in order, and how it ended.
struct Seen {
  std::vector<std::string> train, val, test, predict;
  std::vector<at::Tensor> weights;
  int64_t global_step = 0;
};

/// How a run gets its data and stops.
struct RunSetup {
  const char* name;
  int64_t batches = 12;       // training batches per epoch
  bool iterable = false;      // a loader of unknown length (the loop looks ahead)
  int64_t num_workers = 0;    // DatasetLoader worker threads
  double limit_train = 1.0;   // limit_train_batches as a fraction
  int64_t val_every = 0;      // val_check_interval in batches; 0: per epoch
  int64_t max_steps = -1;
  int64_t accumulate = 1;
};

std::shared_ptr<fulgur::DataLoader> train_loader(const RunSetup& s) {
  auto data = regression_dataset(4 * s.batches);
  if (!s.iterable) {
    return fulgur::make_data_loader(data, {.batch_size = 4, .shuffle = true,
                                           .num_workers = s.num_workers});
  }
  return fulgur::make_iterable_loader([data, n = s.batches](int64_t epoch) -> fulgur::BatchGenerator {
    auto i = std::make_shared<int64_t>(0);
    return [data, n, epoch, i]() -> std::optional<fulgur::Batch> {
      if (*i >= n) return std::nullopt;
      // Each epoch visits the batches in another order.
      const int64_t b = (*i * 5 + epoch * 7) % n;
      ++*i;
      return data->get_batch(torch::arange(4 * b, 4 * b + 4));
    };
  });
}

Seen run(const RunSetup& s, std::optional<bool> prefetch) {
  TempDir dir;
  torch::manual_seed(3);
  LinearRegression model({.momentum = 0.9});
  Seen seen;
  model.train_hook = [&](LinearRegression&, fulgur::Batch& b, int64_t) {
    seen.train.push_back(batch_name(b));
  };
  model.val_hook = [&](LinearRegression& m, fulgur::Batch& b, int64_t) {
    if (!m.trainer().sanity_checking()) seen.val.push_back(batch_name(b));
  };
  model.test_hook = [&](LinearRegression&, fulgur::Batch& b, int64_t) {
    seen.test.push_back(batch_name(b));
  };
  auto options = test_options(dir);
  options.prefetch_to_device = prefetch;
  options.max_epochs = 2;
  options.seed = 11;
  options.max_steps = s.max_steps;
  options.accumulate_grad_batches = s.accumulate;
  options.limit_train_batches = s.limit_train;
  if (s.val_every > 0) options.val_check_interval = static_cast<long long>(s.val_every);
  options.num_sanity_val_steps = 2;
  fulgur::Trainer trainer(options);
  auto val = fulgur::make_data_loader(regression_dataset(14), {.batch_size = 4});
  const auto result = trainer.fit(model, train_loader(s), val);
  seen.global_step = result.global_step;
  seen.weights = fulgur::test::clone_parameters(model);
  trainer.test(model, fulgur::make_data_loader(regression_dataset(10, 3), {.batch_size = 3}));
  for (auto& out : trainer.predict(model, fulgur::make_data_loader(regression_dataset(9),
                                                                     {.batch_size = 2}))) {
    seen.predict.push_back(std::to_string(out.tensor().index({0, 0}).item<float>()));
  }
  return seen;
}

class PrefetchToDevice : public ::testing::TestWithParam<RunSetup> {};

TEST_P(PrefetchToDevice, EveryStepSeesTheSameBatchesAndTheWeightsEndBitIdentical) {
  const RunSetup& s = GetParam();
  const Seen plain = run(s, false);
  const Seen ahead = run(s, true);
  ASSERT_FALSE(plain.train.empty());
  EXPECT_EQ(ahead.train, plain.train);
  EXPECT_EQ(ahead.val, plain.val);
  EXPECT_EQ(ahead.test, plain.test);
  EXPECT_EQ(ahead.predict, plain.predict);
  EXPECT_EQ(ahead.global_step, plain.global_step);
  ASSERT_EQ(ahead.weights.size(), plain.weights.size());
  for (size_t i = 0; i < plain.weights.size(); ++i) {
    EXPECT_TRUE(torch::equal(ahead.weights[i], plain.weights[i])) << "parameter " << i;
  }
  // "auto" on the CPU is the plain move.
  const Seen automatic = run(s, std::nullopt);
  EXPECT_EQ(automatic.train, plain.train);
}

INSTANTIATE_TEST_SUITE_P(
    Loaders, PrefetchToDevice,
    ::testing::Values(RunSetup{.name = "shuffled"},
                      RunSetup{.name = "iterable_of_unknown_length", .iterable = true},
                      RunSetup{.name = "two_loader_workers", .num_workers = 2},
                      RunSetup{.name = "limit_train_batches_half", .limit_train = 0.5},
                      RunSetup{.name = "validation_mid_epoch", .val_every = 5},
                      RunSetup{.name = "max_steps_mid_epoch", .max_steps = 17},
                      RunSetup{.name = "iterable_max_steps_mid_epoch", .iterable = true, .max_steps = 7},
                      RunSetup{.name = "accumulating_three", .batches = 10, .accumulate = 3}),
    [](const ::testing::TestParamInfo<RunSetup>& info) { return std::string(info.param.name); });

/// The order of loads, moves and steps of one epoch of `batches` batches.
std::vector<std::string> order_of_moves(std::optional<bool> prefetch, int64_t batches,
                                        bool iterable) {
  TempDir dir;
  auto events = std::make_shared<std::vector<std::string>>();
  LinearRegression model;
  model.train_hook = [&](LinearRegression&, fulgur::Batch& b, int64_t) {
    events->push_back("step " + batch_name(b));
  };
  auto options = test_options(dir);
  options.prefetch_to_device = prefetch;
  options.strategy = std::make_shared<RecordingStrategy>(events);
  fulgur::Trainer trainer(options);
  trainer.fit(model, train_loader({.name = "", .batches = batches, .iterable = iterable}));
  return *events;
}

TEST(PrefetchToDevice, MovesEachBatchWhileTheStepBeforeItRuns) {
  for (bool iterable : {false, true}) {
    SCOPED_TRACE(iterable ? "a loader of unknown length" : "a loader of known length");
    const auto ahead = order_of_moves(true, 4, iterable);
    ASSERT_EQ(ahead.size(), 8u) << ::testing::PrintToString(ahead);
    // Batch k+1 is moved before step k, and each step takes its own batch.
    std::vector<std::string> moved, stepped;
    for (const auto& e : ahead) (e.rfind("move ", 0) == 0 ? moved : stepped).push_back(e.substr(5));
    ASSERT_EQ(moved, stepped);
    EXPECT_THAT(ahead, ElementsAre("move " + moved[0], "move " + moved[1], "step " + moved[0],
                                   "move " + moved[2], "step " + moved[1], "move " + moved[3],
                                   "step " + moved[2], "step " + moved[3]));
    // Without prefetch each batch is moved when its step starts.
    const auto plain = order_of_moves(false, 4, iterable);
    EXPECT_THAT(plain, ElementsAre("move " + moved[0], "step " + moved[0], "move " + moved[1],
                                   "step " + moved[1], "move " + moved[2], "step " + moved[2],
                                   "move " + moved[3], "step " + moved[3]));
  }
}

TEST(PrefetchToDevice, OneBatchIsMovedOnceAndNotAhead) {
  const auto events = order_of_moves(true, 1, false);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].substr(5), events[1].substr(5));
}

TEST(PrefetchToDevice, TheFlagReadsAutoTrueAndFalseAndRefusesOtherText) {
  const fulgur::TrainerFlag* flag = fulgur::find_trainer_flag("--prefetch-to-device");
  ASSERT_NE(flag, nullptr);
  fulgur::TrainerOptions options;
  EXPECT_EQ(flag->get(options), "auto");
  for (const char* text : {"true", "false", "auto"}) {
    EXPECT_EQ(flag->set(options, text), "");
    EXPECT_EQ(flag->get(options), text);
  }
  EXPECT_EQ(flag->set(options, "1"), "");
  EXPECT_EQ(options.prefetch_to_device, std::optional<bool>(true));
  EXPECT_EQ(flag->set(options, "none"), "");
  EXPECT_EQ(options.prefetch_to_device, std::nullopt);
  auto parsed = fulgur::parse_flags({{"prefetch_to_device", "often"}});
  ASSERT_EQ(parsed.problems.size(), 1u);
  EXPECT_TRUE(fulgur::test::message_contains(
      parsed.problems[0], {"--prefetch_to_device often", "pass auto, true or false"}));
  EXPECT_EQ(parsed.options.prefetch_to_device, std::nullopt);
}

// ---- On a GPU.

TEST(PrefetchToDevice_CUDA, TheSideStreamCopyTrainsBitIdenticallyToThePlainMove) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  auto train = [](std::optional<bool> prefetch) {
    TempDir dir;
    torch::manual_seed(5);
    LinearRegression model({.momentum = 0.9});
    model.train_hook = [&](LinearRegression&, fulgur::Batch& b, int64_t) {
      EXPECT_TRUE(b.pair().first.is_cuda());
    };
    auto options = test_options(dir);
    options.accelerator = std::string("cuda");
    options.devices = fulgur::DevicesSpec(1);
    options.deterministic = true;
    options.max_epochs = 2;
    options.prefetch_to_device = prefetch;
    fulgur::Trainer trainer(options);
    auto loader = fulgur::make_data_loader(regression_dataset(64), {.batch_size = 8, .shuffle = true,
                                                                     .num_workers = 2});
    trainer.fit(model, loader);
    return fulgur::test::clone_parameters(model);
  };
  const auto plain = train(false);
  const auto ahead = train(std::nullopt);  // auto: on, on a GPU
  ASSERT_EQ(plain.size(), ahead.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(torch::equal(plain[i].cpu(), ahead[i].cpu())) << "parameter " << i;
  }
}

/// Records whether the loader's batches reach the hooks in page-locked memory.
class PinnedRecorder : public fulgur::Callback {
 public:
  std::string state_key() const override { return "PinnedRecorder"; }
  void on_train_batch_start(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch& batch,
                            int64_t) override {
    pinned.push_back(batch.pair().first.is_pinned());
  }
  std::vector<bool> pinned;
};

TEST(PrefetchToDevice_CUDA, LoaderBatchesArePinnedByDefaultOnAGpuOnly) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  auto pinned = [](const char* accelerator, std::optional<bool> pin) {
    TempDir dir;
    LinearRegression model;
    auto recorder = std::make_shared<PinnedRecorder>();
    auto options = test_options(dir);
    options.accelerator = std::string(accelerator);
    options.devices = fulgur::DevicesSpec(1);
    options.callbacks = {recorder};
    fulgur::Trainer trainer(options);
    trainer.fit(model, fulgur::make_data_loader(regression_dataset(8),
                                                {.batch_size = 4, .pin_memory = pin}));
    return recorder->pinned;
  };
  EXPECT_THAT(pinned("cuda", std::nullopt), ElementsAre(true, true));
  EXPECT_THAT(pinned("cuda", false), ElementsAre(false, false));
  EXPECT_THAT(pinned("cpu", std::nullopt), ElementsAre(false, false));
}

}  // namespace
