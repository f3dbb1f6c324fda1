// Classification metrics against values computed by hand on fixed data, and
// AUROC against the pairwise count (ties half) on random scores.
#include "fulgur/metrics/classification.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

namespace M = fulgur::metrics;

// 8 samples of 3 classes. Rows: target, columns: prediction:
//   [[2, 0, 0],
//    [1, 1, 1],
//    [0, 1, 2]]
// tp = (2, 1, 2), predicted = (3, 2, 3), actual = (2, 3, 3).
at::Tensor target3() { return torch::tensor({0, 1, 2, 2, 1, 0, 2, 1}, torch::kLong); }
at::Tensor labels3() { return torch::tensor({0, 2, 2, 1, 1, 0, 2, 0}, torch::kLong); }
// The same predictions as scores (the largest is the label).
at::Tensor scores3() { return torch::one_hot(labels3(), 3).to(torch::kFloat) * 2 - 0.5; }

double value(const M::Metric& m) { return m.compute().item<double>(); }

TEST(Metrics, MulticlassMicroIsTheAccuracy) {
  M::ClassificationOptions o{.num_classes = 3};
  M::Accuracy acc(o);
  M::Precision precision(o);
  M::Recall recall(o);
  M::F1Score f1(o);
  for (M::PredictionMetric* m : std::initializer_list<M::PredictionMetric*>{&acc, &precision,
                                                                             &recall, &f1}) {
    // Two updates (scores, then labels) of the same 8 samples.
    m->update(scores3().slice(0, 0, 5), target3().slice(0, 0, 5));
    m->update(labels3().slice(0, 5), target3().slice(0, 5));
    EXPECT_DOUBLE_EQ(value(*m), 5.0 / 8) << m->name();
    EXPECT_EQ(m->update_count(), 2);
  }
}

TEST(Metrics, MulticlassMacroAveragesAsScikitLearn) {
  M::ClassificationOptions o{.num_classes = 3, .average = "macro"};
  M::Accuracy acc(o);
  M::Precision precision(o);
  M::Recall recall(o);
  M::F1Score f1(o);
  for (M::PredictionMetric* m : std::initializer_list<M::PredictionMetric*>{&acc, &precision,
                                                                             &recall, &f1}) {
    m->update(scores3(), target3());
  }
  EXPECT_DOUBLE_EQ(value(acc), (1.0 + 1.0 / 3 + 2.0 / 3) / 3);         // mean recall
  EXPECT_DOUBLE_EQ(value(precision), (2.0 / 3 + 1.0 / 2 + 2.0 / 3) / 3);  // 11/18
  EXPECT_DOUBLE_EQ(value(recall), (1.0 + 1.0 / 3 + 2.0 / 3) / 3);
  EXPECT_DOUBLE_EQ(value(f1), (4.0 / 5 + 2.0 / 5 + 4.0 / 6) / 3);  // 2tp / (2tp + fp + fn)
}

TEST(Metrics, MacroLeavesOutClassesNeitherPredictedNorPresent) {
  // 4 classes, class 3 never occurs: the macro means are those of 3 classes.
  M::F1Score f1({.num_classes = 4, .average = "macro"});
  f1.update(labels3(), target3());
  EXPECT_DOUBLE_EQ(value(f1), (4.0 / 5 + 2.0 / 5 + 4.0 / 6) / 3);
  // A class predicted but never a target counts (precision 0, F1 0).
  M::Precision precision({.num_classes = 4, .average = "macro"});
  precision.update(torch::tensor({3, 0}, torch::kLong), torch::tensor({0, 0}, torch::kLong));
  EXPECT_DOUBLE_EQ(value(precision), (1.0 + 0.0) / 2);
}

TEST(Metrics, ConfusionMatrixRowsAreTargets) {
  M::ConfusionMatrix cm({.num_classes = 3});
  cm.update(scores3(), target3());
  EXPECT_TRUE(torch::equal(cm.compute(),
                           torch::tensor({{2, 0, 0}, {1, 1, 1}, {0, 1, 2}}, torch::kLong)));
  EXPECT_FALSE(cm.is_scalar());
}

