#include "fulgur/distributed/gradient_reducer.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <mutex>
#include <optional>

#include "fulgur/core/errors.h"
#include "fulgur/distributed/process_group.h"
#include "utilities/host_copy.h"

namespace fulgur {

struct GradientReducer::State {
  // One bucket of gradients reduced together.
  struct Bucket {
    std::vector<size_t> params;    // indices into State::params
    std::vector<int64_t> offsets;  // element offset of each in `flat`
    at::Tensor flat;
    size_t pending = 0;
    bool launched = false;
    std::optional<PendingCollective> work;
  };

  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<size_t> bucket_of;  // param index -> bucket
  std::vector<size_t> slot_of;    // param index -> position in its bucket
  std::vector<Bucket> buckets;
  // The last elements of the first bucket, beyond every gradient: [0] 1 on
  // a rank that has gradients to contribute this step, 0 on one that had no
  // loss in it (nor in the micro-batches accumulated before it); [1..] the
  // caller's extra scalars. Summed with the gradients, they count the
  // contributing ranks and sum the extras without a collective of their own.
  at::Tensor tail;
  int64_t tail_size() const { return 1 + static_cast<int64_t>(extra_values.size()); }
  std::vector<char> ready;  // per param, this backward
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<uintptr_t> hook_keys;
  std::shared_ptr<ProcessGroup> group;
  GradientReducerOptions options;
  std::mutex mutex;
  size_t next_to_launch = 0;
  bool armed = false;
  bool require_sync = true;
  bool contributes = true;           // this step: see `tail`
  std::vector<double> extra_values;  // this rank's, for the next exchange: see `tail`
  int64_t exchanges = 0;
  // The tail summed in the last exchange, on its way to the host: read only
  // when asked (contributors(), extra_scalar_sum()), so that on a GPU
  // finalize_backward never waits for the all-reduce to finish; the host
  // waits when it asks, by then with the optimizer step queued behind it.
  detail::AsyncHostCopy sums;      // double [tail_size]
  int contributors = 0;            // ranks with a loss in the last exchange
  std::vector<double> extra_sums;  // summed over ranks in the last exchange

  // After the first synchronised step each .grad is a view into its
  // bucket, so backward accumulates straight into the bucket and nothing is
  // copied; a gradient replaced by someone else (set_to_none) is copied.
  bool grad_in_bucket(size_t p) {
    const at::Tensor& grad = params[p].grad();
    return grad.defined() && grad.data_ptr() == slice(p).data_ptr();
  }

  at::Tensor slice(size_t p) {
    const auto& b = buckets[bucket_of[p]];
    return b.flat.narrow(0, b.offsets[slot_of[p]], params[p].numel());
  }

  void prepare(bool contributes);
  /// Whether there was an exchange (sync on and parameters to average).
  bool finalize(bool ran_backward);
  /// The last exchange's sums into `contributors` and `extra_sums`, waiting
  /// for their copy when it is still on its way.
  void read_sums();

  void launch_ready_buckets() {
    while (next_to_launch < buckets.size() && buckets[next_to_launch].pending == 0) {
      // Written here, on the thread (and CUDA stream) that launches the
      // bucket, like the gradients next to it.
      if (next_to_launch == 0) {
        tail.select(0, 0).fill_(contributes ? 1 : 0);
        for (size_t i = 0; i < extra_values.size(); ++i) {
          tail.select(0, static_cast<int64_t>(i) + 1).fill_(extra_values[i]);
        }
      }
      auto& b = buckets[next_to_launch++];
      b.work.emplace(group->all_reduce_sum_async_(b.flat));
      b.launched = true;
    }
  }

  void mark_ready(size_t p) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!armed || ready[p]) return;
    const at::Tensor& grad = params[p].grad();
    if (!grad.defined()) return;
    if (grad.is_sparse()) {
      throw DistributedError(str("GradientReducer: parameter \"", names[p],
                                 "\" has a sparse "
                                 "gradient, which the bucketed reducer does not average. Use a "
                                 "dense embedding (sparse=false) or the manual strategy."));
    }
    if (!grad_in_bucket(p)) slice(p).copy_(grad.reshape(-1));
    ready[p] = 1;
    --buckets[bucket_of[p]].pending;
    launch_ready_buckets();
  }
};

namespace {

class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::weak_ptr<GradientReducer::State> state, size_t index)
      : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto state = state_.lock()) state->mark_ready(index_);
    return outputs;
  }

 private:
  std::weak_ptr<GradientReducer::State> state_;
  size_t index_;
};

}  // namespace

