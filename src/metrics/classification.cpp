// Classification metrics: a [C, C] count of (target, prediction) pairs for
// precision, recall, F1 and the confusion matrix; per-class hits and support
// for accuracy (top-k too); every score for AUROC.
#include "fulgur/metrics/classification.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "fulgur/core/errors.h"

namespace fulgur::metrics {

namespace {

void check_options(const ClassificationOptions& o, const std::string& name) {
  if (!o.task.is_valid()) {
    throw ConfigError(str(name, ": task=\"", o.task.text(), "\" is not one of ",
                          Choice<Task>::spellings(), "."));
  }
  if (!o.average.is_valid()) {
    throw ConfigError(str(name, ": average=\"", o.average.text(), "\" is not one of ",
                          Choice<Average>::spellings(), "."));
  }
  if (o.task == Task::kMulticlass && o.num_classes < 2) {
    throw ConfigError(str(name, ": num_classes=", o.num_classes,
                          " with task=\"multiclass\": pass the number of classes (>= 2), or "
                          "task=\"binary\" for two."));
  }
  if (o.top_k < 1 || (o.task == Task::kMulticlass && o.top_k > o.num_classes)) {
    throw ConfigError(str(name, ": top_k=", o.top_k, " must be between 1 and num_classes (",
                          o.num_classes, ")."));
  }
  if (!std::isfinite(o.threshold)) {
    throw ConfigError(str(name, ": threshold=", o.threshold,
                          " is not a number a score can reach: pass the score from which a "
                          "sample is positive (0.5 for probabilities, 0 for logits)."));
  }
  if (o.task == Task::kBinary && o.top_k != 1) {
    throw ConfigError(str(name, ": top_k=", o.top_k,
                          " with task=\"binary\": a binary prediction has one score. Drop "
                          "top_k, or use task=\"multiclass\" with num_classes."));
  }
}

std::string shape_of(const at::Tensor& t) { return c10::str(t.sizes()); }

// ConfigError naming a label outside [0, classes); read only where it costs
// no device synchronisation: on the CPU.
void check_label_range(const std::string& name, const ClassificationOptions& o, int64_t classes,
                       const at::Tensor& labels, const char* what) {
  if (labels.is_cuda() || labels.numel() == 0) return;
  const auto [low_t, high_t] = at::aminmax(labels);
  const int64_t low = low_t.item<int64_t>();
  const int64_t high = high_t.item<int64_t>();
  if (low >= 0 && high < classes) return;
  throw ConfigError(str(name, ".update: ", what, " class is outside [0, ", classes, ") (",
                        low < 0 ? low : high,
                        o.task == Task::kBinary ? "; a binary task takes 0 and 1" : "",
                        "). Check num_classes and the labels."));
}

// Checks the shapes of a multiclass or binary update (nothing is read from
// the device) and returns preds as [N] or [N, C].
at::Tensor checked_preds(const std::string& name, const ClassificationOptions& o,
                         const at::Tensor& preds, const at::Tensor& target) {
  if (!preds.defined() || !target.defined()) {
    throw ConfigError(str(name, ".update(preds, target): both must be defined tensors."));
  }
  Metric::check_same_device(name, preds, target);
  if (target.dim() != 1 || c10::isFloatingType(target.scalar_type())) {
    throw ConfigError(str(name, ".update: target has shape ", shape_of(target), " and dtype ",
                          c10::toString(target.scalar_type()),
                          "; pass class indices [N] of an integer dtype."));
  }
  at::Tensor p = preds;
  if (o.task == Task::kBinary && p.dim() == 2 && p.size(1) == 1) p = p.squeeze(1);
  const bool scores = c10::isFloatingType(p.scalar_type());
  if (o.task == Task::kMulticlass && scores && p.dim() == 1) {
    throw ConfigError(str(name, ".update: preds has shape ", shape_of(preds), " and dtype ",
                          c10::toString(p.scalar_type()), " with ", o.num_classes,
                          " classes: one score a sample picks no class. Pass the scores of every "
                          "class [N, ",
                          o.num_classes,
                          "], or class indices [N] of an integer dtype (e.g. "
                          "preds.to(torch::kLong))."));
  }
  const bool ok = p.dim() >= 1 && p.size(0) == target.size(0) &&
                  (p.dim() == 1 || (o.task == Task::kMulticlass && scores && p.dim() == 2 &&
                                    p.size(1) == o.num_classes));
  if (!ok) {
    throw ConfigError(str(
        name, ".update: preds has shape ", shape_of(preds), " and target ", shape_of(target), "; ",
        o.task == Task::kBinary
            ? "a binary task takes preds [N] (scores or 0/1 labels) and target [N]."
            : str("a multiclass task of ", o.num_classes, " classes takes preds [N, ",
                  o.num_classes, "] (scores) or [N] (class indices) and target [N].")));
  }
  return p;
}

// The per-class value tp / denominator with 0 where the denominator is 0.
at::Tensor safe_ratio(const at::Tensor& num, const at::Tensor& den) {
  return torch::where(den > 0, num / den.clamp_min(1), torch::zeros_like(num));
}

enum class Score { kPrecision, kRecall, kF1 };

// Precision, recall or F1 from a [C, C] count matrix (rows: target).
at::Tensor score_from(const at::Tensor& matrix, Score score, const ClassificationOptions& o) {
  const at::Tensor m = matrix.to(at::kDouble);
  const at::Tensor tp = m.diagonal();
  const at::Tensor predicted = m.sum(0);  // tp + fp
  const at::Tensor actual = m.sum(1);     // tp + fn
  auto per_class = [&](const at::Tensor& t, const at::Tensor& p, const at::Tensor& a) {
    switch (score) {
      case Score::kPrecision: return safe_ratio(t, p);
      case Score::kRecall: return safe_ratio(t, a);
      case Score::kF1: return safe_ratio(2 * t, p + a);
    }
    return t;
  };
  // No sample at all: NaN, as Accuracy (not 0: a class without predicted
  // samples has precision 0, but here there is nothing to score).
  const at::Tensor none = torch::full({}, std::nan(""), m.options());
  if (o.task == Task::kBinary) {
    return torch::where(m.sum() > 0, per_class(tp[1], predicted[1], actual[1]), none);
  }
  if (o.average == Average::kMicro) {
    return torch::where(m.sum() > 0, per_class(tp.sum(), predicted.sum(), actual.sum()), none);
  }
  const at::Tensor present = (predicted + actual) > 0;
  const at::Tensor values = per_class(tp, predicted, actual);
  const at::Tensor count = present.sum();
  return torch::where(count > 0, (values * present).sum() / count.clamp_min(1),
                      torch::full({}, std::nan(""), values.options()));
}

}  // namespace

ConfusionCounts::ConfusionCounts(ClassificationOptions options, std::string name, bool pairs)
    : options_(std::move(options)), name_(std::move(name)) {
  check_options(options_, name_);
  classes_ = options_.task == Task::kBinary ? 2 : options_.num_classes;
  if (!pairs) return;
  try {
    add_state("matrix", torch::zeros({classes_, classes_}, torch::kLong), Reduction::kSum);
  } catch (const std::exception& e) {  // c10::Error or std::bad_alloc
    int64_t cells = 0;
    const bool overflows = __builtin_mul_overflow(classes_, classes_, &cells) ||
                           __builtin_mul_overflow(cells, int64_t{8}, &cells);
    throw ConfigError(
        str(name_, ": num_classes=", classes_, " needs a [", classes_, ", ", classes_,
            "] matrix of int64 counts (",
            overflows ? std::string("more bytes than an int64 holds") : str(cells, " bytes"),
            "), which could not be made: ", error_message(e), ". Check num_classes."));
  }
}

std::pair<at::Tensor, at::Tensor> ConfusionCounts::labels(const at::Tensor& preds,
                                                          const at::Tensor& target) const {
  const at::Tensor p = checked_preds(name_, options_, preds, target);
  at::Tensor predicted;
  if (p.dim() == 2) {
    predicted = p.argmax(1);
  } else if (c10::isFloatingType(p.scalar_type())) {
    predicted = (p >= options_.threshold).to(torch::kLong);
  } else {
    predicted = p.to(torch::kLong);
  }
  return {without_padding(predicted.to(torch::kLong)), without_padding(target.to(torch::kLong))};
}

std::pair<at::Tensor, at::Tensor> ConfusionCounts::checked_labels(const at::Tensor& preds,
                                                                  const at::Tensor& target) const {
  auto both = labels(preds, target);
  check_classes(both.second, "a target");
  check_classes(both.first, "a predicted");
  return both;
}

std::string ConfusionCounts::options_text() const {
  if (options_.task == Task::kBinary) return str("task=binary threshold=", options_.threshold);
  return "task=multiclass";
}

void ConfusionCounts::check(const at::Tensor& preds, const at::Tensor& target) const {
  // What checked_labels() refuses, without its labels: a class taken from
  // scores (argmax, threshold) is always in range.
  torch::NoGradGuard no_grad;
  const at::Tensor p = checked_preds(name_, options_, preds, target);
  check_classes(without_padding(target.to(torch::kLong)), "a target");
  if (!c10::isFloatingType(p.scalar_type())) {
    check_classes(without_padding(p.to(torch::kLong)), "a predicted");
  }
}

void ConfusionCounts::update(const at::Tensor& preds, const at::Tensor& target) {
  torch::NoGradGuard no_grad;
  auto [predicted, actual] = checked_labels(preds, target);
  count_update();
  follow(actual);
  const at::Tensor index = actual * classes_ + predicted;
  state("matrix").view({-1}).index_put_({index}, torch::ones_like(index), /*accumulate=*/true);
}

void ConfusionCounts::check_classes(const at::Tensor& labels, const char* what) const {
  check_label_range(name_, options_, classes_, labels, what);
}

Accuracy::Accuracy(ClassificationOptions options)
    : ConfusionCounts(std::move(options), "Accuracy", /*pairs=*/false) {
  add_state("hits", torch::zeros({classes_}, torch::kLong), Reduction::kSum);
  add_state("support", torch::zeros({classes_}, torch::kLong), Reduction::kSum);
}

std::pair<at::Tensor, at::Tensor> Accuracy::hits(const at::Tensor& preds,
                                                 const at::Tensor& target) const {
  const at::Tensor p = checked_preds(name_, options_, preds, target);
  if (options_.top_k > 1) {
    check_top_k(p, preds);
    const at::Tensor actual = without_padding(target.to(torch::kLong));
    check_classes(actual, "a target");
    const at::Tensor top = without_padding(std::get<1>(p.topk(options_.top_k, 1)));
    return {(top == actual.unsqueeze(1)).any(1), actual};
  }
  auto [predicted, actual] = checked_labels(preds, target);
  return {predicted == actual, actual};
}

std::string Accuracy::options_text() const {
  return options_.task == Task::kBinary ? ConfusionCounts::options_text()
                                        : str("task=multiclass top_k=", options_.top_k);
}

void Accuracy::check_top_k(const at::Tensor& p, const at::Tensor& preds) const {
  if (options_.top_k > 1 && p.dim() != 2) {
    throw ConfigError(str(name_, ".update: top_k=", options_.top_k,
                          " needs the scores of every class [N, ", options_.num_classes,
                          "]; preds has shape ", shape_of(preds),
                          " (class indices, which have no second best). Pass the scores, or "
                          "top_k=1."));
  }
}

void Accuracy::check(const at::Tensor& preds, const at::Tensor& target) const {
  ConfusionCounts::check(preds, target);
  check_top_k(checked_preds(name_, options_, preds, target), preds);
}

void Accuracy::update(const at::Tensor& preds, const at::Tensor& target) {
  torch::NoGradGuard no_grad;
  const auto [hit, actual] = hits(preds, target);
  count_update();
  follow(actual);
  state("support").index_put_({actual}, torch::ones_like(actual), /*accumulate=*/true);
  state("hits").index_put_({actual}, hit.to(torch::kLong), /*accumulate=*/true);
}

at::Tensor Accuracy::compute_from(const std::vector<at::Tensor>& states) const {
  const at::Tensor hits = states[0].to(at::kDouble);
  const at::Tensor support = states[1].to(at::kDouble);
  if (options_.task == Task::kBinary || options_.average == Average::kMicro) {
    const at::Tensor total = support.sum();
    return torch::where(total > 0, hits.sum() / total.clamp_min(1),
                        torch::full({}, std::nan(""), total.options()));
  }
  const at::Tensor present = support > 0;
  const at::Tensor count = present.sum();
  return torch::where(count > 0,
                      (safe_ratio(hits, support) * present).sum() / count.clamp_min(1),
                      torch::full({}, std::nan(""), hits.options()));
}

Precision::Precision(ClassificationOptions options)
    : ConfusionCounts(std::move(options), "Precision") {}
at::Tensor Precision::compute_from(const std::vector<at::Tensor>& states) const {
  return score_from(states[0], Score::kPrecision, options_);
}

Recall::Recall(ClassificationOptions options) : ConfusionCounts(std::move(options), "Recall") {}
at::Tensor Recall::compute_from(const std::vector<at::Tensor>& states) const {
  return score_from(states[0], Score::kRecall, options_);
}

F1Score::F1Score(ClassificationOptions options) : ConfusionCounts(std::move(options), "F1Score") {}
at::Tensor F1Score::compute_from(const std::vector<at::Tensor>& states) const {
  return score_from(states[0], Score::kF1, options_);
}

ConfusionMatrix::ConfusionMatrix(ClassificationOptions options)
    : ConfusionCounts(std::move(options), "ConfusionMatrix") {}
at::Tensor ConfusionMatrix::compute_from(const std::vector<at::Tensor>& states) const {
  return states[0].clone();
}

double binary_auroc(const at::Tensor& scores, const at::Tensor& positive) {
  const at::Tensor s = scores.to(at::kCPU, at::kDouble).reshape({-1});
  const at::Tensor pos = positive.to(at::kCPU, at::kDouble).reshape({-1});
  const double n_pos = pos.sum().item<double>();
  const double n_neg = static_cast<double>(s.size(0)) - n_pos;
  if (n_pos == 0 || n_neg == 0) return std::nan("");
  // Ranks 1..N of the sorted scores, tied scores sharing their mean rank.
  const auto [sorted, order] = s.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
  const auto [values, group, counts] =
      at::unique_consecutive(sorted, /*return_inverse=*/true, /*return_counts=*/true);
  const at::Tensor ends = counts.cumsum(0).to(at::kDouble);
  const at::Tensor mean_rank = ends - (counts.to(at::kDouble) - 1) / 2;
  const double rank_sum = (mean_rank.index_select(0, group) * pos.index_select(0, order))
                              .sum()
                              .item<double>();
  return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg);
}

