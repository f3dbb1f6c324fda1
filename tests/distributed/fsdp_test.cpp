// Sharded data parallel (fsdp_shard_grad_op, and fsdp with its layers
// declared as fulgur::nn::FSDPUnit) with real processes and Gloo over
// 127.0.0.1, through tests/distributed/ddp_worker.cpp: two ranks with batch
// b end with the parameters of one process with batch 2b (as DDP does),
// under SGD and Adam, accumulation, manual optimization, a layer some steps
// do not use, and clipping by the norm over every shard; a CNN (as DDP and
// one process); `fulgur checkpoint consolidate`; the fork launcher;
// a rank killed and restarted resumes from the sharded checkpoint and ends
// bit-identical to the run never stopped. Under FULL_SHARD a rank holds one
// unit's full parameters at a time.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "distributed/worker.h"
#include "support/test_support.h"

namespace {

using fulgur::test::expect_equivalent;
using fulgur::test::expect_identical_runs;
using fulgur::test::recovery_training;
using fulgur::test::result_value;
using fulgur::test::run_worker;
using fulgur::test::TempDir;
using fulgur::test::uneven_ranks;
using fulgur::test::worker_predictions;
using namespace std::chrono_literals;

constexpr const char* kFsdp = "fsdp_shard_grad_op";
constexpr const char* kFullShard = "fsdp";

std::vector<std::string> with_units(std::vector<std::string> args) {
  args.emplace_back("--fsdp-units");
  return args;
}

TEST(FSDP, ShardGradOpOnTwoRanksMatchesOneProcessWithTheDoubleBatch) {
  expect_equivalent({"--steps", "20"}, kFsdp);
}

// FULL_SHARD's forward gathers on every rank, so every rank predicts as
// many batches (21 samples in batches of 5: 11 each, one repeated); before,
// rank 0's third batch waited in a gather that rank 1, done after two, never
// joined.
TEST(FSDP, FullShardPredictsOnEveryRankAndReadsBackEachSampleOnce) {
  TempDir dir;
  fulgur::test::ProcessResult one, two;
  const at::Tensor single = worker_predictions(dir, "one", "auto", 1, 21, {"--fsdp-units"}, &one);
  const at::Tensor merged =
      worker_predictions(dir, "two", kFullShard, 2, 21, {"--fsdp-units"}, &two);
  ASSERT_TRUE(single.defined() && merged.defined());
  EXPECT_EQ(result_value(two.output, "predicted_rank0"), "11") << two.output;
  EXPECT_EQ(result_value(two.output, "predicted_rank1"), "11") << two.output;
  ASSERT_EQ(merged.sizes(), single.sizes());
  EXPECT_TRUE(torch::allclose(merged, single, /*rtol=*/1e-5, /*atol=*/1e-6));
}

// FULL_SHARD's forward gathers on every rank: validation loaders of other
// lengths (use_distributed_sampler=false, rank 1's 6 batches to rank 0's 4)
// are named at the first validation after the sanity check's 2 batches,
// before a gather could wait until the process-group timeout (60 s here).
// A rank with no validation batch at all (it skips the pass) is named too,
// at the sanity check. Under ddp, whose forward is each rank's own, the
// loaders of other lengths validate.
TEST(FSDP, FullShardNamesValidationLoadersOfDifferentLengthsWhereDdpRunsThem) {
  TempDir dir;
  auto run = [&](const std::string& strategy, const std::string& name, const std::string& extra) {
    return run_worker(
        uneven_ranks(strategy, dir.path(), name,
                     {"--steps", "8", "--fsdp-units", "--uneven-val", "--uneven-samples", extra}),
        {}, 90s);
  };
  auto sharded = run(kFullShard, "sharded", "32");
  EXPECT_NE(sharded.exit_code, 0) << sharded.output;
  EXPECT_THAT(sharded.output,
              ::testing::HasSubstr("the validation loader has a different number of batches on "
                                   "different ranks (rank 0: 4 batches; rank 1: 6 batches). "
                                   "Under fsdp every rank must evaluate as many batches"));
  EXPECT_THAT(sharded.output, ::testing::HasSubstr("or cap the pass with limit_val_batches=4."));
  EXPECT_LT(sharded.seconds, 45) << sharded.output;
  auto empty = run(kFullShard, "empty", "-64");
  EXPECT_NE(empty.exit_code, 0) << empty.output;
  EXPECT_THAT(empty.output,
              ::testing::HasSubstr("the validation loader has a different number of batches on "
                                   "different ranks (rank 0: 2 batches; rank 1: 0 batches)"));
  EXPECT_LT(empty.seconds, 45) << empty.output;
  auto ddp = run("ddp", "ddp", "32");
  EXPECT_EQ(ddp.exit_code, 0) << ddp.output;
}

// FULL_SHARD over validation loaders of unknown length (iterables: rank 1's
// has 6 batches, rank 0's 4): the ranks agree on each batch's look-ahead and
// both validate 4, so the averaged val_acc is the one of a run where rank 1
// has 4 batches too (before, rank 1's fifth forward waited in a gather);
// so do the training epochs and SWA's BatchNorm pass over the training data.
TEST(FSDP, FullShardValidatesLoadersOfUnknownLengthUpToTheShortestRanksEnd) {
  TempDir dir;
  auto run = [&](const std::string& name, std::vector<std::string> more) {
    more.insert(more.end(), {"--fsdp-units", "--iterable"});
    return run_worker(uneven_ranks(kFullShard, dir.path(), name, more), {}, 90s);
  };
  auto val = [&](const std::string& name, const std::string& extra) {
    return run(name,
               {"--steps", "8", "--uneven-val", "--uneven-samples", extra, "--sync-dist", "true"});
  };
  auto uneven = val("uneven", "32");
  ASSERT_EQ(uneven.exit_code, 0) << uneven.output;
  EXPECT_LT(uneven.seconds, 45) << uneven.output;
  auto even = val("even", "0");
  ASSERT_EQ(even.exit_code, 0) << even.output;
  EXPECT_FALSE(result_value(even.output, "val_acc").empty()) << even.output;
  EXPECT_EQ(result_value(uneven.output, "val_acc"), result_value(even.output, "val_acc"));
  // Training loaders of unknown length (6 batches and 4), and
  // StochasticWeightAveraging's last pass recomputing SyncBatchNorm's
  // statistics with FULL_SHARD's gathering forwards over them: it too ends
  // at the shortest rank's end, and the run ends as an even one does.
  auto swa = [&](const std::string& name, const std::string& extra) {
    return run(name, {"--steps", "12", "--uneven-samples", extra, "--batchnorm", "sync",
                      "--sync-batchnorm", "--swa-start", "1"});
  };
  auto swa_uneven = swa("swa_uneven", "32");
  ASSERT_EQ(swa_uneven.exit_code, 0) << swa_uneven.output;
  EXPECT_LT(swa_uneven.seconds, 45) << swa_uneven.output;
  auto swa_even = swa("swa_even", "0");
  ASSERT_EQ(swa_even.exit_code, 0) << swa_even.output;
  EXPECT_TRUE(fulgur::test::same_params(dir.path() + "/swa_even.pt", dir.path() + "/swa_uneven.pt",
                                        {.exact = true}));
}

TEST(FSDP, ShardGradOpWithShuffleAndAdamMatches) {
  expect_equivalent({"--steps", "20", "--shuffle", "--optimizer", "adam"}, kFsdp);
}

TEST(FSDP, GradientAccumulationReducesOncePerStepAndMatches) {
  expect_equivalent({"--steps", "10", "--accumulate", "2"}, kFsdp);
}

// Two optimizers, each stepping its half of the parameters (sharded each
// on its own), train as one SGD over all of them on one process.
TEST(FSDP, TwoOptimizersMatch) {
  expect_equivalent({"--steps", "10", "--optimizer", "split-sgd"}, kFsdp);
}

TEST(FSDP, ManualOptimizationMatches) {
  expect_equivalent({"--steps", "20", "--manual-optimization"}, kFsdp);
}

TEST(FSDP, ALayerSomeStepsDoNotUseMatches) {
  expect_equivalent({"--steps", "20", "--unused-layer"}, kFsdp);
}

// The clipping norm is over every rank's shard: the same as one process's
// over the whole gradient (a local norm would clip differently, and fail).
// A window no rank has a loss in is no step (zero_grad's zeros in the
// shards are no gradient: a step on them would move SGD's momentum), and a
// rank without a loss joins its peers' reduce-scatter with what it
// accumulated.
TEST(FSDP, ShardGradOpSkipsAStepNoRankHasALossForAndJoinsTheRest) {
  expect_equivalent({"--steps", "8", "--accumulate", "2", "--skip-ranks", "0,1", "--skip-at",
                     "3,6,7"},
                    kFsdp);
  expect_equivalent({"--steps", "20", "--skip-ranks", "1", "--skip-at", "3,8"}, kFsdp);
}

TEST(FSDP, ClippingByNormUsesTheNormOverEveryShard) {
  expect_equivalent({"--steps", "20", "--gradient-clip-val", "0.05"}, kFsdp);
}

TEST(FSDP, TheForkLauncherMatchesToo) {
  expect_equivalent({"--steps", "20", "--optimizer", "adam"}, "fsdp_shard_grad_op_fork");
}

TEST(FSDP, FullShardOnTwoRanksMatchesOneProcessWithTheDoubleBatch) {
  expect_equivalent(with_units({"--steps", "20"}), kFullShard);
}

TEST(FSDP, FullShardWithShuffleAndAdamMatches) {
  expect_equivalent(with_units({"--steps", "20", "--shuffle", "--optimizer", "adam"}), kFullShard);
}

// No reduce-scatter at the micro-batches that do not step: each unit's full
// gradients accumulate while its parameters are freed between uses.
TEST(FSDP, FullShardGradientAccumulationMatches) {
  expect_equivalent(with_units({"--steps", "10", "--accumulate", "2"}), kFullShard);
}

TEST(FSDP, FullShardManualOptimizationMatches) {
  expect_equivalent(with_units({"--steps", "20", "--manual-optimization"}), kFullShard);
}

// The unit some steps do not run has no gradient then: it is reduced with
// the rest at the end of the backward, and DDP's rule holds.
TEST(FSDP, FullShardALayerSomeStepsDoNotUseMatches) {
  expect_equivalent(with_units({"--steps", "20", "--unused-layer"}), kFullShard);
}
// With prefetch the order of the last step's forward guides the gathers:
// a layer used on even steps only is gathered ahead on the odd ones too
// (and released unused), accumulation runs two forwards per step, and the
// results are one process's. Under SHARD_GRAD_OP prefetch reduce-scatters
// each unit in backward (a unit some steps leave without gradients is
// reduced after it); a step one rank has no loss for is then an error on
// every rank.
TEST(FSDP, WithPrefetchEachStrategyMatchesWhenTheForwardOrderChanges) {
  for (const char* strategy : {kFullShard, kFsdp}) {
    SCOPED_TRACE(strategy);
    expect_equivalent(with_units({"--steps", "20", "--unused-layer"}), strategy, {"--prefetch"});
    expect_equivalent(with_units({"--steps", "10", "--accumulate", "2", "--optimizer", "adam"}),
                      strategy, {"--prefetch"});
  }
  TempDir dir;
  auto r = run_worker(with_units({"--strategy", kFsdp, "--prefetch", "--devices", "2", "--batch",
                                  "8", "--steps", "6", "--root", dir.path(), "--skip-ranks", "1",
                                  "--skip-at", "3", "--skip-after-forward"}));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      r.output, {"\"fsdp_shard_grad_op\" with prefetch", "returned no loss on 1 of 2 ranks",
                 "turn prefetch off"}));
}

