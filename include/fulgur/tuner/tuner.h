// File: fulgur/tuner/tuner.h
//
// The learning-rate and batch-size finders (Lightning's Tuner).
//
// lr_find: a short fit on the module in which every optimizer step takes a
// learning rate growing from min_lr to max_lr, recording the loss after
// each; the suggestion is where the smoothed loss falls fastest.
// scale_batch_size: short fits on growing batches until one runs out of
// memory; the answer is the largest that fit. Everything a trial changes is
// put back afterwards (the module's parameters, buffers and gradients, the
// random generators), so the fit that follows is the one that would have
// run without it.
//
//   fulgur::Tuner tuner(options);                     // the TrainerOptions of the real fit
//   auto found = tuner.lr_find(model, train_loader, {.plot_path = "lr_find.png"});
//   if (found.suggestion) model.lr = *found.suggestion;
//   fulgur::Trainer(options).fit(model, train_loader);
//
// A trial runs a Trainer of `options` with: max_steps = num_training (or
// steps_per_trial), no epoch limit, no validation or sanity check, no
// checkpoints, loggers, profiler, progress bar or callbacks of the options
// (they would record a run that is not one). configure_optimizers is
// called for it as for any fit; in lr_find the rate of every parameter
// group of every optimizer is set before each step (a scheduler's change is
// overridden). A module's own members beyond its parameters and buffers
// (counters, an optimizer it keeps) are its to reset.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fulgur/core/choice.h"
#include "fulgur/trainer/trainer_options.h"

namespace fulgur {

class DataLoader;
class DataModule;
class Module;

enum class LRSweep { kExponential, kLinear };
template <>
struct ChoiceNames<LRSweep> {
  static constexpr std::pair<LRSweep, const char*> kNames[] = {
      {LRSweep::kExponential, "exponential"}, {LRSweep::kLinear, "linear"}};
};

struct LRFinderOptions {
  /// The rates of the first and the last step (0 < min_lr < max_lr).
  double min_lr = 1e-8;
  double max_lr = 1.0;
  /// Optimizer steps of the sweep (>= 2).
  int64_t num_training = 100;
  /// How the rate grows from step to step: by a constant factor
  /// ("exponential") or a constant amount ("linear").
  Choice<LRSweep> mode = LRSweep::kExponential;
  /// The sweep stops once the smoothed loss exceeds this times the lowest
  /// one seen (it diverged): Lightning's rule, for a lowest loss > 0. A loss
  /// that can be negative (a log-likelihood, an ELBO) stops once it rises
  /// above the lowest by (this - 1) times the lowest's magnitude, the same
  /// distance; <= 0: it never stops early.
  double early_stop_threshold = 4.0;
  /// Weight of the past in the loss's exponential moving average, in [0, 1)
  /// (bias-corrected, as Lightning's).
  double smoothing = 0.98;
  /// Points left out at the start and at the end when looking for the
  /// steepest fall (the first are noisy, the last may be diverging).
  int64_t skip_begin = 10;
  int64_t skip_end = 1;
  /// Where to draw the curve (loss against rate, log-scaled rates for the
  /// exponential sweep, the suggestion marked) as a PNG with gnuplot; "":
  /// no picture.
  std::string plot_path = "";
};

struct LRFinderResult {
  /// The rate of each step taken, and the smoothed loss after it.
  std::vector<double> lrs;
  std::vector<double> losses;
  /// lrs[suggestion_index]: where the smoothed loss falls fastest (the most
  /// negative slope against the rate, over the finite losses between
  /// skip_begin and the last skip_end); none when fewer than two such
  /// points exist (`note` says so).
  std::optional<double> suggestion;
  int64_t suggestion_index = -1;
  /// Stopped early: the loss diverged (or became NaN) at the last step.
  bool diverged = false;
  /// Not run: the options ask for fast_dev_run (as Lightning's finder, it
  /// skips; `note` says so).
  bool skipped = false;
  /// Why there is no suggestion, or why no picture was drawn; empty when
  /// there is nothing to say.
  std::string note;
};

/// The index of `lrs` where the loss falls fastest (Lightning's rule: the
/// minimum of the loss's gradient against the rate, second-order central
/// differences on the uneven spacing, one-sided at the ends), over the finite
/// losses of [skip_begin, size - skip_end); -1 when fewer than two remain.
int64_t steepest_descent(const std::vector<double>& lrs, const std::vector<double>& losses,
                         int64_t skip_begin, int64_t skip_end);

/// How scale_batch_size looks for the largest batch: doubling it until a
/// trial fails ("power"), or doubling and then halving the gap between the
/// largest batch that fit and the smallest that did not ("binsearch").
enum class BatchSizeSearch { kPower, kBinarySearch };
template <>
struct ChoiceNames<BatchSizeSearch> {
  static constexpr std::pair<BatchSizeSearch, const char*> kNames[] = {
      {BatchSizeSearch::kPower, "power"}, {BatchSizeSearch::kBinarySearch, "binsearch"}};
};

struct BatchSizeFinderOptions {
  Choice<BatchSizeSearch> mode = BatchSizeSearch::kPower;
  /// The first batch size tried (>= 1).
  int64_t init_val = 2;
  /// Trials at most (>= 1).
  int64_t max_trials = 25;
  /// Optimizer steps of each trial (>= 1): the first steps allocate what
  /// the later ones reuse (gradients, the optimizer's state).
  int64_t steps_per_trial = 3;
  /// On the CPU (required there): the bytes of tensor storage a trial may
  /// hold at once, beyond what exists when it starts (the model's
  /// parameters; data loaded before the search). An allocation past it fails
  /// the trial as a GPU's does when its memory runs out
  /// (c10::OutOfMemoryError). Without a cap nothing would run out before the
  /// machine does. On a GPU the device's memory is the cap and this is not
  /// used.
  int64_t host_memory_cap = 0;
};

struct BatchSizeTrial {
  int64_t batch_size = 0;
  /// Its steps ran; false: it ran out of memory (`failure` says where).
  bool fits = false;
  /// Under host_memory_cap: the most bytes of the trial's tensors alive at
  /// once (of a failed trial: before the allocation refused); else -1.
  int64_t peak_bytes = -1;
  std::string failure;
};

struct BatchSizeFinderResult {
  /// The largest batch size that fit; 0 when none did (`note` says why).
  int64_t batch_size = 0;
  /// Every trial, in the order run.
  std::vector<BatchSizeTrial> trials;
  /// Not run: the options ask for fast_dev_run (as Lightning's finder, it
  /// skips; batch_size 0, `note` says so).
  bool skipped = false;
  /// Why the search ended where it did when that is not a failed trial
  /// (max_trials reached, the whole training set in one batch, a size the
  /// loader makes no batch of), or why nothing fit.
  std::string note;
};

class Tuner {
 public:
  /// The options of the fit to tune; checked as a Trainer checks them.
  explicit Tuner(TrainerOptions options);

