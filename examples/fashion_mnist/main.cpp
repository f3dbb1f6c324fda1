// fashion_mnist: trains a small CNN on Fashion-MNIST with fulgur.
//
//   fashion_mnist                          # defaults: 3 epochs, test accuracy >= 0.90
//   fashion_mnist --max_epochs 5 --lr 5e-4
//   fashion_mnist --ckpt-path last         # resume from the newest valid checkpoint
//   fashion_mnist --fast_dev_run 1         # one batch of everything, no outputs
//   fashion_mnist --help                   # every Trainer flag
//
// Every field of fulgur::TrainerOptions that can be written on a command line
// is a flag of the same name (`--max_epochs` or `--max-epochs`).
//
// Exit codes: 0 success, 1 test accuracy below --min-test-acc or a runtime
// failure, 2 bad command line or configuration (the message says which flag).
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "fashion_mnist_data.h"
#include "fulgur/fulgur.h"

namespace {

namespace F = torch::nn::functional;

// ---------------------------------------------------------------------------
// The model: two conv blocks (conv 3x3 → batch norm → ReLU → max pool 2),
// then a 128-unit hidden layer. About 420k parameters; ~1 minute per epoch
// on two CPU cores.
class FashionCNN : public fulgur::Module {
 public:
  FashionCNN(double lr, int64_t lr_step_size, double lr_gamma)
      : fulgur::Module("FashionCNN"), lr_(lr), lr_step_size_(lr_step_size), lr_gamma_(lr_gamma) {
    conv1_ = register_module(
        "conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1).bias(false)));
    // fulgur's BatchNorm: LibTorch's unless --sync_batchnorm true under ddp,
    // where the statistics span every rank's batch.
    bn1_ = register_module("bn1", fulgur::nn::SyncBatchNorm(32));
    conv2_ = register_module(
        "conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1).bias(false)));
    bn2_ = register_module("bn2", fulgur::nn::SyncBatchNorm(64));
    drop_conv_ = register_module("drop_conv", torch::nn::Dropout(0.25));
    fc1_ = register_module("fc1", torch::nn::Linear(64 * 7 * 7, 128));
    drop_fc_ = register_module("drop_fc", torch::nn::Dropout(0.25));
    fc2_ = register_module("fc2", torch::nn::Linear(128, 10));
  }

  // [N, 1, 28, 28] → logits [N, 10].
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(bn1_(conv1_(x))), {2, 2});  // 32 x 14 x 14
    x = torch::max_pool2d(torch::relu(bn2_(conv2_(x))), {2, 2});  // 64 x 7 x 7
    x = drop_conv_(x).flatten(1);
    x = drop_fc_(torch::relu(fc1_(x)));
    return fc2_(x);
  }

  torch::Tensor training_step(fulgur::Batch& batch, int64_t /*batch_idx*/) override {
    auto& [x, y] = batch.pair();
    auto logits = forward(x);
    auto loss = F::cross_entropy(logits, y);
    log("train_loss", loss.detach(), {.prog_bar = true});
    log("train_acc", accuracy(logits, y));
    return loss;
  }

  void validation_step(fulgur::Batch& batch, int64_t /*batch_idx*/) override {
    auto& [x, y] = batch.pair();
    auto logits = forward(x);
    // sync_dist: with several ranks, each sees part of the data; the
    // logged epoch values are reduced across them (a no-op on one process).
    log("val_loss", F::cross_entropy(logits, y), {.prog_bar = true, .sync_dist = true});
    log("val_acc", accuracy(logits, y), {.prog_bar = true, .sync_dist = true});
  }

  void test_step(fulgur::Batch& batch, int64_t /*batch_idx*/) override {
    auto& [x, y] = batch.pair();
    auto logits = forward(x);
    log("test_loss", F::cross_entropy(logits, y), {.sync_dist = true});
    log("test_acc", accuracy(logits, y), {.sync_dist = true});
  }

  fulgur::OptimizerConfig configure_optimizers() override {
    std::shared_ptr<torch::optim::Optimizer> adam =
        std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(lr_));
    fulgur::OptimizerConfig config(adam);
    if (lr_step_size_ > 0) {
      // Multiply the learning rate by lr_gamma every lr_step_size epochs.
      config.schedulers.push_back(
          fulgur::SchedulerConfig{.scheduler = std::make_shared<torch::optim::StepLR>(
                                      *adam, static_cast<unsigned>(lr_step_size_), lr_gamma_),
                                  .interval = fulgur::Interval::Epoch,
                                  .frequency = 1});
    }
    return config;
  }