// Rank 1 requests a stop (where `where` says); every rank ends after
// `steps` optimizer steps, having run `batches` training steps (its
// buffer, not broadcast under FSDP, counts rank + 1 a batch), together
// instead of rank 0 waiting alone in its next collective.
void expect_everyone_stops(const std::vector<std::string>& strategy,
                           const std::vector<std::string>& where, int steps, int batches) {
  std::vector<std::string> args = strategy;
  for (const char* arg : {"--devices", "2", "--steps", "20", "--stop-rank", "1", "--timeout", "60",
                          "--count-buffer"}) {
    args.emplace_back(arg);
  }
  args.insert(args.end(), where.begin(), where.end());
  auto r = run_worker(args, {}, 50s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(result_value(r.output, "global_step"), std::to_string(steps)) << r.output;
  EXPECT_EQ(result_value(r.output, "seen_rank0"), std::to_string(batches)) << r.output;
  EXPECT_EQ(result_value(r.output, "seen_rank1"), std::to_string(2 * batches)) << r.output;
}

// The stop votes ride in each step's agreement (under SHARD_GRAD_OP the
// one before its reduce-scatter, on which parameters have gradients; under
// FULL_SHARD the ranks' losses before the backward), as DDP's ride in its
// gradient all-reduce: a request made after batch 5's backward
// (on_train_batch_end) stops every rank after batch 6, and one made in a
// micro-batch that only accumulates (batch 4) at the step after it. Agreed
// after each batch on its own, as before, they stopped the ranks after
// batches 5 and 4.
TEST(FSDP, AStopRequestedOnOneRankIsAgreedInTheStepsAgreement) {
  for (const auto& strategy :
       {std::vector<std::string>{"--strategy", kFsdp}, with_units({"--strategy", kFullShard})}) {
    SCOPED_TRACE(strategy[1]);
    expect_everyone_stops(strategy, {"--stop-in", "batch-end", "--fault-step", "5"}, 7, 7);
    expect_everyone_stops(strategy, {"--accumulate", "2", "--fault-step", "4"}, 3, 6);
  }
}

// A steady-state step's collectives (its logged values not reduced):
// under SHARD_GRAD_OP one all-reduce agreeing which parameters have
// gradients (the stop votes in it), the reduce-scatter and the all-gather
// of the packed parameters (4 before: a stop vote of its own); under
// FULL_SHARD with two units, the agreement on the ranks' losses (the votes
// in it), each unit's all-gather before its forward and its backward, and
// its reduce-scatter (10 before: an agreement per unit, read back inside
// the backward, and a stop vote of its own).
TEST(FSDP, AStepStartsOneAgreementBesideItsGathersAndReduceScatters) {
  auto per_step = [](std::vector<std::string> args) {
    for (const char* arg :
         {"--devices", "2", "--steps", "6", "--count-collectives", "--sync-dist", "false"}) {
      args.emplace_back(arg);
    }
    auto r = run_worker(args);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const std::string rank0 = result_value(r.output, "collectives_per_step_rank0");
    EXPECT_EQ(rank0, result_value(r.output, "collectives_per_step_rank1")) << r.output;
    return rank0;
  };
  EXPECT_EQ(per_step({"--strategy", kFsdp}), "3");
  // Two optimizers: one agreement for both, then each one's reduce-scatter
  // and all-gather (6 with an agreement per optimizer).
  EXPECT_EQ(per_step({"--strategy", kFsdp, "--optimizer", "split-sgd"}), "5");
  EXPECT_EQ(per_step(with_units({"--strategy", kFullShard})), "7");
}

TEST(FSDP, FullShardClippingByNormMatches) {
  expect_equivalent(with_units({"--steps", "20", "--gradient-clip-val", "0.05"}), kFullShard);
}

TEST(FSDP, FullShardTheForkLauncherMatchesToo) {
  expect_equivalent(with_units({"--steps", "20", "--optimizer", "adam"}), "fsdp_fork");
}

// A frozen parameter inside a unit stays whole on every rank and never
// moves; the unit shards the rest.
TEST(FSDP, FullShardAFrozenParameterStaysWholeAndMatches) {
  expect_equivalent(with_units({"--steps", "20", "--frozen-bias"}), kFullShard);
  expect_equivalent({"--steps", "20", "--frozen-bias"}, kFsdp);
}

// Three ranks: every parameter's element count (16x32, 32, 32x4, 4) leaves
// the last rank a shorter, padded chunk. Batch 8 on each equals one
// process with batch 24.
TEST(FSDP, EachStrategyOnThreeRanksWithUnevenShardsMatchesOneProcess) {
  TempDir dir;
  const std::string single = dir.path() + "/single.pt", multi = dir.path() + "/multi.pt";
  const std::vector<std::string> common = {"--steps", "20", "--samples", "240", "--optimizer",
                                           "adam", "--fsdp-units", "--root", dir.path()};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), common.begin(), common.end());
    return more;
  };
  auto one = run_worker(with({"--devices", "1", "--batch", "24", "--out", single}));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto three = run_worker(
      with({"--strategy", kFullShard, "--devices", "3", "--batch", "8", "--out", multi}));
  ASSERT_EQ(three.exit_code, 0) << three.output;
  EXPECT_EQ(result_value(three.output, "world_size"), "3") << three.output;
  EXPECT_TRUE(fulgur::test::same_params(single, multi));
  // SHARD_GRAD_OP on the same 3 ranks (shards that are views of their
  // parameters, and padded copies for the last rank's chunks).
  const std::string grad_op = dir.path() + "/grad_op.pt";
  auto sgo = run_worker(
      with({"--strategy", kFsdp, "--devices", "3", "--batch", "8", "--out", grad_op}));
  ASSERT_EQ(sgo.exit_code, 0) << sgo.output;
  EXPECT_TRUE(fulgur::test::same_params(single, grad_op));
}

