// examples/sharded_embeddings under strategy = "manual": the model sharded
// over 2 ranks computes the same first forward pass and the same parameter
// updates as the unsharded model on 1 process with the same (double) batch,
// and its loss falls.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "support/process.h"
#include "support/test_support.h"

namespace {

using fulgur::test::load_tensors;
using fulgur::test::ProcessResult;
using fulgur::test::TempDir;
using namespace std::chrono_literals;

ProcessResult run_example(std::vector<std::string> args) {
  args.insert(args.begin(), FULGUR_SHARDED_EXAMPLE);
  auto r = fulgur::test::run_process(args, {}, 180s);
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.leftover_processes, 0) << r.output;
  return r;
}

// (ids, logits) of one or more files, ordered by sample id.
std::pair<at::Tensor, at::Tensor> by_id(const std::vector<std::string>& files) {
  std::vector<at::Tensor> ids, logits;
  for (const auto& f : files) {
    auto t = load_tensors(f);
    ids.push_back(t[0]);
    logits.push_back(t[1]);
  }
  auto all_ids = torch::cat(ids);
  auto order = all_ids.argsort();
  return {all_ids.index_select(0, order), torch::cat(logits).index_select(0, order)};
}

TEST(ShardedEmbeddings, TwoRanksMatchTheUnshardedModel) {
  TempDir dir;
  const std::string one = dir.path() + "/one", two = dir.path() + "/two";
  std::filesystem::create_directories(one);
  std::filesystem::create_directories(two);
  const std::vector<std::string> common = {"--rows",       "1000", "--dim",     "8",
                                           "--active_ids", "200",  "--samples", "256",
                                           "--max_steps",  "5",    "--lr",      "0.5"};
  auto args = [&](const std::string& devices, const std::string& batch, const std::string& out) {
    std::vector<std::string> a = common;
    for (const auto& s :
         {std::string("--devices"), devices, std::string("--batch"), batch, std::string("--dump"),
          out, std::string("--default_root_dir"), dir.path() + "/runs-" + devices}) {
      a.push_back(s);
    }
    return a;
  };
  auto r1 = run_example(args("1", "32", one));
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  auto r2 = run_example(args("2", "16", two));
  ASSERT_EQ(r2.exit_code, 0) << r2.output;

  // The first forward pass: the same logits for the same samples.
  auto [ids1, logits1] = by_id({one + "/first-logits-rank-0.pt"});
  auto [ids2, logits2] = by_id({two + "/first-logits-rank-0.pt", two + "/first-logits-rank-1.pt"});
  ASSERT_TRUE(torch::equal(ids1, ids2));
  EXPECT_TRUE(torch::allclose(logits1, logits2, 1e-5, 1e-6));

  // After 5 steps: both tables (shards put back together) and the MLP.
  auto p1 = load_tensors(one + "/params-rank-0.pt");
  auto p2a = load_tensors(two + "/params-rank-0.pt");
  auto p2b = load_tensors(two + "/params-rank-1.pt");
  ASSERT_EQ(p1.size(), p2a.size());
  for (size_t table : {0u, 1u}) {
    auto joined = torch::cat({p2a[table], p2b[table]});
    ASSERT_EQ(joined.sizes(), p1[table].sizes());
    EXPECT_TRUE(torch::allclose(joined, p1[table], 1e-4, 1e-6))
        << "table " << table << " differs by " << (joined - p1[table]).abs().max().item<double>();
  }
  for (size_t i = 2; i < p1.size(); ++i) {
    EXPECT_TRUE(torch::allclose(p2a[i], p1[i], 1e-4, 1e-6)) << "dense parameter " << i;
    EXPECT_TRUE(torch::equal(p2a[i], p2b[i])) << "replicas diverged: dense parameter " << i;
  }
}

TEST(ShardedEmbeddings, LossFallsOnTwoRanks) {
  TempDir dir;
  auto r = run_example({"--devices",
                        "2",
                        "--rows",
                        "20000",
                        "--dim",
                        "16",
                        "--active_ids",
                        "400",
                        "--samples",
                        "8192",
                        "--batch",
                        "64",
                        "--max_epochs",
                        "4",
                        "--lr",
                        "1.0",
                        "--default_root_dir",
                        dir.path(),
                        "--min_improvement",
                        "0.2"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/checkpoints/last.ckpt/rank-1-of-2.ckpt"))
      << r.output;
}

}  // namespace

namespace {

// The example's command line is fulgur::CLI's: a bad value is named with its
// key and where it came from, and the program exits 2 before training.
TEST(ShardedEmbeddings, ABadOptionIsNamedAndExitsTwo) {
  auto r = run_example({"--rows", "many"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("model.rows: \"many\" (from the command line): not an integer"),
            std::string::npos)
      << r.output;
}

}  // namespace