 private:
  static torch::Tensor accuracy(const torch::Tensor& logits, const torch::Tensor& target) {
    return (logits.detach().argmax(1) == target).to(torch::kFloat32).mean();
  }

  double lr_;
  int64_t lr_step_size_;
  double lr_gamma_;
  torch::nn::Conv2d conv1_{nullptr};
  fulgur::nn::SyncBatchNorm bn1_{nullptr};
  torch::nn::Conv2d conv2_{nullptr};
  fulgur::nn::SyncBatchNorm bn2_{nullptr};
  torch::nn::Dropout drop_conv_{nullptr};
  torch::nn::Linear fc1_{nullptr};
  torch::nn::Dropout drop_fc_{nullptr};
  torch::nn::Linear fc2_{nullptr};
};

// ---------------------------------------------------------------------------
// Command line. Flags whose type CLI11 cannot express directly (optional
// values, "int or fraction", device specs) are read as strings and converted
// after parsing; a bad value throws CLI::ValidationError naming the flag.

struct Args {
  // The example's own flags.
  std::string data_dir = fashion_mnist::kDefaultDataDir;
  int64_t batch_size = 128;
  int64_t test_batch_size = 1000;
  double lr = 1e-3;
  int64_t lr_step_size = 2;
  double lr_gamma = 0.1;
  int64_t val_size = 5000;
  std::string ckpt_path;
  int threads = 0;
  double min_test_acc = 0.0;

  // TrainerOptions, in declaration order.
  std::string accelerator = "auto";
  std::string strategy = "auto";
  std::string devices = "auto";
  int num_nodes = 1;
  std::string precision = "32-true";
  std::string plugins;
  bool sync_batchnorm = false;
  std::string deterministic = "false";
  bool benchmark = false;
  std::string max_epochs = "3";
  int64_t min_epochs = 0;
  int64_t max_steps = -1;
  double max_time = 0;
  int64_t min_steps = 0;
  std::string fast_dev_run = "0";
  std::string limit_train_batches = "1.0";
  std::string limit_val_batches = "1.0";
  std::string limit_test_batches = "1.0";
  std::string limit_predict_batches = "1.0";
  std::string val_check_interval = "1.0";
  std::string check_val_every_n_epoch = "1";
  int64_t num_sanity_val_steps = 2;
  int64_t accumulate_grad_batches = 1;
  std::string gradient_clip_val = "none";
  std::string gradient_clip_algorithm = "norm";
  std::string seed = "42";
  std::string default_root_dir = "runs/fashion_mnist";
  bool enable_checkpointing = true;
  bool enable_progress_bar = true;
  bool logger = true;
  int64_t log_every_n_steps = 50;
  int max_restarts = 0;
  double heartbeat_timeout = 10;
  int64_t every_n_train_steps = 0;
};

bool is_none(const std::string& text) { return text == "none" || text == "None" || text.empty(); }

int64_t parse_int(const std::string& flag, const std::string& text) {
  size_t pos = 0;
  long long value = 0;
  bool ok = true;
  try {
    value = std::stoll(text, &pos);
  } catch (const std::exception&) {
    ok = false;
  }
  if (!ok || pos != text.size()) {
    throw CLI::ValidationError(flag, fulgur::str("'", text, "' is not an integer"));
  }
  return static_cast<int64_t>(value);
}

double parse_double(const std::string& flag, const std::string& text) {
  size_t pos = 0;
  double value = 0;
  bool ok = true;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    ok = false;
  }
  if (!ok || pos != text.size()) {
    throw CLI::ValidationError(flag, fulgur::str("'", text, "' is not a number"));
  }
  return value;
}

std::optional<int64_t> parse_optional_int(const std::string& flag, const std::string& text) {
  if (is_none(text)) return std::nullopt;
  return parse_int(flag, text);
}

std::optional<double> parse_optional_double(const std::string& flag, const std::string& text) {
  if (is_none(text)) return std::nullopt;
  return parse_double(flag, text);
}

