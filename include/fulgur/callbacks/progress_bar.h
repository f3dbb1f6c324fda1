// File: fulgur/callbacks/progress_bar.h
#pragma once

#include <chrono>
#include <cstdio>

#include "fulgur/callbacks/callback.h"

namespace fulgur {

/// Progress on stderr, rank 0 only. On a terminal one line is redrawn per
/// batch (at most every `refresh_ms`); otherwise one line is printed per
/// epoch and per evaluation, so logs stay short.
class ProgressBar : public Callback {
 public:
  explicit ProgressBar(int refresh_ms = 100, std::FILE* out = stderr);
  std::string state_key() const override { return "ProgressBar"; }
  void on_train_epoch_start(Trainer& trainer, Module& module) override;
  void on_train_batch_end(Trainer& trainer, Module& module, const at::Tensor& loss,
                          const Batch& batch, int64_t batch_idx) override;
  void on_train_epoch_end(Trainer& trainer, Module& module) override;
  void on_validation_end(Trainer& trainer, Module& module) override;

 private:
  void print_line(Trainer& trainer, bool final_line);

  int refresh_ms_;
  std::FILE* out_;
  bool tty_;
  std::chrono::steady_clock::time_point last_draw_{};
  std::chrono::steady_clock::time_point epoch_start_{};
  int64_t batches_ = 0;
};

}  // namespace fulgur
