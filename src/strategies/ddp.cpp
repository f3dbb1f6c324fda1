#include "fulgur/strategies/ddp.h"

#include <torch/torch.h>

#include <map>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/distributed/gradient_reducer.h"
#include "fulgur/distributed/process_group.h"
#include "fulgur/nn/sync_batch_norm.h"
#include "fulgur/plugins/environments/cluster_environment.h"

namespace fulgur {

DDPStrategy::DDPStrategy(DDPOptions options, std::string name)
    : ParallelStrategy(options.parallel, "DDPStrategy", options.start_method),
      options_(std::move(options)),
      name_(std::move(name)) {
  set_traits({.sync_batchnorm_unsupported_reason = {}, .trainable_change_unsupported_reason = {}});
  // At most 1 TiB: a bucket's byte count is an int64 (beyond ~8.8e12 MiB
  // it overflowed, and every parameter got a bucket of its own).
  if (!(options_.bucket_cap_mb > 0) || !(options_.bucket_cap_mb <= 1024.0 * 1024.0)) {
    throw ConfigError(str("DDPStrategy: bucket_cap_mb=", options_.bucket_cap_mb,
                          " must be > 0 and at most 1048576 (1 TiB; default 25)."));
  }
}

DDPStrategy::~DDPStrategy() = default;

void DDPStrategy::do_setup(Module& module) {
  module.to(root_device());
  if (sync_batchnorm()) connect_sync_batchnorm(module);
  // The buffers in one flat tensor per (dtype, device), broadcast from rank
  // 0 now and, with broadcast_buffers, before every synchronised step.
  buffer_groups_.clear();
  std::map<std::pair<int, std::string>, size_t> group_of;
  for (auto& b : module.buffers()) {
    if (!b.defined() || b.numel() == 0) continue;
    auto key = std::make_pair(static_cast<int>(b.scalar_type()), b.device().str());
    auto it = group_of.find(key);
    if (it == group_of.end()) {
      it = group_of.emplace(key, buffer_groups_.size()).first;
      buffer_groups_.emplace_back();
    }
    buffer_groups_[it->second].buffers.push_back(b);
  }
  for (auto& g : buffer_groups_) {
    int64_t total = 0;
    for (auto& b : g.buffers) total += b.numel();
    g.flat = torch::empty({total}, g.buffers.front().options().requires_grad(false));
    int64_t offset = 0;
    for (auto& b : g.buffers) {
      g.slices.push_back(g.flat.narrow(0, offset, b.numel()).view(b.sizes()));
      offset += b.numel();
    }
  }
  // Every rank starts from rank 0's parameters and buffers.
  broadcast_parameters_from_rank_zero(module);
  broadcast_buffers();
  parameters_.clear();
  for (auto& item : module.named_parameters()) parameters_.emplace_back(item.key(), item.value());
  compared_epoch_ = -1;
  build_reducer();
  set_stop_vote(false);
}

void DDPStrategy::build_reducer() {
  reducer_.reset();  // its hooks off the parameters first
  trainable_.clear();
  for (const auto& item : parameters_) trainable_.push_back(item.second.requires_grad() ? 1 : 0);
  GradientReducerOptions reducer_options;
  reducer_options.bucket_cap_mb = options_.bucket_cap_mb;
  reducer_options.find_unused_parameters = options_.find_unused_parameters;
  reducer_options.extra_scalars = 1;  // kStopVote
  reducer_ =
      std::make_unique<GradientReducer>(parameters_, shared_process_group(), reducer_options);
  reducer_->set_require_sync(gradient_sync());
  restart_stop_votes(0);  // the new reducer counts its exchanges from 0
}

void DDPStrategy::follow_trainable_parameters(Module& module) {
  size_t k = 0;
  while (k < parameters_.size() &&
         (parameters_[k].second.requires_grad() ? 1 : 0) == trainable_[k]) {
    ++k;
  }
  const bool changed = k < parameters_.size();
  // Every rank reaches the first synchronised step of each epoch (the ranks
  // step alike), and compares there which parameters train: a change made
  // on some ranks only (a callback's on_train_epoch_start deciding from a
  // value of its own rank) is named instead of pairing unlike gradient
  // buckets. A change within an epoch is compared at the step it is seen
  // (every rank must make it at the same step).
  const int64_t epoch = module.current_epoch();
  if (!changed && epoch == compared_epoch_) return;
  compared_epoch_ = epoch;
  int64_t before = 0;
  int64_t now = 0;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    before += trainable_[i];
    now += parameters_[i].second.requires_grad() ? 1 : 0;
  }
  if (world_size() > 1) {
    std::vector<uint8_t> flags;
    for (const auto& item : parameters_) flags.push_back(item.second.requires_grad() ? 1 : 0);
    const at::Tensor mine =
        torch::from_blob(flags.data(), {static_cast<int64_t>(flags.size())}, torch::kByte).clone();
    const at::Tensor all = all_gather(mine).cpu();
    std::vector<std::string> differ;
    for (int64_t r = 0; r < all.size(0); ++r) {
      const at::Tensor theirs = all[r];
      if (theirs.equal(mine)) continue;
      const int64_t j = (theirs != mine).nonzero()[0][0].item<int64_t>();
      differ.push_back(str("rank ", r, " trains ", theirs.sum().item<int64_t>(), ", ",
                           theirs[j].item<int>() != 0 ? "with" : "without", " \"",
                           parameters_[static_cast<size_t>(j)].first, "\""));
    }
    if (!differ.empty()) {
      throw DistributedError(
          str(name(), ": rank ", global_rank(), " trains ", now, " parameters (", before,
              " at the last comparison) and its peers others: ", join(differ),
              ". Freeze and unfreeze the same parameters on every rank at the same step (a "
              "callback's on_train_epoch_start runs on every rank: decide there from values every "
              "rank has, such as metrics logged with sync_dist=true)."));
    }
  }
  if (!changed) return;
  if (is_global_zero()) {
    detail::print_note(str(name(), ": the trainable parameters changed (", before, " before, ", now,
                           " now; first \"", parameters_[k].first,
                           "\"): their gradients are reduced from this step on."));
  }
  build_reducer();
}

