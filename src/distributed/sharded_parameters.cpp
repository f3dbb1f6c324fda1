#include "fulgur/distributed/sharded_parameters.h"

#include <torch/torch.h>

#include <utility>

#include "fulgur/core/errors.h"
#include "fulgur/distributed/process_group.h"

namespace fulgur {

namespace {

// `indices` of `parameters` per (dtype, device), in order of first
// appearance: one collective each.
std::vector<std::vector<size_t>> by_dtype_and_device(const std::vector<at::Tensor>& parameters,
                                                     const std::vector<size_t>& indices) {
  std::vector<std::vector<size_t>> groups;
  std::vector<std::pair<c10::ScalarType, c10::Device>> keys;
  for (size_t i : indices) {
    const std::pair<c10::ScalarType, c10::Device> key{parameters[i].scalar_type(),
                                                      parameters[i].device()};
    size_t g = 0;
    while (g < keys.size() && keys[g] != key) ++g;
    if (g == keys.size()) {
      keys.push_back(key);
      groups.emplace_back();
    }
    groups[g].push_back(i);
  }
  return groups;
}

// Chunk `rank` of `parameter` (flattened) into `shard`; the padding past the
// parameter's end stays as it is (zeros).
void copy_chunk(const at::Tensor& parameter, int64_t rank, at::Tensor& shard) {
  const int64_t n = parameter.numel(), k = shard.numel();
  const int64_t start = std::min(rank * k, n);
  const int64_t take = std::min(k, n - start);
  if (take > 0) {
    shard.detach()
        .narrow(0, 0, take)
        .copy_(parameter.detach().reshape({-1}).narrow(0, start, take));
  }
}

}  // namespace

ShardedExchange::ShardedExchange() = default;
ShardedExchange::~ShardedExchange() = default;
ShardedExchange::ShardedExchange(ShardedExchange&&) noexcept = default;
ShardedExchange& ShardedExchange::operator=(ShardedExchange&&) noexcept = default;

bool ShardedExchange::pending() const { return !exchanges_.empty() || !then_.empty(); }

void ShardedExchange::wait() {
  for (auto& e : exchanges_) e.wait();
  exchanges_.clear();
  auto then = std::move(then_);
  then_.clear();
  for (auto& step : then) step();
}

ShardedParameters::ShardedParameters(std::vector<at::Tensor> parameters,
                                     std::shared_ptr<ProcessGroup> group, bool share_storage)
    : parameters_(std::move(parameters)), group_(std::move(group)) {
  if (!group_) {
    throw ConfigError("ShardedParameters: pass the process group the parameters are sharded over.");
  }
  if (parameters_.empty()) {
    throw ConfigError(
        "ShardedParameters: no parameters to shard. Pass the parameters the optimizer steps.");
  }
  const int64_t world = group_->size();
  const int64_t rank = group_->rank();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const at::Tensor& p = parameters_[i];
    if (!p.defined() || !p.requires_grad()) {
      throw ConfigError(fulgur::str("ShardedParameters: parameter ", i, " (",
                                    p.defined() ? p.sizes() : at::IntArrayRef{},
                                    ") does not require a gradient. Shard only the parameters that "
                                    "train; frozen ones stay whole on every rank."));
    }
    const int64_t n = p.numel();
    sizes_.emplace_back(p.sizes().begin(), p.sizes().end());
    bytes_.push_back(static_cast<int64_t>(p.nbytes()));
    const int64_t k = (n + world - 1) / world;
    chunks_.push_back(k);
    at::Tensor shard;
    const bool view = share_storage && p.is_contiguous() && (rank + 1) * k <= n;
    if (view) {
      // Shares p's memory (and version counter): the optimizer's in-place
      // step on the shard is a write of p's chunk.
      shard = p.detach().view({-1}).narrow(0, rank * k, k);
    } else {
      shard = torch::zeros({k}, p.options().requires_grad(false));
      copy_chunk(p, rank, shard);
    }
    shards_.push_back(shard.requires_grad_(true));
    shared_.push_back(view ? 1 : 0);
  }
  released_.assign(parameters_.size(), 0);
}

