// Multi-process DDP with real processes and real Gloo over 127.0.0.1: each
// test runs tests/distributed/ddp_worker.cpp (FULGUR_DDP_WORKER) under a
// time limit and compares what rank 0 wrote.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "fulgur/distributed/process_group.h"
#include "distributed/worker.h"
#include "support/process.h"
#include "support/test_support.h"

namespace {

using fulgur::test::expect_equivalent;
using fulgur::test::ProcessResult;
using fulgur::test::result_value;
using fulgur::test::run_process;
using fulgur::test::run_worker;
using fulgur::test::same_params;
using fulgur::test::TempDir;
using fulgur::test::uneven_ranks;
using fulgur::test::worker_predictions;
using namespace std::chrono_literals;

TEST(DDP, TwoRanksMatchOneProcessWithTheDoubleBatch) {
  expect_equivalent({"--steps", "20"}, "ddp");
}

TEST(DDP, TwoRanksMatchOneProcessWithShuffleAndAdam) {
  expect_equivalent({"--steps", "20", "--shuffle", "--optimizer", "adam"}, "ddp");
}

// Loaders made again every epoch, each larger (64, 96, 128 samples: 4, 6
// and 8 batches of 8 per rank): every reloaded loader is split across the
// ranks as the first one was, so two ranks still train as one process.
TEST(DDP, ReloadedLoadersAreSplitAcrossTheRanksAsTheFirstWas) {
  expect_equivalent({"--steps", "15", "--samples", "64", "--shuffle", "--reload-every", "1"},
                    "ddp");
}

// BackboneFinetuning: fc1 frozen for epoch 0 (4 steps), then trained in a
// parameter group of its own at rising rates. The ranks rebuild their
// gradient buckets when it becomes trainable, so two ranks still train as
// one process.
TEST(DDP, AFinetunedBackboneIsAveragedOnceItTrains) {
  expect_equivalent({"--steps", "16", "--samples", "64", "--finetune-at", "1"}, "ddp");
}

// Two ranks fine-tuning fc1 from epoch 2 (4 steps an epoch), resumed from a
// checkpoint before the unfreezing (step 5) and after it (step 10, mid-epoch
// 2): parameters and optimizer state end bit-identical to the uninterrupted
// run's (the added group is rebuilt on every rank before its state loads).
TEST(DDP, AFinetunedRunResumedBeforeOrAfterTheUnfreezingEndsBitIdentical) {
  TempDir dir;
  const std::string d = dir.path();
  auto run = [&](const std::string& steps, const std::string& name, std::vector<std::string> more) {
    std::vector<std::string> args = {"--strategy",
                                     "ddp",
                                     "--devices",
                                     "2",
                                     "--batch",
                                     "8",
                                     "--steps",
                                     steps,
                                     "--samples",
                                     "64",
                                     "--finetune-at",
                                     "2",
                                     "--deterministic",
                                     "--every-n-train-steps",
                                     "5",
                                     "--root",
                                     d + "/" + name};
    args.insert(args.end(), more.begin(), more.end());
    auto r = run_worker(args);
    EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
  };
  auto outputs = [&](const std::string& name) {
    return std::vector<std::string>{"--out", d + "/" + name + ".pt", "--out-optimizer",
                                    d + "/" + name + "-optimizer.pt"};
  };
  run("20", "ref", outputs("ref"));
  for (const char* steps : {"5", "10"}) {
    const std::string part = std::string("part-") + steps;
    run(steps, part, {});
    auto more = outputs(part);
    more.insert(more.end(), {"--ckpt-path", d + "/" + part + "/checkpoints/last.ckpt"});
    run("20", part, more);
    fulgur::test::expect_identical_runs(d, "ref", part);
  }
}

// A value logged without sync_dist is each rank's own (here 10 * rank +
// the global step). A checkpoint of one file keeps every rank's where they
// differ, so each rank resumes reading its own, as the uninterrupted run
// did (it read global rank 0's on every rank). Resumed on another number of
// ranks: global rank 0's on each, with a note.
TEST(DDP, AResumeGivesEachRankTheCallbackMetricsItHad) {
  TempDir dir;
  const std::string d = dir.path();
  auto run = [&](const std::string& devices, const std::string& steps,
                 std::vector<std::string> more) {
    std::vector<std::string> args = {"--strategy", "ddp",          "--devices",
                                     devices,      "--steps",      steps,
                                     "--samples",  "64",           "--batch",
                                     "8",          "--own-metric", "--every-n-train-steps",
                                     "3",          "--root",       d};
    args.insert(args.end(), more.begin(), more.end());
    return run_worker(args);
  };
  auto first = run("2", "3", {});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_EQ(result_value(first.output, "start_own_rank1"), "-1") << first.output;
  const std::string last = d + "/checkpoints/last.ckpt";
  auto resumed = run("2", "4", {"--ckpt-path", last});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  // Logged last at global step 2, the third batch's.
  EXPECT_EQ(result_value(resumed.output, "start_own_rank0"), "2") << resumed.output;
  EXPECT_EQ(result_value(resumed.output, "start_own_rank1"), "12") << resumed.output;
  EXPECT_EQ(resumed.output.find("callback metrics of"), std::string::npos) << resumed.output;
  auto alone = run("1", "4", {"--ckpt-path", last});
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  EXPECT_EQ(result_value(alone.output, "start_own_rank0"), "2") << alone.output;
  EXPECT_THAT(alone.output,
              ::testing::HasSubstr("holds the callback metrics of 2 ranks, which differ (values "
                                   "logged without sync_dist); this run has 1: every rank starts "
                                   "from global rank 0's"));
}

// A ModelCheckpoint ranking by a value logged without sync_dist: each
// rank has its own ("skew": the step on rank 0, 100 minus it on rank 1).
// Every rank ranks and names the checkpoints by global rank 0's values,
// which it writes, so the ranks make the same saves (each save is a
// collective: rank 1's would have saved at step 3, where rank 0 did not)
// and keep the same best path; said once.
TEST(DDP, ACheckpointRankedByEachRanksOwnValueFollowsRankZero) {
  TempDir dir;
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "6", "--samples", "64",
                       "--batch", "8", "--monitor-skew", "--timeout", "30", "--root", dir.path()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Logged at global steps 0 and 1, saved after steps 1 and 2.
  EXPECT_THAT(fulgur::test::list_files(dir.file("skew")),
              ::testing::ElementsAre("step=1-skew=0.ckpt", "step=2-skew=1.ckpt"));
  const std::string best = dir.file("skew/step=1-skew=0.ckpt");
  EXPECT_EQ(result_value(r.output, "skew_best_rank0"), best) << r.output;
  EXPECT_EQ(result_value(r.output, "skew_best_rank1"), best) << r.output;
  EXPECT_EQ(fulgur::test::count_occurrences(
                r.output,
                "ModelCheckpoint(monitor=\"skew\"): the ranks' values of \"skew\" differ at step "
                "1 (rank 0: 0; rank 1: 100): logged without sync_dist, each rank has its own. "
                "Checkpoints are ranked and named by global rank 0's"),
            1)
      << r.output;
  // A monitor none logged, at a save where one rank has asked to stop (in
  // its first training step): every rank treats it as the run's last save
  // (nothing to rank, a note), as the stop agreed after it makes it; none
  // refuses the missing metric while its peer saves.
  TempDir stopping;
  auto stop = run_worker({"--strategy",
                          "ddp",
                          "--devices",
                          "2",
                          "--steps",
                          "6",
                          "--samples",
                          "64",
                          "--batch",
                          "8",
                          "--monitor-skew",
                          "--skew-monitor",
                          "absent",
                          "--stop-rank",
                          "1",
                          "--fault-step",
                          "0",
                          "--stop-in",
                          "step",
                          "--timeout",
                          "30",
                          "--root",
                          stopping.path()});
  ASSERT_EQ(stop.exit_code, 0) << stop.output;
  EXPECT_EQ(result_value(stop.output, "global_step"), "1") << stop.output;
  EXPECT_THAT(stop.output, ::testing::HasSubstr("ModelCheckpoint(monitor=\"absent\"): saving at "
                                                "step 1 before any validation of this fit"));
  // Without the stop, every rank refuses the missing monitor, saying that
  // rank 0's values decide and whose names it lists.
  TempDir missing;
  auto refused = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "6", "--samples",
                             "64", "--batch", "8", "--monitor-skew", "--skew-monitor", "absent",
                             "--timeout", "30", "--root", missing.path()});
  EXPECT_NE(refused.exit_code, 0) << refused.output;
  EXPECT_THAT(refused.output,
              ::testing::HasSubstr("ModelCheckpoint(monitor=\"absent\"): no metric of that name "
                                   "was logged on global rank 0, whose values rank the "
                                   "checkpoints. Logged metrics on rank 0: skew, train_loss"));
}

