// File: fulgur/data/dataset.h
//
// A map-style Dataset: a known size and random access to a batch of indices.
// TensorDataset is the in-memory case (every tensor indexed on dimension 0);
// fulgur/data/torch_dataset.h adapts torch::data datasets.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "fulgur/data/batch.h"

namespace fulgur {

class Dataset {
 public:
  virtual ~Dataset() = default;
  /// Number of samples.
  virtual int64_t size() const = 0;
  /// The samples at `indices` (an int64 CPU tensor), collated into one batch.
  virtual Batch get_batch(const at::Tensor& indices) const = 0;
};

/// Tensors that share dimension 0; a batch has the same kind as the tensors
/// given: one tensor → a tensor batch, two → a pair, more → a list.
class TensorDataset : public Dataset {
 public:
  /// Throws ConfigError if the tensors are empty or differ in dimension 0.
  explicit TensorDataset(std::vector<at::Tensor> tensors);
  TensorDataset(at::Tensor input, at::Tensor target);

  int64_t size() const override;
  Batch get_batch(const at::Tensor& indices) const override;
  const std::vector<at::Tensor>& tensors() const { return tensors_; }

 private:
  std::vector<at::Tensor> tensors_;
};

}  // namespace fulgur
