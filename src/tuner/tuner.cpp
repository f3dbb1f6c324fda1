#include "fulgur/tuner/tuner.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#ifdef FULGUR_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <string_view>
#include <unordered_set>
#include <utility>

#include "core/run_program.h"
#include "loggers/gnuplot_text.h"
#include "utilities/durable_file.h"
#include "trainer/loop_flags.h"
#include "trainer/tuner_trial.h"
#include "tuner/host_memory_cap.h"
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

void check_batch_size_finder_options(const BatchSizeFinderOptions& o) {
  std::vector<std::string> problems;
  if (!o.mode.is_valid()) {
    problems.push_back(str("mode=\"", o.mode.text(), "\": pass ", o.mode.spellings()));
  }
  if (o.init_val < 1) problems.push_back(str("init_val=", o.init_val, ": must be >= 1, e.g. 2"));
  if (o.max_trials < 1) {
    problems.push_back(str("max_trials=", o.max_trials, ": must be >= 1, e.g. 25"));
  }
  if (o.steps_per_trial < 1) {
    problems.push_back(str("steps_per_trial=", o.steps_per_trial, ": must be >= 1, e.g. 3"));
  }
  if (o.host_memory_cap < 0) {
    problems.push_back(str("host_memory_cap=", o.host_memory_cap,
                           ": must be >= 0 bytes, e.g. 2147483648 for 2 GiB"));
  }
  if (!problems.empty()) {
    throw ConfigError(str("Tuner.scale_batch_size(", join(problems, "; "), ")."));
  }
}

// Whether `e` says that memory ran out: a GPU's caching allocator's error,
// cuDNN's and cuBLAS's failures to allocate their workspace (cuDNN says "not
// supported" when a batch is too large for it, which Lightning's finder
// reads as out of memory too), or host_memory_cap's refusal (recognised by
// its text too, where LibTorch passed it on as another error).
bool is_out_of_memory(const std::exception& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) return true;
  if (detail::HostMemoryCap::is_refusal(e)) return true;
  const std::string_view text = e.what();
  for (const char* said :
       {"CUDA out of memory", "DefaultCPUAllocator: not enough memory",
        "DefaultCPUAllocator: can't allocate memory", "CUDNN_STATUS_NOT_SUPPORTED",
        "CUDNN_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_ALLOC_FAILED"}) {
    if (text.find(said) != std::string_view::npos) return true;
  }
  return false;
}

