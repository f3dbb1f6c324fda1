#include "trainer/profiler.h"

#include <algorithm>
#include <cstdio>

namespace fulgur::detail {

namespace {
double to_seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}
}  // namespace

const char* LoopProfiler::name(Phase phase) {
  switch (phase) {
    case Phase::kFetch: return "fetch batch";
    case Phase::kTrainingStep: return "training_step";
    case Phase::kBackward: return "backward";
    case Phase::kOptimizerStep: return "optimizer step";
    case Phase::kGraphStep: return "CUDA-graph step";
    case Phase::kLogging: return "logging";
    case Phase::kBatchEnd: return "on_train_batch_end";
    case Phase::kValidation: return "validation";
    case Phase::kEpochEnd: return "epoch end";
    case Phase::kCount: break;
  }
  return "?";
}

void SimpleProfiler::start() {
  stats_ = {};
  started_ = std::chrono::steady_clock::now();
}

void SimpleProfiler::add(Phase phase, std::chrono::steady_clock::duration elapsed) {
  Stat& s = stats_[index(phase)];
  ++s.calls;
  s.total += elapsed;
  s.max = std::max(s.max, elapsed);
}

double SimpleProfiler::seconds(Phase phase) const { return to_seconds(stats_[index(phase)].total); }

std::string SimpleProfiler::table() const {
  const double whole = to_seconds(std::chrono::steady_clock::now() - started_);
  std::string out = "profiler (simple): where the fit loop's time went\n";
  char line[160];
  std::snprintf(line, sizeof line, "  %-20s %8s %11s %11s %11s %7s\n", "phase", "calls", "total s",
                "mean ms", "max ms", "%");
  out += line;
  double listed = 0;
  for (size_t i = 0; i < stats_.size(); ++i) {
    const Stat& s = stats_[i];
    if (s.calls == 0) continue;
    const double total = to_seconds(s.total);
    listed += total;
    std::snprintf(line, sizeof line, "  %-20s %8lld %11.3f %11.3f %11.3f %6.1f%%\n",
                  name(static_cast<Phase>(i)), static_cast<long long>(s.calls), total,
                  1e3 * total / static_cast<double>(s.calls), 1e3 * to_seconds(s.max),
                  whole > 0 ? 100 * total / whole : 0.0);
    out += line;
  }
  const double rest = std::max(0.0, whole - listed);
  std::snprintf(line, sizeof line, "  %-20s %8s %11.3f %11s %11s %6.1f%%\n", "other", "", rest, "",
                "", whole > 0 ? 100 * rest / whole : 0.0);
  out += line;
  std::snprintf(line, sizeof line, "  %-20s %8s %11.3f\n", "fit loop", "", whole);
  out += line;
  return out;
}

}  // namespace fulgur::detail