std::vector<size_t> ShardedParameters::all_indices() const {
  std::vector<size_t> indices(parameters_.size());
  for (size_t i = 0; i < indices.size(); ++i) indices[i] = i;
  return indices;
}

int64_t ShardedParameters::held_parameter_bytes() const {
  int64_t bytes = 0;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (!released(i)) bytes += bytes_[i];
  }
  return bytes;
}

void ShardedParameters::release_parameters(const std::vector<size_t>& indices) {
  for (size_t i : indices) {
    if (released(i)) continue;
    const at::Tensor& p = parameters_[i];
    if (shares_storage(i)) {
      throw ConfigError(fulgur::str(
          "ShardedParameters: parameter ", i, " (", p.sizes(),
          ") holds its own shard "
          "(share_storage), so its memory cannot be freed between uses; shard it without "
          "share_storage to release it."));
    }
    c10::StorageImpl* storage = p.storage().unsafeGetStorageImpl();
    if (storage->nbytes() != p.nbytes() || p.storage_offset() != 0 || !p.is_contiguous()) {
      throw ConfigError(fulgur::str(
          "ShardedParameters: parameter ", i, " (", p.sizes(), ") is a view of a storage of ",
          storage->nbytes(), " bytes, not the owner of its own ", p.nbytes(),
          " bytes; freeing it between uses would free what shares that storage. Give the "
          "parameter its own tensor (e.g. register_parameter(name, tensor.clone()))."));
    }
    if (storage->allocator() == nullptr) {
      throw ConfigError(fulgur::str("ShardedParameters: parameter ", i, " (", p.sizes(),
                                    ") wraps memory fulgur cannot allocate again (from_blob); "
                                    "give the parameter a tensor of its own."));
    }
    // The same StorageImpl stays (graphs saved views of it): only its
    // memory goes, and comes back in place. The parameter itself shows no
    // elements meanwhile, so an op on it is a shape error (or an empty
    // result), never a read of freed memory; its shape comes back with
    // the values (and so for a graph that saved the parameter itself).
    storage->set_data_ptr_noswap(c10::DataPtr(nullptr, p.device()));
    storage->set_nbytes(0);
    p.unsafeGetTensorImpl()->set_sizes_contiguous({0});
    released_[i] = 1;
  }
}

int64_t ShardedParameters::shard_bytes() const {
  int64_t bytes = 0;
  for (size_t i = 0; i < shards_.size(); ++i) {
    if (!shares_storage(i)) bytes += static_cast<int64_t>(shards_[i].nbytes());
  }
  return bytes;
}

int64_t ShardedParameters::parameter_bytes() const {
  int64_t bytes = 0;
  for (int64_t b : bytes_) bytes += b;
  return bytes;
}

int64_t ShardedParameters::numel(size_t i) const { return c10::multiply_integers(sizes_[i]); }

bool ShardedParameters::direct(size_t i) const {
  const int64_t n = numel(i);
  return n >= kDirectElements && n == chunks_[i] * group_->size() &&
         (released(i) || parameters_[i].is_contiguous());
}

void ShardedParameters::add_to_shard_grad(size_t i, const at::Tensor& part, bool owned) {
  at::Tensor& grad = shards_[i].mutable_grad();
  if (grad.defined()) {
    grad.add_(part);  // a second backward before the step accumulates
  } else {
    grad = owned ? part : part.clone();
  }
}

void ShardedParameters::allocate_if_released(size_t i) {
  if (!released(i)) return;
  at::Tensor& p = parameters_[i];
  c10::StorageImpl* storage = p.storage().unsafeGetStorageImpl();
  const auto bytes = static_cast<size_t>(bytes_[i]);
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
  p.unsafeGetTensorImpl()->set_sizes_contiguous(sizes_[i]);
  released_[i] = 0;
}

bool ShardedParameters::reduce_scatter_gradients() {
  return reduce_scatter_gradients(all_indices());
}

bool ShardedParameters::reduce_scatter_gradients(const std::vector<size_t>& indices,
                                                 bool contributes) {
  auto exchange = start_reduce_scatter_gradients(indices, contributes);
  exchange.wait();
  return exchange.any_gradient();
}