// The weight averages under each sharding strategy, where the optimizer
// steps shards and FULL_SHARD frees the units' parameters between their
// uses: an EMA (updated every step, validated with: its weights swapped in
// and out through the shards) and SWA (its rate annealed on the shards'
// optimizer, the average of two epochs' ends given to the module at the
// end) end with the parameters of one process with the double batch and of
// DDP, and the EMA's last validation loss (of the average, swapped in) is
// one process's. Each rank of ddp holds a whole average; each rank of fsdp
// its shards of it, half the model on two ranks (every parameter's element
// count is even).
TEST(FSDP, WeightAveragesEndAsOnOneProcessAndUnderDdpWithEachShardingStrategy) {
  TempDir dir;
  const std::string d = dir.path();
  for (const std::vector<std::string>& averaging :
       {std::vector<std::string>{"--ema", "0.8", "--val-every", "10"},
        std::vector<std::string>{"--swa-start", "2"}}) {
    const std::string kind = averaging[0].substr(2);
    std::map<std::string, double> val_loss;
    std::map<std::string, std::string> output;
    auto train = [&](const std::string& name, std::vector<std::string> args, bool average) {
      if (average) args.insert(args.end(), averaging.begin(), averaging.end());
      args.insert(args.end(), {"--steps", "60", "--samples", "320", "--root", d + "/" + kind + name,
                               "--out", d + "/" + kind + name + ".pt"});
      auto r = run_worker(args);
      EXPECT_EQ(r.exit_code, 0) << kind << " " << name << ":\n" << r.output;
      EXPECT_EQ(result_value(r.output, "global_step"), "60") << kind << " " << name << ":\n"
                                                             << r.output;
      const std::string loss = result_value(r.output, "val_loss");
      if (!loss.empty()) val_loss[name] = std::stod(loss);
      output[name] = r.output;
    };
    train("single", {"--devices", "1", "--batch", "16"}, true);
    train("ddp", {"--strategy", "ddp", "--devices", "2", "--batch", "8"}, true);
    train("shard_grad_op", {"--strategy", kFsdp, "--devices", "2", "--batch", "8"}, true);
    train("full_shard", {"--strategy", kFullShard, "--devices", "2", "--batch", "8", "--fsdp-units"},
          true);
    for (const char* other : {"ddp", "shard_grad_op", "full_shard"}) {
      EXPECT_TRUE(fulgur::test::same_params(d + "/" + kind + "single.pt",
                                            d + "/" + kind + other + ".pt"))
          << kind << " under " << other;
    }
    const std::string whole = result_value(output["single"], "parameter_elements");
    ASSERT_FALSE(whole.empty()) << output["single"];
    EXPECT_EQ(result_value(output["single"], "rank0_average_elements"), whole) << kind;
    for (const char* rank : {"rank0_average_elements", "rank1_average_elements"}) {
      EXPECT_EQ(result_value(output["ddp"], rank), whole) << kind << " " << rank;
      for (const char* sharded : {"shard_grad_op", "full_shard"}) {
        EXPECT_EQ(result_value(output[sharded], rank), std::to_string(std::stoll(whole) / 2))
            << kind << " under " << sharded << ", " << rank << ":\n" << output[sharded];
      }
    }
    if (kind == "ema") {
      ASSERT_EQ(val_loss.size(), 4u);
      for (const char* other : {"ddp", "shard_grad_op", "full_shard"}) {
        EXPECT_NEAR(val_loss[other], val_loss["single"], 1e-5 * val_loss["single"]) << other;
      }
    }
    // The average, not the last weights, is what the module ended with.
    train("plain", {"--devices", "1", "--batch", "16"}, false);
    EXPECT_FALSE(fulgur::test::same_params(d + "/" + kind + "single.pt", d + "/" + kind + "plain.pt"))
        << kind;
  }
}

