// File: fulgur/distributed/gradient_reducer.h
//
// Averages gradients across the ranks of a ProcessGroup while backward is
// still running: parameters are grouped into buckets (default 25 MiB, in
// reverse registration order, roughly the order backward produces their
// gradients); a hook on each parameter's gradient accumulator marks it ready,
// and as soon as a bucket is complete its all-reduce starts asynchronously,
// so communication overlaps the rest of backward. Buckets are started in the
// same order on every rank. finalize_backward() waits for all of them and
// writes the averages back into the parameters' .grad. A rank with no loss
// in a step joins with join_without_backward(); the mean is then over the
// ranks that had one (counted in the first bucket, at no extra collective).
// On a GPU a backward's exchange does not wait on the host: the count
// divides the sums where they are, and the host reads it (contributors(),
// the extra scalars) only when asked; join_without_backward() reads it at
// once (whether anyone steps).
// The first bucket can also carry a few scalars of the caller's
// (GradientReducerOptions::extra_scalars: set_extra_scalar() before, then
// extra_scalar_sum()), summed across ranks with the gradients at no
// collective of their own; DDPStrategy exchanges its ranks' stop votes so.
//
//   GradientReducer reducer(module.named_parameters(), group);
//   reducer.prepare_for_backward();
//   loss.backward();
//   reducer.finalize_backward();   // .grad now holds the cross-rank mean
//
// DDPStrategy drives one for the whole module; a Module under the `manual`
// strategy can drive one for a sub-module.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fulgur {

class ProcessGroup;

struct GradientReducerOptions {
  /// Bucket size in MiB (> 0).
  double bucket_cap_mb = 25.0;
  /// Parameters that get no gradient in a step are treated as zero on this
  /// rank instead of being an error; a parameter no rank used keeps an
  /// undefined .grad, as on one process.
  bool find_unused_parameters = false;
  /// How many scalars of the caller's ride in the first bucket, summed
  /// across ranks in every exchange (in the parameters' dtype: exact for
  /// small integers such as votes).
  size_t extra_scalars = 0;
};

class GradientReducer {
 public:
  /// Parameters that do not require grad are ignored. Throws ConfigError on
  /// a non-positive bucket size.
  GradientReducer(std::vector<std::pair<std::string, at::Tensor>> named_parameters,
                  std::shared_ptr<ProcessGroup> group, GradientReducerOptions options = {});
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  /// Arms the hooks for the next backward (when sync is on).
  void prepare_for_backward();
  /// Waits for every bucket (on a GPU: makes the current stream wait) and
  /// writes the averaged gradients. Throws DistributedError naming the
  /// parameters that got no gradient (unless find_unused_parameters) and on
  /// a failed collective.
  void finalize_backward();
  /// For a rank that has no loss this step while its peers run backward:
  /// joins their all-reduces, so the collectives stay paired, and takes the
  /// mean over the ranks that contributed. It contributes the gradients it
  /// accumulated in earlier micro-batches when `accumulated`, else nothing.
  /// Returns how many ranks contributed: when 0, nobody should step.
  int join_without_backward(bool accumulated = false);
  /// Off: backward only accumulates locally (gradient accumulation's
  /// non-stepping micro-batches); the next synchronised backward averages
  /// the accumulated gradients.
  void set_require_sync(bool sync);
  bool require_sync() const;
  /// This rank's value of extra scalar `i` in the next exchange
  /// (finalize_backward or join_without_backward); it stays until set again.
  /// ConfigError when `i` is not below GradientReducerOptions::extra_scalars.
  void set_extra_scalar(size_t i, double value);
  /// Extra scalar `i` summed over the ranks in the last exchange (0 before
  /// any). On a GPU the host waits here for that exchange's all-reduce.
  double extra_scalar_sum(size_t i) const;
  /// How many ranks contributed to the last exchange: the world size,
  /// unless some joined without a backward (0 before any). On a GPU the
  /// host waits here for that exchange's all-reduce.
  int contributors() const;
  /// How many exchanges completed so far (a backward or join with sync on
  /// and parameters to average): tells whether extra_scalar_sum() is new.
  int64_t exchanges() const;

  /// Parameter names per bucket, in launch order (for tests and describe).
  std::vector<std::vector<std::string>> bucket_layout() const;

  /// Implementation detail (shared with the autograd hooks).
  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace fulgur
