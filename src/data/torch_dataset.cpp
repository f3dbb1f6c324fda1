#include "fulgur/data/torch_dataset.h"

#include <torch/torch.h>

namespace fulgur {

namespace detail {

Batch collate(const std::vector<torch::data::Example<>>& examples) {
  std::vector<at::Tensor> data, target;
  data.reserve(examples.size());
  target.reserve(examples.size());
  for (const auto& e : examples) {
    data.push_back(e.data);
    target.push_back(e.target);
  }
  return Batch(torch::stack(data), torch::stack(target));
}

Batch collate(const std::vector<torch::data::TensorExample>& examples) {
  std::vector<at::Tensor> data;
  data.reserve(examples.size());
  for (const auto& e : examples) data.push_back(e.data);
  return Batch(torch::stack(data));
}

std::vector<size_t> to_index_vector(const at::Tensor& indices) {
  auto contiguous = indices.to(torch::kLong).contiguous();
  const int64_t* p = contiguous.data_ptr<int64_t>();
  return std::vector<size_t>(p, p + contiguous.numel());
}

}  // namespace detail

TorchSamplerAdapter::TorchSamplerAdapter(std::shared_ptr<torch::data::samplers::Sampler<>> sampler)
    : sampler_(std::move(sampler)) {
  if (!sampler_) throw ConfigError("TorchSamplerAdapter(nullptr): pass a torch::data sampler.");
}

at::Tensor TorchSamplerAdapter::epoch_indices(int64_t epoch, int64_t dataset_size) {
  if (restored_ && epoch == epoch_) {
    restored_ = false;
    return shard(order_);
  }
  restored_ = false;
  sampler_->reset(static_cast<size_t>(dataset_size));
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(dataset_size));
  while (auto chunk = sampler_->next(static_cast<size_t>(std::max<int64_t>(dataset_size, 1)))) {
    if (chunk->empty()) break;
    for (size_t i : *chunk) order.push_back(static_cast<int64_t>(i));
  }
  epoch_ = epoch;
  order_ = torch::tensor(order, torch::kLong);
  return shard(order_);
}

StateDict TorchSamplerAdapter::state_dict() const {
  StateDict state;
  state.set("epoch", epoch_);
  if (order_.defined()) state.set_buffer("order", order_);
  return state;
}

void TorchSamplerAdapter::load_state_dict(const StateDict& state) {
  if (state.contains("epoch") && state.contains("order")) {
    const int64_t epoch = state.integer("epoch");
    order_ = state.tensor("order");
    epoch_ = epoch;
    restored_ = true;
  }
}

}  // namespace fulgur