// Ranks that make different parameters trainable, at one step or on one
// rank only: they name the difference instead of pairing unlike gradient
// buckets.
TEST(DDP, RanksThatUnfreezeDifferentParametersAreNamed) {
  TempDir dir;
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "8", "--samples", "64",
                       "--unfreeze-mismatch-step", "2", "--root", dir.path()});
  EXPECT_NE(r.exit_code, 0) << r.output;
  // Rank 0 trains fc1.weight (and fc2's two), rank 1 fc1.bias instead.
  EXPECT_THAT(r.output, ::testing::HasSubstr("ddp: rank 0 trains 3 parameters (2 at the last "
                                             "comparison) and its peers others: rank 1 trains "
                                             "3, without \"fc1.weight\""));
  EXPECT_THAT(r.output,
              ::testing::HasSubstr("Freeze and unfreeze the same parameters on every rank"));
  // One rank alone unfreezing at an epoch's start is named at the epoch's
  // first step, where its peers compare too.
  auto alone =
      run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "12", "--samples", "64",
                  "--unfreeze-mismatch-step", "4", "--unfreeze-rank", "1", "--root", dir.path()});
  EXPECT_NE(alone.exit_code, 0) << alone.output;
  EXPECT_THAT(alone.output, ::testing::HasSubstr("rank 1 trains 3, with \"fc1.bias\""));
}

// use_distributed_sampler=false with a dataset that depends on the rank:
// rank 1's training loader has 6 batches where rank 0's has 4, from the
// fit's start or only in the loaders made again for epoch 1. The ranks say
// so, naming each rank's count, before the epoch's first step, where a step
// would wait for a peer until the process-group timeout (60 s here).
TEST(DDP, TrainingLoadersOfDifferentLengthsAreNamedAtTheFitsStartAndAtAReload) {
  TempDir dir;
  auto at_start = run_worker(uneven_ranks("ddp", dir.path(), "start", {"--steps", "12"}), {}, 90s);
  EXPECT_NE(at_start.exit_code, 0) << at_start.output;
  EXPECT_THAT(at_start.output,
              ::testing::HasSubstr("the training loader has a different number of batches on "
                                   "different ranks (rank 0: 4 batches; rank 1: 6 batches)"));
  EXPECT_THAT(at_start.output, ::testing::HasSubstr("with use_distributed_sampler=false, give "
                                                    "every rank as many samples, or cap the pass "
                                                    "with limit_train_batches=4."));
  EXPECT_EQ(at_start.output.find("rank 1: in "), std::string::npos) << at_start.output;
  EXPECT_LT(at_start.seconds, 45) << at_start.output;

  auto at_reload =
      run_worker(uneven_ranks("ddp", dir.path(), "reload",
                              {"--steps", "12", "--reload-every", "1", "--uneven-from", "1"}),
                 {}, 90s);
  EXPECT_NE(at_reload.exit_code, 0) << at_reload.output;
  EXPECT_THAT(at_reload.output,
              ::testing::HasSubstr("reload_dataloaders_every_n_epochs=1, the loaders made for "
                                   "epoch 1: the training loader has a different number of "
                                   "batches on different ranks (rank 0: 4 batches; rank 1: 6 "
                                   "batches)"));
  EXPECT_LT(at_reload.seconds, 45) << at_reload.output;
}

// Loaders of unknown length (iterables, each rank reading its own part):
// rank 1's has 6 batches an epoch, rank 0's 4. The ranks agree on each
// batch's look-ahead, so every epoch ends for both after 4 batches, rank 1
// saying once that its further batches are left out, and the run ends
// bit-identical to one where rank 1 has 4 batches too (before, rank 1's
// fifth step waited for rank 0 until the process-group timeout). A rank
// whose loader has a length joins the votes of a peer whose loader has none.
TEST(DDP, LoadersOfUnknownLengthEndEveryRanksEpochAtTheShortestRanksEnd) {
  TempDir dir;
  const std::string d = dir.path();
  auto run = [&](const std::string& name, std::vector<std::string> more) {
    more.insert(more.end(), {"--steps", "12", "--iterable"});
    return run_worker(uneven_ranks("ddp", d, name, more), {}, 90s);
  };
  auto uneven = run("uneven", {});
  ASSERT_EQ(uneven.exit_code, 0) << uneven.output;
  EXPECT_EQ(result_value(uneven.output, "global_step"), "12") << uneven.output;
  EXPECT_EQ(fulgur::test::count_occurrences(uneven.output,
                                            "rank 1: the training loader (of unknown length) "
                                            "ended sooner on another rank"),
            1)
      << uneven.output;
  EXPECT_LT(uneven.seconds, 45) << uneven.output;
  auto even = run("even", {"--uneven-samples", "0"});
  ASSERT_EQ(even.exit_code, 0) << even.output;
  EXPECT_EQ(even.output.find("ended sooner on another rank"), std::string::npos) << even.output;
  EXPECT_TRUE(fulgur::test::same_params(d + "/even.pt", d + "/uneven.pt", {.exact = true}));
  // Rank 0's loader has a length (4) and rank 1's not, both capped at 3 by
  // limit_train_batches: their counts agree (3), and rank 0 joins the
  // look-ahead votes rank 1's loader needs, as an even run does.
  auto mixed = run("mixed", {"--known-length-rank", "0", "--limit-train-batches", "3"});
  ASSERT_EQ(mixed.exit_code, 0) << mixed.output;
  EXPECT_EQ(result_value(mixed.output, "global_step"), "12") << mixed.output;
  EXPECT_LT(mixed.seconds, 45) << mixed.output;
  auto capped = run("capped", {"--uneven-samples", "0", "--limit-train-batches", "3"});
  ASSERT_EQ(capped.exit_code, 0) << capped.output;
  EXPECT_TRUE(fulgur::test::same_params(d + "/capped.pt", d + "/mixed.pt", {.exact = true}));
}

// Under ddp every rank predicts its own part of the data (37 samples: 19 and
// 18) and a PredictionFileWriter writes it; read back, the parts are one
// process's predictions, in the dataset's order.
TEST(DDP, EveryRanksPredictionsReadBackInTheDatasetsOrder) {
  TempDir dir;
  fulgur::test::ProcessResult one, two, lone;
  const at::Tensor single = worker_predictions(dir, "one", "auto", 1, 37, {}, &one);
  EXPECT_EQ(result_value(one.output, "predicted_rank0"), "37") << one.output;
  const at::Tensor merged = worker_predictions(dir, "two", "ddp", 2, 37, {}, &two);
  ASSERT_TRUE(single.defined() && merged.defined());
  EXPECT_EQ(result_value(two.output, "predicted_rank0"), "19") << two.output;
  EXPECT_EQ(result_value(two.output, "predicted_rank1"), "18") << two.output;
  ASSERT_EQ(merged.sizes(), single.sizes());
  EXPECT_EQ(merged.size(0), 37);
  EXPECT_TRUE(torch::allclose(merged, single, /*rtol=*/1e-5, /*atol=*/1e-6));
  // One sample: rank 1 predicts nothing, and its file says so.
  const at::Tensor one_row = worker_predictions(dir, "lone", "ddp", 2, 1, {}, &lone);
  ASSERT_TRUE(one_row.defined());
  EXPECT_EQ(result_value(lone.output, "predicted_rank1"), "0") << lone.output;
  EXPECT_EQ(one_row.size(0), 1);
  EXPECT_TRUE(torch::allclose(one_row, single.slice(0, 0, 1), /*rtol=*/1e-5, /*atol=*/1e-6));
}

