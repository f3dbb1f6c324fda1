// File: fulgur/metrics/classification.h
//
// Classification metrics over every sample of an epoch, exact across ranks
// (fulgur/metrics/metric.h): Accuracy, Precision, Recall, F1Score,
// ConfusionMatrix and AUROC, for binary and multiclass tasks.
//
//   fulgur::metrics::F1Score f1({.num_classes = 10, .average = "macro"});
//   f1.update(logits, labels);     // logits [N, 10], labels [N] (int64)
//   log("val_f1", f1);
//
// Inputs. Binary: `preds` [N] are scores of the positive class
// (probabilities: a sample is positive from `threshold` on; pass threshold
// 0 for logits) or 0/1 labels of an integer dtype; `target` [N] is 0 or 1.
// Multiclass: `preds` [N, C] are scores (the largest is the prediction) or
// [N] class indices of an integer dtype (float [N] preds are refused: they
// are neither); `target` [N] holds class indices in [0, C). Nothing is read
// back to the host in update() on a GPU (labels are range-checked on the
// CPU only). Updates record no autograd history: a loss that needs
// gradients can be passed as it is.
//
// Averages, as scikit-learn's: "micro" counts every sample once (for
// single-label multiclass data, precision, recall and F1 are then all the
// accuracy); "macro" is the unweighted mean of the per-class values over the
// classes that occur in the targets or the predictions (a class with no
// predicted sample has precision 0). Accuracy's macro average is the mean
// per-class recall over the classes in the targets (balanced accuracy).
// With no sample at all every metric's value is NaN.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "fulgur/core/choice.h"
#include "fulgur/metrics/metric.h"

namespace fulgur::metrics {

enum class Task { kBinary, kMulticlass };
enum class Average { kMicro, kMacro };

}  // namespace fulgur::metrics

namespace fulgur {
template <>
struct ChoiceNames<metrics::Task> {
  static constexpr std::pair<metrics::Task, const char*> kNames[] = {
      {metrics::Task::kBinary, "binary"}, {metrics::Task::kMulticlass, "multiclass"}};
};
template <>
struct ChoiceNames<metrics::Average> {
  static constexpr std::pair<metrics::Average, const char*> kNames[] = {
      {metrics::Average::kMicro, "micro"}, {metrics::Average::kMacro, "macro"}};
};
}  // namespace fulgur

namespace fulgur::metrics {

struct ClassificationOptions {
  /// "multiclass" (needs num_classes) or "binary".
  Choice<Task> task = Task::kMulticlass;
  /// Multiclass: the number of classes C (>= 2).
  int64_t num_classes = 0;
  /// Binary: a score from this value on predicts the positive class
  /// (finite).
  double threshold = 0.5;
  /// Multiclass: "micro" or "macro" (see above). AUROC always averages the
  /// classes' one-vs-rest values as "macro" does.
  Choice<Average> average = Average::kMicro;
  /// Accuracy of multiclass scores: a sample is right when its target is
  /// among its top_k scores (preds [N, C]; class indices are refused).
  int64_t top_k = 1;
};

/// Counts of (target, predicted) class pairs, shared by the metrics below
/// that are computed from them.
class ConfusionCounts : public PredictionMetric {
 public:
  /// ConfigError naming the option for a bad task, class count, average
  /// or top_k. `pairs`: declares the [C, C] count state ("matrix").
  ConfusionCounts(ClassificationOptions options, std::string name, bool pairs = true);
  void update(const at::Tensor& preds, const at::Tensor& target) override;
  void check(const at::Tensor& preds, const at::Tensor& target) const override;
  std::string name() const override { return name_; }
  /// The task, and the threshold of a binary task (top_k too: Accuracy).
  std::string options_text() const override;
  const ClassificationOptions& options() const { return options_; }
  /// 2 for a binary task.
  int64_t classes() const { return classes_; }