// Under fsdp the EMA averages each rank's shards, and a checkpoint holds
// the average whole: two ranks resume from it (full and sharded layouts)
// and end bit-identical to the run never stopped, and one process that
// loads the last checkpoint ends with exactly the average that run gave its
// module.
TEST(FSDP, AnEmaAveragedInShardsIsSavedWholeAndResumesBitIdentical) {
  TempDir dir;
  const std::string d = dir.path();
  auto run = [&](const std::string& strategy, const std::string& devices, const std::string& batch,
                 const std::string& steps, const std::string& layout, const std::string& root,
                 std::vector<std::string> more) {
    std::vector<std::string> args = {
        "--strategy", strategy, "--devices", devices, "--batch", batch, "--steps", steps,
        "--optimizer", "adam", "--fsdp-units", "--ema", "0.8", "--every-n-train-steps", "10",
        "--state-dict-type", layout, "--samples", "960", "--root", d + "/" + root};
    args.insert(args.end(), more.begin(), more.end());
    auto r = run_worker(args);
    EXPECT_EQ(r.exit_code, 0) << root << ":\n" << r.output;
    return r;
  };
  run(kFullShard, "2", "8", "20", "full", "ref", {"--out", d + "/ref.pt"});
  for (const char* layout : {"full", "sharded"}) {
    SCOPED_TRACE(layout);
    const std::string part = std::string("part-") + layout;
    run(kFullShard, "2", "8", "10", layout, part, {});
    run(kFullShard, "2", "8", "20", layout, part,
        {"--ckpt-path", d + "/" + part + "/checkpoints/last.ckpt", "--out",
         d + "/" + part + ".pt"});
    EXPECT_TRUE(fulgur::test::same_params(d + "/ref.pt", d + "/" + part + ".pt", {.exact = true}));
  }
  // Nothing left to train: the loaded average goes to the module at the end.
  auto single = run("auto", "1", "16", "20", "full", "single",
                    {"--ckpt-path", d + "/ref/checkpoints/last.ckpt", "--out", d + "/single.pt"});
  EXPECT_EQ(result_value(single.output, "global_step"), "20") << single.output;
  EXPECT_TRUE(fulgur::test::same_params(d + "/ref.pt", d + "/single.pt", {.exact = true}));
}

// Rank 0 fails alone while validating with the EMA's average swapped in:
// putting the training weights back under fsdp is a collective its peer,
// waiting in validation's next collective, never joins. Rank 0 waits 10 s
// for it, keeps the average, says so, and the launcher names it as the
// cause (no hang).
TEST(FSDP, ARankFailingAloneWhileValidatingWithTheAverageKeepsItAndSaysWhy) {
  TempDir dir;
  auto r = run_worker({"--strategy", kFsdp, "--devices", "2", "--batch", "8", "--steps", "60",
                       "--samples", "320", "--ema", "0.8", "--val-every", "10", "--fail-rank", "0",
                       "--fail-in", "validation", "--fault-step", "10", "--timeout", "60", "--root",
                       dir.path()},
                      {}, 120s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 0 fails on its own in validation"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(std::string("EMA: rank 0 keeps the averaged weights it was validating "
                                      "with: under strategy \"") +
                          kFsdp + "\" putting the training weights back needs every rank, and "
                                  "not every rank failed here within 10 s."),
            std::string::npos)
      << r.output;
  // Rank 1 waited in validation's next collective for rank 0, which waited
  // for it: both give up, and rank 0 is the cause.
  EXPECT_NE(r.output.find("launcher: rank 0 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ERROR rank 0 fails on its own in validation"), std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
}

// The example's kind of model: convolutions (one a unit under FULL_SHARD)
// before the linear layers. Two ranks of each sharding strategy end with
// the parameters of DDP and of one process with the double batch, under
// Adam.
TEST(FSDP, ACnnTrainsAsDdpAndOneProcessUnderEachShardingStrategy) {
  TempDir dir;
  const std::string d = dir.path();
  auto train = [&](const std::string& name, std::vector<std::string> args) {
    args.insert(args.end(), {"--cnn", "--steps", "20", "--optimizer", "adam", "--root", d,
                             "--out", d + "/" + name + ".pt"});
    auto r = run_worker(args);
    EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
    EXPECT_EQ(result_value(r.output, "global_step"), "20") << name << ":\n" << r.output;
  };
  train("single", {"--devices", "1", "--batch", "16"});
  train("ddp", {"--strategy", "ddp", "--devices", "2", "--batch", "8"});
  train("shard_grad_op", {"--strategy", kFsdp, "--devices", "2", "--batch", "8"});
  train("full_shard", {"--strategy", kFullShard, "--devices", "2", "--batch", "8", "--fsdp-units"});
  for (const char* sharded : {"shard_grad_op", "full_shard"}) {
    EXPECT_TRUE(fulgur::test::same_params(d + "/single.pt", d + "/" + sharded + ".pt")) << sharded;
    EXPECT_TRUE(fulgur::test::same_params(d + "/ddp.pt", d + "/" + sharded + ".pt")) << sharded;
  }
}

