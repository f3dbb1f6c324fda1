// File: fulgur/data/dataset.h
//
// A map-style Dataset: a known size and random access to a batch of indices.
// TensorDataset is the in-memory case (every tensor indexed on dimension 0);
// fulgur/data/torch_dataset.h adapts torch::data datasets.
#pragma once

#include <ATen/core/Generator.h>
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

/// The generator for the random choices (augmentation) of sample `index`
/// while a loader loads it in Dataset::get_batch: seeded from the loader's
/// seed, the epoch and `index`, so a sample gets the same choices whichever
/// worker thread loads it and whichever batch holds it, and a resumed run
/// repeats them. (torch's default generator is shared by every thread: in a
/// loader with workers, draw from this one.) Outside a loader: seed 0,
/// epoch 0.
///
///   Batch get_batch(const at::Tensor& indices) const override {
///     ... auto flip = torch::rand({1}, fulgur::sample_generator(i)).item<float>() < 0.5;
at::Generator sample_generator(int64_t index);

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
