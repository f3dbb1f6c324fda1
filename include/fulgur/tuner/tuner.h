// File: fulgur/tuner/tuner.h
//
// The learning-rate finder (Lightning's Tuner.lr_find): a short fit on the
// module in which every optimizer step takes a learning rate growing from
// min_lr to max_lr, recording the loss after each; the suggestion is where
// the smoothed loss falls fastest. Everything the trial changes is put back
// afterwards (the module's parameters and buffers, the random generators),
// so the fit that follows is the one that would have run without it.
//
//   fulgur::Tuner tuner(options);                     // the TrainerOptions of the real fit
//   auto found = tuner.lr_find(model, train_loader, {.plot_path = "lr_find.png"});
//   if (found.suggestion) model.lr = *found.suggestion;
//   fulgur::Trainer(options).fit(model, train_loader);
//
// The trial runs a Trainer of `options` with: max_steps = num_training,
// no epoch limit, no validation or sanity check, no checkpoints, loggers,
// progress bar or callbacks of the options (they would record a run that
// is not one). configure_optimizers is called for it as for any fit; the
// rate of every parameter group of every optimizer is set before each
// step (a scheduler's change is overridden). A module's own members beyond
// its parameters and buffers (counters, an optimizer it keeps) are its to
// reset.
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
  /// one seen (it diverged); <= 0: it never stops early.
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

class Tuner {
 public:
  /// The options of the fit to tune; checked as a Trainer checks them.
  explicit Tuner(TrainerOptions options);

  LRFinderResult lr_find(Module& module, std::shared_ptr<DataLoader> train,
                         LRFinderOptions options = {});
  LRFinderResult lr_find(Module& module, DataModule& data, LRFinderOptions options = {});

 private:
  LRFinderResult run_lr_find(Module& module, const std::function<void(class Trainer&)>& fit,
                             const LRFinderOptions& options);
  TrainerOptions options_;
};

}  // namespace fulgur