// state_dict_type "full": rank 0 writes one file with every optimizer state
// gathered whole. One process loads it and holds exactly DDP's parameters
// and Adam moments; fsdp resumes from it on 2 ranks as if never stopped,
// and loads it on 3 (enough samples that step 20 is inside the first epoch
// of 3 ranks too).
TEST(FSDP, AFullStateDictIsOneFileThatLoadsOnAnyWorldSize) {
  TempDir dir;
  const std::string d = dir.path();
  auto run = [&](const std::string& strategy, const std::string& devices, const std::string& batch,
                 const std::string& steps, const std::string& root,
                 std::vector<std::string> more) {
    std::vector<std::string> args = {"--strategy", strategy, "--devices", devices, "--batch",
                                     batch, "--steps", steps, "--optimizer", "adam",
                                     "--fsdp-units", "--every-n-train-steps", "10",
                                     "--state-dict-type", "full", "--samples", "960", "--root",
                                     d + "/" + root};
    args.insert(args.end(), more.begin(), more.end());
    auto r = run_worker(args);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r;
  };
  run(kFullShard, "2", "8", "20", "ref", {"--out", d + "/ref.pt"});
  run(kFullShard, "2", "8", "10", "part", {});
  EXPECT_TRUE(std::filesystem::is_regular_file(d + "/part/checkpoints/last.ckpt"));
  run(kFullShard, "2", "8", "20", "part",
      {"--ckpt-path", d + "/part/checkpoints/last.ckpt", "--out", d + "/resumed.pt"});
  EXPECT_TRUE(fulgur::test::same_params(d + "/ref.pt", d + "/resumed.pt", {.exact = true}));

  auto ddp = run_worker({"--strategy", "ddp", "--devices", "2", "--batch", "8", "--steps", "20",
                         "--samples", "960", "--optimizer", "adam", "--root", d + "/ddp", "--out",
                         d + "/ddp.pt",
                         "--out-optimizer", d + "/ddp-optimizer.pt"});
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  const std::string last = d + "/ref/checkpoints/last.ckpt";
  run("auto", "1", "16", "20", "single",
      {"--ckpt-path", last, "--out", d + "/single.pt", "--out-optimizer",
       d + "/single-optimizer.pt"});
  EXPECT_TRUE(fulgur::test::same_params(d + "/ddp.pt", d + "/single.pt"));
  EXPECT_TRUE(
      fulgur::test::same_params(d + "/ddp-optimizer.pt", d + "/single-optimizer.pt"));
  run(kFullShard, "3", "8", "20", "three", {"--ckpt-path", last, "--out", d + "/three.pt"});
  EXPECT_TRUE(fulgur::test::same_params(d + "/ref.pt", d + "/three.pt", {.exact = true}));
}

// OnExceptionCheckpoint under fsdp, whose saves are collective: when every
// rank fails at the same step it saves the sharded checkpoint (which
// resumes); when one rank fails alone, its peers are in another collective,
// so it saves nothing and says so after its peer_timeout, instead of
// waiting the process group's timeout (10 minutes here) for them.
TEST(FSDP, OnExceptionCheckpointSavesWhenEveryRankFailsAndSkipsWhenOneDoes) {
  TempDir dir;
  const std::string d = dir.path();
  auto all = run_worker(with_units({"--strategy", kFullShard, "--devices", "2", "--batch", "8",
                                    "--steps", "10", "--root", d + "/all", "--fail-all",
                                    "--fault-step", "4", "--on-exception-checkpoint", "20",
                                    "--timeout", "600"}));
  EXPECT_NE(all.exit_code, 0) << all.output;
  EXPECT_NE(all.output.find("OnExceptionCheckpoint: saved"), std::string::npos) << all.output;
  const std::string saved = d + "/all/checkpoints/on_exception.ckpt";
  EXPECT_TRUE(std::filesystem::exists(saved + "/manifest.txt")) << all.output;
  auto resumed = run_worker(with_units({"--strategy", kFullShard, "--devices", "2", "--batch",
                                        "8", "--steps", "10", "--root", d + "/all",
                                        "--ckpt-path", saved}));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(result_value(resumed.output, "global_step"), "10") << resumed.output;

  auto one = run_worker(with_units({"--strategy", kFullShard, "--devices", "2", "--batch", "8",
                                    "--steps", "10", "--root", d + "/one", "--fail-rank", "1",
                                    "--fault-step", "4", "--on-exception-checkpoint", "2",
                                    "--timeout", "600"}));
  EXPECT_NE(one.exit_code, 0) << one.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      one.output, {"rank 1 fails on its own now", "OnExceptionCheckpoint: not saving",
                   "not every rank reached this point within 2 s"}));
  EXPECT_FALSE(std::filesystem::exists(d + "/one/checkpoints/on_exception.ckpt"));
}

// sync_batchnorm: two ranks with fulgur::nn::SyncBatchNorm normalise as one
// process's BatchNorm over the double batch, under each sharding strategy;
// a step one rank has no loss for is the same error on every rank (its
// peers' backward reduces the statistics' gradients).
TEST(FSDP, SyncBatchNormMatchesOneProcessBatchNormUnderEachShardingStrategy) {
  expect_equivalent({"--steps", "12", "--batchnorm", "sync"}, kFsdp, {"--sync-batchnorm"});
  // (SGD: fc1's bias feeds the normalisation, so its true gradient is 0
  // and Adam would scale rounding noise up to whole steps, under ddp too.)
  expect_equivalent(with_units({"--steps", "12", "--batchnorm", "sync"}), kFullShard,
                    {"--sync-batchnorm"});
  TempDir dir;
  auto r = run_worker({"--strategy", kFsdp, "--devices", "2", "--batch", "8", "--steps", "6",
                       "--batchnorm", "sync", "--sync-batchnorm", "--root", dir.path(),
                       "--skip-ranks", "1", "--skip-at", "3", "--skip-after-forward"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_GE(fulgur::test::count_occurrences(r.output, "returned no loss on 1 of 2 ranks"), 2)
      << r.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      r.output, {"sync_batchnorm=true", "SyncBatchNorm reduces across ranks in backward",
                 "turn sync_batchnorm off"}));
}

// StochasticWeightAveraging's last pass recomputes the BatchNorm statistics
// of the averaged weights with forwards over the training data: under each
// sharding strategy (FULL_SHARD's forwards gather their units) with
// SyncBatchNorm, two ranks end with the parameters and the statistics of one
// process with the double batch.
TEST(FSDP, SwaRecomputesSyncBatchNormStatisticsAsOneProcessUnderEachShardingStrategy) {
  const std::vector<std::string> swa = {"--steps",     "60",   "--samples",     "320",
                                        "--batchnorm", "sync", "--swa-start", "2"};
  expect_equivalent(swa, kFsdp, {"--sync-batchnorm"});
  expect_equivalent(with_units(swa), kFullShard, {"--sync-batchnorm"});
}