void DDPStrategy::broadcast_buffers() {
  torch::NoGradGuard no_grad;
  const bool source = global_rank() == 0;
  auto& group = process_group();
  for (auto& g : buffer_groups_) {
    if (source) {
      for (size_t k = 0; k < g.buffers.size(); ++k) g.slices[k].copy_(g.buffers[k]);
    }
    group.broadcast_(g.flat, 0);
    if (!source) {
      for (size_t k = 0; k < g.buffers.size(); ++k) g.buffers[k].copy_(g.slices[k]);
    }
  }
}

at::Tensor DDPStrategy::training_step(Module& module, Batch& batch, int64_t batch_idx) {
  // As PyTorch's DDP: only before a forward whose gradients are synchronised
  // (not in the no_sync micro-batches of gradient accumulation).
  if (options_.broadcast_buffers && gradient_sync() && !buffer_groups_.empty()) {
    broadcast_buffers();
  }
  return ParallelStrategy::training_step(module, batch, batch_idx);
}

void DDPStrategy::do_teardown() {
  buffer_groups_.clear();
  reducer_.reset();
  parameters_.clear();
  trainable_.clear();
  ParallelStrategy::do_teardown();
}

void DDPStrategy::backward(const at::Tensor& loss, Module& module) {
  // At a step whose gradients sync: there every rank calls this or
  // steps_without_loss (a no_sync micro-batch's gradients accumulate in the
  // parameters, which the rebuilt reducer takes at the next sync).
  if (reducer_ && gradient_sync()) follow_trainable_parameters(module);
  if (reducer_) reducer_->set_require_sync(gradient_sync());
  bool sync = reducer_ && gradient_sync();
  if (sync) {
    reducer_->set_extra_scalar(kStopVote, stop_vote() ? 1.0 : 0.0);
    reducer_->prepare_for_backward();
  }
  ParallelStrategy::backward(loss, module);
  if (sync) reducer_->finalize_backward();
}

bool DDPStrategy::steps_without_loss(Module& module, bool accumulated) {
  if (!reducer_ || !gradient_sync()) return accumulated;
  if (sync_batchnorm()) {
    // Its peers' backward runs SyncBatchNorm's all-reduces, which this rank
    // cannot pair without a backward of its own.
    throw ConfigError(str("rank ", global_rank(), ": ", module.name(),
                          "'s training_step returned "
                          "no loss while sync_batchnorm=true: SyncBatchNorm reduces across ranks "
                          "in forward and backward, so every rank must run both. Return a loss "
                          "on every rank (e.g. loss * 0 to make a batch count for nothing), or "
                          "turn sync_batchnorm off."));
  }
  follow_trainable_parameters(module);
  reducer_->set_require_sync(true);  // the micro-batches before may have run without it
  reducer_->set_extra_scalar(kStopVote, stop_vote() ? 1.0 : 0.0);
  return reducer_->join_without_backward(accumulated) > 0;
}

bool DDPStrategy::agree_to_stop(bool requested, bool boundary) {
  // Every rank votes in each gradient exchange (each rank runs one exactly
  // when its peers do).
  return agree_to_stop_from_votes(requested, boundary, reducer_ ? reducer_->exchanges() : 0,
                                  [this] { return reducer_->extra_scalar_sum(kStopVote) > 0.5; });
}

std::string DDPStrategy::describe_options(const DDPOptions& o) {
  return str("start_method=", o.start_method.text(),
             ", find_unused_parameters=", o.find_unused_parameters ? "true" : "false",
             ", bucket_cap_mb=", o.bucket_cap_mb,
             ", broadcast_buffers=", o.broadcast_buffers ? "true" : "false",
             describe_parallel_options(o.parallel));
}

}  // namespace fulgur
