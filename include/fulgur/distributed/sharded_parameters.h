// File: fulgur/distributed/sharded_parameters.h
//
// Parameters sharded across the ranks of a process group, one shard per
// parameter (as PyTorch's FSDP2 shards them): each parameter is flattened,
// padded to a multiple of the world size, and rank r keeps chunk r as a 1-D
// leaf tensor of its own. An optimizer built on the shards steps only this
// rank's part, so its state is 1/N of DDP's, and a parameter keeps its own
// optimizer options and state (no flat parameter mixes them).
//
//   fulgur::ShardedParameters sharded(model.parameters(), group);
//   torch::optim::Adam adam(sharded.shards(), 1e-3);
//   loss.backward();                      // full gradients, as usual
//   sharded.reduce_scatter_gradients();   // shard.grad = this rank's part of the mean
//   adam.step();                          // on the shards
//   sharded.all_gather_parameters();      // every rank's parameters updated
//
// The gradients follow DDP's rule: the mean over the ranks that ran a
// backward, one without a gradient for a parameter counting as zeros, and a
// parameter no rank has a gradient for left as it is (without one, the
// optimizer skips it). Small parameters are exchanged packed, one
// collective per dtype (a reduce-scatter of their chunks, an all-gather of
// their shards); large ones on their own, straight from their gradient and
// into their storage (plus a small all-reduce of which have gradients).
// The start_* forms return the exchange under way, to overlap it with
// computation.
//
// This is the mechanism of sharded data parallel; the `fsdp` strategy is
// built on it. Under `manual`, a Module can use it directly to shard its
// optimizer state (ZeRO stage 1 and 2).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace fulgur {

class ProcessGroup;
class PendingExchange;

/// An exchange of ShardedParameters under way (its start_* calls): wait()
/// ends it, the parameters then holding their values or the shards their
/// gradients. Until then the tensors it works on (the parameters being
/// gathered, the gradients being reduced) must not be used.
class ShardedExchange {
 public:
  ShardedExchange();
  ~ShardedExchange();
  ShardedExchange(ShardedExchange&&) noexcept;
  ShardedExchange& operator=(ShardedExchange&&) noexcept;
  void wait();
  bool pending() const;
  /// A reduce-scatter's: whether any rank had a gradient for any of them
  /// (known when it starts).
  bool any_gradient() const { return any_; }

 private:
  friend class ShardedParameters;
  std::vector<PendingExchange> exchanges_;
  std::vector<std::function<void()>> then_;
  bool any_ = false;
};

class ShardedParameters {
 public:
  /// Every rank passes the same parameters (the same shapes, in the same
  /// order, of one dtype and device each) with the same values (broadcast
  /// them first). ConfigError for an empty list or a parameter that does
  /// not require a gradient (keep frozen ones out).
  ///
  /// `share_storage` (ZeRO 2's layout, for parameters that stay whole): a
  /// shard whose chunk lies wholly inside its (contiguous) parameter is a
  /// view of the parameter's memory instead of a copy, so it costs no
  /// memory and the optimizer's step writes the parameter's chunk in
  /// place. Such parameters cannot be released (ConfigError); a chunk that
  /// needs padding (the last ranks' of a parameter not divisible by the
  /// world size) stays a copy.
  ShardedParameters(std::vector<at::Tensor> parameters, std::shared_ptr<ProcessGroup> group,
                    bool share_storage = false);

  /// This rank's shard of each parameter, in order: 1-D leaf tensors that
  /// require a gradient, `chunk(i)` elements each.
  const std::vector<at::Tensor>& shards() const { return shards_; }
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  /// Elements of parameter i's shard: its element count divided by the
  /// world size, rounded up.
  int64_t chunk(size_t i) const { return chunks_[i]; }
  /// Parameters of at least this many elements, contiguous and divisible by
  /// the world size, are exchanged on their own, straight from their
  /// gradient and into their storage (no packed copy); smaller ones are
  /// packed together, one exchange per dtype.
  static constexpr int64_t kDirectElements = 65536;
  /// Parameter i's whole shape (also while it is released and the
  /// parameter itself shows [0]).
  const std::vector<int64_t>& full_sizes(size_t i) const { return sizes_[i]; }
  /// Shard `shard` (chunk(i) elements, this rank's) of a tensor of
  /// parameter i's shape, padded with zeros; and the whole tensor from
  /// every rank's shard of it (one all-gather).
  at::Tensor shard_of(size_t i, const at::Tensor& whole) const;
  at::Tensor gather_whole(size_t i, const at::Tensor& shard) const;
  /// Bytes of this rank's shards that hold memory of their own (a shard
  /// that is a view of its parameter holds none), and of the full
  /// parameters.
  int64_t shard_bytes() const;
  /// Whether shard i is a view of parameter i's memory (share_storage).
  bool shares_storage(size_t i) const { return shared_[i] != 0; }
  int64_t parameter_bytes() const;