TEST(DDP, CheckpointedActivationsTrainLikeOneProcess) {
  // The hidden block recomputed in backward (fulgur::nn::checkpoint): its
  // parameters' gradients reach DDP's reducer through the checkpoint's node.
  expect_equivalent({"--steps", "20", "--shuffle", "--optimizer", "adam"}, "ddp",
                    {"--checkpoint-activations"});
}

// A rank writing to a peer that died gets an error (EPIPE) it reports, not a
// SIGPIPE that kills it first and gets it named as the cause (seen under
// load: rank 0 "killed by signal 13" when rank 1 had been SIGKILLed). One
// process leaves the program's SIGPIPE as it was.
TEST(DDP, RanksIgnoreSigpipeAsPythonDoes) {
  TempDir dir;
  auto two =
      run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "2", "--root", dir.path()});
  EXPECT_EQ(two.exit_code, 0) << two.output;
  EXPECT_EQ(result_value(two.output, "sigpipe"), "ignored") << two.output;
  auto one = run_worker({"--devices", "1", "--steps", "2", "--root", dir.path()});
  EXPECT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(result_value(one.output, "sigpipe"), "default") << one.output;
}

TEST(DDP, GradientAccumulationSkipsSyncAndStillMatches) {
  expect_equivalent({"--steps", "10", "--accumulate", "2"}, "ddp");
}

TEST(DDP, SmallBucketsMatchToo) {
  // 16x32 + 32 + 32x4 + 4 floats: a 1 KiB cap makes several buckets.
  expect_equivalent({"--steps", "20", "--bucket-mb", "0.001"}, "ddp");
}

TEST(DDP, FindUnusedParametersMatches) {
  expect_equivalent({"--steps", "20", "--unused-layer"}, "ddp_find_unused_parameters_true");
}

TEST(DDP, WithoutTheDistributedSamplerEveryRankSeesEveryBatch) {
  // use_distributed_sampler=false: each rank iterates the whole loader, so
  // two ranks average two equal gradients: one process with the same batch.
  TempDir dir;
  const std::string single = dir.path() + "/single.pt";
  const std::string multi = dir.path() + "/multi.pt";
  auto one = run_worker({"--devices", "1", "--batch", "8", "--steps", "12", "--shuffle", "--out",
                         single, "--root", dir.path()});
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto two = run_worker({"--strategy", "ddp", "--devices", "2", "--batch", "8", "--steps", "12",
                         "--shuffle", "--distributed-sampler", "false", "--out", multi, "--root",
                         dir.path()});
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_TRUE(same_params(single, multi)) << two.output;
  // And with the sampler (the default) the ranks split the data: different.
  auto split = run_worker({"--strategy", "ddp", "--devices", "2", "--batch", "8", "--steps", "12",
                           "--shuffle", "--out", multi, "--root", dir.path()});
  ASSERT_EQ(split.exit_code, 0) << split.output;
  EXPECT_FALSE(same_params(single, multi));
}

TEST(DDP, ARankWithoutALossTakesTheStepOfTheRanksWithOne) {
  // Rank 1's training_step returns no loss at batches 3 and 8: those steps
  // are rank 0's gradient alone, as on one process without rank 1's rows.
  // (Rank 1 skipping its all-reduces would pair them with the wrong ones.)
  expect_equivalent({"--steps", "20", "--skip-ranks", "1", "--skip-at", "3,8"}, "ddp");
}

TEST(DDP, WhenNoRankHasALossNobodySteps) {
  expect_equivalent({"--steps", "20", "--skip-ranks", "0,1", "--skip-at", "4"}, "ddp");
}

TEST(DDP, NoLossAtAnAccumulationStepStepsWithWhatWasAccumulated) {
  // Windows of two: {2,3} steps with batch 2's gradients; {6,7} has none.
  expect_equivalent(
      {"--steps", "8", "--accumulate", "2", "--skip-ranks", "0,1", "--skip-at", "3,6,7"}, "ddp");
}

TEST(DDP, NoLossOnOneRankUnderSyncBatchNormIsAClearError) {
  // SyncBatchNorm reduces in forward and backward: a rank that skips them
  // cannot be paired with its peers, so it says so instead of hanging.
  auto r =
      run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "20", "--batchnorm", "sync",
                  "--sync-batchnorm", "--skip-ranks", "1", "--skip-at", "3", "--timeout", "60"},
                 {}, 50s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("returned no loss while sync_batchnorm=true"), std::string::npos)
      << r.output;
}

TEST(DDP, BuffersComeFromRankZeroBeforeEachStep) {
  // Each rank adds rank + 1 to a buffer in every training step; 6 steps.
  auto run = [](const std::string& broadcast) {
    return run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "6", "--count-buffer",
                       "--broadcast-buffers", broadcast});
  };
  auto synced = run("true");
  ASSERT_EQ(synced.exit_code, 0) << synced.output;
  EXPECT_EQ(result_value(synced.output, "seen_rank0"), "6") << synced.output;
  // Rank 0's 5 before the last step, then its own 2.
  EXPECT_EQ(result_value(synced.output, "seen_rank1"), "7") << synced.output;
  auto local = run("false");
  ASSERT_EQ(local.exit_code, 0) << local.output;
  EXPECT_EQ(result_value(local.output, "seen_rank1"), "12") << local.output;
}

TEST(DDP, SyncDistMetricsThatDifferAcrossRanksAreAnErrorNotAMixUp) {
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "20",
                       "--extra-metric-rank", "1", "--timeout", "30"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("differ across ranks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 0 logged train_loss (mean); rank 1 logged only_here (mean), "
                          "train_loss (mean)"),
            std::string::npos)
      << r.output;
}

// Every rank's loggers take global rank 0's directory at each stage's
// start (each rank picked the next free version of its own, whenever it
// first asked): the ranks' log_dir() agree, and the PyTorch profiler's
// traces of both ranks land in the run's one version directory (rank 1's
// went to a version_1 of its own, taken from the next run).
TEST(DDP, EveryRankLogsToGlobalRankZerosDirectory) {
  TempDir dir;
  // An earlier run's version: the next is version_1, on every rank.
  std::filesystem::create_directories(dir.file("fulgur_logs/version_0"));
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "4", "--csv-and-profiler",
                       "--timeout", "60", "--root", dir.path()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string version = dir.file("fulgur_logs/version_1");
  EXPECT_EQ(result_value(r.output, "log_dir_rank0"), version) << r.output;
  EXPECT_EQ(result_value(r.output, "log_dir_rank1"), version) << r.output;
  EXPECT_THAT(fulgur::test::list_files(version + "/profiler"),
              ::testing::IsSupersetOf({"fit-rank0.pt.trace.json", "fit-rank1.pt.trace.json"}));
  std::vector<std::string> versions;
  for (const auto& e : std::filesystem::directory_iterator(dir.file("fulgur_logs"))) {
    versions.push_back(e.path().filename().string());
  }
  EXPECT_THAT(versions, ::testing::UnorderedElementsAre("version_0", "version_1"));
}

