#include "fulgur/tuner/tuner.h"

#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include "core/run_program.h"
#include "fulgur/callbacks/callback.h"
#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/data/data_loader.h"
#include "fulgur/data/data_module.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"
#include "fulgur/utilities/seed.h"

namespace fulgur {

namespace {

void check_lr_finder_options(const LRFinderOptions& o) {
  std::vector<std::string> problems;
  if (!(o.min_lr > 0.0 && std::isfinite(o.min_lr))) {
    problems.push_back(str("min_lr=", o.min_lr, ": must be a finite number > 0, e.g. 1e-8"));
  }
  if (!(o.max_lr > o.min_lr && std::isfinite(o.max_lr))) {
    problems.push_back(str("max_lr=", o.max_lr, ": must be finite and larger than min_lr=",
                           o.min_lr, ", e.g. 1.0"));
  }
  if (o.num_training < 2) {
    problems.push_back(str("num_training=", o.num_training, ": must be >= 2 steps, e.g. 100"));
  }
  if (!o.mode.is_valid()) {
    problems.push_back(str("mode=\"", o.mode.text(), "\": pass ", o.mode.spellings()));
  }
  if (!(o.smoothing >= 0.0 && o.smoothing < 1.0)) {
    problems.push_back(str("smoothing=", o.smoothing, ": must be in [0, 1), e.g. 0.98"));
  }
  if (o.skip_begin < 0 || o.skip_end < 0) {
    problems.push_back(str("skip_begin=", o.skip_begin, ", skip_end=", o.skip_end,
                           ": must be >= 0"));
  }
  if (!problems.empty()) {
    throw ConfigError(str("Tuner.lr_find(", join(problems, "; "), ")."));
  }
}

// The rate of step `k` of the sweep.
double sweep_lr(const LRFinderOptions& o, int64_t k) {
  const double t = static_cast<double>(k) / static_cast<double>(o.num_training - 1);
  if (o.mode.value() == LRSweep::kLinear) return o.min_lr + t * (o.max_lr - o.min_lr);
  return o.min_lr * std::pow(o.max_lr / o.min_lr, t);
}

// Sets each step's rate, records the smoothed loss after it, and stops the
// fit when the loss diverges.
class LRFinderCallback : public Callback {
 public:
  LRFinderCallback(const LRFinderOptions& options, LRFinderResult& result)
      : options_(options), result_(result) {}
  std::string state_key() const override { return "LRFinder"; }

  // The training loader's position, put back when the trial ends (the fit
  // that follows may take the same loader, and would start mid-epoch).
  void on_train_start(Trainer& trainer, Module&) override {
    loader_ = trainer.train_dataloader();
    if (loader_ != nullptr) position_ = loader_->state_dict();
  }
  void on_train_end(Trainer&, Module&) override { put_loader_back(); }
  void on_exception(Trainer&, Module&, const std::exception&) override { put_loader_back(); }

  void on_before_optimizer_step(Trainer& trainer, Module&,
                                torch::optim::Optimizer& optimizer) override {
    const double lr = sweep_lr(options_, trainer.global_step());
    for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
    step_lr_ = lr;
  }

  void on_train_batch_end(Trainer& trainer, Module&, const at::Tensor& loss, const Batch&,
                          int64_t) override {
    // Once per optimizer step (the last micro-batch of an accumulation).
    if (trainer.global_step() == recorded_steps_ || !step_lr_) return;
    recorded_steps_ = trainer.global_step();
    if (!loss.defined()) {
      // No loss (a skipped batch, manual optimization): a gap in the curve,
      // as Lightning records it; the average and the sweep go on.
      result_.lrs.push_back(*step_lr_);
      result_.losses.push_back(std::nan(""));
      step_lr_.reset();
      return;
    }
    // Every rank's loss (one all-reduce; none on one process), so that
    // every rank under torchrun records the same curve and suggestion.
    const double value =
        trainer.strategy().all_reduce(loss.detach().to(torch::kDouble).reshape({1}))
            .item<double>();
    ++averaged_;
    average_ = options_.smoothing * average_ + (1.0 - options_.smoothing) * value;
    const double smoothed =
        average_ / (1.0 - std::pow(options_.smoothing, static_cast<double>(averaged_)));
    result_.lrs.push_back(*step_lr_);
    result_.losses.push_back(smoothed);
    step_lr_.reset();
    const bool exploded = options_.early_stop_threshold > 0.0 && averaged_ > 1 &&
                          smoothed > options_.early_stop_threshold * best_;
    if (!std::isfinite(smoothed) || exploded) {
      result_.diverged = true;
      trainer.request_stop();
      return;
    }
    best_ = std::min(best_, smoothed);
  }

