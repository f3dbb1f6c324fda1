// Private: Trainer option profiler = "simple". Wall time of each phase of
// the fit loop (fetching a batch, training_step, backward, the optimizer
// steps, logging, the batch-end hooks and checkpoints, validation, the
// epoch's end), summed over the fit and printed as a table by global rank
// 0 when the fit ends. On a GPU a phase's time is what the host spent in it
// (the kernels it queued may run later), as with Lightning's simple
// profiler; a captured CUDA-graph step is one phase. Off (the default), the
// loop holds no profiler and each phase costs one null check. Not installed.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>

namespace fulgur::detail {

class SimpleProfiler {
 public:
  enum class Phase {
    kFetch,          // the training loader's next batch (and its move ahead)
    kTrainingStep,   // training_step, under the strategy's step scope
    kBackward,       // backward (and the hooks around it)
    kOptimizerStep,  // clipping, the optimizer steps, zero_grad, schedulers
    kGraphStep,      // a CUDA-graph step (cuda_graph): all of the above
    kLogging,        // the step's logged values to the loggers
    kBatchEnd,       // on_train_batch_end of the module and the callbacks
    kValidation,     // validation runs during fit
    kEpochEnd,       // the epoch's end: hooks, epoch metrics, checkpoints
    kCount
  };
  static const char* name(Phase phase);

  /// Times one phase from construction to destruction; does nothing when
  /// `profiler` is null (the option is off).
  class Scope {
   public:
    Scope(SimpleProfiler* profiler, Phase phase)
        : profiler_(profiler),
          phase_(phase),
          start_(profiler != nullptr ? std::chrono::steady_clock::now()
                                     : std::chrono::steady_clock::time_point()) {}
    ~Scope() {
      if (profiler_ != nullptr) profiler_->add(phase_, std::chrono::steady_clock::now() - start_);
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    SimpleProfiler* profiler_;
    Phase phase_;
    std::chrono::steady_clock::time_point start_;
  };

  /// The fit loop's whole time starts now.
  void start();
  void add(Phase phase, std::chrono::steady_clock::duration elapsed);
  /// Calls and total time of a phase so far.
  int64_t calls(Phase phase) const { return stats_[index(phase)].calls; }
  double seconds(Phase phase) const;
  /// The table printed at the end of fit: per phase its calls, total and
  /// mean time and share of the fit loop's time, then the time outside the
  /// listed phases.
  std::string table() const;

 private:
  static size_t index(Phase phase) { return static_cast<size_t>(phase); }
  struct Stat {
    int64_t calls = 0;
    std::chrono::steady_clock::duration total{};
    std::chrono::steady_clock::duration max{};
  };
  std::array<Stat, static_cast<size_t>(Phase::kCount)> stats_{};
  std::chrono::steady_clock::time_point started_{};
};

}  // namespace fulgur::detail