TEST(Metrics, BinaryFromProbabilitiesAndAThreshold) {
  // Predicted (>= 0.5): 1 0 1 0 1 0 against 1 0 0 1 1 0: tp 2, fp 1, fn 1, tn 2.
  const auto probs = torch::tensor({0.9, 0.2, 0.6, 0.4, 0.7, 0.1});
  const auto target = torch::tensor({1, 0, 0, 1, 1, 0}, torch::kLong);
  M::ClassificationOptions o{.task = "binary"};
  M::Accuracy acc(o);
  M::Precision precision(o);
  M::Recall recall(o);
  M::F1Score f1(o);
  M::ConfusionMatrix cm(o);
  for (M::PredictionMetric* m : std::initializer_list<M::PredictionMetric*>{&acc, &precision,
                                                                             &recall, &f1, &cm}) {
    m->update(probs, target);
  }
  EXPECT_DOUBLE_EQ(value(acc), 4.0 / 6);
  EXPECT_DOUBLE_EQ(value(precision), 2.0 / 3);
  EXPECT_DOUBLE_EQ(value(recall), 2.0 / 3);
  EXPECT_DOUBLE_EQ(value(f1), 2.0 / 3);
  EXPECT_TRUE(torch::equal(cm.compute(), torch::tensor({{2, 1}, {1, 2}}, torch::kLong)));
  // Logits with threshold 0: the same decisions.
  M::Accuracy logits({.task = "binary", .threshold = 0.0});
  logits.update(torch::logit(probs), target);
  EXPECT_DOUBLE_EQ(value(logits), 4.0 / 6);
}

TEST(Metrics, TopKAccuracy) {
  // Target 2 is the 2nd score of sample 0 and the 3rd of sample 1.
  const auto scores = torch::tensor({{0.5, 0.1, 0.4}, {0.5, 0.3, 0.2}, {0.1, 0.8, 0.1}});
  const auto target = torch::tensor({2, 2, 1}, torch::kLong);
  M::Accuracy top1({.num_classes = 3});
  M::Accuracy top2({.num_classes = 3, .top_k = 2});
  top1.update(scores, target);
  top2.update(scores, target);
  EXPECT_DOUBLE_EQ(value(top1), 1.0 / 3);
  EXPECT_DOUBLE_EQ(value(top2), 2.0 / 3);
}

TEST(Metrics, NoSampleIsNaNAndResetStartsOver) {
  M::Accuracy acc({.num_classes = 3});
  EXPECT_TRUE(std::isnan(value(acc)));
  // Every average of the scores too (micro and binary read 0 before: an
  // empty validation epoch logged val_f1=0).
  for (const M::ClassificationOptions& o :
       {M::ClassificationOptions{.num_classes = 3},
        M::ClassificationOptions{.num_classes = 3, .average = "macro"},
        M::ClassificationOptions{.task = "binary"}}) {
    EXPECT_TRUE(std::isnan(value(M::Precision(o))));
    EXPECT_TRUE(std::isnan(value(M::Recall(o))));
    EXPECT_TRUE(std::isnan(value(M::F1Score(o))));
    EXPECT_TRUE(std::isnan(value(M::AUROC(o))));
  }
  // A NaN score (a diverged model) makes the area NaN (sorted as the
  // largest score, it read 0.5 or more).
  M::AUROC with_nan({.task = "binary"});
  with_nan.update(torch::tensor({0.1, std::nan(""), 0.8, 0.2}),
                  torch::tensor({0, 1, 1, 0}, torch::kLong));
  EXPECT_TRUE(std::isnan(value(with_nan)));
  // A binary task whose samples all are negative and predicted negative
  // scores 0 (scikit-learn's zero_division), not NaN.
  M::Precision negatives({.task = "binary"});
  negatives.update(torch::tensor({0.1, 0.2}), torch::tensor({0, 0}, torch::kLong));
  EXPECT_EQ(value(negatives), 0.0);
  acc.update(scores3(), target3());
  acc.reset();
  EXPECT_EQ(acc.update_count(), 0);
  acc.update(labels3().slice(0, 0, 1), target3().slice(0, 0, 1));
  EXPECT_DOUBLE_EQ(value(acc), 1.0);
}

// The area as the probability that a positive outscores a negative, ties
// counting half: every pair counted.
double pairwise_auroc(const at::Tensor& scores, const at::Tensor& positive) {
  auto s = scores.to(torch::kDouble).contiguous();
  auto p = positive.to(torch::kBool).contiguous();
  double wins = 0, pairs = 0;
  for (int64_t i = 0; i < s.size(0); ++i) {
    if (!p[i].item<bool>()) continue;
    for (int64_t j = 0; j < s.size(0); ++j) {
      if (p[j].item<bool>()) continue;
      const double a = s[i].item<double>(), b = s[j].item<double>();
      wins += a > b ? 1.0 : (a == b ? 0.5 : 0.0);
      pairs += 1;
    }
  }
  return wins / pairs;
}

