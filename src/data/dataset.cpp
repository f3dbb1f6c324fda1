#include "fulgur/data/dataset.h"

#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include "data/sample_scope.h"
#include "fulgur/core/errors.h"

namespace fulgur {

namespace {

struct SampleContext {
  uint64_t seed = 0;
  int64_t epoch = 0;
};
thread_local SampleContext sample_context;

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

namespace detail {
SampleScope::SampleScope(uint64_t seed, int64_t epoch)
    : previous_seed_(sample_context.seed), previous_epoch_(sample_context.epoch) {
  sample_context = {seed, epoch};
}
SampleScope::~SampleScope() { sample_context = {previous_seed_, previous_epoch_}; }
}  // namespace detail

at::Generator sample_generator(int64_t index) {
  uint64_t h = splitmix64(sample_context.seed);
  h = splitmix64(h ^ static_cast<uint64_t>(sample_context.epoch));
  h = splitmix64(h ^ static_cast<uint64_t>(index));
  return at::make_generator<at::CPUGeneratorImpl>(h);
}

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