// A fit resumed from a checkpoint of a run that logged under another root
// logs to a new version there; every rank takes it again after the
// checkpoint is read (each rank chose a version of its own there, after
// rank 0 may have made its directory). A fit resumed from its own run's
// checkpoint continues its metrics.csv, a row per step: rank 1's loggers
// also wrote it at each checkpoint (the resumed step's rows only, over
// rank 0's).
TEST(DDP, AResumeOfAnotherRootsRunLogsToOneVersionOnEveryRank) {
  TempDir dir;
  const std::string d = dir.path();
  auto run = [&](const std::string& root, const std::string& steps, std::vector<std::string> more) {
    std::vector<std::string> args = {"--strategy",
                                     "ddp",
                                     "--devices",
                                     "2",
                                     "--steps",
                                     steps,
                                     "--every-n-train-steps",
                                     "2",
                                     "--root",
                                     d + "/" + root,
                                     "--csv-and-profiler",
                                     "--timeout",
                                     "60"};
    args.insert(args.end(), more.begin(), more.end());
    return run_worker(args);
  };
  auto first = run("a", "2", {});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  std::filesystem::create_directories(d + "/b/fulgur_logs/version_0");
  auto r = run("b", "4", {"--ckpt-path", d + "/a/checkpoints/last.ckpt"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string version = d + "/b/fulgur_logs/version_1";
  EXPECT_EQ(result_value(r.output, "log_dir_rank0"), version) << r.output;
  EXPECT_EQ(result_value(r.output, "log_dir_rank1"), version) << r.output;
  std::vector<std::string> versions;
  for (const auto& e : std::filesystem::directory_iterator(d + "/b/fulgur_logs")) {
    versions.push_back(e.path().filename().string());
  }
  EXPECT_THAT(versions, ::testing::UnorderedElementsAre("version_0", "version_1"));
  EXPECT_TRUE(std::filesystem::exists(version + "/metrics.csv"));

  auto again = run("a", "8", {"--ckpt-path", d + "/a/checkpoints/last.ckpt"});
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(result_value(again.output, "log_dir_rank1"), d + "/a/fulgur_logs/version_0");
  // The steps of the rows of train_loss_step (the epoch's rows are others).
  const auto lines = fulgur::test::read_lines(d + "/a/fulgur_logs/version_0/metrics.csv");
  ASSERT_FALSE(lines.empty());
  const auto header = fulgur::test::split(lines[0], ',');
  const auto column = std::find(header.begin(), header.end(), "train_loss_step") - header.begin();
  std::vector<std::string> steps;
  for (size_t i = 1; i < lines.size(); ++i) {
    const auto cells = fulgur::test::split(lines[i], ',');
    if (column < static_cast<std::ptrdiff_t>(cells.size()) &&
        !cells[static_cast<size_t>(column)].empty()) {
      steps.push_back(cells[0]);
    }
  }
  EXPECT_THAT(steps, ::testing::ElementsAre("1", "2", "3", "4", "5", "6", "7", "8"))
      << fulgur::test::read_text(d + "/a/fulgur_logs/version_0/metrics.csv");
}

// Ranks that see other files (node-local disks: here rank 1's IO fails, or
// it gets another ckpt_path): a rank that cannot read the checkpoint
// stopped alone, its peer resumed and went into the fit's collectives
// (under torchrun or SLURM, to wait there until the timeout); ranks that
// find different checkpoints resumed different states. Now both are an
// error on every rank, naming what each found.
TEST(DDP, RanksThatFindOtherCheckpointsAreRefusedOnEveryRank) {
  TempDir dir;
  const std::string d = dir.path();
  auto run = [&](std::vector<std::string> more, const std::string& steps = "4") {
    std::vector<std::string> args = {
        "--strategy", "ddp",    "--devices", "2",         "--steps", steps, "--every-n-train-steps",
        "2",          "--root", d,           "--timeout", "120"};
    args.insert(args.end(), more.begin(), more.end());
    return run_worker(args);
  };
  auto first = run({});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string last = d + "/checkpoints/last.ckpt";
  ASSERT_TRUE(std::filesystem::exists(last));

  auto unread = run({"--ckpt-path", last, "--rank1-cannot-read"});
  EXPECT_NE(unread.exit_code, 0);
  EXPECT_THAT(unread.output,
              ::testing::HasSubstr(fulgur::str("rank 1 of 2 cannot read the checkpoint, so no rank "
                                               "resumes: cannot read \"",
                                               last, "\": Input/output error")))
      << unread.output;

  // "best" in a new process reads the checkpoint that records it; under a
  // sharded layout that read was the layout's collective load, made by
  // the ranks resolving "best" only (here rank 0), paired with rank 1's
  // agreement. Sharded checkpoints of fsdp: "best" resumes on both ranks,
  // and "best" on rank 0 against a fresh start on rank 1 is the error
  // below.
  auto sharded = [&](std::vector<std::string> more) {
    std::vector<std::string> args = {
        "--strategy", "fsdp",   "--devices", "2",         "--checkpoint", "--state-dict-type",
        "sharded",    "--root", d + "/fsdp", "--timeout", "120"};
    args.insert(args.end(), more.begin(), more.end());
    return run_worker(args);
  };
  auto trained = sharded({"--steps", "4"});
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  auto best = sharded({"--steps", "6", "--ckpt-path", "best"});
  EXPECT_EQ(best.exit_code, 0) << best.output;
  auto mixed = sharded({"--steps", "8", "--ckpt-path", "best", "--ckpt-path-rank1", ""});
  EXPECT_NE(mixed.exit_code, 0);
  EXPECT_THAT(mixed.output,
              ::testing::HasSubstr("rank 1 of 2 finds none (a fresh start), global rank 0 \""))
      << mixed.output;

  auto other = run({"--ckpt-path", last, "--ckpt-path-rank1", ""});
  EXPECT_NE(other.exit_code, 0);
  EXPECT_THAT(other.output,
              ::testing::HasSubstr(fulgur::str("rank 1 of 2 finds none (a fresh start), global "
                                               "rank 0 \"",
                                               last,
                                               "\". Every rank reads the "
                                               "checkpoint itself")))
      << other.output;

  // One save under another name on rank 1 (a node's own copy, another
  // mount) is the same checkpoint: both resume (and save step 6 as last).
  const std::string copy = d + "/copy.ckpt";
  std::filesystem::copy_file(last, copy);
  std::filesystem::copy_file(last, last + ".rank1");
  auto renamed = run({"--ckpt-path", last, "--ckpt-path-rank1", copy}, "6");
  EXPECT_EQ(renamed.exit_code, 0) << renamed.output;
  // Another save under the same name on rank 1's disk (a node-local copy
  // of step 4's last.ckpt, where rank 0's is step 6's): refused, naming
  // both files.
  const std::string step4 = last + ".rank1";
  auto stale = run({"--ckpt-path", last, "--rank1-disk-suffix", ".rank1"}, "8");
  EXPECT_NE(stale.exit_code, 0);
  const auto size_of = [](const std::string& p) {
    return std::to_string(std::filesystem::file_size(p));
  };
  EXPECT_THAT(stale.output, ::testing::HasSubstr(fulgur::str("rank 1 of 2 finds \"", last, "\" (",
                                                             size_of(step4), " bytes, CRC32C ")))
      << stale.output;
  EXPECT_THAT(stale.output, ::testing::HasSubstr(fulgur::str("global rank 0 another file at that "
                                                             "path (",
                                                             size_of(last), " bytes, CRC32C ")))
      << stale.output;
}

// A metric object logged on one rank only, at a checkpoint in the middle
// of the epoch: every rank compares the names before the states'
// collectives (the rank that logged none too), so the save is the same
// error on every rank, not collectives that pair up wrongly (rank 1's
// callback-metrics exchange met rank 0's names: an InternalError, a name
// of garbage bytes).
TEST(DDP, AMetricObjectLoggedOnOneRankIsNamedAtACheckpoint) {
  TempDir dir;
  auto r =
      run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "6", "--metric-object-rank",
                  "0", "--every-n-train-steps", "2", "--timeout", "30", "--root", dir.path()});
  EXPECT_NE(r.exit_code, 0) << r.output;
  // Rank 1's line is prefixed (and quoted again by the launcher), rank 0's not.
  const std::string error =
      "ERROR metrics logged with sync_dist=true or as metric objects differ across ranks this "
      "epoch: rank 0 logged rank_metric (MeanMetric); rank 1 logged none.";
  EXPECT_THAT(r.output, ::testing::HasSubstr("[rank 1] " + error));
  EXPECT_GE(fulgur::test::count_occurrences(r.output, error), 2) << r.output;
  EXPECT_EQ(r.output.find("bug in fulgur"), std::string::npos) << r.output;
}

