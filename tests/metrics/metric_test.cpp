// The Metric base: states combined across ranks (real Gloo groups of 2 and
// 3 ranks, uneven shards, an empty one) give exactly the one-process value;
// padded rows are left out; states in checkpoints.
#include "fulgur/metrics/metric.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

namespace M = fulgur::metrics;

struct Data {
  at::Tensor scores, target, values;
};

// 101 samples of 5 classes, scores correlated with the target.
Data data() {
  torch::manual_seed(7);
  Data d;
  d.target = torch::randint(0, 5, {101}, torch::kLong);
  d.scores = (torch::randn({101, 5}) + 1.5 * torch::one_hot(d.target, 5)).softmax(1);
  d.values = torch::randn({101});
  return d;
}

// Every metric of one run, in a fixed order.
struct All {
  M::Accuracy acc{{.num_classes = 5, .average = "macro"}};
  M::Accuracy top2{{.num_classes = 5, .top_k = 2}};
  M::F1Score f1{{.num_classes = 5, .average = "macro"}};
  M::Precision precision{{.num_classes = 5, .average = "macro"}};
  M::Recall recall{{.num_classes = 5}};
  M::ConfusionMatrix cm{{.num_classes = 5}};
  M::AUROC auroc{{.num_classes = 5}};
  M::MeanSquaredError mse;
  M::MeanAbsoluteError mae;
  M::MeanMetric mean;
  M::SumMetric sum;

  std::vector<M::PredictionMetric*> predictions() {
    return {&acc, &top2, &f1, &precision, &recall, &cm, &auroc};
  }
  void update(const Data& d, int64_t begin, int64_t end) {
    const auto s = d.scores.slice(0, begin, end), t = d.target.slice(0, begin, end);
    for (auto* m : predictions()) m->update(s, t);
    const auto v = d.values.slice(0, begin, end);
    mse.update(v, v.sign());
    mae.update(v, v.sign());
    mean.update(v);
    sum.update(v);
  }
  std::vector<at::Tensor> compute(fulgur::ProcessGroup* group) {
    std::vector<at::Tensor> out;
    for (auto* m : predictions()) out.push_back(m->compute(group));
    for (M::Metric* m : std::initializer_list<M::Metric*>{&mse, &mae, &mean, &sum}) {
      out.push_back(m->compute(group));
    }
    return out;
  }
};

void expect_same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    // Counts give the same doubles; float sums of another grouping may
    // differ in the last bits, the areas not at all (ranks of the same scores).
    if (a[i].scalar_type() == torch::kLong) {
      EXPECT_TRUE(torch::equal(a[i], b[i])) << "metric " << i;
    } else {
      EXPECT_NEAR(a[i].item<double>(), b[i].item<double>(), 1e-12) << "metric " << i;
    }
  }
}

TEST(Metric, EveryRanksStatesGiveTheOneProcessValue) {
  const Data d = data();
  All one;
  one.update(d, 0, 40);
  one.update(d, 40, 101);
  const std::vector<at::Tensor> expected = one.compute(nullptr);
  // 2 ranks: 60 + 41 samples; 3 ranks: 50, none, 51 (a rank without a
  // batch still takes part).
  for (const std::vector<int64_t>& bounds :
       {std::vector<int64_t>{0, 60, 101}, std::vector<int64_t>{0, 50, 50, 101}}) {
    const int world = static_cast<int>(bounds.size()) - 1;
    SCOPED_TRACE(std::to_string(world) + " ranks");
    std::vector<std::vector<at::Tensor>> got(world);
    fulgur::test::on_ranks(world, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
      All mine;
      if (bounds[rank + 1] > bounds[rank]) mine.update(d, bounds[rank], bounds[rank + 1]);
      got[rank] = mine.compute(group.get());
    });
    for (int r = 0; r < world; ++r) expect_same(got[r], expected);
  }
}