std::optional<uint64_t> parse_seed(const std::string& flag, const std::string& text) {
  if (is_none(text)) return std::nullopt;
  const int64_t value = parse_int(flag, text);
  if (value < 0) {
    throw CLI::ValidationError(flag, fulgur::str("'", text, "' must be >= 0 (or none)"));
  }
  return static_cast<uint64_t>(value);
}

// "10" → ten batches; "0.25" → a quarter of the loader.
fulgur::BatchLimit parse_batch_limit(const std::string& flag, const std::string& text) {
  if (text.find('.') != std::string::npos) return fulgur::BatchLimit(parse_double(flag, text));
  return fulgur::BatchLimit(parse_int(flag, text));
}

int64_t parse_fast_dev_run(const std::string& flag, const std::string& text) {
  if (text == "true" || text == "True") return 1;
  if (text == "false" || text == "False") return 0;
  return parse_int(flag, text);
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto first = item.find_first_not_of(" \t");
    if (first == std::string::npos) continue;
    const auto last = item.find_last_not_of(" \t");
    out.push_back(item.substr(first, last - first + 1));
  }
  return out;
}

void add_flags(CLI::App& app, Args& a) {
  // The example.
  app.add_option("--data-dir,--data_dir", a.data_dir,
                 "Directory holding the four Fashion-MNIST *-ubyte.gz files");
  app.add_option("--batch-size,--batch_size", a.batch_size, "Training batch size");
  app.add_option("--test-batch-size,--test_batch_size", a.test_batch_size,
                 "Validation and test batch size");
  app.add_option("--lr", a.lr, "Adam learning rate");
  app.add_option("--lr-step-size,--lr_step_size", a.lr_step_size,
                 "Multiply the learning rate by --lr-gamma every N epochs (0: constant)");
  app.add_option("--lr-gamma,--lr_gamma", a.lr_gamma, "Learning-rate decay factor");
  app.add_option("--val-size,--val_size", a.val_size,
                 "Training images held out for validation (0: no validation)");
  app.add_option("--ckpt-path,--ckpt_path", a.ckpt_path,
                 "Resume from this checkpoint; \"last\": the newest one of this run that "
                 "verifies; \"auto\": the same, or a fresh start when there is none");
  app.add_option("--threads", a.threads, "torch::set_num_threads (0: LibTorch's default)");
  app.add_option("--min-test-acc,--min_test_acc", a.min_test_acc,
                 "Exit with status 1 when the test accuracy is below this (0: off)");

  // fulgur::TrainerOptions.
  app.add_option("--accelerator", a.accelerator,
                 "\"auto\", \"cpu\", \"cuda\" (\"gpu\"), or a registered name")
      ->group("Trainer: hardware");
  app.add_option("--strategy", a.strategy, "\"auto\", \"single_device\", ... or a registered name")
      ->group("Trainer: hardware");
  app.add_option("--devices", a.devices, "\"auto\", a count, -1 for all, or indices \"0,2\"")
      ->group("Trainer: hardware");
  app.add_option("--num_nodes,--num-nodes", a.num_nodes, "Number of machines")
      ->group("Trainer: hardware");
  app.add_option(
         "--precision", a.precision,
         "32-true, 64-true, bf16-mixed, 16-mixed, bf16-true, 16-true (legacy: 32, 64, 16, bf16)")
      ->group("Trainer: hardware");
  app.add_option("--plugins", a.plugins, "Comma-separated registered plugin names (e.g. slurm)")
      ->group("Trainer: hardware");
  app.add_option("--sync_batchnorm,--sync-batchnorm", a.sync_batchnorm,
                 "Synchronise BatchNorm statistics across ranks (ddp)")
      ->group("Trainer: hardware");
  app.add_option("--deterministic", a.deterministic, "true, false or warn")
      ->group("Trainer: hardware");
  app.add_option("--benchmark", a.benchmark, "cuDNN autotuning (CUDA only)")
      ->group("Trainer: hardware");

  app.add_option("--max_epochs,--max-epochs", a.max_epochs,
                 "Epochs to train; none: 1000, or unlimited when --max_steps is set")
      ->group("Trainer: run length");
  app.add_option("--min_epochs,--min-epochs", a.min_epochs, "Train at least this many epochs")
      ->group("Trainer: run length");
  app.add_option("--max_steps,--max-steps", a.max_steps,
                 "Optimizer steps to train for (-1: no limit)")
      ->group("Trainer: run length");
  app.add_option("--max_time,--max-time", a.max_time,
                 "Stop after this many seconds of training, with a checkpoint (0: no limit)")
      ->group("Trainer: run length");
  app.add_option("--min_steps,--min-steps", a.min_steps, "Train at least this many steps")
      ->group("Trainer: run length");
  app.add_option("--fast_dev_run,--fast-dev-run", a.fast_dev_run,
                 "Run N (true = 1) batches of each stage and stop; no checkpoints or logs")
      ->group("Trainer: run length");
  app.add_option("--limit_train_batches,--limit-train-batches", a.limit_train_batches,
                 "Training batches per epoch: a count (10) or a fraction (0.25)")
      ->group("Trainer: run length");
  app.add_option("--limit_val_batches,--limit-val-batches", a.limit_val_batches,
                 "Validation batches: a count or a fraction")
      ->group("Trainer: run length");
  app.add_option("--limit_test_batches,--limit-test-batches", a.limit_test_batches,
                 "Test batches: a count or a fraction")
      ->group("Trainer: run length");
  app.add_option("--limit_predict_batches,--limit-predict-batches", a.limit_predict_batches,
                 "Prediction batches: a count or a fraction")
      ->group("Trainer: run length");

  app.add_option("--val_check_interval,--val-check-interval", a.val_check_interval,
                 "Validate every N training batches (int) or fraction of an epoch")
      ->group("Trainer: validation");
  app.add_option("--check_val_every_n_epoch,--check-val-every-n-epoch", a.check_val_every_n_epoch,
                 "Validate at the end of every N-th epoch (none: by batch count across epochs)")
      ->group("Trainer: validation");
  app.add_option("--num_sanity_val_steps,--num-sanity-val-steps", a.num_sanity_val_steps,
                 "Validation batches run before training (-1: all)")
      ->group("Trainer: validation");

  app.add_option("--accumulate_grad_batches,--accumulate-grad-batches", a.accumulate_grad_batches,
                 "Batches whose gradients are summed per step")
      ->group("Trainer: optimization");
  app.add_option("--gradient_clip_val,--gradient-clip-val", a.gradient_clip_val,
                 "Clip gradients at this value (none: no clipping)")
      ->group("Trainer: optimization");
  app.add_option("--gradient_clip_algorithm,--gradient-clip-algorithm", a.gradient_clip_algorithm,
                 "\"norm\" or \"value\"")
      ->group("Trainer: optimization");

  app.add_option("--seed", a.seed, "Seed of every RNG (none: unseeded)")
      ->group("Trainer: reproducibility");

  app.add_option("--default_root_dir,--default-root-dir", a.default_root_dir,
                 "Root of logs and checkpoints")
      ->group("Trainer: outputs");
  app.add_option("--enable_checkpointing,--enable-checkpointing", a.enable_checkpointing,
                 "Save checkpoints (last.ckpt and the best by val_acc)")
      ->default_str("true")
      ->group("Trainer: outputs");
  app.add_option("--enable_progress_bar,--enable-progress-bar", a.enable_progress_bar,
                 "Show progress")
      ->default_str("true")
      ->group("Trainer: outputs");
  app.add_option("--logger", a.logger, "Write metrics.csv and hparams.yaml")
      ->default_str("true")
      ->group("Trainer: outputs");
  app.add_option("--log_every_n_steps,--log-every-n-steps", a.log_every_n_steps,
                 "Logged metrics reach the loggers every N optimizer steps")
      ->group("Trainer: outputs");

  app.add_option("--max_restarts,--max-restarts", a.max_restarts,
                 "Start every rank again (resuming from the newest checkpoint) this many times "
                 "when one dies, freezes or hangs")
      ->group("Trainer: recovery");
  app.add_option("--heartbeat_timeout,--heartbeat-timeout", a.heartbeat_timeout,
                 "Seconds without a heartbeat before a rank is named as frozen (0: off)")
      ->group("Trainer: recovery");
  app.add_option("--every_n_train_steps,--every-n-train-steps", a.every_n_train_steps,
                 "Save a checkpoint (and last.ckpt) every N optimizer steps (0: every epoch)")
      ->group("Trainer: recovery");
}