// A step value logged with sync_dist is reduced across ranks at each step
// (it was each rank's own: rank 0 read 0 and rank 1 read 10 where both
// should read their mean, 5).
TEST(DDP, SyncDistStepValuesAreReducedAtEveryStep) {
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "6", "--rank-step-metric",
                       "0", "--count-collectives"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* rank : {"0", "1"}) {
    EXPECT_EQ(result_value(r.output, std::string("rank_step_rank") + rank), "5") << r.output;
    EXPECT_EQ(result_value(r.output, std::string("rank_max_rank") + rank), "1") << r.output;
  }
  EXPECT_EQ(r.output.find("its step values are this rank's"), std::string::npos) << r.output;
  // A rank that logs none at a step (one without a loss there, say): the
  // others reduce without it (a mean over the ranks that logged), and it
  // keeps its last value; no error.
  auto skipped = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "6",
                             "--rank-step-metric", "0", "--rank-step-skip-at", "5"});
  ASSERT_EQ(skipped.exit_code, 0) << skipped.output;
  EXPECT_EQ(result_value(skipped.output, "rank_step_rank0"), "0") << skipped.output;
  EXPECT_EQ(result_value(skipped.output, "rank_max_rank0"), "0") << skipped.output;
  EXPECT_EQ(result_value(skipped.output, "rank_step_rank1"), "5") << skipped.output;
  // First logged after the epoch's first step, where the ranks agree whether
  // they reduce step values, and that step logged none (train_loss without
  // sync_dist): each rank's own, with a note (not a hang).
  auto late =
      run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "6", "--rank-step-metric", "1",
                  "--sync-dist", "false", "--count-collectives"});
  ASSERT_EQ(late.exit_code, 0) << late.output;
  EXPECT_EQ(result_value(late.output, "rank_step_rank1"), "10") << late.output;
  EXPECT_EQ(fulgur::test::count_occurrences(late.output,
                                            "log(\"rank_step\", sync_dist=true): "
                                            "its step values are this rank's"),
            1)
      << late.output;
  // A steady-state step reduces its values (one all-reduce per reduction:
  // the means, rank_max) and starts nothing else for them: the ranks'
  // names are agreed at the epoch's first step, not compared at every step
  // (an all-gather read back: a host sync per step on a GPU).
  for (const char* rank : {"0", "1"}) {
    const std::string name = std::string("collectives_per_step_rank") + rank;
    EXPECT_EQ(std::stoi(result_value(r.output, name)),
              std::stoi(result_value(late.output, name)) + 2)
        << r.output << late.output;
  }
  // First logged after the epoch's first step, which reduced others: that
  // step's value is the rank's own (the run of 2 steps ends there), the
  // count of such ranks rides in its reduction, and the ranks agree on the
  // new names at the next step, from which they are reduced; no note.
  for (const char* steps : {"2", "6"}) {
    SCOPED_TRACE(steps);
    auto added = run_worker(
        {"--strategy", "ddp", "--devices", "2", "--steps", steps, "--rank-step-metric", "1"});
    ASSERT_EQ(added.exit_code, 0) << added.output;
    const bool first = std::string(steps) == "2";
    EXPECT_EQ(result_value(added.output, "rank_step_rank0"), first ? "0" : "5") << added.output;
    EXPECT_EQ(result_value(added.output, "rank_step_rank1"), first ? "10" : "5") << added.output;
    EXPECT_EQ(added.output.find("its step values are this rank's"), std::string::npos)
        << added.output;
  }
  // Logged in on_train_batch_end, after the step's values were reduced
  // for that hook's callbacks: reduced with its own step (the step's row
  // follows those hooks). It was reduced with the next step's values, and
  // the last step's stayed each rank's own, unreduced: 10 and 16 after 6
  // steps where both ranks should read their mean, 11. Reduced in every
  // steady-state step: one all-reduce more than without it.
  auto at_batch_end =
      run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "6", "--rank-step-metric", "0",
                  "--batch-end-step-metric", "--count-collectives"});
  ASSERT_EQ(at_batch_end.exit_code, 0) << at_batch_end.output;
  for (const char* rank : {"0", "1"}) {
    EXPECT_EQ(result_value(at_batch_end.output, std::string("end_step_rank") + rank), "11")
        << at_batch_end.output;
    EXPECT_EQ(result_value(at_batch_end.output, std::string("rank_step_rank") + rank), "5")
        << at_batch_end.output;
    const std::string name = std::string("collectives_per_step_rank") + rank;
    EXPECT_EQ(std::stoi(result_value(at_batch_end.output, name)),
              std::stoi(result_value(r.output, name)) + 1)
        << r.output << at_batch_end.output;
  }
}

// EarlyStopping decides on rank 1 only (its metric, logged without
// sync_dist, gets worse; rank 0's gets better): every rank stops at the
// end of the same epoch.
TEST(DDP, EarlyStoppingOnOneRankStopsEveryRankAtTheSameStep) {
  TempDir dir;
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "1000", "--samples", "320",
                       "--early-stop-rank", "1", "--timeout", "30", "--root", dir.path()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 20 steps per epoch; rank 1's metric is worse at epoch 1 (patience 1).
  EXPECT_EQ(result_value(r.output, "global_step"), "40") << r.output;
  EXPECT_NE(r.output.find("EarlyStopping: another rank's EarlyStopping decided to stop"),
            std::string::npos)
      << r.output;
}

// The monitored metric logged on rank 1 only: every rank names it at the
// first check (rank 0 threw alone, and rank 1 waited in the decision's
// collective for it).
TEST(DDP, EarlyStoppingOnAMetricOneRankLacksIsAnErrorOnEveryRank) {
  TempDir dir;
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "1000", "--samples", "320",
                       "--early-stop-rank", "1", "--early-stop-metric-on-that-rank-only",
                       "--timeout", "60", "--root", dir.path()});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::HasSubstr("EarlyStopping(monitor=\"es_metric\"): no metric of "
                                             "that name was logged on rank 0"))
      << r.output;
  EXPECT_THAT(r.output, ::testing::HasSubstr("another rank logged no metric of that name (this "
                                             "rank 1 did)"))
      << r.output;
}

