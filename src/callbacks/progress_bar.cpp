#include "fulgur/callbacks/progress_bar.h"

#include <unistd.h>

#include <string>

#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"

namespace fulgur {

ProgressBar::ProgressBar(int refresh_ms, std::FILE* out)
    : refresh_ms_(refresh_ms), out_(out), tty_(::isatty(::fileno(out)) != 0) {}

void ProgressBar::on_train_epoch_start(Trainer&, Module&) {
  epoch_start_ = std::chrono::steady_clock::now();
  last_draw_ = {};
  batches_ = 0;
}

void ProgressBar::print_line(Trainer& trainer, bool final_line) {
  if (!trainer.strategy().is_global_zero()) return;
  std::string line = "Epoch " + std::to_string(trainer.current_epoch());
  int64_t total = trainer.num_training_batches();
  line += " [" + std::to_string(batches_) + (total >= 0 ? "/" + std::to_string(total) : "") + "]";
  double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_start_).count();
  char buf[64];
  std::snprintf(buf, sizeof buf, " %.1fs", secs);
  line += buf;
  for (const auto& [name, value] : trainer.progress_bar_metrics()) {
    std::snprintf(buf, sizeof buf, " %s=%.4g", name.c_str(), value);
    line += buf;
  }
  if (tty_) {
    std::fprintf(out_, "\r\033[K%s%s", line.c_str(), final_line ? "\n" : "");
  } else {
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
}

void ProgressBar::on_train_batch_end(Trainer& trainer, Module&, const at::Tensor&, const Batch&,
                                     int64_t) {
  ++batches_;
  if (!tty_) return;
  auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ < std::chrono::milliseconds(refresh_ms_)) return;
  last_draw_ = now;
  print_line(trainer, false);
}

void ProgressBar::on_train_epoch_end(Trainer& trainer, Module&) { print_line(trainer, true); }

void ProgressBar::on_validation_end(Trainer& trainer, Module&) {
  if (trainer.sanity_checking() || tty_) return;
  // Without a terminal, mid-epoch validations get their own line.
  if (trainer.num_training_batches() >= 0 && batches_ < trainer.num_training_batches()) {
    print_line(trainer, false);
  }
}

}  // namespace fulgur
