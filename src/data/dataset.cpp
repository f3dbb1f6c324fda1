#include "fulgur/data/dataset.h"

#include <torch/torch.h>

#include "fulgur/core/errors.h"

namespace fulgur {

TensorDataset::TensorDataset(std::vector<at::Tensor> tensors) : tensors_(std::move(tensors)) {
  if (tensors_.empty()) {
    throw ConfigError("TensorDataset({}): needs at least one tensor.");
  }
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const auto& t = tensors_[i];
    if (!t.defined() || t.dim() == 0) {
      throw ConfigError(str("TensorDataset: tensor ", i,
                            " is undefined or a scalar; every tensor needs a sample dimension 0."));
    }
    if (t.size(0) != tensors_[0].size(0)) {
      throw ConfigError(str("TensorDataset: tensor ", i, " has ", t.size(0),
                            " samples in dimension 0 but tensor 0 has ", tensors_[0].size(0),
                            ". All tensors must have the same number of samples."));
    }
  }
}

TensorDataset::TensorDataset(at::Tensor input, at::Tensor target)
    : TensorDataset(std::vector<at::Tensor>{std::move(input), std::move(target)}) {}

int64_t TensorDataset::size() const { return tensors_[0].size(0); }

Batch TensorDataset::get_batch(const at::Tensor& indices) const {
  if (tensors_.size() == 1) return Batch(tensors_[0].index_select(0, indices));
  if (tensors_.size() == 2) {
    return Batch(tensors_[0].index_select(0, indices), tensors_[1].index_select(0, indices));
  }
  Batch::List out;
  out.reserve(tensors_.size());
  for (const auto& t : tensors_) out.push_back(t.index_select(0, indices));
  return Batch(std::move(out));
}

}  // namespace fulgur