// Rank 1 requests a stop (where `where` says); every rank must end after
// `steps` optimizer steps having run `batches` training steps. Each step
// adds rank + 1 to a buffer that rank 0 broadcasts before the next one, so
// rank 1 ends with rank 0's count from before its last step plus 2.
void expect_everyone_stops(std::vector<std::string> where, int steps, int batches) {
  std::vector<std::string> args = {"--strategy",  "ddp", "--devices", "2",  "--steps",       "20",
                                   "--stop-rank", "1",   "--timeout", "60", "--count-buffer"};
  args.insert(args.end(), where.begin(), where.end());
  auto r = run_worker(args, {}, 50s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(result_value(r.output, "global_step"), std::to_string(steps)) << r.output;
  EXPECT_EQ(result_value(r.output, "seen_rank0"), std::to_string(batches)) << r.output;
  EXPECT_EQ(result_value(r.output, "seen_rank1"), std::to_string(batches + 1)) << r.output;
}

TEST(DDP, AStopRequestedOnOneRankStopsEveryRank) {
  // Rank 1 calls request_stop() in batch 5 of 20: every rank ends after
  // that batch (6 steps), and the run succeeds instead of rank 0 waiting
  // for rank 1 in its next collective until the timeout.
  expect_everyone_stops({"--fault-step", "5"}, 6, 6);
}

TEST(DDP, AStopRequestedAfterBackwardIsAgreedAtTheNextBatch) {
  // The stop votes ride in each batch's gradient all-reduce: a request made
  // in on_train_batch_end of batch 5 is in batch 6's votes, so every rank
  // ends after batch 6 (7 steps), together.
  expect_everyone_stops({"--stop-in", "batch-end", "--fault-step", "5"}, 7, 7);
}

TEST(DDP, AStopRequestedInANoSyncMicroBatchIsAgreedAtTheStep) {
  // Batch 4 only accumulates (accumulate_grad_batches=2): no exchange to
  // vote in, so the request waits for batch 5's, which steps; every rank
  // ends there, after 3 optimizer steps (6 batches).
  expect_everyone_stops({"--accumulate", "2", "--fault-step", "4"}, 3, 6);
}

TEST(DDP, AStopRequestedInValidationStopsEveryRankBeforeTheNextBatch) {
  // A validation is a boundary: the ranks agree right after it, so a stop
  // requested from its metrics (as early stopping does) takes effect at
  // once, as on one process.
  expect_everyone_stops({"--val-every", "4", "--stop-in", "validation", "--fault-step", "4"}, 4, 4);
}

TEST(DDP, ManualOptimizationIsSynchronisedToo) {
  expect_equivalent({"--steps", "20", "--manual-optimization"}, "ddp");
}

TEST(DDP, ForkLauncherReturnsTrainedWeightsToTheCaller) {
  expect_equivalent({"--steps", "20", "--shuffle"}, "ddp_fork");
}

// A layer built in configure_model(), which the ranks run and the calling
// process did not: the trained weights came back to a module without it
// (a CheckpointError after the whole fit, its result lost).
TEST(DDP, ForkLauncherReturnsTheWeightsOfLayersBuiltInConfigureModel) {
  expect_equivalent({"--steps", "12", "--head-in-configure-model"}, "ddp_fork");
  // The calling process runs configure_model() only for layers it lacks
  // (its process group, its device are the ranks').
  for (const bool head_later : {true, false}) {
    std::vector<std::string> args = {"--strategy", "ddp_fork", "--devices", "2", "--steps", "4"};
    if (head_later) args.push_back("--head-in-configure-model");
    auto r = run_worker(args);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(result_value(r.output, "configure_model_calls"), head_later ? "1" : "0") << r.output;
  }
}

// Ranks whose modules differ (here a buffer one rank's configure_model adds)
// are named before any broadcast: unlike tensors were copied in part, or
// aborted the process in gloo, or waited for a peer forever.
TEST(DDP, RanksWithDifferentModulesAreNamedBeforeAnyBroadcast) {
  for (const char* strategy : {"ddp", "ddp_fork", "fsdp"}) {
    auto r = run_worker({"--strategy", strategy, "--devices", "2", "--steps", "4",
                         "--extra-buffer-rank", "1", "--timeout", "30"});
    EXPECT_NE(r.exit_code, 0) << strategy << "\n" << r.output;
    EXPECT_NE(r.output.find("differs across ranks: rank 1 has buffer extra_state ([3] Float), "
                            "which rank 0 has not"),
              std::string::npos)
        << strategy << "\n"
        << r.output;
    EXPECT_EQ(r.output.find("SIGABRT"), std::string::npos) << strategy << "\n" << r.output;
  }
}

TEST(DDP, ForkLauncherUpdatesTheCallersModelCheckpoint) {
  TempDir dir;
  auto r = run_worker({"--strategy", "ddp_fork", "--devices", "2", "--steps", "6", "--checkpoint",
                       "--root", dir.path()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto best = result_value(r.output, "callback_best");
  EXPECT_FALSE(best.empty()) << r.output;
  EXPECT_EQ(best, result_value(r.output, "result_best")) << r.output;
  EXPECT_EQ(result_value(r.output, "callback_dirpath"), dir.path() + "/checkpoints") << r.output;
  EXPECT_EQ(result_value(r.output, "callback_last"), dir.path() + "/checkpoints/last.ckpt")
      << r.output;
}

TEST(DDP, SyncBatchNormMatchesOneProcessBatchNorm) {
  // Batch statistics over both ranks' 8 samples = one process's 16.
  expect_equivalent({"--steps", "12", "--batchnorm", "sync"}, "ddp", {"--sync-batchnorm"});
}

TEST(DDP, WithoutSyncBatchNormEachRankNormalisesAlone) {
  // The control: per-rank statistics differ from the double batch's, so the
  // comparison above can fail.
  EXPECT_FALSE(expect_equivalent({"--steps", "12", "--batchnorm", "sync"}, "ddp", {},
                                 /*expect_same=*/false));
}

// ---- On CUDA: NCCL (scripts/gpu-check.sh runs these on a machine with GPUs;
// elsewhere they skip, saying how many GPUs they need).

TEST(DDP, NcclTwoRanksMatchOneProcess_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(2);
  expect_equivalent({"--steps", "12", "--accelerator", "cuda"}, "ddp");
}

TEST(DDP, NcclOnCudaMatchesGlooOnCpu_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(2);
  TempDir dir;
  const std::string gloo = dir.path() + "/gloo.pt";
  const std::string nccl = dir.path() + "/nccl.pt";
  for (const auto& [accelerator, out] : {std::pair{"cpu", gloo}, std::pair{"cuda", nccl}}) {
    auto r = run_worker({"--steps", "12", "--strategy", "ddp", "--devices", "2", "--batch", "8",
                         "--accelerator", accelerator, "--out", out, "--root", dir.path()});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(result_value(r.output, "process_group_backend"),
              std::string(accelerator) == "cuda" ? "nccl" : "gloo")
        << r.output;
  }
  // CUDA kernels sum in another order than the CPU's: close, not identical.
  EXPECT_TRUE(same_params(gloo, nccl, {.atol = 1e-4}));
}

TEST(DDP, SyncBatchNormOnCudaMatchesOneProcessBatchNorm_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(2);
  expect_equivalent({"--steps", "12", "--batchnorm", "sync", "--accelerator", "cuda"}, "ddp",
                    {"--sync-batchnorm"});
}

TEST(DDP, ForkLauncherOnCudaIsRefusedPointingToDdp_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(2);
  TempDir dir;
  auto r = run_worker(
      {"--strategy", "ddp_fork", "--devices", "2", "--accelerator", "cuda", "--root", dir.path()});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("forks its ranks, which cannot use CUDA"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Use strategy \"ddp\""), std::string::npos) << r.output;
}

// LibTorch 2.x refuses a backward in a process forked from one that has
// run a backward (its autograd engine's threads do not survive fork). A
// ddp_fork fit after a fit in the same process is refused before it forks,
// naming both ways out; after a backward of the program's own, each rank's
// failure says why. Every rank failed at its first step with LibTorch's
// message alone. LibTorch 1.x goes on. A test (no backward) forks as ever.
TEST(DDP, AForkLaunchAfterABackwardInTheLaunchingProcessIsNamed) {
  {
    TempDir dir;
    auto r = run_worker({"--strategy", "ddp_fork", "--devices", "2", "--backward-before", "fit",
                         "--skip-fit", "--test-samples", "64", "--root", dir.path()});
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }
  for (const char* before : {"fit", "raw"}) {
    SCOPED_TRACE(before);
    TempDir dir;
    auto r = run_worker({"--strategy", "ddp_fork", "--devices", "2", "--steps", "2",
                         "--backward-before", before, "--root", dir.path()});
    if (!FULGUR_TORCH_AT_LEAST(2, 0)) {
      EXPECT_EQ(r.exit_code, 0) << r.output;
      continue;
    }
    EXPECT_NE(r.exit_code, 0) << r.output;
    if (std::string(before) == "fit") {
      EXPECT_TRUE(fulgur::test::message_contains(
          r.output, {"fitted once in the launching process",
                     "strategy \"ddp_fork\" forks its ranks, and this process has already run a "
                     "training step",
                     "or use strategy \"ddp\""}))
          << r.output;
    } else {
      EXPECT_TRUE(fulgur::test::message_contains(
          r.output, {"rank 0 failed", "autograd's threading",
                     "had run a backward pass before fit()", "strategy \"ddp\""}))
          << r.output;
    }
  }
}

TEST(DDP, SyncBatchNormNamesLibTorchBatchNormLayers) {
  TempDir dir;
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--batchnorm", "plain",
                       "--sync-batchnorm", "--steps", "2", "--root", dir.path()});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(fulgur::test::message_contains(
      r.output,
      {"sync_batchnorm=true", "torch::nn::BatchNorm layers (bn)", "fulgur::nn::SyncBatchNorm"}));
}