AUROC::AUROC(ClassificationOptions options) : options_(std::move(options)) {
  check_options(options_, "AUROC");
  add_state("scores",
            options_.task == Task::kBinary ? at::empty({0}, at::kDouble)
                                           : at::empty({0, options_.num_classes}, at::kDouble),
            Reduction::kCat);
  add_state("target", at::empty({0}, at::kLong), Reduction::kCat);
}

std::pair<at::Tensor, at::Tensor> AUROC::checked_scores(const at::Tensor& preds,
                                                        const at::Tensor& target) const {
  const at::Tensor p = checked_preds("AUROC", options_, preds, target);
  if (!c10::isFloatingType(p.scalar_type()) || (options_.task == Task::kMulticlass && p.dim() != 2)) {
    throw ConfigError(str("AUROC.update: preds has shape ", shape_of(preds), " and dtype ",
                          c10::toString(preds.scalar_type()),
                          "; the area needs scores (a floating dtype)",
                          options_.task == Task::kMulticlass
                              ? str(" of every class: [N, ", options_.num_classes, "]")
                              : std::string(" [N]"),
                          ", not labels."));
  }
  const at::Tensor t = without_padding(target.to(torch::kLong));
  check_label_range("AUROC", options_, options_.task == Task::kBinary ? 2 : options_.num_classes, t,
                    "a target");
  return {without_padding(p), t};
}

