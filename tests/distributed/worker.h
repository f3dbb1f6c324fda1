// Runs tests/distributed/ddp_worker.cpp (FULGUR_DDP_WORKER) with `args`
// under a time limit, expecting it to finish and leave no process behind;
// and compares a multi-rank run with one process.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "fulgur/callbacks/prediction_writer.h"
#include "support/process.h"
#include "support/test_support.h"

namespace fulgur::test {

// The argv of the launch tests' run (12 shuffled Adam steps) with `extra`,
// rank 0 writing its parameters to `out`, logs and checkpoints under `root`.
inline std::vector<std::string> launch_worker(const std::vector<std::string>& extra,
                                              const std::string& out, const std::string& root) {
  std::vector<std::string> args = {FULGUR_DDP_WORKER, "--steps",     "12",
                                   "--shuffle",       "--optimizer", "adam"};
  args.insert(args.end(), extra.begin(), extra.end());
  for (const std::string& s : {std::string("--out"), out, std::string("--root"), root}) {
    args.push_back(s);
  }
  return args;
}

inline ProcessResult run_worker(std::vector<std::string> args,
                                std::map<std::string, std::string> env = {},
                                std::chrono::seconds timeout = std::chrono::seconds(120)) {
  args.insert(args.begin(), FULGUR_DDP_WORKER);
  auto r = run_process(args, env, timeout);
  EXPECT_FALSE(r.timed_out) << "the worker did not finish in " << timeout.count() << " s:\n"
                            << r.output;
  EXPECT_EQ(r.leftover_processes, 0) << "processes were left running:\n" << r.output;
  return r;
}

// One process with batch 2b against two ranks with batch b each (the two
// ranks also get `multi_only`). Returns whether the parameters matched.
inline bool expect_equivalent(const std::vector<std::string>& common, const std::string& strategy,
                              const std::vector<std::string>& multi_only = {},
                              bool expect_same = true) {
  TempDir dir;
  const std::string single = dir.path() + "/single.pt";
  const std::string multi = dir.path() + "/multi.pt";
  auto one = run_worker([&] {
    auto a = common;
    for (std::string s : {"--devices", "1", "--batch", "16", "--out", single.c_str(), "--root",
                          dir.path().c_str()}) {
      a.push_back(s);
    }
    return a;
  }());
  EXPECT_EQ(one.exit_code, 0) << one.output;
  if (one.exit_code != 0) return false;
  auto two = run_worker([&] {
    auto a = common;
    a.insert(a.end(), multi_only.begin(), multi_only.end());
    for (std::string s : {"--strategy", strategy.c_str(), "--devices", "2", "--batch", "8", "--out",
                          multi.c_str(), "--root", dir.path().c_str()}) {
      a.push_back(s);
    }
    return a;
  }());
  EXPECT_EQ(two.exit_code, 0) << two.output;
  if (two.exit_code != 0) return false;
  EXPECT_EQ(result_value(two.output, "world_size"), "2") << two.output;
  EXPECT_EQ(result_value(two.output, "global_step"), result_value(one.output, "global_step"));
  auto same = same_params(single, multi);
  if (expect_same) {
    EXPECT_TRUE(same) << two.output;
  }
  return static_cast<bool>(same);
}

// 30 optimizer steps over 20 steps per epoch (an epoch boundary inside),
// Adam (whose state counts steps), shuffled, deterministic, a checkpoint
// every 4 steps: the run every recovery test compares against.
inline std::vector<std::string> recovery_training(const std::string& strategy, int seed,
                                                  const std::string& dir, const std::string& name) {
  return {"--strategy",
          strategy,
          "--devices",
          strategy == "auto" ? "1" : "2",
          "--batch",
          strategy == "auto" ? "16" : "8",
          "--steps",
          "30",
          "--samples",
          "320",
          "--shuffle",
          "--optimizer",
          "adam",
          "--deterministic",
          "--seed",
          std::to_string(seed),
          "--every-n-train-steps",
          "4",
          "--timeout",
          "60",
          "--root",
          dir + "/" + name,
          "--out",
          dir + "/" + name + ".pt",
          "--out-optimizer",
          dir + "/" + name + "-optimizer.pt"};
}

// Two ranks reading their own parts of the data (use_distributed_sampler
// false, the worker's UnevenData): rank 1's loaders are given
// --uneven-samples more samples (`more` says which loader, how many and how
// read), batches of 16 of 64 samples, 60 s for a collective. Writes its
// parameters to <dir>/<name>.pt and its files under <dir>/<name>.
inline std::vector<std::string> uneven_ranks(const std::string& strategy, const std::string& dir,
                                             const std::string& name,
                                             const std::vector<std::string>& more) {
  std::vector<std::string> args = {"--strategy",
                                   strategy,
                                   "--devices",
                                   "2",
                                   "--batch",
                                   "16",
                                   "--samples",
                                   "64",
                                   "--distributed-sampler",
                                   "false",
                                   "--uneven-rank",
                                   "1",
                                   "--timeout",
                                   "60",
                                   "--deterministic",
                                   "--root",
                                   dir + "/" + name,
                                   "--out",
                                   dir + "/" + name + ".pt"};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

// Parameters and optimizer state bit-identical to the run named `reference`.
inline void expect_identical_runs(const std::string& dir, const std::string& reference,
                                  const std::string& name) {
  EXPECT_TRUE(same_params(dir + "/" + reference + ".pt", dir + "/" + name + ".pt", {.exact = true}))
      << name;
  EXPECT_TRUE(same_params(dir + "/" + reference + "-optimizer.pt",
                          dir + "/" + name + "-optimizer.pt", {.exact = true}))
      << name;
}

// The worker's predictions without training (--skip-fit) of `samples`
// samples on `devices` ranks of `strategy` (with `extra`), each rank writing
// with a PredictionFileWriter into dir/`name`, read back; undefined when
// the run failed (the failure is reported). `run`: the worker's result.
inline at::Tensor worker_predictions(const TempDir& dir, const std::string& name,
                                     const std::string& strategy, int devices, int64_t samples,
                                     const std::vector<std::string>& extra, ProcessResult* run) {
  std::vector<std::string> args = {"--skip-fit",
                                   "--strategy",
                                   strategy,
                                   "--devices",
                                   std::to_string(devices),
                                   "--predict-dir",
                                   dir.file(name),
                                   "--predict-samples",
                                   std::to_string(samples),
                                   "--root",
                                   dir.path()};
  args.insert(args.end(), extra.begin(), extra.end());
  *run = run_worker(args, {}, std::chrono::seconds(60));
  EXPECT_EQ(run->exit_code, 0) << run->output;
  if (run->exit_code != 0) return at::Tensor();
  return fulgur::PredictionFileWriter::read(dir.file(name)).tensor();
}

}  // namespace fulgur::test