GradientReducer::GradientReducer(std::vector<std::pair<std::string, at::Tensor>> named_parameters,
                                 std::shared_ptr<ProcessGroup> group,
                                 GradientReducerOptions options)
    : state_(std::make_shared<State>()) {
  if (!(options.bucket_cap_mb > 0)) {
    throw ConfigError(str("GradientReducer: bucket_cap_mb=", options.bucket_cap_mb,
                          " must be > 0 (default 25)."));
  }
  if (!group) throw ConfigError("GradientReducer: the process group is null.");
  auto& s = *state_;
  s.group = std::move(group);
  s.options = options;
  s.extra_values.assign(options.extra_scalars, 0.0);
  s.extra_sums.assign(options.extra_scalars, 0.0);
  for (auto& [name, p] : named_parameters) {
    if (!p.requires_grad()) continue;
    s.names.push_back(name);
    s.params.push_back(p);
  }
  const auto cap = static_cast<int64_t>(options.bucket_cap_mb * 1024 * 1024);
  // The first bucket (the last layers) is small so that communication
  // starts early in backward, as PyTorch's DDP does.
  const int64_t first_cap = std::min<int64_t>(cap, 1024 * 1024);
  s.bucket_of.resize(s.params.size());
  s.slot_of.resize(s.params.size());
  // Reverse order: backward produces the last layers' gradients first.
  std::map<std::pair<int, std::string>, size_t> open;  // (dtype, device) -> bucket
  std::vector<int64_t> sizes;
  for (size_t k = s.params.size(); k-- > 0;) {
    const auto& p = s.params[k];
    auto key = std::make_pair(static_cast<int>(p.scalar_type()), p.device().str());
    int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    auto it = open.find(key);
    // A new bucket when this one would pass the cap; an empty bucket takes
    // any parameter, however large.
    const int64_t limit = it != open.end() && it->second == 0 ? first_cap : cap;
    if (it == open.end() || (sizes[it->second] > 0 && sizes[it->second] + bytes > limit)) {
      s.buckets.emplace_back();
      sizes.push_back(0);
      it = open.insert_or_assign(key, s.buckets.size() - 1).first;
    }
    auto& b = s.buckets[it->second];
    s.bucket_of[k] = it->second;
    s.slot_of[k] = b.params.size();
    b.params.push_back(k);
    b.offsets.push_back(sizes[it->second] / static_cast<int64_t>(p.element_size()));
    sizes[it->second] += bytes;
  }
  for (size_t i = 0; i < s.buckets.size(); ++i) {
    const auto& first = s.params[s.buckets[i].params.front()];
    const int64_t extra = i == 0 ? s.tail_size() : 0;
    s.buckets[i].flat =
        torch::zeros({sizes[i] / static_cast<int64_t>(first.element_size()) + extra},
                     first.options().requires_grad(false));
  }
  if (!s.buckets.empty()) {
    s.tail = s.buckets[0].flat.narrow(0, s.buckets[0].flat.numel() - s.tail_size(), s.tail_size());
  }
  s.ready.assign(s.params.size(), 0);
  for (size_t k = 0; k < s.params.size(); ++k) {
    auto accumulator = torch::autograd::impl::grad_accumulator(s.params[k]);
    if (!accumulator) {
      throw ConfigError(str("GradientReducer: parameter \"", s.names[k],
                            "\" is not a leaf "
                            "tensor; pass the module's own parameters."));
    }
    s.hook_keys.push_back(accumulator->add_post_hook(std::make_unique<ReadyHook>(state_, k)));
    s.accumulators.push_back(std::move(accumulator));
  }
}

GradientReducer::~GradientReducer() {
  auto& s = *state_;
  for (size_t k = 0; k < s.accumulators.size(); ++k)
    s.accumulators[k]->del_post_hook(s.hook_keys[k]);
}

void GradientReducer::set_require_sync(bool sync) { state_->require_sync = sync; }
bool GradientReducer::require_sync() const { return state_->require_sync; }
namespace {
void check_extra_index(const char* method, size_t i, size_t count) {
  if (i < count) return;
  throw ConfigError(str("GradientReducer::", method, "(", i, "): the reducer carries ", count,
                        " extra scalar(s) (GradientReducerOptions::extra_scalars); pass an index "
                        "below it, or raise extra_scalars."));
}
}  // namespace

void GradientReducer::set_extra_scalar(size_t i, double value) {
  check_extra_index("set_extra_scalar", i, state_->extra_values.size());
  state_->extra_values[i] = value;
}

double GradientReducer::extra_scalar_sum(size_t i) const {
  check_extra_index("extra_scalar_sum", i, state_->extra_sums.size());
  state_->read_sums();
  return state_->extra_sums[i];
}
int GradientReducer::contributors() const {
  state_->read_sums();
  return state_->contributors;
}
int64_t GradientReducer::exchanges() const { return state_->exchanges; }

void GradientReducer::prepare_for_backward() { state_->prepare(/*contributes=*/true); }

void GradientReducer::finalize_backward() { state_->finalize(/*ran_backward=*/true); }

int GradientReducer::join_without_backward(bool accumulated) {
  auto& s = *state_;
  s.prepare(/*contributes=*/accumulated);
  if (!s.finalize(/*ran_backward=*/false)) return 0;
  s.read_sums();  // whether anyone steps: needed now
  return s.contributors;
}

void GradientReducer::State::read_sums() {
  if (!sums.unread()) return;
  // Exact for float32/64 at any world size (and for half/bf16 up to 2048
  // and 256 ranks); rounded to be safe.
  const double* values = sums.read().data_ptr<double>();
  contributors = static_cast<int>(std::lround(values[0]));
  for (size_t i = 0; i < extra_sums.size(); ++i) extra_sums[i] = values[i + 1];
}