void AUROC::check(const at::Tensor& preds, const at::Tensor& target) const {
  torch::NoGradGuard no_grad;
  (void)checked_scores(preds, target);
}

void AUROC::update(const at::Tensor& preds, const at::Tensor& target) {
  torch::NoGradGuard no_grad;
  auto [scores, t] = checked_scores(preds, target);
  if (options_.task == Task::kMulticlass && scores.numel() > 0) {
    // Logits (a score outside [0, 1]) become probabilities, decided on the
    // device (no read-back).
    const at::Tensor logits = ((scores < 0) | (scores > 1)).any();
    scores = torch::where(logits, scores.softmax(1), scores);
  }
  count_update();
  append("scores", scores);
  append("target", t);
}

at::Tensor AUROC::compute_from(const std::vector<at::Tensor>& states) const {
  const at::Tensor& scores = states[0];
  const at::Tensor target = states[1].to(at::kCPU);
  // A NaN score (a diverged model) has no rank: the area is NaN, not the
  // value of NaNs sorted as the largest scores.
  if (scores.numel() > 0 && scores.isnan().any().item<bool>()) {
    return torch::tensor(std::nan(""), torch::kDouble);
  }
  if (options_.task == Task::kBinary) {
    return torch::tensor(binary_auroc(scores, target == 1), torch::kDouble);
  }
  double sum = 0;
  int64_t classes = 0;
  for (int64_t c = 0; c < options_.num_classes; ++c) {
    const double area = binary_auroc(scores.select(1, c), target == c);
    if (std::isnan(area)) continue;
    sum += area;
    ++classes;
  }
  return torch::tensor(classes > 0 ? sum / static_cast<double>(classes) : std::nan(""),
                       torch::kDouble);
}

}  // namespace fulgur::metrics
