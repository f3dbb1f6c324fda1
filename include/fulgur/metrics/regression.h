// File: fulgur/metrics/regression.h
//
// Regression metrics over every element of an epoch, exact across ranks
// (fulgur/metrics/metric.h), and the plain aggregations:
//
//   fulgur::metrics::MeanSquaredError mse;
//   mse.update(prediction, target);        // same shape; every element counts
//   log("val_mse", mse);
//
//   fulgur::metrics::MeanMetric loss;      // a mean over samples, not batches
//   loss.update(per_sample_loss);          // or update(batch_mean, batch_size)
#pragma once

#include <string>

#include "fulgur/metrics/metric.h"

namespace fulgur::metrics {

/// The mean of (preds - target)^2 over every element (float64 sums).
class MeanSquaredError : public PredictionMetric {
 public:
  MeanSquaredError();
  void update(const at::Tensor& preds, const at::Tensor& target) override;
  void check(const at::Tensor& preds, const at::Tensor& target) const override;
  std::string name() const override { return "MeanSquaredError"; }

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& states) const override;
};

/// The mean of |preds - target| over every element (float64 sums).
class MeanAbsoluteError : public PredictionMetric {
 public:
  MeanAbsoluteError();
  void update(const at::Tensor& preds, const at::Tensor& target) override;
  void check(const at::Tensor& preds, const at::Tensor& target) const override;
  std::string name() const override { return "MeanAbsoluteError"; }

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& states) const override;
};

/// The weighted mean of every value updated: update(values) weighs each
/// element 1; update(value, weight) weighs every element of `value` by
/// `weight` (a batch's mean loss with the batch's size). NaN before any
/// weight. Padded repeats (see metric.h) are left out of per-sample values
/// only: a batch's mean (a 0-dim value or a number) already holds them,
/// so under fsdp FULL_SHARD evaluation update with per-sample values.
class MeanMetric : public Metric {
 public:
  MeanMetric();
  void update(const at::Tensor& values, double weight = 1.0);
  void update(double value, double weight = 1.0);
  std::string name() const override { return "MeanMetric"; }

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& states) const override;
};

/// The sum of every element updated (float64).
class SumMetric : public Metric {
 public:
  SumMetric();
  void update(const at::Tensor& values);
  void update(double value);
  std::string name() const override { return "SumMetric"; }

 protected:
  at::Tensor compute_from(const std::vector<at::Tensor>& states) const override;
};

}  // namespace fulgur::metrics
