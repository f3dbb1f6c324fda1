// Private: the evaluation loop (validation and test) and the prediction
// loop: eval mode, no gradients, the stage's step and hooks. Not installed.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "fulgur/data/data_loader.h"
#include "fulgur/trainer/trainer.h"

namespace fulgur::detail {

class EvaluationLoop {
 public:
  explicit EvaluationLoop(Trainer::Impl& trainer) : trainer_(trainer) {}
  EvaluationLoop(const EvaluationLoop&) = delete;
  EvaluationLoop& operator=(const EvaluationLoop&) = delete;

  /// One pass of the first `limit` batches (all when unset) of `loader`
  /// through validation_step or test_step; returns the epoch's metrics,
  /// published unless sanity checking.
  Metrics run(DataLoader& loader, Stage stage, std::optional<int64_t> limit);
  /// Batches of the pass running (or last run); -1 when unknown.
  int64_t num_batches() const { return num_batches_; }

 private:
  Trainer::Impl& trainer_;
  int64_t num_batches_ = -1;
  // A note said that another rank's loader of unknown length ended sooner.
  bool noted_shorter_peer_ = false;
};

class PredictionLoop {
 public:
  explicit PredictionLoop(Trainer::Impl& trainer) : trainer_(trainer) {}
  PredictionLoop(const PredictionLoop&) = delete;
  PredictionLoop& operator=(const PredictionLoop&) = delete;

  /// predict_step over the first `limit` batches of `loader`, in order.
  std::vector<Batch> run(DataLoader& loader, std::optional<int64_t> limit);
  /// Batches of the pass running (or last run); -1 when unknown.
  int64_t num_batches() const { return num_batches_; }
  /// The loader of the pass running; nullptr outside run().
  DataLoader* loader() const { return loader_; }

 private:
  Trainer::Impl& trainer_;
  int64_t num_batches_ = -1;
  DataLoader* loader_ = nullptr;
  bool noted_shorter_peer_ = false;  // as EvaluationLoop's
};

}  // namespace fulgur::detail