std::vector<int> ShardedParameters::local_gradients(const std::vector<size_t>& indices) const {
  std::vector<int> flags(indices.size(), 0);
  for (size_t j = 0; j < indices.size(); ++j) {
    if (parameters_[indices[j]].grad().defined()) flags[j] = 1;
  }
  return flags;
}

ShardedExchange ShardedParameters::start_reduce_scatter_gradients(
    const std::vector<size_t>& indices, bool contributes) {
  if (indices.empty()) return {};
  // Which parameters have a gradient on some rank (DDP's rule: the others
  // keep none, and the optimizer skips them), and how many ranks
  // contribute (the mean is over them, as DDP's join takes it).
  std::vector<int> flags = local_gradients(indices);
  flags.push_back(contributes ? 1 : 0);
  at::Tensor summed = torch::tensor(flags, torch::kInt);
  group_->all_reduce_(summed, ReduceOp::kSum);
  const auto n = static_cast<int64_t>(indices.size());
  GradientAgreement agreed;
  const int* sums = summed.data_ptr<int>();
  agreed.anywhere.assign(sums, sums + n);
  agreed.contributors = sums[n];
  return start_reduce_scatter_gradients(indices, agreed);
}

ShardedExchange ShardedParameters::start_reduce_scatter_gradients(
    const std::vector<size_t>& indices, const GradientAgreement& agreed) {
  ShardedExchange exchange;
  if (indices.empty()) return exchange;
  FULGUR_ASSERT(agreed.anywhere.size() == indices.size(),
                "a gradient agreement of another exchange's parameters");
  torch::NoGradGuard no_grad;
  std::vector<char> anywhere(parameters_.size(), 0);
  bool any = false;
  for (size_t j = 0; j < indices.size(); ++j) {
    anywhere[indices[j]] = static_cast<char>(agreed.anywhere[j] != 0);
    any = any || agreed.anywhere[j] != 0;
  }
  const int64_t contributors = agreed.contributors;
  const int64_t world = group_->size();
  const double mean_over = static_cast<double>(std::max<int64_t>(contributors, 1));
  for (const auto& group : by_dtype_and_device(parameters_, indices)) {
    // Rank-major packing: block r holds every parameter's chunk r, so the
    // reduce-scatter hands each rank its chunks of all of them at once.
    std::vector<size_t> mine;
    std::vector<int64_t> offsets;
    int64_t total = 0;
    for (size_t i : group) {
      if (anywhere[i] == 0) continue;
      if (direct(i)) {
        // Straight from the gradient (a view of it); zeros where this rank has none.
        const at::Tensor& p = parameters_[i];
        const at::Tensor grad = p.grad();
        // The gradient's memory is the exchange's scratch (it is released
        // below); the shard's gradient is a copy of its chunk.
        at::Tensor flat = grad.defined()
                              ? grad.reshape({-1})
                              : torch::zeros({p.numel()}, p.options().requires_grad(false));
        exchange.exchanges_.push_back(group_->reduce_scatter_sum_async_(flat));
        const int64_t k = chunks_[i], r = group_->rank();
        exchange.then_.push_back([this, i, flat, k, r, mean_over] {
          torch::NoGradGuard no_grad;
          add_to_shard_grad(i, flat.narrow(0, r * k, k).div_(mean_over), /*owned=*/false);
        });
        continue;
      }
      mine.push_back(i);
      offsets.push_back(total);
      total += chunks_[i];
    }
    if (mine.empty()) continue;
    const at::Tensor& first = parameters_[mine.front()];
    at::Tensor packed = torch::zeros({world * total}, first.options().requires_grad(false));
    const at::Tensor blocks = packed.view({world, total});
    for (size_t j = 0; j < mine.size(); ++j) {
      const at::Tensor grad = parameters_[mine[j]].grad();
      if (!grad.defined()) continue;  // zeros from this rank
      const at::Tensor flat = grad.reshape({-1});
      const int64_t n = flat.numel(), k = chunks_[mine[j]];
      for (int64_t r = 0; r < world && r * k < n; ++r) {
        const int64_t len = std::min(k, n - r * k);
        blocks[r].narrow(0, offsets[j], len).copy_(flat.narrow(0, r * k, len));
      }
    }
    exchange.exchanges_.push_back(group_->reduce_scatter_sum_async_(packed));
    exchange.then_.push_back([this, packed, mine, offsets, total, mean_over] {
      torch::NoGradGuard no_grad;
      const at::Tensor reduced = packed.narrow(0, group_->rank() * total, total).div_(mean_over);
      for (size_t j = 0; j < mine.size(); ++j) {
        add_to_shard_grad(mine[j], reduced.narrow(0, offsets[j], chunks_[mine[j]]),
                          /*owned=*/false);
      }
    });
  }
  // The gradients are the exchanges' scratch until they end.
  exchange.then_.push_back([this, indices] {
    for (size_t i : indices) parameters_[i].mutable_grad().reset();
  });
  exchange.any_ = any;
  return exchange;
}