  LRFinderResult lr_find(Module& module, std::shared_ptr<DataLoader> train,
                         LRFinderOptions options = {});
  LRFinderResult lr_find(Module& module, DataModule& data, LRFinderOptions options = {});

  /// The largest training batch that fits in memory (Lightning's
  /// Tuner.scale_batch_size): short fits of steps_per_trial optimizer steps
  /// on loaders of growing batch sizes, from `make_loader(batch_size)`,
  /// until one runs out of memory: a CUDA out-of-memory error on a GPU,
  /// host_memory_cap on the CPU. After every trial the module's parameters,
  /// buffers and gradients and the random generators are put back as they
  /// were, so the fit that follows is the one that would have run without
  /// it. An exception that is not about memory ends the search and is
  /// rethrown (after the same putting back). One process only: under a
  /// launcher or torchrun a rank that runs out alone would leave its peers
  /// waiting in a collective.
  ///
  ///   auto found = tuner.scale_batch_size(model, [&](int64_t b) {
  ///     return fulgur::make_data_loader(train_set, {.batch_size = b});
  ///   }, {.mode = "binsearch"});
  BatchSizeFinderResult scale_batch_size(
      Module& module, const std::function<std::shared_ptr<DataLoader>(int64_t)>& make_loader,
      BatchSizeFinderOptions options = {});
  /// The same on a DataModule's training loader, through its batch_size()
  /// and set_batch_size() (prepare_data and setup(kFit) run once before the
  /// first trial, teardown(kFit) after the last). It is left holding the
  /// size found (its own when none fit), as Lightning leaves
  /// datamodule.batch_size.
  BatchSizeFinderResult scale_batch_size(Module& module, DataModule& data,
                                         BatchSizeFinderOptions options = {});

 private:
  LRFinderResult run_lr_find(Module& module, const std::function<void(class Trainer&)>& fit,
                             const LRFinderOptions& options);
  TrainerOptions options_;
};

}  // namespace fulgur