TEST(DDP, UnusedParameterWithoutFindUnusedIsNamed) {
  TempDir dir;
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--unused-layer", "--steps", "4",
                       "--root", dir.path()});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("extra.weight"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ddp_find_unused_parameters_true"), std::string::npos) << r.output;
}

TEST(DDP, EvaluationIsExactOnOneTwoAndThreeRanks) {
  // The same (untrained, seeded) model evaluated on 1001 samples: 3 ranks
  // get 334, 334 and 333 of them, none twice.
  TempDir dir;
  std::vector<std::string> acc;
  for (std::string devices : {"1", "2", "3"}) {
    auto r = run_worker({"--strategy", devices == "1" ? "auto" : "ddp", "--devices", devices,
                         "--skip-fit", "--test-samples", "1001", "--root", dir.path()});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(result_value(r.output, "test_count"), "1001") << r.output;
    acc.push_back(result_value(r.output, "test_acc"));
  }
  ASSERT_FALSE(acc[0].empty());
  EXPECT_EQ(acc[0], acc[1]);
  EXPECT_EQ(acc[0], acc[2]);
}

// fulgur::metrics logged in test_step: every rank's states are combined
// before the value is computed, so macro accuracy, macro F1 and a
// one-vs-rest AUROC over 1001 samples (shards of 501/500 and 334/334/333)
// are the one-process values, and every sample counts once. Under fsdp
// (FULL_SHARD: the forward is collective, so evaluation is padded to
// 501+501 and 334x3), the padded repeats are left out.
TEST(DDP, MetricsAreExactOnOneTwoAndThreeRanksAndPaddingCountsOnce) {
  TempDir dir;
  struct Run {
    std::string strategy, devices;
  };
  std::vector<std::map<std::string, std::string>> values;
  for (const Run& run : {Run{"auto", "1"}, Run{"ddp", "2"}, Run{"ddp", "3"}, Run{"fsdp", "2"},
                         Run{"fsdp", "3"}}) {
    auto r = run_worker({"--strategy", run.strategy, "--devices", run.devices, "--skip-fit",
                         "--test-samples", "1001", "--root", dir.path()});
    ASSERT_EQ(r.exit_code, 0) << run.strategy << " x" << run.devices << ":\n" << r.output;
    std::map<std::string, std::string> v;
    // Every batch's rows, repeats included (a plain sum of the batch sizes):
    // the padded runs did see 1002.
    EXPECT_EQ(result_value(r.output, "test_count"), run.strategy == "fsdp" ? "1002" : "1001")
        << r.output;
    for (const char* key : {"exact_test_macro_acc", "exact_test_macro_f1", "exact_test_auroc",
                            "exact_test_samples"}) {
      v[key] = result_value(r.output, key);
      ASSERT_FALSE(v[key].empty()) << key << " missing:\n" << r.output;
    }
    values.push_back(v);
  }
  EXPECT_EQ(values[0]["exact_test_samples"], "1001");
  for (size_t i = 1; i < values.size(); ++i) {
    SCOPED_TRACE("run " + std::to_string(i));
    EXPECT_EQ(values[i]["exact_test_samples"], "1001");
    // Counts: the same integers, so the same double to the last bit.
    EXPECT_EQ(values[i]["exact_test_macro_acc"], values[0]["exact_test_macro_acc"]);
    EXPECT_EQ(values[i]["exact_test_macro_f1"], values[0]["exact_test_macro_f1"]);
    // Scores: batches of another composition may round a logit's last bit
    // differently; one sample counted twice or missed would move the area
    // by ~1e-6.
    EXPECT_NEAR(std::stod(values[i]["exact_test_auroc"]), std::stod(values[0]["exact_test_auroc"]),
                1e-9);
  }
}

TEST(DDP, FitThenTestShareTheProcessGroup) {
  for (std::string strategy : {"ddp", "ddp_fork"}) {
    TempDir dir;
    auto r = run_worker({"--strategy", strategy, "--devices", "2", "--steps", "6", "--test-samples",
                         "1001", "--root", dir.path()});
    ASSERT_EQ(r.exit_code, 0) << strategy << ":\n" << r.output;
    EXPECT_EQ(result_value(r.output, "test_count"), "1001") << strategy << ":\n" << r.output;
    EXPECT_EQ(result_value(r.output, "global_step"), "6") << strategy << ":\n" << r.output;
  }
}

TEST(DDP, EveryRanksSetupWaitsForTheNodesPrepareData) {
  // prepare_data() (local rank 0) takes 1.5 s to write the file that every
  // rank's setup() reads.
  TempDir dir;
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "4", "--prepare-seconds",
                       "1.5", "--root", dir.path()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(result_value(r.output, "global_step"), "4") << r.output;
}

TEST(ProcessGroup, StoreListensOnTheMainAddressOnly) {
  const int port = fulgur::find_free_port("127.0.0.1");
  auto group = fulgur::ProcessGroup::connect({.main_address = "127.0.0.1",
                                              .main_port = port,
                                              .world_size = 1,
                                              .rank = 0,
                                              .timeout = std::chrono::seconds(10)});
  // Another loopback address, same port: free unless the store listened
  // on every interface.
  int sock = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.2", &addr.sin_addr);
  EXPECT_EQ(::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0)
      << "port " << port << " is taken on 127.0.0.2: the store listens beyond 127.0.0.1";
  ::close(sock);
  // The group works: world size 1 collectives are identities.
  auto t = torch::tensor({1.0, 2.0});
  group->all_reduce_(t, fulgur::ReduceOp::kSum);
  EXPECT_TRUE(torch::equal(t, torch::tensor({1.0, 2.0})));
  EXPECT_EQ(group->broadcast_bytes("abc"), "abc");
}

TEST(DDPFaults, KilledRankStopsEveryProcessAndIsNamed) {
  TempDir dir;
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "1000", "--samples",
                       "100000", "--die-rank", "1", "--fault-step", "5", "--root", dir.path()},
                      {}, 60s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("killed by signal 9 (SIGKILL)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1 dies now"), std::string::npos) << r.output;
}