 protected:
  /// The predicted class of each sample ([N], int64) and the checked target.
  std::pair<at::Tensor, at::Tensor> labels(const at::Tensor& preds, const at::Tensor& target) const;
  /// ConfigError naming a label outside [0, classes()) (`what`: "a
  /// target"); checked where it costs no synchronisation (CPU tensors). On
  /// a GPU such a label trips LibTorch's device-side index check.
  void check_classes(const at::Tensor& labels, const char* what) const;
  /// labels(), both checked by check_classes.
  std::pair<at::Tensor, at::Tensor> checked_labels(const at::Tensor& preds,
                                                   const at::Tensor& target) const;

  ClassificationOptions options_;
  std::string name_;
  int64_t classes_ = 2;
};

/// The fraction of samples classified right (top_k: target among the top k
/// scores); macro: balanced accuracy.
class Accuracy : public ConfusionCounts {
 public:
  explicit Accuracy(ClassificationOptions options = {});
  void update(const at::Tensor& preds, const at::Tensor& target) override;
  void check(const at::Tensor& preds, const at::Tensor& target) const override;
  std::string options_text() const override;

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& states) const override;

 private:
  /// ConfigError for top_k > 1 without scores (`p`: checked_preds).
  void check_top_k(const at::Tensor& p, const at::Tensor& preds) const;
  /// Whether each sample is right, and its checked target.
  std::pair<at::Tensor, at::Tensor> hits(const at::Tensor& preds, const at::Tensor& target) const;
};

/// tp / (tp + fp): of the class 1 (binary), or averaged.
class Precision : public ConfusionCounts {
 public:
  explicit Precision(ClassificationOptions options = {});

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& states) const override;
};

/// tp / (tp + fn): of the class 1 (binary), or averaged.
class Recall : public ConfusionCounts {
 public:
  explicit Recall(ClassificationOptions options = {});

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& states) const override;
};

/// 2 tp / (2 tp + fp + fn): of the class 1 (binary), or averaged (macro:
/// the mean of the classes' F1).
class F1Score : public ConfusionCounts {
 public:
  explicit F1Score(ClassificationOptions options = {});

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& states) const override;
};

/// The [C, C] matrix (2 x 2 for binary) of sample counts, row: the target
/// class, column: the predicted one (int64). Not a number: compute() it;
/// log() refuses it.
class ConfusionMatrix : public ConfusionCounts {
 public:
  explicit ConfusionMatrix(ClassificationOptions options = {});
  bool is_scalar() const override { return false; }

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& states) const override;
};

/// The area under the ROC curve, exact from every score (ties count half,
/// as the Mann-Whitney statistic does). Binary: of the positive class's
/// scores; multiclass: the mean of the one-vs-rest areas over the classes
/// that have both positive and negative samples. NaN where there are none,
/// and when a score is NaN. Multiclass scores of a batch that are not all
/// in [0, 1] (logits) are taken through a softmax over the classes first,
/// as torchmetrics does: the one-vs-rest areas rank probabilities (a
/// softmax does not keep a class's order across samples).
/// Keeps every score of the epoch (8 bytes per score, per class).
class AUROC : public PredictionMetric {
 public:
  explicit AUROC(ClassificationOptions options = {});
  void update(const at::Tensor& preds, const at::Tensor& target) override;
  void check(const at::Tensor& preds, const at::Tensor& target) const override;
  std::string name() const override { return "AUROC"; }

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& states) const override;

 private:
  /// The scores ([N] or [N, C]) and the target, checked.
  std::pair<at::Tensor, at::Tensor> checked_scores(const at::Tensor& preds,
                                                   const at::Tensor& target) const;
  ClassificationOptions options_;
};

/// The binary AUROC of `scores` for the samples where `positive` is true
/// (ties count half); NaN when either side is empty.
double binary_auroc(const at::Tensor& scores, const at::Tensor& positive);

}  // namespace fulgur::metrics
