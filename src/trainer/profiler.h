// Private: the fit loop's profilers (Trainer option profiler). The loop
// marks its phases (fetching a batch, training_step, backward, the
// optimizer steps, logging, the batch-end hooks and checkpoints, validation,
// the epoch's end) and its training batches on a LoopProfiler; off (the
// default), the loop holds none and each mark costs one null check.
//
// profiler = "simple" (SimpleProfiler, here): wall time of each phase,
// summed over the fit and printed as a table by global rank 0 when the fit
// ends. On a GPU a phase's time is what the host spent in it (the kernels it
// queued may run later), as with Lightning's simple profiler; a captured
// CUDA-graph step is one phase. profiler = "pytorch": TorchProfiler
// (torch_profiler.h). Not installed.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>

namespace fulgur::detail {

class LoopProfiler {
 public:
  enum class Phase {
    kFetch,          // the training loader's next batch (and its move ahead)
    kTrainingStep,   // training_step, under the strategy's step scope
    kBackward,       // backward (and the hooks around it)
    kOptimizerStep,  // clipping, the optimizer steps, zero_grad, schedulers
    kGraphStep,      // a CUDA-graph step (cuda_graph): all of the above
    kLogging,        // the step's logged values published (twice a step: what
                     // on_train_batch_end reads, then its row to the loggers)
    kBatchEnd,       // on_train_batch_end of the module and the callbacks
    kValidation,     // validation runs during fit
    kEpochEnd,       // the epoch's end: hooks, epoch metrics, checkpoints
    kCount
  };
  static const char* name(Phase phase);

  virtual ~LoopProfiler() = default;
  /// The fit loop starts (its whole time starts now).
  virtual void start() {}
  virtual void begin(Phase phase) = 0;
  virtual void end(Phase phase) = 0;
  /// A training batch begins (before the loader is asked for the next one)
  /// and ends (after its step, hooks and any validation it triggered).
  virtual void batch_begin() {}
  virtual void batch_end() {}
  /// The fit loop ended normally: what global rank 0 prints ("" for none).
  virtual std::string finish() = 0;
  /// The fit loop ended by an exception (or after finish): let go of
  /// anything still running.
  virtual void abandon() {}

  /// Marks one phase from construction to destruction; does nothing when
  /// `profiler` is null (profiling is off).
  class Scope {
   public:
    Scope(LoopProfiler* profiler, Phase phase) : profiler_(profiler), phase_(phase) {
      if (profiler_ != nullptr) profiler_->begin(phase_);
    }
    ~Scope() {
      if (profiler_ != nullptr) profiler_->end(phase_);
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    LoopProfiler* profiler_;
    Phase phase_;
  };
};

class SimpleProfiler final : public LoopProfiler {
 public:
  void start() override;
  void begin(Phase phase) override { open_[index(phase)] = std::chrono::steady_clock::now(); }
  void end(Phase phase) override {
    add(phase, std::chrono::steady_clock::now() - open_[index(phase)]);
  }
  std::string finish() override { return table(); }

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
  std::array<std::chrono::steady_clock::time_point, static_cast<size_t>(Phase::kCount)> open_{};
  std::chrono::steady_clock::time_point started_{};
};

}  // namespace fulgur::detail
