#include "fulgur/callbacks/gradient_accumulation_scheduler.h"

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/trainer/trainer.h"

namespace fulgur {

GradientAccumulationScheduler::GradientAccumulationScheduler(std::map<int64_t, int64_t> scheduling)
    : scheduling_(std::move(scheduling)) {
  std::vector<std::string> problems;
  if (scheduling_.empty()) problems.push_back("an empty schedule: give {epoch, factor} pairs");
  for (const auto& [epoch, factor] : scheduling_) {
    if (epoch < 0) problems.push_back(str("epoch ", epoch, ": must be >= 0"));
    if (factor < 1)
      problems.push_back(str("factor ", factor, " at epoch ", epoch, ": must be >= 1"));
  }
  if (!problems.empty()) {
    throw ConfigError(str("GradientAccumulationScheduler(", join(problems, "; "), ")."));
  }
}

int64_t GradientAccumulationScheduler::factor(int64_t epoch) const {
  auto it = scheduling_.upper_bound(epoch);
  return it == scheduling_.begin() ? 1 : std::prev(it)->second;
}

void GradientAccumulationScheduler::setup(Trainer& trainer, Module&, Stage stage) {
  // Before anything trains (not at the epoch the factor first grows), and
  // before the graph's own checks of the fit.
  if (stage != Stage::kFit || !trainer.options().cuda_graph) return;
  for (const auto& [epoch, factor] : scheduling_) {
    // (From an epoch the fit reaches.)
    if (factor == 1 || (trainer.max_epochs() >= 0 && epoch >= trainer.max_epochs())) continue;
    throw ConfigError(str("GradientAccumulationScheduler with cuda_graph=true: factor ", factor,
                          " from epoch ", epoch,
                          " accumulates, and a captured step steps the optimizers every "
                          "batch. Keep every factor at 1, or pass cuda_graph=false."));
  }
}

void GradientAccumulationScheduler::on_fit_start(Trainer& trainer, Module& module) {
  if (trainer.options().accumulate_grad_batches != 1) {
    throw ConfigError(str("GradientAccumulationScheduler with Trainer(accumulate_grad_batches=",
                          trainer.options().accumulate_grad_batches,
                          "): set the accumulation in one place (leave accumulate_grad_batches "
                          "at 1, or drop the scheduler)."));
  }
  if (!module.automatic_optimization()) {
    throw ConfigError(
        "GradientAccumulationScheduler with manual optimization: accumulation is the Module's "
        "job when it steps itself.");
  }
}

void GradientAccumulationScheduler::on_train_epoch_start(Trainer& trainer, Module&) {
  trainer.set_accumulate_grad_batches(factor(trainer.current_epoch()));
}

}  // namespace fulgur