  /// Adds to each shard's gradient (or sets, when it has none) this rank's
  /// part of the mean over the ranks of its parameter's gradient; a shard
  /// whose parameter has a gradient on no rank is left as it is (without
  /// one, the optimizer skips it). The parameters' gradients are released.
  /// One all-reduce of a flag per parameter (which have a gradient
  /// anywhere), one reduce-scatter per dtype. Returns whether any rank had
  /// a gradient for any of them (a shard's gradient left at zeros by
  /// zero_grad is no gradient: the optimizers must not step on it).
  bool reduce_scatter_gradients();
  /// Every parameter takes the ranks' shards (after the optimizer stepped
  /// them): one all-gather per dtype.
  void all_gather_parameters();
  /// Each shard takes this rank's chunk of its parameter again (after the
  /// parameters were loaded from a checkpoint); the shard tensors stay the
  /// same objects, so an optimizer built on them stays valid.
  void take_from_parameters();

  /// The same three, for some of the parameters (indices into parameters(),
  /// in any order), as sharding between uses (FULL_SHARD) does per unit.
  /// `contributes`: false on a rank that ran no backward in this step (its
  /// training_step returned no loss, and no earlier micro-batch
  /// accumulated): the mean is over the ranks that contribute, as DDP's.
  bool reduce_scatter_gradients(const std::vector<size_t>& indices, bool contributes = true);
  /// Gives back the full values of released parameters (allocating them).
  void all_gather_parameters(const std::vector<size_t>& indices);
  /// The same two, started, to overlap with computation (the flags'
  /// all-reduce of the reduce-scatter runs before it returns). Exchanges
  /// under way at once end in any order.
  ShardedExchange start_reduce_scatter_gradients(const std::vector<size_t>& indices,
                                                 bool contributes = true);
  ShardedExchange start_all_gather_parameters(const std::vector<size_t>& indices);

  /// What a reduce-scatter's flags all-reduce agrees on, when the caller
  /// has agreed it already: in one all-reduce for several exchanges (with
  /// votes of its own beside the flags), or without one where it is known
  /// (in a backward every rank runs, a parameter whose gradient arrived
  /// here has one on every rank, and every rank contributes).
  struct GradientAgreement {
    /// Per entry of the exchange's `indices`: whether that parameter has a
    /// gradient on some rank (the sum over the ranks of local_gradients).
    std::vector<int> anywhere;
    /// Ranks that contribute (see `contributes` above); at least 1 counts.
    int64_t contributors = 0;
  };
  /// This rank's flags for `indices`, for a GradientAgreement: 1 where the
  /// parameter has a gradient here.
  std::vector<int> local_gradients(const std::vector<size_t>& indices) const;
  /// start_reduce_scatter_gradients with the agreement made: no collective
  /// before the reduce-scatters. Every rank passes the same agreement.
  ShardedExchange start_reduce_scatter_gradients(const std::vector<size_t>& indices,
                                                 const GradientAgreement& agreed);
  /// Frees the memory of these parameters' full values; their shards stay.
  /// A released parameter shows shape [0] (an op on it is a shape error,
  /// never a read of freed memory) until all_gather_parameters brings its
  /// shape and values back into the same storage, for any graph that saved
  /// it or a view of it.
  /// ConfigError for a parameter that does not own its whole storage (a
  /// view of a bigger tensor): freeing it would free its neighbours too.
  void release_parameters(const std::vector<size_t>& indices);
  bool released(size_t i) const { return released_[i] != 0; }
  /// Bytes of the full parameters whose values are held now (released
  /// ones hold none).
  int64_t held_parameter_bytes() const;

 private:
  std::vector<size_t> all_indices() const;
  /// Parameter i's element count (also while it is released).
  int64_t numel(size_t i) const;
  /// Whether parameter i is exchanged on its own (kDirectElements).
  bool direct(size_t i) const;
  void add_to_shard_grad(size_t i, const at::Tensor& part, bool owned);
  void allocate_if_released(size_t i);

  std::vector<at::Tensor> parameters_;
  std::vector<at::Tensor> shards_;
  std::vector<int64_t> chunks_;
  std::vector<char> released_;
  std::vector<char> shared_;  // shard i is a view of parameter i (share_storage)
  // Each parameter's shape and bytes (a released one shows none).
  std::vector<std::vector<int64_t>> sizes_;
  std::vector<int64_t> bytes_;
  std::shared_ptr<ProcessGroup> group_;
};

}  // namespace fulgur