// Converts the string flags; throws CLI::ValidationError naming a bad one.
fulgur::TrainerOptions trainer_options(const Args& a) {
  fulgur::TrainerOptions o;
  o.accelerator = a.accelerator;
  o.strategy = a.strategy;
  o.devices = fulgur::DevicesSpec(a.devices);
  o.num_nodes = a.num_nodes;
  o.precision = a.precision;
  for (const auto& name : split_commas(a.plugins)) o.plugins.emplace_back(name);
  o.sync_batchnorm = a.sync_batchnorm;
  o.deterministic = a.deterministic;
  o.benchmark = a.benchmark;
  o.max_epochs = parse_optional_int("--max_epochs", a.max_epochs);
  o.min_epochs = a.min_epochs;
  o.max_steps = a.max_steps;
  if (!(a.max_time >= 0)) {
    throw CLI::ValidationError("--max_time", fulgur::str(a.max_time,
                                                         " is not a number of seconds >= 0 (0: no "
                                                         "limit)"));
  }
  if (a.max_time > 0) o.max_time = std::chrono::milliseconds(std::llround(a.max_time * 1000));
  o.min_steps = a.min_steps;
  o.fast_dev_run = parse_fast_dev_run("--fast_dev_run", a.fast_dev_run);
  o.limit_train_batches = parse_batch_limit("--limit_train_batches", a.limit_train_batches);
  o.limit_val_batches = parse_batch_limit("--limit_val_batches", a.limit_val_batches);
  o.limit_test_batches = parse_batch_limit("--limit_test_batches", a.limit_test_batches);
  o.limit_predict_batches = parse_batch_limit("--limit_predict_batches", a.limit_predict_batches);
  o.val_check_interval = parse_batch_limit("--val_check_interval", a.val_check_interval);
  o.check_val_every_n_epoch =
      parse_optional_int("--check_val_every_n_epoch", a.check_val_every_n_epoch);
  o.num_sanity_val_steps = a.num_sanity_val_steps;
  o.accumulate_grad_batches = a.accumulate_grad_batches;
  o.gradient_clip_val = parse_optional_double("--gradient_clip_val", a.gradient_clip_val);
  const auto algorithm = fulgur::parse_gradient_clip_algorithm(a.gradient_clip_algorithm);
  if (!algorithm) {
    throw CLI::ValidationError("--gradient_clip_algorithm",
                               fulgur::str("'", a.gradient_clip_algorithm,
                                           "' is not an algorithm; pass \"norm\" or \"value\""));
  }
  o.gradient_clip_algorithm = *algorithm;
  o.seed = parse_seed("--seed", a.seed);
  o.default_root_dir = a.default_root_dir;
  o.enable_checkpointing = a.enable_checkpointing;
  o.enable_progress_bar = a.enable_progress_bar;
  o.logger = a.logger;
  o.log_every_n_steps = a.log_every_n_steps;
  o.max_restarts = a.max_restarts;
  if (!(a.heartbeat_timeout >= 0)) {
    throw CLI::ValidationError(
        "--heartbeat_timeout",
        fulgur::str(a.heartbeat_timeout, " is not a number of seconds >= 0 (0 turns it off)"));
  }
  o.heartbeat_timeout = std::chrono::milliseconds(std::llround(a.heartbeat_timeout * 1000));
  const bool validates =
      a.val_size > 0 && (o.limit_val_batches.is_fraction() ? o.limit_val_batches.fraction() > 0.0
                                                           : o.limit_val_batches.count() > 0);
  if (a.enable_checkpointing && validates) {
    // Keep the best checkpoint by validation accuracy (and last.ckpt).
    // Recovery points every N steps too, when asked, and the best checked
    // at every epoch's end still.
    o.callbacks.push_back(std::make_shared<fulgur::ModelCheckpoint>(
        fulgur::ModelCheckpointOptions{.monitor = "val_acc",
                                       .mode = "max",
                                       .save_top_k = 1,
                                       .every_n_train_steps = a.every_n_train_steps,
                                       .every_n_epochs = 1}));
  } else {
    o.every_n_train_steps = a.every_n_train_steps;
  }
  return o;
}