// No rank with a sample (a metric logged but updated on no rank this
// epoch): every rank's value is the one process's (nan), and the states
// combine (concatenated states of no rows on any rank: no all_gather of
// empty tensors, which Gloo cannot do).
TEST(Metric, NoRankWithASampleGivesTheOneProcessValue) {
  All none;
  const std::vector<at::Tensor> expected = none.compute(nullptr);
  std::vector<std::vector<at::Tensor>> got(2);
  std::vector<int64_t> rows(2, -1);
  fulgur::test::on_ranks(2, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    All mine;
    got[rank] = mine.compute(group.get());
    rows[rank] = mine.auroc.state_dict(group.get()).at("scores").size(0);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(got[r].size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_TRUE(torch::allclose(got[r][i].to(torch::kDouble), expected[i].to(torch::kDouble), 0.0,
                                  0.0, /*equal_nan=*/true))
          << "rank " << r << ", metric " << i << ": " << got[r][i] << " vs " << expected[i];
    }
    EXPECT_EQ(rows[r], 0);
  }
}

// A state_dict() is a copy: the metric going on (an update, a reset)
// leaves it as it was, and a loaded one stays the caller's. value_of()
// gives the value of saved states without loading them.
TEST(Metric, AStateDictIsTheCallersOwn) {
  const Data d = data();
  M::F1Score f1({.num_classes = 5, .average = "macro"});
  M::AUROC auroc({.num_classes = 5});
  f1.update(d.scores.slice(0, 0, 50), d.target.slice(0, 0, 50));
  auroc.update(d.scores.slice(0, 0, 50), d.target.slice(0, 0, 50));
  const at::Tensor value = f1.compute();
  std::map<std::string, at::Tensor> saved = f1.state_dict();
  std::map<std::string, at::Tensor> saved_rows = auroc.state_dict();
  std::map<std::string, at::Tensor> before;
  for (const auto& [k, t] : saved) before[k] = t.clone();
  f1.update(d.scores.slice(0, 50), d.target.slice(0, 50));
  f1.reset();
  for (const auto& [k, t] : saved) EXPECT_TRUE(torch::equal(t, before.at(k))) << k;
  EXPECT_TRUE(torch::equal(f1.value_of(saved), value));
  EXPECT_TRUE(torch::equal(auroc.value_of(saved_rows), auroc.compute()));
  // Loaded, then changed by the metric: the caller's map is unchanged.
  f1.load_state_dict(saved);
  f1.update(d.scores.slice(0, 50), d.target.slice(0, 50));
  f1.reset();
  for (const auto& [k, t] : saved) EXPECT_TRUE(torch::equal(t, before.at(k))) << k;
  // Merged likewise.
  f1.merge_state_dict(saved);
  f1.update(d.scores.slice(0, 50), d.target.slice(0, 50));
  for (const auto& [k, t] : saved) EXPECT_TRUE(torch::equal(t, before.at(k))) << k;
  // A saved state of the right shape in another layout (a transpose's
  // strides): loaded as values, updated as the metric's own (a flat view
  // of it was LibTorch's "view size is not compatible").
  std::map<std::string, at::Tensor> strided = saved;
  strided["matrix"] = saved.at("matrix").t().contiguous().t();
  ASSERT_FALSE(strided["matrix"].is_contiguous());
  f1.load_state_dict(strided);
  f1.update(d.scores.slice(0, 50), d.target.slice(0, 50));
  f1.load_state_dict(saved);
  f1.update(d.scores.slice(0, 50), d.target.slice(0, 50));
  EXPECT_TRUE(torch::equal(f1.state_dict().at("matrix"), f1.state_dict().at("matrix")));
}

