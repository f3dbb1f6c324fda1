// File: fulgur/callbacks/progress_bar.h
#pragma once

#include <array>
#include <chrono>
#include <cstdio>

#include "fulgur/callbacks/callback.h"

namespace fulgur {

/// Progress on stderr, global rank 0 only (the Trainer adds one unless
/// enable_progress_bar is false).
///
/// On a terminal, one line redrawn at most every `refresh_ms` per stage:
///
///   Epoch 1/3 [=========>          ] 38/60 12.4it/s 00:03<00:02 train_loss=0.3412
///   Validation [====================] 5/5 41.0it/s 00:00<00:00
///
/// the count, rate, elapsed time and time left, and on the training bar the
/// metrics logged with prog_bar; a training epoch's line stays (with the
/// validation metrics), the others are replaced. Drawing allocates nothing: the line is written
/// into a buffer of the callback's own.
///
/// Elsewhere (a file, a pipe, CI logs), one line per training epoch and
/// per validation within an epoch, so logs stay short.
class ProgressBar : public Callback {
 public:
  explicit ProgressBar(int refresh_ms = 100, std::FILE* out = stderr);
  std::string state_key() const override { return "ProgressBar"; }
  void on_train_epoch_start(Trainer& trainer, Module& module) override;
  void on_train_batch_end(Trainer& trainer, Module& module, const at::Tensor& loss,
                          const Batch& batch, int64_t batch_idx) override;
  void on_train_epoch_end(Trainer& trainer, Module& module) override;
  void on_validation_start(Trainer& trainer, Module& module) override;
  void on_validation_batch_end(Trainer& trainer, Module& module, const Batch& batch,
                               int64_t batch_idx) override;
  void on_validation_end(Trainer& trainer, Module& module) override;
  void on_test_start(Trainer& trainer, Module& module) override;
  void on_test_batch_end(Trainer& trainer, Module& module, const Batch& batch,
                         int64_t batch_idx) override;
  void on_test_epoch_end(Trainer& trainer, Module& module) override;
  void on_predict_start(Trainer& trainer, Module& module) override;
  void on_predict_batch_end(Trainer& trainer, Module& module, const Batch& prediction,
                            const Batch& batch, int64_t batch_idx) override;
  void on_predict_end(Trainer& trainer, Module& module) override;

 private:
  using Clock = std::chrono::steady_clock;
  struct Bar {
    int64_t done = 0;
    Clock::time_point start{};
    Clock::time_point last_draw{};
    // Batches done at `start`: 1 when the bar started at its first batch's
    // end (the start of a test or predict pass is not timed: the loader's
    // first batch comes after it), the batches before it for an epoch
    // resumed mid-way.
    int64_t done_at_start = 0;
  };
  // Draws `bar` for `label` (redrawn on a terminal; `final` ends the line).
  void draw(Trainer& trainer, Bar& bar, const char* label, int64_t total, bool final);
  // The training epoch's bar.
  void draw_epoch(Trainer& trainer, bool final);
  // Counts a batch of an evaluation stage and draws at the refresh rate.
  void evaluation_batch(Trainer& trainer, const char* label);
  /// A standalone evaluation's end: its bar stays, complete, on a terminal.
  void end_evaluation(Trainer& trainer, const char* label);

  int refresh_ms_;
  std::FILE* out_;
  bool tty_;
  int width_ = 100;  // the terminal's columns
  Bar train_;
  Bar eval_;
  std::array<char, 1024> line_{};
  std::array<char, 32> label_{};
};

}  // namespace fulgur