// `fulgur checkpoint consolidate`: the sharded checkpoint of 3 ranks
// (uneven shards, Adam, a frozen parameter in the optimizer) made one file
// loads into one process exactly as the full checkpoint of the same step
// does, and trains on from it identically (and so does fsdp on 2 ranks with
// its default sharded layout). It never replaces a file, and
// says what to pass instead of a one-file checkpoint.
TEST(FSDP, AShardedCheckpointConsolidatesIntoTheFullOne) {
  TempDir dir;
  const std::string d = dir.path();
  for (const char* type : {"sharded", "full"}) {
    auto r = run_worker({"--strategy", kFullShard, "--devices", "3", "--batch", "8", "--steps",
                         "10", "--optimizer", "adam", "--fsdp-units", "--frozen-bias",
                         "--every-n-train-steps", "10", "--state-dict-type", type, "--samples",
                         "960", "--root", d + "/" + type});
    ASSERT_EQ(r.exit_code, 0) << type << ":\n" << r.output;
  }
  const std::string sharded = d + "/sharded/checkpoints/last.ckpt";
  const std::string consolidated = d + "/consolidated.ckpt";
  ASSERT_TRUE(std::filesystem::is_directory(sharded));
  auto inspected = fulgur::test::run_process({FULGUR_CLI, "checkpoint", "inspect", sharded}, {},
                                             120s);
  EXPECT_EQ(inspected.exit_code, 0) << inspected.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      inspected.output, {"3 shard(s)", "strategy fsdp, sharded", "fulgur checkpoint consolidate"}));
  auto c = fulgur::test::run_process(
      {FULGUR_CLI, "checkpoint", "consolidate", sharded, consolidated}, {}, 120s);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  for (const std::string source : {"full", "consolidated"}) {
    const std::string ckpt =
        source == "full" ? d + "/full/checkpoints/last.ckpt" : consolidated;
    auto r = run_worker({"--devices", "1", "--batch", "24", "--steps", "20", "--optimizer",
                         "adam", "--frozen-bias", "--samples", "960", "--root",
                         d + "/single-" + source, "--ckpt-path", ckpt, "--out",
                         d + "/" + source + ".pt", "--out-optimizer",
                         d + "/" + source + "-optimizer.pt"});
    ASSERT_EQ(r.exit_code, 0) << source << ":\n" << r.output;
  }
  EXPECT_TRUE(fulgur::test::same_params(d + "/full.pt", d + "/consolidated.pt", {.exact = true}));
  EXPECT_TRUE(fulgur::test::same_params(d + "/full-optimizer.pt", d + "/consolidated-optimizer.pt",
                                        {.exact = true}));
  // fsdp with its sharded layout resumes from the one file too (it takes
  // each rank's shards from it), on another world size, as from the full one.
  for (const std::string source : {"full", "consolidated"}) {
    const std::string ckpt =
        source == "full" ? d + "/full/checkpoints/last.ckpt" : consolidated;
    auto r = run_worker({"--strategy", kFullShard, "--devices", "2", "--batch", "12", "--steps",
                         "20", "--optimizer", "adam", "--fsdp-units", "--frozen-bias",
                         "--state-dict-type", "sharded", "--samples", "960", "--root",
                         d + "/fsdp-" + source, "--ckpt-path",
                         ckpt, "--out", d + "/fsdp-" + source + ".pt"});
    ASSERT_EQ(r.exit_code, 0) << source << ":\n" << r.output;
  }
  EXPECT_TRUE(
      fulgur::test::same_params(d + "/fsdp-full.pt", d + "/fsdp-consolidated.pt", {.exact = true}));

  auto again = fulgur::test::run_process(
      {FULGUR_CLI, "checkpoint", "consolidate", sharded, consolidated}, {}, 120s);
  EXPECT_EQ(again.exit_code, 1) << again.output;
  EXPECT_TRUE(fulgur::test::message_contains(again.output, {consolidated, "exists", "never replaces"}));
  auto file = fulgur::test::run_process(
      {FULGUR_CLI, "checkpoint", "consolidate", consolidated, d + "/twice.ckpt"}, {}, 120s);
  EXPECT_EQ(file.exit_code, 1) << file.output;
  EXPECT_TRUE(fulgur::test::message_contains(file.output, {"is a file", "whole already"}));
  EXPECT_FALSE(std::filesystem::exists(d + "/twice.ckpt"));
  // Not into the checkpoint it is made from.
  auto inside = fulgur::test::run_process(
      {FULGUR_CLI, "checkpoint", "consolidate", sharded, sharded + "/whole.ckpt"}, {}, 120s);
  EXPECT_EQ(inside.exit_code, 1) << inside.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      inside.output, {"is inside the sharded checkpoint", "Write it beside the checkpoint"}))
      << inside.output;
  EXPECT_FALSE(std::filesystem::exists(sharded + "/whole.ckpt"));

  // A damaged shard is named, and nothing is written.
  const std::string broken = d + "/broken.ckpt";
  std::filesystem::copy(sharded, broken);
  const std::string shard = broken + "/rank-1-of-3.ckpt";
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(std::filesystem::file_size(shard) / 2));
    const char byte = static_cast<char>(f.get() ^ 0x5a);
    f.seekp(static_cast<std::streamoff>(std::filesystem::file_size(shard) / 2));
    f.put(byte);
  }
  auto damaged = fulgur::test::run_process(
      {FULGUR_CLI, "checkpoint", "consolidate", broken, d + "/from-broken.ckpt"}, {}, 120s);
  EXPECT_EQ(damaged.exit_code, 1) << damaged.output;
  EXPECT_TRUE(fulgur::test::message_contains(damaged.output, {"rank-1-of-3.ckpt", "corrupt"}));
  EXPECT_FALSE(std::filesystem::exists(d + "/from-broken.ckpt"));
  // So is one that is another shard (of this save, here: rank 0's in rank 1's place).
  const std::string swapped = d + "/swapped.ckpt";
  std::filesystem::copy(sharded, swapped);
  std::filesystem::copy_file(swapped + "/rank-0-of-3.ckpt", swapped + "/rank-1-of-3.ckpt",
                             std::filesystem::copy_options::overwrite_existing);
  auto foreign = fulgur::test::run_process(
      {FULGUR_CLI, "checkpoint", "consolidate", swapped, d + "/from-swapped.ckpt"}, {}, 120s);
  EXPECT_EQ(foreign.exit_code, 1) << foreign.output;
  EXPECT_TRUE(fulgur::test::message_contains(
      foreign.output, {"mixes saves: its shard rank-1-of-3.ckpt", "is not the one its save wrote"}));
  EXPECT_FALSE(std::filesystem::exists(d + "/from-swapped.ckpt"));
  // So is a missing one, before any shard is read.
  std::filesystem::remove(broken + "/rank-2-of-3.ckpt");
  auto missing = fulgur::test::run_process(
      {FULGUR_CLI, "checkpoint", "consolidate", broken, d + "/from-broken.ckpt"}, {}, 120s);
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_TRUE(fulgur::test::message_contains(missing.output,
                                             {"is missing shard(s) rank-2-of-3.ckpt", "of the 3"}));
  EXPECT_FALSE(std::filesystem::exists(d + "/from-broken.ckpt"));
}

