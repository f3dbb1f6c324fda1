#include "fulgur/callbacks/progress_bar.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "fulgur/core/errors.h"
#include "fulgur/data/data_loader.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"

namespace fulgur {

namespace {

// "mm:ss", or "h:mm:ss" past an hour.
void clock_text(char* out, size_t size, double seconds) {
  const auto s = static_cast<long long>(std::clamp(seconds, 0.0, 3.6e8));
  if (s >= 3600) {
    std::snprintf(out, size, "%lld:%02lld:%02lld", s / 3600, (s / 60) % 60, s % 60);
  } else {
    std::snprintf(out, size, "%02lld:%02lld", s / 60, s % 60);
  }
}

}  // namespace

namespace {

std::FILE* checked_stream(std::FILE* out) {
  if (out == nullptr) {
    throw ConfigError(
        "ProgressBar: the output stream is null. Pass stderr (the default), stdout "
        "or an open FILE*.");
  }
  return out;
}

}  // namespace

ProgressBar::ProgressBar(int refresh_ms, std::FILE* out)
    : refresh_ms_(refresh_ms), out_(checked_stream(out)), tty_(::isatty(::fileno(out_)) != 0) {}

void ProgressBar::on_train_epoch_start(Trainer& trainer, Module&) {
  // An epoch resumed mid-way counts on from where its loader is (also where
  // no batch of it is left), and the rate counts the batches this bar sees.
  const DataLoader* loader = trainer.train_dataloader();
  const int64_t done =
      loader != nullptr && loader->epoch() == trainer.current_epoch() ? loader->position() : 0;
  train_ = Bar{done, Clock::now(), {}, done};
  if (tty_) {
    winsize size{};
    if (::ioctl(::fileno(out_), TIOCGWINSZ, &size) == 0 && size.ws_col >= 40) width_ = size.ws_col;
  }
}

void ProgressBar::draw(Trainer& trainer, Bar& bar, const char* label, int64_t total, bool final) {
  if (!trainer.strategy().is_global_zero()) return;
  const auto now = Clock::now();
  bar.last_draw = now;
  const double elapsed = std::chrono::duration<double>(now - bar.start).count();
  const int64_t timed = bar.done - bar.done_at_start;
  const double rate = elapsed > 0 && timed > 0 ? static_cast<double>(timed) / elapsed : 0.0;
  char* p = line_.data();
  char* const end = line_.data() + line_.size() - 4;  // room for "\n" and the NUL
  auto put = [&](const char* format, auto... args) {
    if (p < end) {
      const int n = std::snprintf(p, static_cast<size_t>(end - p), format, args...);
      if (n > 0) p += std::min<ptrdiff_t>(n, end - p);
    }
  };
  put("%s", label);
  if (tty_ && total > 0) {
    // The bar takes what the text leaves of a third of the terminal.
    const int cells = std::clamp(width_ / 4, 10, 40);
    const int filled = static_cast<int>(static_cast<double>(cells) *
                                        std::min<double>(1.0, static_cast<double>(bar.done) /
                                                                  static_cast<double>(total)));
    put("%s", " [");
    for (int i = 0; i < cells; ++i) {
      put("%c", i < filled ? '=' : (i == filled && bar.done < total ? '>' : ' '));
    }
    put("%s", "]");
  }
  if (total > 0) {
    put(" %lld/%lld", static_cast<long long>(bar.done), static_cast<long long>(total));
  } else {
    put(" %lld", static_cast<long long>(bar.done));
  }
  put(" %.1fit/s", rate);
  char spent[64], left[64];
  clock_text(spent, sizeof spent, elapsed);
  if (total > 0 && rate > 0) {
    clock_text(left, sizeof left, static_cast<double>(total - bar.done) / rate);
    put(" %s<%s", spent, left);
  } else {
    put(" %s", spent);
  }
  if (&bar == &train_) {
    for (const auto& [name, value] : trainer.progress_bar_metrics()) {
      put(" %s=%.4g", name.c_str(), value);
    }
  }
  *p = '\0';
  if (tty_) {
    // Cut at the terminal's width so that the line redraws in place.
    if (p - line_.data() >= width_) line_[static_cast<size_t>(width_ - 1)] = '\0';
    std::fprintf(out_, "\r\033[K%s%s", line_.data(), final ? "\n" : "");
  } else {
    std::fprintf(out_, "%s\n", line_.data());
  }
  std::fflush(out_);
}

void ProgressBar::on_train_batch_end(Trainer& trainer, Module&, const at::Tensor&, const Batch&,
                                     int64_t batch_idx) {
  train_.done = batch_idx + 1;  // the batch's place in the epoch
  if (!tty_ || Clock::now() - train_.last_draw < std::chrono::milliseconds(refresh_ms_)) return;
  draw_epoch(trainer, false);
}

void ProgressBar::draw_epoch(Trainer& trainer, bool final) {
  std::snprintf(label_.data(), label_.size(), "Epoch %lld",
                static_cast<long long>(trainer.current_epoch()));
  draw(trainer, train_, label_.data(), trainer.num_training_batches(), final);
}

void ProgressBar::on_train_epoch_end(Trainer& trainer, Module&) { draw_epoch(trainer, true); }

void ProgressBar::on_validation_start(Trainer&, Module&) { eval_ = Bar{0, Clock::now(), {}}; }

// Each stage's bar starts at 0 (one of an earlier stage may not have ended:
// a predict of unknown length).
void ProgressBar::on_test_start(Trainer&, Module&) { eval_ = Bar{}; }
void ProgressBar::on_predict_start(Trainer&, Module&) { eval_ = Bar{}; }

void ProgressBar::evaluation_batch(Trainer& trainer, const char* label) {
  ++eval_.done;
  if (eval_.start == Clock::time_point{}) {
    eval_.start = Clock::now();
    eval_.done_at_start = eval_.done;
  }
  if (!tty_ || Clock::now() - eval_.last_draw < std::chrono::milliseconds(refresh_ms_)) return;
  draw(trainer, eval_, label, trainer.num_evaluation_batches(), false);
}

void ProgressBar::on_validation_batch_end(Trainer& trainer, Module&, const Batch&, int64_t) {
  evaluation_batch(trainer, trainer.sanity_checking() ? "Sanity check" : "Validation");
}

void ProgressBar::on_validation_end(Trainer& trainer, Module&) {
  if (trainer.stage() != Stage::kFit) {
    end_evaluation(trainer, "Validation");  // Trainer::validate
    return;
  }
  if (tty_) {
    // Back to the training line (it is redrawn at its next refresh).
    if (trainer.strategy().is_global_zero() && eval_.done > 0) {
      std::fprintf(out_, "\r\033[K");
      std::fflush(out_);
    }
    eval_ = Bar{};
    return;
  }
  eval_ = Bar{};
  if (trainer.sanity_checking()) return;
  // Without a terminal, mid-epoch validations get their own line.
  if (trainer.num_training_batches() >= 0 && train_.done < trainer.num_training_batches()) {
    draw_epoch(trainer, false);
  }
}

void ProgressBar::on_test_batch_end(Trainer& trainer, Module&, const Batch&, int64_t) {
  evaluation_batch(trainer, "Testing");
}

void ProgressBar::end_evaluation(Trainer& trainer, const char* label) {
  if (tty_ && eval_.done > 0) draw(trainer, eval_, label, trainer.num_evaluation_batches(), true);
  eval_ = Bar{};
}

void ProgressBar::on_test_epoch_end(Trainer& trainer, Module&) { end_evaluation(trainer, "Testing"); }

void ProgressBar::on_predict_batch_end(Trainer& trainer, Module&, const Batch&, const Batch&,
                                       int64_t) {
  evaluation_batch(trainer, "Predicting");
}

// The bar ends on its own line, complete (also where the length was unknown).
void ProgressBar::on_predict_end(Trainer& trainer, Module&) {
  end_evaluation(trainer, "Predicting");
}

}  // namespace fulgur