TEST(Metrics, BinaryAurocByHandAndWithTies) {
  M::AUROC auroc({.task = "binary"});
  auroc.update(torch::tensor({0.9, 0.2, 0.6}), torch::tensor({1, 0, 0}, torch::kLong));
  auroc.update(torch::tensor({0.4, 0.7, 0.1}), torch::tensor({1, 1, 0}, torch::kLong));
  EXPECT_DOUBLE_EQ(value(auroc), 8.0 / 9);
  // Scores rounded to tenths: many ties.
  torch::manual_seed(3);
  const auto scores = (torch::rand({300}) * 10).round() / 10;
  const auto target = (torch::rand({300}) < scores).to(torch::kLong);
  M::AUROC tied({.task = "binary"});
  tied.update(scores, target);
  EXPECT_NEAR(value(tied), pairwise_auroc(scores, target == 1), 1e-12);
  // One side empty: no area.
  M::AUROC one_sided({.task = "binary"});
  one_sided.update(torch::tensor({0.3, 0.8}), torch::tensor({1, 1}, torch::kLong));
  EXPECT_TRUE(std::isnan(value(one_sided)));
}

TEST(Metrics, MulticlassAurocIsTheMeanOfOneVsRest) {
  torch::manual_seed(4);
  const auto target = torch::randint(0, 4, {200}, torch::kLong);
  const auto scores = (torch::randn({200, 4}) + torch::one_hot(target, 4)).softmax(1);
  M::AUROC auroc({.num_classes = 4});
  auroc.update(scores.slice(0, 0, 77), target.slice(0, 0, 77));
  auroc.update(scores.slice(0, 77), target.slice(0, 77));
  double mean = 0;
  for (int64_t c = 0; c < 4; ++c) mean += pairwise_auroc(scores.select(1, c), target == c) / 4;
  EXPECT_NEAR(value(auroc), mean, 1e-12);
}

// Logits: each batch's scores outside [0, 1] are taken through a softmax,
// as torchmetrics does (ranked raw, 0.677 where torchmetrics and
// scikit-learn give 0.710 here). Probabilities are taken as they are.
TEST(Metrics, MulticlassAurocOfLogitsIsTheAurocOfTheirSoftmax) {
  torch::manual_seed(5);
  const auto target = torch::randint(0, 3, {200}, torch::kLong);
  const auto logits = torch::randn({200, 3}) * 3 + torch::one_hot(target, 3);
  M::AUROC of_logits({.num_classes = 3});
  of_logits.update(logits.slice(0, 0, 90), target.slice(0, 0, 90));
  of_logits.update(logits.slice(0, 90), target.slice(0, 90));
  M::AUROC of_probabilities({.num_classes = 3});
  of_probabilities.update(logits.softmax(1), target);
  EXPECT_NEAR(value(of_logits), value(of_probabilities), 1e-12);
  double mean = 0;
  for (int64_t c = 0; c < 3; ++c) {
    mean += pairwise_auroc(logits.softmax(1).select(1, c), target == c) / 3;
  }
  EXPECT_NEAR(value(of_logits), mean, 1e-12);
}