// A resumed run's global rank 0 merges the states every rank had combined
// at the checkpoint; the other ranks start empty: the epoch's value is the
// uninterrupted one's, on another world size too.
TEST(Metric, StatesCombinedAtACheckpointAndMergedAfterAResumeCountEveryBatch) {
  const Data d = data();
  All uninterrupted;
  uninterrupted.update(d, 0, 101);
  const std::vector<at::Tensor> expected = uninterrupted.compute(nullptr);
  // Before the checkpoint: 2 ranks with 30 and 20 samples.
  std::vector<std::map<std::string, at::Tensor>> saved[2];
  fulgur::test::on_ranks(2, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    All mine;
    mine.update(d, rank == 0 ? 0 : 30, rank == 0 ? 30 : 50);
    for (auto* m : mine.predictions()) saved[rank].push_back(m->state_dict(group.get()));
    for (M::Metric* m : std::initializer_list<M::Metric*>{&mine.mse, &mine.mae, &mine.mean,
                                                          &mine.sum}) {
      saved[rank].push_back(m->state_dict(group.get()));
    }
  });
  ASSERT_TRUE(torch::equal(saved[0][0].at("updates"), torch::tensor({2}, torch::kLong)));
  // After it, on one process: the rest of the samples, then the merge.
  All resumed;
  resumed.update(d, 50, 101);
  std::vector<M::Metric*> all;
  for (auto* m : resumed.predictions()) all.push_back(m);
  for (M::Metric* m : {static_cast<M::Metric*>(&resumed.mse), static_cast<M::Metric*>(&resumed.mae),
                       static_cast<M::Metric*>(&resumed.mean),
                       static_cast<M::Metric*>(&resumed.sum)}) {
    all.push_back(m);
  }
  ASSERT_EQ(all.size(), saved[0].size());
  for (size_t i = 0; i < all.size(); ++i) all[i]->merge_state_dict(saved[0][i]);
  expect_same(resumed.compute(nullptr), expected);
  EXPECT_EQ(resumed.acc.update_count(), 3);
}

TEST(Metric, PaddedRowsAreLeftOut) {
  const Data d = data();
  M::Accuracy padded({.num_classes = 5});
  M::Accuracy plain({.num_classes = 5});
  M::MeanMetric mean;
  plain.update(d.scores.slice(0, 0, 10), d.target.slice(0, 0, 10));
  padded.update(d.scores.slice(0, 0, 8), d.target.slice(0, 0, 8));
  M::Metric::set_padded_rows(2);  // rows 8 and 9 below repeat rows 0 and 1
  padded.update(torch::cat({d.scores.slice(0, 8, 10), d.scores.slice(0, 0, 2)}),
                torch::cat({d.target.slice(0, 8, 10), d.target.slice(0, 0, 2)}));
  mean.update(torch::tensor({1.0, 2.0, 9.0}));
  M::Metric::set_padded_rows(0);
  EXPECT_TRUE(torch::equal(padded.compute(), plain.compute()));
  EXPECT_DOUBLE_EQ(mean.compute().item<double>(), 1.0);
}

TEST(Metric, AnUpdateWhileACudaGraphCapturesIsRefused) {
  M::MeanMetric mean;
  M::Metric::set_capturing(true);
  EXPECT_THROWS_WITH(fulgur::ConfigError, mean.update(1.0), {"MeanMetric.update()", "CUDA graph",
                                                            "on_train_batch_end"});
  M::Metric::set_capturing(false);
  mean.update(2.0, /*weight=*/3.0);
  EXPECT_EQ(mean.update_count(), 1);
  EXPECT_DOUBLE_EQ(mean.compute().item<double>(), 2.0);
}

