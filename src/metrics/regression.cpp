// MeanSquaredError, MeanAbsoluteError, MeanMetric and SumMetric: float64
// sums and counts.
#include "fulgur/metrics/regression.h"

#include <torch/torch.h>

#include <cmath>

#include "fulgur/core/errors.h"

namespace fulgur::metrics {

namespace {

void check_same_shape(const std::string& name, const at::Tensor& preds, const at::Tensor& target) {
  if (!preds.defined() || !target.defined() || preds.sizes() != target.sizes()) {
    throw ConfigError(str(name, ".update(preds, target): preds has shape ",
                          preds.defined() ? c10::str(preds.sizes()) : std::string("undefined"),
                          " and target ",
                          target.defined() ? c10::str(target.sizes()) : std::string("undefined"),
                          "; pass two tensors of one shape."));
  }
  Metric::check_same_device(name, preds, target);
}

void check_defined(const std::string& name, const at::Tensor& values) {
  if (!values.defined()) {
    throw ConfigError(str(name,
                          ".update(values): values is an undefined tensor; pass the values "
                          "to add (a loss, a per-sample tensor) or a number."));
  }
}

at::Tensor mean_of(const at::Tensor& sum, const at::Tensor& count) {
  return torch::where(count > 0, sum / count.clamp_min(1).to(at::kDouble),
                      torch::full({}, std::nan(""), sum.options()));
}

}  // namespace

MeanSquaredError::MeanSquaredError() {
  add_state("sum", torch::zeros({}, torch::kDouble), Reduction::kSum);
  add_state("count", torch::zeros({}, torch::kLong), Reduction::kSum);
}

void MeanSquaredError::update(const at::Tensor& preds, const at::Tensor& target) {
  torch::NoGradGuard no_grad;  // no history: a loss may need gradients
  check_same_shape(name(), preds, target);
  const at::Tensor p = without_padding(preds);
  count_update();
  follow(p);
  state("sum").add_((p.to(at::kDouble) - without_padding(target).to(at::kDouble)).square().sum());
  state("count").add_(p.numel());
}

void MeanSquaredError::check(const at::Tensor& preds, const at::Tensor& target) const {
  check_same_shape(name(), preds, target);
}

at::Tensor MeanSquaredError::compute_from(const std::vector<at::Tensor>& states) const {
  return mean_of(states[0], states[1]);
}

MeanAbsoluteError::MeanAbsoluteError() {
  add_state("sum", torch::zeros({}, torch::kDouble), Reduction::kSum);
  add_state("count", torch::zeros({}, torch::kLong), Reduction::kSum);
}

void MeanAbsoluteError::update(const at::Tensor& preds, const at::Tensor& target) {
  torch::NoGradGuard no_grad;  // no history: a loss may need gradients
  check_same_shape(name(), preds, target);
  const at::Tensor p = without_padding(preds);
  count_update();
  follow(p);
  state("sum").add_((p.to(at::kDouble) - without_padding(target).to(at::kDouble)).abs().sum());
  state("count").add_(p.numel());
}

void MeanAbsoluteError::check(const at::Tensor& preds, const at::Tensor& target) const {
  check_same_shape(name(), preds, target);
}

at::Tensor MeanAbsoluteError::compute_from(const std::vector<at::Tensor>& states) const {
  return mean_of(states[0], states[1]);
}

MeanMetric::MeanMetric() {
  add_state("sum", torch::zeros({}, torch::kDouble), Reduction::kSum);
  add_state("weight", torch::zeros({}, torch::kDouble), Reduction::kSum);
}

void MeanMetric::update(const at::Tensor& values, double weight) {
  if (!(weight >= 0) || !std::isfinite(weight)) {
    throw ConfigError(str("MeanMetric.update: weight=", weight, " must be finite and >= 0."));
  }
  torch::NoGradGuard no_grad;  // no history: a loss may need gradients
  check_defined(name(), values);
  const at::Tensor v = values.dim() == 0 ? values : without_padding(values);
  count_update();
  follow(v);
  state("sum").add_(v.to(at::kDouble).sum() * weight);
  state("weight").add_(static_cast<double>(v.numel()) * weight);
}

void MeanMetric::update(double value, double weight) {
  if (!(weight >= 0) || !std::isfinite(weight)) {
    throw ConfigError(str("MeanMetric.update: weight=", weight, " must be finite and >= 0."));
  }
  count_update();
  // Scalars added where the states are (no copy to a GPU).
  state("sum").add_(value * weight);
  state("weight").add_(weight);
}

at::Tensor MeanMetric::compute_from(const std::vector<at::Tensor>& states) const {
  return torch::where(states[1] > 0, states[0] / states[1],
                      torch::full({}, std::nan(""), states[0].options()));
}

SumMetric::SumMetric() { add_state("sum", torch::zeros({}, torch::kDouble), Reduction::kSum); }

void SumMetric::update(const at::Tensor& values) {
  torch::NoGradGuard no_grad;  // no history: a loss may need gradients
  check_defined(name(), values);
  const at::Tensor v = values.dim() == 0 ? values : without_padding(values);
  count_update();
  follow(v);
  state("sum").add_(v.to(at::kDouble).sum());
}

void SumMetric::update(double value) {
  count_update();
  state("sum").add_(value);
}

at::Tensor SumMetric::compute_from(const std::vector<at::Tensor>& states) const {
  return states[0].clone();
}

}  // namespace fulgur::metrics
