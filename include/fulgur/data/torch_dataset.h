// File: fulgur/data/torch_dataset.h
//
// Adapters for LibTorch's own data API: a map-style torch::data dataset
// becomes a fulgur::Dataset, and a torch::data sampler becomes a
// fulgur::Sampler, so existing datasets and samplers plug into fulgur's
// loaders (and so into exact mid-epoch resume).
//
//   struct MyData : torch::data::datasets::Dataset<MyData> {
//     torch::data::Example<> get(size_t i) override { ... }
//     torch::optional<size_t> size() const override { return n; }
//   };
//   auto loader = fulgur::make_data_loader(
//       fulgur::from_torch_dataset(MyData{}), {.batch_size = 32},
//       std::make_shared<fulgur::TorchSamplerAdapter>(
//           std::make_shared<torch::data::samplers::RandomSampler>(0)));
#pragma once

#include <torch/data/datasets/base.h>
#include <torch/data/example.h>
#include <torch/data/samplers/base.h>

#include <memory>
#include <type_traits>
#include <vector>

#include "fulgur/core/errors.h"
#include "fulgur/data/dataset.h"
#include "fulgur/data/sampler.h"

namespace fulgur {

namespace detail {
/// Stacks a batch of examples: Example<Tensor, Tensor> → pair, TensorExample
/// → tensor. Other example types need a custom fulgur::Dataset.
Batch collate(const std::vector<torch::data::Example<>>& examples);
Batch collate(const std::vector<torch::data::TensorExample>& examples);
std::vector<size_t> to_index_vector(const at::Tensor& indices);
}  // namespace detail

/// A map-style torch::data dataset (anything with size() and get_batch())
/// as a fulgur::Dataset. The dataset is owned by the adapter.
template <class TorchDataset>
class TorchDatasetAdapter : public Dataset {
 public:
  explicit TorchDatasetAdapter(TorchDataset dataset) : dataset_(std::move(dataset)) {
    if (!dataset_.size().has_value()) {
      throw ConfigError(
          "from_torch_dataset: the dataset's size() is unknown; fulgur's "
          "DatasetLoader needs a map-style dataset of known size. Wrap a "
          "stream in make_iterable_loader instead.");
    }
  }
  int64_t size() const override { return static_cast<int64_t>(*dataset_.size()); }
  Batch get_batch(const at::Tensor& indices) const override {
    // torch::data's get_batch is not const; the adapter never exposes the
    // dataset elsewhere, so reading through it does not break constness.
    auto& dataset = const_cast<TorchDataset&>(dataset_);
    return detail::collate(dataset.get_batch(detail::to_index_vector(indices)));
  }
  TorchDataset& dataset() { return dataset_; }

 private:
  TorchDataset dataset_;
};

template <class TorchDataset>
std::shared_ptr<Dataset> from_torch_dataset(TorchDataset dataset) {
  return std::make_shared<TorchDatasetAdapter<TorchDataset>>(std::move(dataset));
}

/// A torch::data sampler (RandomSampler, SequentialSampler, ...) as a
/// fulgur::Sampler. At each epoch start it resets the sampler and draws the
/// whole epoch's order; checkpoints store that order, so a resumed epoch
/// visits the same samples even though torch's RandomSampler draws from the
/// global generator.
class TorchSamplerAdapter : public Sampler {
 public:
  explicit TorchSamplerAdapter(std::shared_ptr<torch::data::samplers::Sampler<>> sampler);
  at::Tensor epoch_indices(int64_t epoch, int64_t dataset_size) override;
  /// "epoch" (int) and, once an epoch was drawn, "order" (the epoch's
  /// unsharded order: an int64 buffer). Loaded only when both are there.
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;

 private:
  std::shared_ptr<torch::data::samplers::Sampler<>> sampler_;
  int64_t epoch_ = -1;
  at::Tensor order_;
  bool restored_ = false;
};

}  // namespace fulgur