// The first line of an error's text (LibTorch appends a backtrace).
std::string first_line(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  std::string text = error != nullptr ? error->msg() : e.what();
  const size_t end = text.find('\n');
  return end == std::string::npos ? text : text.substr(0, end);
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
    // The mean of the ranks' losses (one all-reduce of the sum and of how
    // many have one; none on one process), so that every rank under
    // torchrun records the same curve and suggestion. A rank without a
    // loss (a skipped batch) takes part too: its peers wait for it.
    const at::Tensor own = loss.defined()
                               ? torch::stack({loss.detach().to(torch::kDouble).reshape({}).cpu(),
                                               torch::ones({}, torch::kDouble)})
                               : torch::zeros({2}, torch::kDouble);
    const at::Tensor sums = trainer.strategy().all_reduce(own, ReduceOp::kSum);
    const double count = sums[1].item<double>();
    if (count == 0.0) {
      // No loss on any rank (a skipped batch, manual optimization): a gap
      // in the curve, as Lightning records it; the average and the sweep go on.
      result_.lrs.push_back(*step_lr_);
      result_.losses.push_back(std::nan(""));
      step_lr_.reset();
      return;
    }
    const double value = sums[0].item<double>() / count;
    ++averaged_;
    average_ = options_.smoothing * average_ + (1.0 - options_.smoothing) * value;
    const double smoothed =
        average_ / (1.0 - std::pow(options_.smoothing, static_cast<double>(averaged_)));
    result_.lrs.push_back(*step_lr_);
    result_.losses.push_back(smoothed);
    step_lr_.reset();
    // Lightning's smoothed > threshold * best, for a loss of any sign.
    const bool exploded =
        options_.early_stop_threshold > 0.0 && averaged_ > 1 &&
        smoothed - best_ > (options_.early_stop_threshold - 1.0) * std::abs(best_);
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

// The options of a trial: the fit's, without what would record a run that
// is not one or change its length.
TrainerOptions trial_options(const TrainerOptions& options, int64_t max_steps) {
  TrainerOptions trial = options;
  trial.max_steps = max_steps;
  trial.max_epochs = -1;
  trial.min_epochs = 0;
  trial.min_steps = 0;
  trial.max_time = std::nullopt;
  trial.fast_dev_run = 0;
  if (!trial.overfit_batches.is_zero()) {
    // The fit's training batches, without its validation (overfit_batches
    // would set that too).
    trial.limit_train_batches = trial.overfit_batches;
    trial.overfit_batches = 0;
  }
  trial.limit_val_batches = 0;
  trial.num_sanity_val_steps = 0;
  trial.enable_checkpointing = false;
  trial.enable_progress_bar = false;
  trial.logger = false;
  trial.loggers = {};
  trial.profiler = ProfilerKind::kNone;
  trial.every_n_train_steps = 0;
  // A trial's loaders are given to fit (or made once by the DataModule):
  // its steps run on one set of them.
  trial.reload_dataloaders_every_n_epochs = 0;
  trial.callbacks = {};
  return trial;
}

// What a trial changes, to put back: the parameters and buffers (each
// tensor's data as it was, dtype and device included: a precision plugin
// or the strategy may convert and move them), the gradients, the random
// generators. The copies are kept in host memory: on a GPU, the trials
// (scale_batch_size's especially) have the device as the fit will.
class ModuleSnapshot {
 public:
  // `seeded`: the trials (and the fit) seed the generators at their start.
  ModuleSnapshot(Module& module, bool seeded) : rng_(rng_state_dict()), seeded_(seeded) {
    keep_tensors(module);
  }
  // Right after a trial's configure_model(): what that built (layers made
  // there, as the README recommends, have no state before the trial; the
  // fit after it finds them built and trains them from these values).
  void keep_new(Module& module) {
    const size_t kept = kept_.size();
    keep_tensors(module);
    // What that build drew from the generators is behind them after the
    // tuner too (the fit finds the layers built, and draws nothing for
    // them): unless the fit seeds them at its start, its random numbers
    // are then those of a fit without the tuner.
    if (built_ || kept_.size() == kept) return;
    built_ = true;
    if (!seeded_) rng_ = rng_state_dict();
  }
  // The parameters and buffers not kept yet.
  void keep_tensors(Module& module) {
    for (const auto& p : module.parameters()) {
      if (!kept_.insert(p.unsafeGetTensorImpl()).second) continue;
      weights_.push_back(copy_of(p));
      grads_.push_back({p, p.grad().defined() ? copy_of(p.grad()).saved : at::Tensor(),
                        p.grad().defined() ? p.grad().device() : p.device(),
                        p.grad().defined() ? p.grad().scalar_type() : p.scalar_type()});
    }
    for (const auto& b : module.buffers()) {
      if (kept_.insert(b.unsafeGetTensorImpl()).second) weights_.push_back(copy_of(b));
    }
  }
  // For a trial's TunerTrial.
  std::function<void(Module&)> keeper() {
    return [this](Module& module) { keep_new(module); };
  }
  void restore() {
    torch::NoGradGuard no_grad;
    // A new tensor each time: the one given to set_data is the module's
    // from then on, and the next trial's steps change it in place.
    for (auto& w : weights_) w.tensor.set_data(w.back());
    for (auto& g : grads_) g.tensor.mutable_grad() = g.saved.defined() ? g.back() : at::Tensor();
    load_rng_state_dict(rng_);
  }
  // After a failed trial: put back, saying (not throwing) when that fails
  // too, so that the trial's own error is the one that reaches the caller.
  void restore_after_failure(const char* what) noexcept {
    try {
      restore();
    } catch (const std::exception& e) {
      detail::print_note(str(what, ": putting the module back after the failed trial failed too: ",
                             e.what()));
    }
  }

 private:
  struct Saved {
    at::Tensor tensor;  // the module's
    at::Tensor saved;   // its copy in host memory
    c10::Device device;
    c10::ScalarType dtype;
    at::Tensor back() const {
      return saved.to(device, dtype, /*non_blocking=*/false, /*copy=*/true);
    }
  };
  static Saved copy_of(const at::Tensor& t) {
    return {t, t.detach().to(c10::kCPU, /*non_blocking=*/false, /*copy=*/true), t.device(),
            t.scalar_type()};
  }
  std::vector<Saved> weights_;
  std::vector<Saved> grads_;
  std::unordered_set<const c10::TensorImpl*> kept_;
  StateDict rng_;
  bool seeded_ = false;
  bool built_ = false;  // a trial's configure_model() built something
};

std::string plot_lr_find(const LRFinderResult& r, const LRFinderOptions& o) {
  std::ostringstream script;
  script.precision(17);
  if (std::string problem = detail::not_a_picture_to_replace(o.plot_path, "lr_find");
      !problem.empty()) {
    return problem;
  }
  if (std::string problem = detail::unwritable(o.plot_path); !problem.empty()) {
    return str("lr_find: cannot write the plot \"", o.plot_path, "\": ", problem,
               ". Pass a plot path in a directory this user can write.");
  }
  // Drawn beside plot_path first, and put there once whole.
  const std::string tmp = detail::temporary_path_for(o.plot_path);
  script << "set terminal pngcairo size 800,500\n"
         << "set output " << detail::gnuplot_quoted(tmp) << "\n"
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
  return detail::run_gnuplot_to(
      script.str(), tmp, o.plot_path, "lr_find",
      str("lr_find: gnuplot is not installed, so \"", o.plot_path,
          "\" was not drawn: apt install gnuplot-nox (scripts/install-deps.sh installs it)."));
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

Tuner::Tuner(TrainerOptions options) : options_(std::move(options)) {
  // Before a sweep, not after it (a trial overrides the loop flags).
  detail::check_trainer_options(options_);
}

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

namespace {

// Under fast_dev_run (a check that the program runs) a finder skips, as
// Lightning's do; `result` says so.
template <typename Result>
bool skips_under_fast_dev_run(const TrainerOptions& options, const char* finder, const char* why,
                              Result& result) {
  if (options.fast_dev_run <= 0) return false;
  result.skipped = true;
  result.note = str(finder, ": skipped: fast_dev_run=", options.fast_dev_run,
                    " checks that the program runs, ", why, ". Drop fast_dev_run to run it.");
  return true;
}

// A trial that can run no training step finds nothing (and would count as
// a fit).
void check_trials_train(const TrainerOptions& options, const char* what) {
  if (options.limit_train_batches.is_zero() && options.overfit_batches.is_zero()) {
    throw ConfigError(str("Tuner.", what,
                          " with limit_train_batches=", options.limit_train_batches.text(),
                          ": its trials would run no training step. Pass a positive "
                          "limit_train_batches (or leave it at 1.0)."));
  }
}

}  // namespace

LRFinderResult Tuner::run_lr_find(Module& module, const std::function<void(Trainer&)>& fit,
                                  const LRFinderOptions& options) {
  check_lr_finder_options(options);
  check_trials_train(options_, "lr_find");
  LRFinderResult result;
  if (skips_under_fast_dev_run(options_, "lr_find", "and a sweep of that few steps finds no rate",
                               result)) {
    return result;
  }
  TrainerOptions trial = trial_options(options_, options.num_training);
  // A captured step would run the sweep's first rate for good.
  trial.cuda_graph = false;
  trial.callbacks = {std::make_shared<LRFinderCallback>(options, result)};
  ModuleSnapshot snapshot(module, options_.seed.has_value());
  const detail::TunerTrial trial_scope(snapshot.keeper());
  bool global_zero = true;  // of the ranks that sweep in step (under torchrun)
  try {
    Trainer trainer(trial);
    global_zero = trainer.strategy().is_global_zero();
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
    snapshot.restore_after_failure("Tuner.lr_find");
    throw;
  }
  snapshot.restore();

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
  // Every rank has the same curve: global rank 0 draws it.
  if (!options.plot_path.empty() && !result.lrs.empty() && global_zero) {
    const std::string problem = plot_lr_find(result, options);
    if (!problem.empty()) result.note += (result.note.empty() ? "" : " ") + problem;
  }
  return result;
}

BatchSizeFinderResult Tuner::scale_batch_size(
    Module& module, const std::function<std::shared_ptr<DataLoader>(int64_t)>& make_loader,
    BatchSizeFinderOptions options) {
  check_batch_size_finder_options(options);
  check_trials_train(options_, "scale_batch_size");
  if (!make_loader) {
    throw ConfigError(
        "Tuner.scale_batch_size(module, make_loader): make_loader is empty. Pass a function "
        "that returns the training loader for a batch size.");
  }
  const bool power = options.mode.value() == BatchSizeSearch::kPower;
  BatchSizeFinderResult result;
  if (skips_under_fast_dev_run(options_, "scale_batch_size", "not how much memory a batch takes",
                               result)) {
    return result;
  }
  ModuleSnapshot snapshot(module, options_.seed.has_value());
  const TrainerOptions trial = trial_options(options_, options.steps_per_trial);
  // Sizes not tried because the fit's fraction of its batches rounds down
  // to none of them there, and why.
  std::map<int64_t, std::string> limited;

  // One trial: whether `batch_size` fits; nullopt when the loader yields no
  // batch at that size (drop_last past the training set's size).
  bool on_cuda = false;
  auto run_trial = [&](int64_t batch_size, bool& whole_set) -> std::optional<BatchSizeTrial> {
    BatchSizeTrial outcome;
    outcome.batch_size = batch_size;
    // The cap outlives the loader and the Trainer (their threads and their
    // teardown allocate under it).
    std::optional<detail::HostMemoryCap> cap;
    {
      const detail::TunerTrial trial_scope(snapshot.keeper());
      Trainer trainer(trial);
      if (!trainer.resolution().launcher.empty() || trainer.strategy().world_size() > 1) {
        throw ConfigError(str(
            "Tuner.scale_batch_size under strategy \"", trainer.resolution().strategy,
            "\" with ", trainer.strategy().world_size(),
            " processes: a rank that ran out of memory alone would leave its peers waiting in a "
            "collective. Find the batch size with devices=1 (one process holds one rank's "
            "batch) and use it on every rank."));
      }
      on_cuda = trainer.strategy().root_device().is_cuda();
      if (!on_cuda && options.host_memory_cap == 0) {
        throw ConfigError(
            "Tuner.scale_batch_size on the CPU with host_memory_cap=0: nothing would run out "
            "of memory before the machine does. Pass host_memory_cap, the bytes a trial's "
            "tensors may take (e.g. 4 << 30 for 4 GiB), or run it on a GPU.");
      }
      auto loader_of = [&](int64_t size) {
        std::shared_ptr<DataLoader> loader = make_loader(size);
        if (!loader) {
          throw ConfigError(str("Tuner.scale_batch_size: make_loader(", size,
                                ") returned no loader. Return the training loader for that "
                                "batch size."));
        }
        // A loader of another batch size would make every trial the same.
        if (const auto* dataset = dynamic_cast<const DatasetLoader*>(loader.get());
            dataset != nullptr && dataset->options().batch_size != size) {
          throw ConfigError(str("Tuner.scale_batch_size: make_loader(", size,
                                ") returned a loader of batch_size=", dataset->options().batch_size,
                                ". Return a loader of the batch size asked for (with a "
                                "DataModule: set_batch_size(n) makes its next "
                                "train_dataloader() batch n samples)."));
        }
        return loader;
      };
      std::shared_ptr<DataLoader> loader = loader_of(batch_size);
      const std::optional<int64_t> batches = loader->num_batches();
      if (batches && *batches == 0) return std::nullopt;
      // A fraction of the fit's batches that rounds down to none at this
      // size: no batch to try (the trial's fit would refuse the fraction).
      if (const BatchLimit& limit = trial.limit_train_batches;
          batches && limit.is_fraction() && limit.fraction() > 0.0 && limit.fraction() < 1.0 &&
          std::floor(static_cast<double>(*batches) * limit.fraction()) == 0.0) {
        limited[batch_size] =
            str(options_.overfit_batches.is_zero() ? "limit_train_batches=" : "overfit_batches=",
                limit.text(), " of its ", *batches, " batches rounds down to none");
        return std::nullopt;
      }
      // One batch that twice the size makes one of too: every sample is in
      // it (a loader that drops a last partial batch makes none of twice).
      if (batches && *batches == 1 && batch_size <= std::numeric_limits<int64_t>::max() / 2) {
        const std::optional<int64_t> twice = loader_of(batch_size * 2)->num_batches();
        whole_set = twice && *twice == 1;
      }
      // Made from here on, the trial's tensors count (the loader's workers
      // start with the fit).
      if (!on_cuda) cap.emplace(options.host_memory_cap);
      try {
        trainer.fit(module, loader);
        outcome.fits = true;
      } catch (const std::exception& e) {
        if (!is_out_of_memory(e)) throw;
        outcome.failure = first_line(e);
      }
    }
    if (cap) outcome.peak_bytes = cap->peak();
    return outcome;
  };

  int64_t low = 0;   // the largest batch size that fit
  int64_t high = 0;  // the smallest that did not, or yields no batch (0: none yet)
  int64_t size = options.init_val;
  for (;;) {
    if (static_cast<int64_t>(result.trials.size()) == options.max_trials) {
      result.note = str("scale_batch_size: stopped after max_trials=", options.max_trials,
                        " trials; batch_size=", size, " was not tried. Raise max_trials to "
                        "search further.");
      break;
    }
    bool whole_set = false;
    std::optional<BatchSizeTrial> outcome;
    try {
      outcome = run_trial(size, whole_set);
    } catch (...) {
      snapshot.restore_after_failure("Tuner.scale_batch_size");
      throw;
    }
    snapshot.restore();
#ifdef FULGUR_WITH_CUDA
    // What the trial cached (a failed one's especially) goes back to the
    // device, now that its Trainer and tensors are gone.
    if (on_cuda) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
    const bool fits = outcome && outcome->fits;
    if (outcome) result.trials.push_back(*outcome);
    int64_t next;
    if (fits) {
      low = size;
      if (whole_set) {
        result.note = str("scale_batch_size: batch_size=", size,
                          " holds the whole training set in one batch; a larger one would hold "
                          "the same samples.");
        break;
      }
      if (high == 0) {
        if (size > std::numeric_limits<int64_t>::max() / 2) break;
        next = size * 2;
      } else if (power) {
        break;  // twice this size did not fit
      } else {
        next = low + (high - low) / 2;
      }
    } else {
      // Out of memory, or more samples than the loader makes a batch of
      // (it drops a last partial batch): look below.
      high = size;
      if (low == 0) {
        if (size == 1) break;
        next = size / 2;
      } else if (power && outcome) {
        break;
      } else {
        next = low + (high - low) / 2;
      }
    }
    if (next <= low || (high > 0 && next >= high)) break;  // nothing left between
    size = next;
  }
  result.batch_size = low;
  if (auto it = limited.find(high); high > 0 && it != limited.end() && result.note.empty()) {
    result.note = str("scale_batch_size: batch_size=", high, " was not tried: ", it->second,
                      ". Pass a larger fraction, or a number of batches (an int), to try it.");
  } else if (low == 0 && result.note.empty()) {
    const std::string why = result.trials.empty() ? "" : result.trials.back().failure;
    result.note = result.trials.empty()
                      ? str("scale_batch_size: the loader yields no batch even of ", high,
                            " sample(s): the training set is empty.")
                      : str("scale_batch_size: no batch size fit; batch_size=", high,
                            " ran out of memory: ", why);
  } else if (low > 0 && result.note.empty() && high > 0 &&
             (result.trials.empty() || result.trials.back().batch_size != high)) {
    result.note = str("scale_batch_size: the loader yields no batch of ", high,
                      " samples (the training set is smaller, and the loader drops a last "
                      "partial batch).");
  }
  return result;
}

BatchSizeFinderResult Tuner::scale_batch_size(Module& module, DataModule& data,
                                               BatchSizeFinderOptions options) {
  const std::optional<int64_t> own = data.batch_size();
  if (!own) {
    throw ConfigError(
        "Tuner.scale_batch_size(module, data): the DataModule has no batch size to scale. "
        "Override its batch_size() (return the training loader's) and set_batch_size(n) (the "
        "next train_dataloader() batches n samples), or pass a function that makes the loader "
        "for a batch size.");
  }
  // The data is loaded before the first trial, outside any cap: a trial
  // counts what its steps allocate. As the fit sets it up: seeded first
  // when the fit seeds (a random split is the fit's), and what it draws is
  // put back after (the generators are as before the tuner, as the trials
  // leave them).
  const StateDict generators = rng_state_dict();
  if (options_.seed) seed_everything(*options_.seed);
  data.prepare_data();
  data.setup(Stage::kFit);
  load_rng_state_dict(generators);
  auto make_loader = [&](int64_t batch_size) {
    data.set_batch_size(batch_size);
    return data.train_dataloader();
  };
  BatchSizeFinderResult result;
  try {
    result = scale_batch_size(module, make_loader, options);
  } catch (...) {
    data.set_batch_size(*own);
    data.teardown(Stage::kFit);
    throw;
  }
  data.set_batch_size(result.batch_size > 0 ? result.batch_size : *own);
  data.teardown(Stage::kFit);
  return result;
}

}  // namespace fulgur