// bf16-mixed (autocast, fp32 parameters and gradients): the same steps as
// DDP's, whose ranks compute the same bf16 products (one process with the
// double batch would sum in another order).
TEST(FSDP, FullShardInBf16MixedTrainsAsDdpDoes) {
  TempDir dir;
  for (const char* strategy : {"ddp", kFullShard}) {
    auto r = run_worker(with_units({"--strategy", strategy, "--devices", "2", "--batch", "8",
                                    "--steps", "20", "--optimizer", "adam", "--precision",
                                    "bf16-mixed", "--root", dir.path(), "--out",
                                    dir.path() + "/" + strategy + ".pt"}));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("RESULT global_step=20"), std::string::npos) << r.output;
  }
  EXPECT_TRUE(fulgur::test::same_params(dir.path() + "/ddp.pt", dir.path() + "/fsdp.pt"));
}

// A step no rank has a loss for is skipped together (what earlier
// micro-batches accumulated is still reduced); a step some ranks have a
// loss for and others not is the same error on every rank, never a hang.
TEST(FSDP, FullShardSkipsAStepEveryRankSkipsAndRefusesAMixedOne) {
  expect_equivalent(with_units({"--steps", "8", "--accumulate", "2", "--skip-ranks", "0,1",
                                "--skip-at", "3,6,7"}),
                    kFullShard);
  TempDir dir;
  auto r = run_worker(with_units({"--strategy", kFullShard, "--devices", "2", "--batch", "8",
                                  "--steps", "6", "--root", dir.path(), "--skip-ranks", "1",
                                  "--skip-at", "3", "--skip-after-forward"}));
  EXPECT_NE(r.exit_code, 0) << r.output;
  // Each rank's error (the launcher repeats the first).
  EXPECT_GE(fulgur::test::count_occurrences(r.output, "returned no loss on 1 of 2 ranks"), 2)
      << r.output;
  EXPECT_NE(r.output.find("(this rank: a loss)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(this rank: none)"), std::string::npos) << r.output;
  // A rank that skips its forward too leaves its peers in a unit's gather:
  // the process group's timeout ends it, naming the collective.
  auto before = run_worker(with_units({"--strategy", kFullShard, "--devices", "2", "--batch", "8",
                                       "--steps", "6", "--root", dir.path(), "--skip-ranks", "1",
                                       "--skip-at", "3", "--timeout", "3"}));
  EXPECT_NE(before.exit_code, 0) << before.output;
  EXPECT_NE(before.output.find("process_group_timeout"), std::string::npos) << before.output;
}

// TensorBoard's parameter histograms read every parameter at the end of an
// epoch: the units are gathered around them (a released parameter has no
// elements, and would leave its histogram out).
TEST(FSDP, FullShardGathersTheParametersForTensorBoardHistograms) {
  TempDir dir;
  auto r = run_worker(with_units({"--strategy", kFullShard, "--devices", "2", "--batch", "8",
                                  "--steps", "6", "--samples", "48", "--root", dir.path(),
                                  "--histograms"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::string events;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir.path())) {
    if (entry.path().filename().string().rfind("events.out.tfevents", 0) == 0) {
      events += fulgur::test::read_text(entry.path().string());
    }
  }
  for (const char* tag : {"parameters/fc1.weight", "parameters/fc2.bias"}) {
    EXPECT_NE(events.find(tag), std::string::npos) << tag << "\n" << r.output;
  }
}

// Without declared units the strategy says so, and trains as SHARD_GRAD_OP.
TEST(FSDP, FullShardWithoutUnitsSaysSoAndMatches) {
  TempDir dir;
  auto r = run_worker({"--strategy", kFullShard, "--devices", "2", "--batch", "8", "--steps", "4",
                       "--root", dir.path()});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("declares no fulgur::nn::FSDPUnit"), std::string::npos) << r.output;
  expect_equivalent({"--steps", "20"}, kFullShard);
}

// Between steps a rank holds no unit's full parameters, and at most one
// unit's at any time without prefetch (fc1: 16x32 + 32 floats, the larger
// of the two), two with it (the next unit is gathered while one computes);
// its shards are half of every parameter. Prefetch changes no result.
TEST(FSDP, FullShardHoldsOneUnitsParametersAtATimeOrTwoWithPrefetch) {
  TempDir dir;
  const int64_t fc1 = (16 * 32 + 32) * 4, fc2 = (32 * 4 + 4) * 4;
  for (const bool prefetch : {false, true}) {
    SCOPED_TRACE(prefetch ? "prefetch" : "no prefetch");
    std::vector<std::string> args = {"--strategy", kFullShard, "--devices", "2", "--batch",
                                     "8", "--steps", "6", "--root", dir.path(), "--out",
                                     dir.path() + (prefetch ? "/with.pt" : "/without.pt")};
    if (prefetch) args.emplace_back("--prefetch");
    auto r = run_worker(with_units(args));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    for (const char* rank : {"rank0", "rank1"}) {
      EXPECT_EQ(result_value(r.output, std::string(rank) + "_held_parameter_bytes"), "0")
          << r.output;
      EXPECT_EQ(result_value(r.output, std::string(rank) + "_peak_parameter_bytes"),
                std::to_string(prefetch ? fc1 + fc2 : fc1))
          << r.output;
      EXPECT_EQ(result_value(r.output, std::string(rank) + "_shard_bytes"),
                std::to_string((fc1 + fc2) / 2))
          << r.output;
      // Each unit twice a step, before its forward and before its backward,
      // but the first forward (the module comes whole); a prefetch is the
      // gather it replaces.
      EXPECT_EQ(result_value(r.output, std::string(rank) + "_unit_gathers"),
                std::to_string(2 * 2 * 6 - 2))
          << r.output;
    }
  }
  EXPECT_TRUE(fulgur::test::same_params(dir.path() + "/with.pt", dir.path() + "/without.pt",
                                        {.exact = true}));
}