 private:
  void put_loader_back() {
    if (loader_ != nullptr) loader_->load_state_dict(position_);
    loader_ = nullptr;
  }

  const LRFinderOptions& options_;
  LRFinderResult& result_;
  DataLoader* loader_ = nullptr;
  StateDict position_;
  std::optional<double> step_lr_;
  int64_t recorded_steps_ = 0;
  int64_t averaged_ = 0;  // losses in the average
  double average_ = 0.0;
  double best_ = std::numeric_limits<double>::infinity();
};

std::string plot_lr_find(const LRFinderResult& r, const LRFinderOptions& o) {
  std::ostringstream script;
  script.precision(17);
  script << "set terminal pngcairo size 800,500\n"
         << "set output '" << o.plot_path << "'\n"
         << "set title 'learning-rate finder'\n"
         << "set xlabel 'learning rate'\nset ylabel 'loss (smoothed)'\nset grid\n"
         << "unset key\n";
  if (o.mode.value() == LRSweep::kExponential) script << "set logscale x\nset format x '%.0e'\n";
  script << "$curve << EOD\n";
  for (size_t i = 0; i < r.lrs.size(); ++i) {
    if (std::isfinite(r.losses[i])) script << r.lrs[i] << " " << r.losses[i] << "\n";
  }
  script << "EOD\n";
  if (r.suggestion) {
    script << "$best << EOD\n"
           << *r.suggestion << " " << r.losses[static_cast<size_t>(r.suggestion_index)] << "\n"
           << "EOD\n"
           << "plot $curve using 1:2 with lines lw 2, $best using 1:2 with points pt 7 ps 2\n";
  } else {
    script << "plot $curve using 1:2 with lines lw 2\n";
  }
  const auto ran = detail::run_program({"gnuplot"}, script.str(), std::chrono::seconds(60));
  if (ran.spawn_error != 0) {
    return str("lr_find: gnuplot is not installed, so \"", o.plot_path,
               "\" was not drawn: apt install gnuplot-nox (scripts/install-deps.sh installs it).");
  }
  if (ran.timed_out) return str("lr_find: gnuplot did not finish in 60 s drawing \"", o.plot_path, "\".");
  if (!ran.succeeded() || !std::filesystem::exists(o.plot_path)) {
    return str("lr_find: gnuplot failed drawing \"", o.plot_path,
               "\": ", ran.output.empty() ? ran.how_it_ended() : ran.output);
  }
  return "";
}

}  // namespace

int64_t steepest_descent(const std::vector<double>& lrs, const std::vector<double>& losses,
                         int64_t skip_begin, int64_t skip_end) {
  const int64_t n = static_cast<int64_t>(std::min(lrs.size(), losses.size()));
  std::vector<double> x, y;
  std::vector<int64_t> index;
  for (int64_t i = std::max<int64_t>(skip_begin, 0); i < n - std::max<int64_t>(skip_end, 0); ++i) {
    if (!std::isfinite(losses[static_cast<size_t>(i)])) continue;
    x.push_back(lrs[static_cast<size_t>(i)]);
    y.push_back(losses[static_cast<size_t>(i)]);
    index.push_back(i);
  }
  const size_t m = x.size();
  if (m < 2) return -1;
  int64_t best = -1;
  double best_slope = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < m; ++i) {
    double slope;
    if (i == 0) {
      slope = (y[1] - y[0]) / (x[1] - x[0]);
    } else if (i == m - 1) {
      slope = (y[m - 1] - y[m - 2]) / (x[m - 1] - x[m - 2]);
    } else {
      // Second-order accurate on uneven spacing (as torch.gradient).
      const double hl = x[i] - x[i - 1], hr = x[i + 1] - x[i];
      slope = (hl * hl * y[i + 1] - hr * hr * y[i - 1] + (hr * hr - hl * hl) * y[i]) /
              (hl * hr * (hl + hr));
    }
    if (slope < best_slope) {
      best_slope = slope;
      best = index[i];
    }
  }
  return best;
}