TEST(DDPFaults, ForkLauncherNamesTheKilledRank) {
  TempDir dir;
  auto r = run_worker({"--strategy", "ddp_fork", "--devices", "2", "--steps", "1000", "--samples",
                       "100000", "--die-rank", "0", "--fault-step", "3", "--root", dir.path()},
                      {}, 60s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
  EXPECT_NE(r.output.find("rank 0 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("SIGKILL"), std::string::npos) << r.output;
}

TEST(DDPFaults, HungRankIsNamedAtTheTimeout) {
  TempDir dir;
  auto r =
      run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "1000", "--samples", "100000",
                  "--hang-rank", "1", "--fault-step", "3", "--timeout", "4", "--root", dir.path()},
                 {}, 60s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("hung"), std::string::npos) << r.output;
  // Named at the 4 s timeout (plus start-up), not after minutes.
  EXPECT_LT(r.seconds, 45) << r.output;
}

TEST(DDPFaults, ARankStuckOnItsWayOutIsNamedOnceItsPeersFinished) {
  TempDir dir;
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "4", "--hang-at-exit-rank",
                       "1", "--timeout", "4", "--root", dir.path()},
                      {}, 90s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("still running"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("after rank 0 finished"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1 hangs on its way out"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 45) << r.output;
}

TEST(DDPFaults, ARankThatFailsOnItsOwnIsNamedNotAPeerBehindIt) {
  // Rank 1 sleeps after batch 2 (behind, not hung); rank 0 throws in batch
  // 3's training_step, outside any collective. Rank 0 is the cause.
  TempDir dir;
  auto r = run_worker(
      {"--strategy", "ddp", "--devices", "2", "--steps", "100", "--fail-rank", "0", "--slow-rank",
       "1", "--slow-seconds", "6", "--fault-step", "3", "--timeout", "30", "--root", dir.path()},
      {}, 90s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("launcher: rank 0 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 0 fails on its own now"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("hung"), std::string::npos) << r.output;
}

// A rank that leaves the fit with status 0 (an exit() on one rank): it is
// named as the cause, not the peer that waited for it (which exited with 1
// and was named alone).
TEST(DDPFaults, ARankThatExitsWithStatusZeroMidFitIsNamed) {
  for (const char* strategy : {"ddp", "ddp_fork"}) {
    TempDir dir;
    auto r =
        run_worker({"--strategy", strategy, "--devices", "2", "--steps", "100", "--exit-zero-rank",
                    "1", "--fault-step", "3", "--timeout", "30", "--root", dir.path()},
                   {}, 90s);
    EXPECT_NE(r.exit_code, 0) << strategy << "\n" << r.output;
    EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << strategy << "\n" << r.output;
    EXPECT_NE(r.output.find("left the fit early: it exited with status 0 while rank 0 still "
                            "waited for it"),
              std::string::npos)
        << strategy << "\n"
        << r.output;
  }
}

TEST(DDPFaults, TheCauseComesFromFailureRecordsNotFromWhatARankPrinted) {
  // Rank 1 fails on its own with an error whose text reads like a lost
  // peer's; rank 0 sleeps, behind it. The launcher knows from rank 1's
  // failure record that it failed on its own: rank 1 is the cause, and rank
  // 0 (behind, not hung) is not blamed.
  TempDir dir;
  const std::string looks_like_a_victim =
      ". A peer rank probably died or stopped responding (see the launcher's message about it), "
      "or the process_group_timeout passed.";
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "100", "--fail-rank", "1",
                       "--fail-text", looks_like_a_victim, "--slow-rank", "0", "--slow-seconds",
                       "6", "--fault-step", "3", "--timeout", "30", "--root", dir.path()},
                      {}, 90s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("launcher: rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1 fails on its own now"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("hung"), std::string::npos) << r.output;
}

TEST(DDPFaults, ARankThatIgnoresSigtermIsKilledAfterTheGracePeriod) {
  // Rank 0 dies while rank 1 sleeps 60 s outside any collective, ignoring
  // SIGTERM: the launcher's SIGKILL after the 5 s grace ends it.
  TempDir dir;
  auto r = run_worker({"--strategy",
                       "ddp",
                       "--devices",
                       "2",
                       "--steps",
                       "100",
                       "--die-rank",
                       "0",
                       "--slow-rank",
                       "1",
                       "--slow-seconds",
                       "60",
                       "--ignore-sigterm-rank",
                       "1",
                       "--fault-step",
                       "3",
                       "--timeout",
                       "120",
                       "--root",
                       dir.path()},
                      {}, 90s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("launcher: rank 0 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Stopped the other ranks: 1 (pid"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 40) << "rank 1 was not killed after the grace period:\n" << r.output;
}

TEST(DDPFaults, ALauncherInAProgramThatIgnoresSigchldStillSeesItsRanks) {
  // With SIGCHLD ignored the kernel would reap the ranks unseen; the
  // launcher supervises with the default disposition.
  TempDir dir;
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "4", "--ignore-sigchld",
                       "--timeout", "20", "--root", dir.path()},
                      {}, 60s);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(result_value(r.output, "global_step"), "4") << r.output;
}

TEST(DDPFaults, RanksReapedByAnotherPartOfTheProgramAreAClearError) {
  // The worker's thread blocked in waitpid(-1) and the supervisor race for
  // each rank's exit status; the thread nearly always wins, but on a loaded
  // machine the supervisor may see a rank's clean exit first (the run then
  // succeeds). So up to three runs: each either succeeds or fails with the
  // clear message, and at least one run must have its ranks reaped away.
  bool reaped_elsewhere = false;
  for (int attempt = 0; attempt < 3 && !reaped_elsewhere; ++attempt) {
    TempDir dir;
    auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "4", "--reap-elsewhere",
                         "--timeout", "20", "--root", dir.path()},
                        {}, 60s);
    if (r.exit_code == 0) {
      EXPECT_EQ(result_value(r.output, "global_step"), "4") << r.output;
      continue;
    }
    EXPECT_NE(r.output.find("ended, but another part of the program reaped it"), std::string::npos)
        << r.output;
    reaped_elsewhere = true;
  }
  EXPECT_TRUE(reaped_elsewhere) << "in three runs the supervisor saw every rank's exit itself";
}

TEST(DDPFaults, AForkLauncherWithoutAUsableTmpdirIsAClearError) {
  TempDir dir;
  const std::string missing = dir.path() + "/no-such-directory";
  auto r =
      run_worker({"--strategy", "ddp_fork", "--devices", "2", "--steps", "4", "--root", dir.path()},
                 {{"TMPDIR", missing}}, 60s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("cannot create a temporary file for rank 0's results in " + missing +
                          " (TMPDIR)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("Set TMPDIR to a writable directory"), std::string::npos) << r.output;
}

TEST(DDPFaults, MainAddressOfAnotherMachineIsAClearError) {
  TempDir dir;
  // 192.0.2.1 is TEST-NET-1: never an address of this machine.
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "4", "--root", dir.path(),
                       "--timeout", "10"},
                      {{"MASTER_ADDR", "192.0.2.1"}, {"MASTER_PORT", "29533"}}, 60s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("is not an address of this machine"), std::string::npos) << r.output;
}

TEST(DDPFaults, MainPortInUseIsAClearError) {
  TempDir dir;
  // Hold a listening socket on the port the ranks are told to use.
  int sock = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(sock, 1), 0);
  socklen_t len = sizeof addr;
  ::getsockname(sock, reinterpret_cast<sockaddr*>(&addr), &len);
  const std::string port = std::to_string(ntohs(addr.sin_port));
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "4", "--root", dir.path(),
                       "--timeout", "10"},
                      {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}}, 60s);
  ::close(sock);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("main port " + port + " (MASTER_PORT) on 127.0.0.1 is already in use"),
            std::string::npos)
      << r.output;
}

TEST(DDPFaults, UnresolvableMainAddressIsAClearError) {
  TempDir dir;
  auto r = run_worker({"--strategy", "ddp", "--devices", "2", "--steps", "4", "--root", dir.path(),
                       "--timeout", "10"},
                      {{"MASTER_ADDR", "no-such-host.invalid"}, {"MASTER_PORT", "29534"}}, 60s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("does not resolve"), std::string::npos) << r.output;
}

}  // namespace