void ShardedParameters::all_gather_parameters() { all_gather_parameters(all_indices()); }

void ShardedParameters::all_gather_parameters(const std::vector<size_t>& all) {
  start_all_gather_parameters(all).wait();
}

ShardedExchange ShardedParameters::start_all_gather_parameters(const std::vector<size_t>& all) {
  ShardedExchange exchange;
  const int64_t world = group_->size();
  torch::NoGradGuard no_grad;
  for (const auto& group : by_dtype_and_device(parameters_, all)) {
    std::vector<size_t> indices;
    for (size_t i : group) {
      if (!direct(i)) {
        indices.push_back(i);
        continue;
      }
      // Straight into the parameter's storage (its layout is the gathered
      // one: chunk r at r * chunk), through an alias with a version counter
      // of its own, as below.
      allocate_if_released(i);
      at::Tensor flat = parameters_[i].variable_data().view({-1});
      exchange.exchanges_.push_back(group_->all_gather_into_async(flat, shards_[i].detach()));
    }
    if (indices.empty()) continue;
    std::vector<at::Tensor> pieces;
    for (size_t i : indices) pieces.push_back(shards_[i].detach());
    const at::Tensor packed = torch::cat(pieces);
    const int64_t total = packed.numel();
    at::Tensor gathered = torch::empty({world * total}, packed.options());
    exchange.exchanges_.push_back(group_->all_gather_into_async(gathered, packed));
    for (size_t i : indices) allocate_if_released(i);
    exchange.then_.push_back([this, gathered, indices, world, total] {
      torch::NoGradGuard no_grad;
      const at::Tensor blocks = gathered.view({world, total});
      int64_t offset = 0;
      for (size_t i : indices) {
        at::Tensor& p = parameters_[i];
        const at::Tensor full = blocks.narrow(1, offset, chunks_[i]).reshape({-1});
        // Written through an alias with a version counter of its own: a
        // graph that saved the parameter (gathered again for its backward)
        // finds it at the version it saved, holding the same values.
        p.variable_data().copy_(full.narrow(0, 0, p.numel()).view(p.sizes()));
        offset += chunks_[i];
      }
    });
  }
  return exchange;
}

at::Tensor ShardedParameters::shard_of(size_t i, const at::Tensor& whole) const {
  at::Tensor shard = torch::zeros({chunks_[i]}, whole.options().requires_grad(false));
  copy_chunk(whole, group_->rank(), shard);
  return shard;
}

at::Tensor ShardedParameters::gather_whole(size_t i, const at::Tensor& shard) const {
  torch::NoGradGuard no_grad;
  at::Tensor gathered = torch::empty({group_->size() * chunks_[i]}, shard.options());
  group_->all_gather_into(gathered, shard.detach().contiguous());
  return gathered.narrow(0, 0, numel(i)).view(sizes_[i]).clone();
}

void ShardedParameters::take_from_parameters() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    // A shard sharing its parameter's memory already holds the new values.
    if (!shares_storage(i)) copy_chunk(parameters_[i], group_->rank(), shards_[i]);
  }
}

}  // namespace fulgur