Tuner::Tuner(TrainerOptions options) : options_(std::move(options)) {}

LRFinderResult Tuner::lr_find(Module& module, std::shared_ptr<DataLoader> train,
                              LRFinderOptions options) {
  if (!train) {
    throw ConfigError(
        "Tuner.lr_find(module, nullptr): no training data. Pass the loader of the fit to tune.");
  }
  return run_lr_find(module, [&](Trainer& trainer) { trainer.fit(module, train); }, options);
}

LRFinderResult Tuner::lr_find(Module& module, DataModule& data, LRFinderOptions options) {
  return run_lr_find(module, [&](Trainer& trainer) { trainer.fit(module, data); }, options);
}

LRFinderResult Tuner::run_lr_find(Module& module, const std::function<void(Trainer&)>& fit,
                                  const LRFinderOptions& options) {
  check_lr_finder_options(options);
  LRFinderResult result;
  TrainerOptions trial = options_;
  trial.max_steps = options.num_training;
  trial.max_epochs = -1;
  trial.min_epochs = 0;
  trial.min_steps = 0;
  trial.max_time = std::nullopt;
  trial.fast_dev_run = 0;
  trial.limit_val_batches = 0;
  trial.num_sanity_val_steps = 0;
  trial.enable_checkpointing = false;
  trial.enable_progress_bar = false;
  trial.logger = false;
  trial.loggers = {};
  trial.profiler = "none";
  trial.every_n_train_steps = 0;
  // A captured step would run the sweep's first rate for good.
  trial.cuda_graph = false;
  trial.callbacks = {std::make_shared<LRFinderCallback>(options, result)};

  // What the trial changes, to put back: the parameters and buffers (each
  // tensor's data as it was, dtype and device included: a precision plugin
  // or the strategy may convert and move them), the random generators.
  std::vector<std::pair<at::Tensor, at::Tensor>> weights;
  for (const auto& p : module.parameters()) weights.emplace_back(p, p.detach().clone());
  for (const auto& b : module.buffers()) weights.emplace_back(b, b.detach().clone());
  const StateDict rng = rng_state_dict();
  auto restore = [&] {
    torch::NoGradGuard no_grad;
    for (auto& [tensor, saved] : weights) tensor.set_data(saved);
    load_rng_state_dict(rng);
  };
  try {
    Trainer trainer(trial);
    if (!trainer.resolution().launcher.empty()) {
      throw ConfigError(str(
          "Tuner.lr_find under strategy \"", trainer.resolution().strategy, "\" with ",
          trainer.resolution().num_devices, " devices: its launcher (",
          trainer.resolution().launcher,
          ") would start processes for the trial. Find the rate with devices=1 (and scale it "
          "with the batch size the ranks add up to), or run the program under torchrun, where "
          "every rank sweeps in step."));
    }
    fit(trainer);
  } catch (...) {
    try {
      restore();
    } catch (const std::exception& e) {
      detail::print_note(str("Tuner.lr_find: putting the module back after the failed trial "
                             "failed too: ", e.what()));
    }
    throw;
  }
  restore();

  result.suggestion_index =
      steepest_descent(result.lrs, result.losses, options.skip_begin, options.skip_end);
  if (result.suggestion_index >= 0) {
    result.suggestion = result.lrs[static_cast<size_t>(result.suggestion_index)];
  } else {
    result.note = str("lr_find: no suggestion: ", result.losses.size(),
                      " step(s) recorded leave fewer than two finite losses between skip_begin=",
                      options.skip_begin, " and skip_end=", options.skip_end,
                      ". Raise num_training, give the loader more batches, or lower max_lr if the "
                      "loss diverged early.");
  }
  if (!options.plot_path.empty() && !result.lrs.empty()) {
    const std::string problem = plot_lr_find(result, options);
    if (!problem.empty()) result.note += (result.note.empty() ? "" : " ") + problem;
  }
  return result;
}

}  // namespace fulgur