// A unit inside a checkpointed block (fulgur::nn::checkpoint around fc1's
// unit and tanh): the block's second run, in backward, gathers fc1 for the
// backward that follows too, so each unit is gathered twice a step as
// without the block (before, the second run released fc1 and its backward
// gathered it again: 3 a step; 4 with prefetch, which did not know the
// block's unit in the forward order). One unit is held at a time (two with
// prefetch), and two ranks train as one process. The same with that block
// inside another checkpointed block (--nested-checkpoint): the inner
// block's first run, inside the outer's second, keeps fc1 for the inner's
// second run and backward (before: 28 and 33 gathers here).
TEST(FSDP, FullShardAUnitInACheckpointedBlockIsGatheredOnceForItsSecondRunAndBackward) {
  TempDir dir;
  const int64_t fc1 = (16 * 32 + 32) * 4, fc2 = (32 * 4 + 4) * 4;
  const int steps = 6;
  for (const bool prefetch : {false, true}) {
    for (const bool nested : {false, true}) {
      SCOPED_TRACE(std::string(prefetch ? "prefetch" : "no prefetch") + (nested ? ", nested" : ""));
      std::vector<std::string> args = {"--strategy",
                                       kFullShard,
                                       "--devices",
                                       "2",
                                       "--batch",
                                       "8",
                                       "--steps",
                                       std::to_string(steps),
                                       "--root",
                                       dir.path(),
                                       "--checkpoint-activations"};
      if (prefetch) args.emplace_back("--prefetch");
      if (nested) args.emplace_back("--nested-checkpoint");
      auto r = run_worker(with_units(args));
      ASSERT_EQ(r.exit_code, 0) << r.output;
      for (const char* rank : {"rank0", "rank1"}) {
        EXPECT_EQ(result_value(r.output, std::string(rank) + "_unit_gathers"),
                  std::to_string(2 * 2 * steps - 2))
            << r.output;
        EXPECT_EQ(result_value(r.output, std::string(rank) + "_peak_parameter_bytes"),
                  std::to_string(prefetch ? fc1 + fc2 : fc1))
            << r.output;
      }
    }
  }
  const auto training =
      with_units({"--steps", "20", "--shuffle", "--optimizer", "adam", "--checkpoint-activations"});
  expect_equivalent(training, kFullShard);
  expect_equivalent(training, kFullShard, {"--prefetch"});
  auto nested = training;
  nested.emplace_back("--nested-checkpoint");
  expect_equivalent(nested, kFullShard, {"--prefetch"});
}

// The other way round, a unit around a fulgur::nn::Checkpoint of fc1: the
// unit gathers around the block as around any layer (its backward's gather
// comes before the block's second run), twice a step, and two ranks train
// as one process.
TEST(FSDP, FullShardAUnitAroundACheckpointedBlockIsGatheredTwiceAStepAndMatches) {
  TempDir dir;
  const int steps = 6;
  auto r = run_worker(
      with_units({"--strategy", kFullShard, "--devices", "2", "--batch", "8", "--steps",
                  std::to_string(steps), "--root", dir.path(), "--unit-around-checkpoint"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(result_value(r.output, "rank0_unit_gathers"), std::to_string(2 * 2 * steps - 2))
      << r.output;
  expect_equivalent(
      with_units({"--steps", "20", "--shuffle", "--optimizer", "adam", "--unit-around-checkpoint"}),
      kFullShard);
}

// FSDPOptions::auto_wrap_min_params: the model's layers held in a
// torch::nn::Sequential ("body": Linear 16->32, Tanh, Linear 32->4) become
// units when they have that many parameters (fc1: 544, fc2: 132), as
// declared units do: one unit's parameters held at a time, the same
// training as one process; after fit the Sequential runs its own entries.
TEST(FSDP, AutoWrapMakesUnitsOfASequentialsLayersAndMatches) {
  TempDir dir;
  const int64_t fc1 = (16 * 32 + 32) * 4, fc2 = (32 * 4 + 4) * 4;
  auto r = run_worker({"--strategy", kFullShard, "--devices", "2", "--batch", "8", "--steps", "6",
                       "--root", dir.path(), "--sequential", "--auto-wrap", "100"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("auto_wrap_min_params = 100 made units of body.0 (torch::nn::Linear, "
                          "544 parameters), body.2 (torch::nn::Linear, 132 parameters)."),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("declares no fulgur::nn::FSDPUnit"), std::string::npos) << r.output;
  for (const char* rank : {"rank0", "rank1"}) {
    EXPECT_EQ(result_value(r.output, std::string(rank) + "_held_parameter_bytes"), "0")
        << r.output;
    EXPECT_EQ(result_value(r.output, std::string(rank) + "_peak_parameter_bytes"),
              std::to_string(fc1))
        << r.output;
    EXPECT_EQ(result_value(r.output, std::string(rank) + "_shard_bytes"),
              std::to_string((fc1 + fc2) / 2))
        << r.output;
  }
  EXPECT_EQ(result_value(r.output, "body_entries_restored"), "1") << r.output;
  // Only fc1 reaches 200; none reaches 1000 (then the strategy says so).
  r = run_worker({"--strategy", kFullShard, "--devices", "2", "--batch", "8", "--steps", "2",
                  "--root", dir.path(), "--sequential", "--auto-wrap", "200"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("made units of body.0 (torch::nn::Linear, 544 parameters)."),
            std::string::npos)
      << r.output;
  r = run_worker({"--strategy", kFullShard, "--devices", "2", "--batch", "8", "--steps", "2",
                  "--root", dir.path(), "--sequential", "--auto-wrap", "1000"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("auto_wrap_min_params = 1000 made no unit"), std::string::npos)
      << r.output;
  // Under SHARD_GRAD_OP without prefetch units change nothing: it says so.
  r = run_worker({"--strategy", kFsdp, "--devices", "2", "--batch", "8", "--steps", "2", "--root",
                  dir.path(), "--sequential", "--auto-wrap", "100"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("auto_wrap_min_params = 100 has no effect here: under SHARD_GRAD_OP"),
            std::string::npos)
      << r.output;
  expect_equivalent({"--steps", "20", "--sequential"}, kFullShard, {"--auto-wrap", "100"});
  expect_equivalent({"--steps", "20", "--sequential", "--optimizer", "adam", "--accumulate", "2"},
                    kFullShard, {"--auto-wrap", "100", "--prefetch"});
}

// recovery_training's run (Adam, shuffled, deterministic, a sharded
// checkpoint every 4 steps); a rank SIGKILLed at step 13 and restarted
// resumes from the newest one.
void expect_bit_identical_after_a_kill(const std::string& strategy,
                                       const std::vector<std::string>& extra) {
  TempDir dir;
  const std::string d = dir.path();
  for (const auto& [name, more] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"reference", {}}, {"killed", {"--max-restarts", "1", "--kill", "1:13"}}}) {
    auto args = recovery_training(strategy, 5, d, name);
    args.insert(args.end(), extra.begin(), extra.end());
    args.insert(args.end(), more.begin(), more.end());
    auto r = run_worker(args);
    EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
    EXPECT_EQ(result_value(r.output, "global_step"), "30") << name << ":\n" << r.output;
    if (name == "killed") {
      EXPECT_NE(r.output.find("fulgur: restart 1 of 1"), std::string::npos) << r.output;
    }
  }
  // The checkpoints are directories of per-rank shards with a manifest.
  EXPECT_TRUE(std::filesystem::exists(d + "/killed/checkpoints/last.ckpt/manifest.txt"));
  expect_identical_runs(d, "reference", "killed");
}

TEST(FSDP, ARankKilledAndRestartedResumesFromTheShardedCheckpointBitIdentical) {
  expect_bit_identical_after_a_kill(kFsdp, {});
}

TEST(FSDP, FullShardARankKilledAndRestartedResumesBitIdentical) {
  expect_bit_identical_after_a_kill(kFullShard, {"--fsdp-units"});
}

}  // namespace