// state_dict() keeps the update count and the options under "updates" and
// "options": a state of either name would be read as them.
TEST(Metric, AStateNamedAsStateDictsOwnEntriesIsRefused) {
  struct Named : M::Metric {
    explicit Named(const std::string& state) {
      add_state(state, torch::zeros({}), M::Reduction::kSum);
    }
    std::string name() const override { return "Named"; }

   protected:
    at::Tensor compute_from(const std::vector<at::Tensor>& s) const override { return s[0]; }
  };
  EXPECT_THROWS_WITH(fulgur::ConfigError, Named("options"),
                     {"Named: a state cannot be named \"options\"", "Name it otherwise"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, Named("updates"), {"\"updates\""});
  EXPECT_NO_THROW(Named("sum"));
}

TEST(Metric, StatesSurviveACheckpoint) {
  const Data d = data();
  M::AUROC auroc({.num_classes = 5});
  M::F1Score f1({.num_classes = 5, .average = "macro"});
  auroc.update(d.scores.slice(0, 0, 50), d.target.slice(0, 0, 50));
  f1.update(d.scores.slice(0, 0, 50), d.target.slice(0, 0, 50));
  // Through the archive codec, as a checkpoint holds them.
  std::string a, b;
  {
    fulgur::StateDict sa, sb;
    auroc.save(sa);
    f1.save(sb);
    EXPECT_TRUE(sa.contains("updates"));
    for (const auto& key : sb.keys()) EXPECT_TRUE(sb.is_buffer(key)) << key;
    a = fulgur::to_bytes(sa);
    b = fulgur::to_bytes(sb);
  }
  M::AUROC auroc2({.num_classes = 5});
  M::F1Score f12({.num_classes = 5, .average = "macro"});
  auroc2.load(fulgur::from_bytes(a));
  f12.load(fulgur::from_bytes(b));
  EXPECT_EQ(auroc2.update_count(), 1);
  using Pair = std::pair<M::PredictionMetric*, M::PredictionMetric*>;
  for (const Pair& pair : {Pair(&auroc, &auroc2), Pair(&f1, &f12)}) {
    pair.first->update(d.scores.slice(0, 50), d.target.slice(0, 50));
    pair.second->update(d.scores.slice(0, 50), d.target.slice(0, 50));
    EXPECT_TRUE(torch::equal(pair.first->compute(), pair.second->compute()))
        << pair.first->name();
  }
  // Another class count: named.
  M::F1Score other({.num_classes = 4});
  EXPECT_THROWS_WITH(c10::Error, other.load(fulgur::from_bytes(b)),
                     {"matrix", "[5, 5]", "[4, 4]"});
  // The options the counts depend on travel with them: another average
  // reads the same counts; another top_k or threshold counted other hits.
  M::F1Score micro({.num_classes = 5});
  EXPECT_NO_THROW(micro.load(fulgur::from_bytes(b)));
  M::Accuracy top2({.num_classes = 5, .top_k = 2});
  top2.update(d.scores, d.target);
  M::Accuracy top1({.num_classes = 5});
  EXPECT_THROWS_WITH(
      c10::Error, top1.load_state_dict(top2.state_dict()),
      {"Accuracy", "counted with task=multiclass top_k=2", "counts with task=multiclass top_k=1"});
  EXPECT_THROWS_WITH(c10::Error, top1.merge_state_dict(top2.state_dict()), {"top_k=2"});
  EXPECT_EQ(top1.update_count(), 0);
  M::Recall half({.task = "binary"});
  M::Recall third({.task = "binary", .threshold = 0.3});
  EXPECT_THROWS_WITH(c10::Error, third.load_state_dict(half.state_dict()),
                     {"threshold=0.5", "threshold=0.3"});
  // Not a metric's state.
  auto bad = top2.state_dict();
  bad["updates"] = torch::tensor({1, 2});
  EXPECT_THROWS_WITH(c10::Error, top2.load_state_dict(bad), {"\"updates\"", "[2]"});
  auto fractions = top2.state_dict();
  fractions["hits"] = fractions["hits"].to(torch::kFloat) * 0.7;  // was truncated to integers
  EXPECT_THROWS_WITH(c10::Error, top2.load_state_dict(fractions),
                     {"state \"hits\" is Float in the checkpoint", "counts in Long"});
}

}  // namespace
