// File: fulgur/strategies/ddp.h
//
// Distributed data parallel: every rank holds the whole module; parameters
// and buffers are broadcast from rank 0 at setup (buffers again before each
// training step, unless broadcast_buffers=false); gradients are averaged in
// buckets while backward runs (GradientReducer); every rank then takes the
// same optimizer step.
//
// Registered variants (one class):
//   ddp                              own launcher re-executes the program
//   ddp_fork, ddp_spawn              ranks are forked at fit(); rank 0's
//                                    results and weights come back
//   ddp_find_unused_parameters_true  ddp, parameters may miss gradients
//   ddp_find_unused_parameters_false ddp (the default, spelled out)
//   ddp_{fork,spawn}_find_unused_parameters_{true,false}
//                                    the same for forked ranks
//
//   fulgur::Trainer trainer({.strategy = "ddp", .devices = 2});
//   fulgur::Trainer trainer({.strategy = std::make_shared<fulgur::DDPStrategy>(
//       fulgur::DDPOptions{.bucket_cap_mb = 4})});
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fulgur/strategies/parallel.h"

namespace fulgur {

class GradientReducer;

struct DDPOptions {
  /// "popen": re-execute the program once per local rank (the launching
  /// process waits for them and exits with their status). "fork": create
  /// the ranks at fit(); the calling process gets rank 0's results.
  Choice<StartMethod> start_method = StartMethod::kPopen;
  bool find_unused_parameters = false;
  /// Gradient bucket size in MiB.
  double bucket_cap_mb = 25.0;
  /// Before each training step that synchronises gradients, every rank
  /// takes rank 0's buffers (BatchNorm running statistics), as PyTorch's
  /// DistributedDataParallel does by default: the replicas stay identical
  /// and a checkpoint holds the statistics every rank used. One broadcast
  /// per buffer dtype; nothing for a module without buffers.
  bool broadcast_buffers = true;
  /// The process group's timeout and backend, and the launcher's stop grace.
  ParallelOptions parallel;
};

class DDPStrategy : public ParallelStrategy {
 public:
  explicit DDPStrategy(DDPOptions options = {}, std::string name = "ddp");
  ~DDPStrategy() override;

  std::string_view name() const override { return name_; }
  const DDPOptions& options() const { return options_; }
  /// The module's reducer after setup(); null before.
  GradientReducer* reducer() const { return reducer_.get(); }

  /// Registers every variant listed above. A subclass registers its own
  /// with register_variants<Subclass>(registry, "prefix").
  static void register_strategies(StrategyRegistry& registry);
  /// "start_method=popen, find_unused_parameters=false, ...", for listings.
  static std::string describe_options(const DDPOptions& options);

  template <class Derived>
  static void register_variants(StrategyRegistry& registry, const std::string& prefix,
                                const std::string& what) {
    struct Variant {
      const char* suffix;
      const char* description;
      StartMethod start_method;
      bool find_unused;
    };
    static constexpr Variant variants[] = {
        {"", "one process per device, launched by re-executing the program", StartMethod::kPopen,
         false},
        {"_fork", "one process per device, forked at fit(); results return to the caller",
         StartMethod::kFork, false},
        {"_spawn", "same as _fork (no pickling in C++)", StartMethod::kFork, false},
        {"_find_unused_parameters_true", "re-executing launcher; parameters may get no gradient",
         StartMethod::kPopen, true},
        {"_find_unused_parameters_false", "re-executing launcher; every parameter gets a gradient",
         StartMethod::kPopen, false},
        {"_fork_find_unused_parameters_true", "forked ranks; parameters may get no gradient",
         StartMethod::kFork, true},
        {"_fork_find_unused_parameters_false", "forked ranks; every parameter gets a gradient",
         StartMethod::kFork, false},
        {"_spawn_find_unused_parameters_true", "same as _fork_find_unused_parameters_true",
         StartMethod::kFork, true},
        {"_spawn_find_unused_parameters_false", "same as _fork_find_unused_parameters_false",
         StartMethod::kFork, false},
    };
    for (const auto& v : variants) {
      std::string name = prefix + v.suffix;
      DDPOptions options;
      options.start_method = v.start_method;
      options.find_unused_parameters = v.find_unused;
      registry.add(
          name, what + ": " + v.description,
          [options, name] { return std::make_unique<Derived>(options, name); },
          describe_options(options));
    }
  }

 protected:
  void do_setup(Module& module) override;
  void do_teardown() override;
  /// Broadcasts rank 0's buffers (broadcast_buffers), then the step.
  at::Tensor training_step(Module& module, Batch& batch, int64_t batch_idx) override;
  /// Backward; when the gradients sync, their all-reduce carries this
  /// rank's stop vote (stop_vote()) in the reducer's extra scalar.
  void backward(const at::Tensor& loss, Module& module) override;
  /// Joins the peers' gradient all-reduces with no gradient; the optimizers
  /// step with the mean over the ranks that had a loss, or nobody steps.
  bool steps_without_loss(Module& module, bool accumulated) override;
  /// After a batch whose gradients were exchanged: the stop votes that
  /// exchange carried (no collective of its own); after a no_sync
  /// micro-batch: deferred to the next exchange; otherwise (a boundary, a
  /// batch without an exchange) a reduce_boolean_decision.
  bool agree_to_stop(bool requested, bool boundary) override;

 private:
  DDPOptions options_;
  std::string name_;
  /// Rank 0's buffers into every rank: one flat broadcast per (dtype,
  /// device), at setup and (broadcast_buffers) before each synced step.
  void broadcast_buffers();

  /// The reducer for the parameters trainable now (requires_grad), with
  /// the stop-vote scalar.
  void build_reducer();
  /// Before each backward whose gradients sync (or a join without one):
  /// at an epoch's first such step, and when which parameters are
  /// trainable changed (a callback unfroze a backbone), the ranks compare
  /// which parameters train (DistributedError naming the difference); a
  /// change rebuilds the reducer.
  void follow_trainable_parameters(Module& module);

  std::unique_ptr<GradientReducer> reducer_;
  /// The module's parameters, and which were trainable when the reducer
  /// was built.
  std::vector<std::pair<std::string, at::Tensor>> parameters_;
  std::vector<char> trainable_;
  /// The epoch whose trainable parameters the ranks last compared.
  int64_t compared_epoch_ = -1;
  /// The reducer's extra scalar that carries the stop votes.
  static constexpr size_t kStopVote = 0;
  struct BufferGroup {
    at::Tensor flat;
    std::vector<at::Tensor> buffers;
    std::vector<at::Tensor> slices;  // views of `flat`, one per buffer
  };
  std::vector<BufferGroup> buffer_groups_;
};

}  // namespace fulgur