int run(const Args& a, fulgur::TrainerOptions options) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  if (a.threads > 0) torch::set_num_threads(a.threads);
  // Seed before building the model so its initial weights are reproducible too.
  if (options.seed) fulgur::seed_everything(*options.seed);

  fulgur::Trainer trainer(std::move(options));
  // With several ranks, only global rank 0 reports. (Under --strategy ddp
  // this process re-executes itself once per rank and only waits.)
  const auto* launcher = trainer.strategy().launcher();
  const bool reports = trainer.strategy().is_global_zero() &&
                       (launcher == nullptr || launcher->is_interactive_compatible());
  if (reports) std::cout << trainer.describe() << std::endl;

  FashionCNN model(a.lr, a.lr_step_size, a.lr_gamma);
  fulgur::HParams hparams;
  hparams["model"] = std::string("FashionCNN");
  hparams["data_dir"] = a.data_dir;
  hparams["batch_size"] = a.batch_size;
  hparams["test_batch_size"] = a.test_batch_size;
  hparams["lr"] = a.lr;
  hparams["lr_step_size"] = a.lr_step_size;
  hparams["lr_gamma"] = a.lr_gamma;
  hparams["val_size"] = a.val_size;
  hparams["max_epochs"] = a.max_epochs;
  hparams["seed"] = a.seed;
  model.save_hyperparameters(std::move(hparams));

  fashion_mnist::FashionMNISTDataModule data({.data_dir = a.data_dir,
                                              .batch_size = a.batch_size,
                                              .val_size = a.val_size,
                                              .test_batch_size = a.test_batch_size});

  const auto result = trainer.fit(model, data, fulgur::FitOptions{.ckpt_path = a.ckpt_path});
  const auto metrics = trainer.test(model, data);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const auto acc = metrics.find("test_acc");
  if (!reports) return a.min_test_acc > 0 && (acc == metrics.end() || acc->second < a.min_test_acc);

  std::cout << "\nstopped: " << result.stop_reason << " after " << result.epochs << " epochs, "
            << result.global_step << " steps\n";
  if (acc != metrics.end()) {
    std::cout << "test_acc=" << std::fixed << std::setprecision(4) << acc->second << "\n";
  } else {
    std::cout << "test_acc: not computed\n";
  }
  const auto loss = metrics.find("test_loss");
  if (loss != metrics.end()) {
    std::cout << "test_loss=" << std::fixed << std::setprecision(4) << loss->second << "\n";
  }
  std::cout << "time: " << std::fixed << std::setprecision(1) << seconds << " s\n";
  if (const auto* checkpoint = trainer.checkpoint_callback()) {
    std::cout << "checkpoints: " << checkpoint->dirpath() << "\n";
  }
  if (!result.best_model_path.empty()) std::cout << "best: " << result.best_model_path << "\n";
  if (!result.last_model_path.empty()) std::cout << "last: " << result.last_model_path << "\n";
  if (const auto log_dir = trainer.log_dir(); !log_dir.empty()) {
    std::cout << "metrics: " << log_dir << "/metrics.csv\n";
    // Drawn at the end of fit when gnuplot is installed.
    if (std::ifstream(log_dir + "/metrics.png")) {
      std::cout << "curves: " << log_dir << "/metrics.png\n";
    }
  }
  std::cout << std::flush;

  if (a.min_test_acc > 0) {
    if (acc == metrics.end() || acc->second < a.min_test_acc) {
      std::cerr << "fashion_mnist: test accuracy "
                << (acc == metrics.end() ? std::string("(none)") : std::to_string(acc->second))
                << " is below --min-test-acc " << a.min_test_acc << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Trains a small CNN on Fashion-MNIST with fulgur."};
  app.option_defaults()->always_capture_default(true);
  Args args;
  add_flags(app, args);

  fulgur::TrainerOptions options;
  try {
    app.parse(argc, argv);
    options = trainer_options(args);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints --help, or the error and a hint
    return code == 0 ? 0 : 2;
  } catch (const fulgur::ConfigError& e) {  // e.g. a malformed --devices
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  }

  try {
    return run(args, std::move(options));
  } catch (const fulgur::ConfigError& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  } catch (const fulgur::CheckpointError& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