TEST(Metrics, BadOptionsAndInputsAreNamed) {
  EXPECT_THROWS_WITH(fulgur::ConfigError, M::Accuracy({.num_classes = 1}), {"num_classes=1"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, M::F1Score({.num_classes = 3, .average = "weighted"}),
                     {"average=\"weighted\"", "\"micro\" or \"macro\""});
  EXPECT_THROWS_WITH(fulgur::ConfigError, M::Accuracy({.task = "multilabel"}),
                     {"task=\"multilabel\""});
  EXPECT_THROWS_WITH(fulgur::ConfigError, M::Accuracy({.num_classes = 3, .top_k = 4}),
                     {"top_k=4"});
  M::Accuracy acc({.num_classes = 3});
  EXPECT_THROWS_WITH(fulgur::ConfigError, acc.update(torch::rand({4, 5}), target3().slice(0, 0, 4)),
                     {"Accuracy.update", "[4, 5]", "[N, 3]"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, acc.update(scores3(), target3().to(torch::kFloat)),
                     {"target", "integer dtype"});
  M::ConfusionMatrix cm({.num_classes = 3});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     cm.update(torch::tensor({0}, torch::kLong), torch::tensor({3}, torch::kLong)),
                     {"outside [0, 3)"});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     cm.update(torch::tensor({3}, torch::kLong), torch::tensor({0}, torch::kLong)),
                     {"a predicted class is outside [0, 3)"});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     acc.update(torch::tensor({0}, torch::kLong), torch::tensor({-1}, torch::kLong)),
                     {"a target class is outside [0, 3) (-1)"});
  EXPECT_EQ(cm.update_count(), 0);
  M::AUROC auroc({.num_classes = 3});
  EXPECT_THROWS_WITH(fulgur::ConfigError, auroc.update(labels3(), target3()),
                     {"AUROC.update", "scores"});
  // Inputs on two devices: named, before anything is counted (a collection
  // checks every metric first; AUROC took them, and Accuracy then threw
  // LibTorch's error with the batch half counted).
  const auto elsewhere = torch::empty({8}, torch::TensorOptions(torch::kLong).device(torch::kMeta));
  EXPECT_THROWS_WITH(fulgur::ConfigError, auroc.update(scores3(), elsewhere),
                     {"AUROC.update: preds is on cpu and target on meta"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, acc.update(scores3(), elsewhere),
                     {"Accuracy.update: preds is on cpu and target on meta", "one device"});
  M::MeanSquaredError mse;
  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      mse.update(torch::zeros({8}), torch::empty({8}, torch::TensorOptions().device(torch::kMeta))),
      {"MeanSquaredError.update: preds is on cpu and target on meta"});
  EXPECT_EQ(auroc.update_count(), 0);
}

// Inputs that were taken and gave a wrong value (a probe's findings): each
// refused naming it, and nothing counted.
TEST(Metrics, InputsThatWouldGiveAWrongValueAreRefused) {
  // A threshold no score reaches (every sample was negative).
  for (const double t : {std::nan(""), HUGE_VAL, -HUGE_VAL}) {
    EXPECT_THROWS_WITH(fulgur::ConfigError, M::Recall({.task = "binary", .threshold = t}),
                       {"Recall: threshold=", "0.5 for probabilities"});
  }
  // Float [N] preds of a multiclass task were thresholded at 0.5 as if
  // binary (class 2 counted as 1).
  M::Accuracy acc({.num_classes = 3});
  EXPECT_THROWS_WITH(fulgur::ConfigError, acc.update(labels3().to(torch::kFloat), target3()),
                     {"Accuracy.update", "[8]", "Float", "[N, 3]", "integer dtype"});
  // top_k of class indices was top-1.
  M::Accuracy top2({.num_classes = 3, .top_k = 2});
  EXPECT_THROWS_WITH(fulgur::ConfigError, top2.update(labels3(), target3()),
                     {"top_k=2", "[N, 3]", "[8]"});
  top2.update(scores3(), target3());  // scores: fine
  // AUROC's targets were not checked: a 2 counted as a negative of a binary
  // task, -1 and 5 as nothing of three classes.
  M::AUROC binary({.task = "binary"});
  EXPECT_THROWS_WITH(
      fulgur::ConfigError,
      binary.update(torch::tensor({0.1, 0.9, 0.8, 0.2}), torch::tensor({0, 2, 1, 0}, torch::kLong)),
      {"AUROC.update", "a target class is outside [0, 2) (2;", "0 and 1"});
  M::AUROC auroc({.num_classes = 3});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     auroc.update(torch::rand({4, 3}), torch::tensor({0, 1, 5, -1}, torch::kLong)),
                     {"AUROC.update", "outside [0, 3) (-1)"});
  // A 0-d prediction: named, not LibTorch's index error.
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     acc.update(torch::tensor(1, torch::kLong), torch::tensor({1}, torch::kLong)),
                     {"Accuracy.update", "preds has shape []"});
  EXPECT_EQ(acc.update_count(), 0);
  EXPECT_EQ(binary.update_count(), 0);
  EXPECT_EQ(auroc.update_count(), 0);
  // A class count whose matrix of counts cannot be made: named.
  EXPECT_THROWS_WITH(fulgur::ConfigError, M::F1Score({.num_classes = int64_t{1} << 40}),
                     {"F1Score: num_classes=1099511627776", "more bytes than an int64 holds",
                      "Check num_classes"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, M::ConfusionMatrix({.num_classes = int64_t{1} << 28}),
                     {"num_classes=268435456", "576460752303423488 bytes"});
}

}  // namespace