void GradientReducer::State::prepare(bool contributes) {
  std::lock_guard<std::mutex> lock(mutex);
  armed = require_sync && !params.empty();
  if (!armed) return;
  std::fill(ready.begin(), ready.end(), 0);
  for (auto& b : buckets) {
    b.pending = b.params.size();
    b.launched = false;
    b.work.reset();
  }
  this->contributes = contributes;
  next_to_launch = 0;
}

bool GradientReducer::State::finalize(bool ran_backward) {
  auto& s = *this;
  std::unique_lock<std::mutex> lock(s.mutex);
  if (!s.armed) return false;
  s.armed = false;
  std::vector<size_t> unused;
  for (size_t k = 0; k < s.params.size(); ++k) {
    if (!s.ready[k]) unused.push_back(k);
  }
  at::Tensor used_anywhere;
  if (!unused.empty()) {
    if (ran_backward && !s.options.find_unused_parameters) {
      std::vector<std::string> names;
      for (size_t i = 0; i < unused.size() && i < 8; ++i) names.push_back(s.names[unused[i]]);
      throw DistributedError(str(
          "DDP: ", unused.size(), " parameter(s) received no gradient in this backward on rank ",
          s.group->rank(), ": ", join(names), unused.size() > names.size() ? ", ..." : "",
          ". Every rank must produce a gradient for every parameter to average them. Use "
          "strategy=\"ddp_find_unused_parameters_true\" when some parameters are skipped in "
          "some steps, or freeze them (requires_grad=false)."));
    }
    for (size_t k : unused) {
      // Its contribution is what it accumulated (e.g. in no_sync
      // micro-batches), or nothing: a rank that joins without contributing
      // adds zeros, whatever its .grad still holds.
      const at::Tensor& grad = s.params[k].grad();
      if (grad.defined() && s.contributes) {
        if (!s.grad_in_bucket(k)) s.slice(k).copy_(grad.reshape(-1));
      } else {
        s.slice(k).zero_();
      }
      --s.buckets[s.bucket_of[k]].pending;
    }
    s.launch_ready_buckets();
  }
  if (s.options.find_unused_parameters) {
    // One extra collective says which parameters some rank used, so that
    // a parameter nobody used keeps an undefined gradient.
    used_anywhere = torch::zeros({static_cast<int64_t>(s.params.size())}, torch::kInt);
    auto* flags = used_anywhere.data_ptr<int>();
    // Used: a gradient from this backward, or one accumulated in earlier
    // micro-batches that this rank contributes; a parameter some rank has a
    // gradient for then gets one on every rank, so all step it alike.
    for (size_t k = 0; k < s.params.size(); ++k) {
      flags[k] = s.ready[k] || (s.contributes && s.params[k].grad().defined()) ? 1 : 0;
    }
  }
  lock.unlock();
  for (auto& b : s.buckets) b.work->wait();
  if (used_anywhere.defined()) s.group->all_reduce_(used_anywhere, ReduceOp::kSum);
  // The sums stay where the all-reduce left them (a GPU): the mean divides
  // by the count there, and the host reads the count and the extras only
  // when asked. A copy, as the division below and the next backward write
  // into the tail.
  const at::Tensor sums = s.tail.to(at::kDouble, /*non_blocking=*/false, /*copy=*/true);
  ++s.exchanges;
  // The mean over the ranks that had a loss. When none had one, nobody
  // steps (and no rank had a gradient to average).
  const at::Tensor count = sums.select(0, 0);
  const at::Tensor divisor = at::where(count.gt(0.5), count, at::Scalar(s.group->size()));
  torch::NoGradGuard no_grad;
  for (auto& b : s.buckets) {
    b.flat.div_(b.flat.device() == divisor.device() ? divisor : divisor.to(b.flat.device()));
  }
  s.sums.start(sums);
  for (size_t k = 0; k < s.params.size(); ++k) {
    auto& p = s.params[k];
    if (s.grad_in_bucket(k)) continue;  // already averaged in place
    // A rank that joined without a backward takes every gradient its peers
    // hold (all of them, unless find_unused_parameters says which), so
    // that every replica takes the same step.
    const bool used_by_a_peer =
        used_anywhere.defined() ? used_anywhere.data_ptr<int>()[k] > 0 : !ran_backward;
    if (p.grad().defined() || used_by_a_peer) {
      // Shares the bucket's storage without being an autograd view, so
      // optimizers may still detach_() and zero_() it.
      const auto& b = s.buckets[s.bucket_of[k]];
      at::Tensor alias = at::empty({0}, b.flat.options());
      alias.set_(b.flat.storage(), b.flat.storage_offset() + b.offsets[s.slot_of[k]], p.sizes());
      p.mutable_grad() = alias;
    }
  }
  return true;
}

std::vector<std::vector<std::string>> GradientReducer::bucket_layout() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& b : state_->buckets) {
    out.emplace_back();
    for (size_t k : b.params) out.back().push_back(state_->names[k]);
  }
  return out;
}

}  // namespace fulgur
