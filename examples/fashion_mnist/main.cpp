// fashion_mnist: trains a small CNN on Fashion-MNIST with fulgur.
//
//   fashion_mnist                          # fit (3 epochs, test accuracy >= 0.90), then test
//   fashion_mnist --max_epochs 5 --lr 5e-4
//   fashion_mnist fit --config examples/fashion_mnist/config.yaml --trainer.max_epochs 1
//   fashion_mnist --ckpt_path last         # resume from the newest valid checkpoint
//   fashion_mnist test --ckpt_path runs/fashion_mnist/checkpoints/last.ckpt
//   fashion_mnist --print_config           # the complete configuration, as YAML
//   fashion_mnist --help                   # every option
//
// The command line is fulgur::CLI's: every Trainer flag (--trainer.max_epochs,
// or --max_epochs where the name is unique), the model's and the data's
// options, YAML config files, and a checkpoint's own config when resuming.
//
// Exit codes: 0 success, 1 test accuracy below min_test_acc or a runtime
// failure, 2 bad command line or configuration (the message says which key).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
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
    // The two large layers are units of sharding for strategy "fsdp": their
    // parameters are sharded across the ranks between uses. Anywhere else a
    // unit is the layer itself, under the same parameter names.
    conv2_ = register_module("conv2", fulgur::nn::FSDPUnit(torch::nn::Conv2d(
                                          torch::nn::Conv2dOptions(32, 64, 3).padding(1).bias(false))));
    bn2_ = register_module("bn2", fulgur::nn::SyncBatchNorm(64));
    drop_conv_ = register_module("drop_conv", torch::nn::Dropout(0.25));
    fc1_ = register_module("fc1", fulgur::nn::FSDPUnit(torch::nn::Linear(64 * 7 * 7, 128)));
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
    // A metric: every rank's counts are combined, then the ratio taken once.
    val_acc_.update(logits, y);
    log("val_acc", val_acc_, {.prog_bar = true});
  }

  void test_step(fulgur::Batch& batch, int64_t /*batch_idx*/) override {
    auto& [x, y] = batch.pair();
    auto logits = forward(x);
    log("test_loss", F::cross_entropy(logits, y), {.sync_dist = true});
    test_acc_.update(logits, y);
    log("test_acc", test_acc_);
  }

  fulgur::OptimizerConfig configure_optimizers() override {
    // fulgur's Adam: torch::optim::Adam's options, state and checkpoints,
    // stepped with multi-tensor kernels (bit-identical on the CPU), and
    // the optimizer --cuda_graph true needs on a GPU.
    std::shared_ptr<torch::optim::Optimizer> adam =
        std::make_shared<fulgur::optim::Adam>(parameters(), torch::optim::AdamOptions(lr_));
    fulgur::OptimizerConfig config(adam);
    if (lr_step_size_ > 0) {
      // Multiply the learning rate by lr_gamma every lr_step_size epochs.
      config.schedulers.push_back(
          fulgur::SchedulerConfig{.scheduler = std::make_shared<torch::optim::StepLR>(
                                      *adam, static_cast<unsigned>(lr_step_size_), lr_gamma_),
                                  .interval = fulgur::Interval::kEpoch,
                                  .frequency = 1});
    }
    return config;
  }

 private:
  static torch::Tensor accuracy(const torch::Tensor& logits, const torch::Tensor& target) {
    return (logits.detach().argmax(1) == target).to(torch::kFloat32).mean();
  }

  // Accuracy over every validation / test sample, exact on any number of ranks.
  fulgur::metrics::Accuracy val_acc_{{.num_classes = 10}};
  fulgur::metrics::Accuracy test_acc_{{.num_classes = 10}};
  double lr_;
  int64_t lr_step_size_;
  double lr_gamma_;
  torch::nn::Conv2d conv1_{nullptr};
  fulgur::nn::SyncBatchNorm bn1_{nullptr};
  fulgur::nn::FSDPUnit<torch::nn::Conv2d> conv2_{nullptr};
  fulgur::nn::SyncBatchNorm bn2_{nullptr};
  torch::nn::Dropout drop_conv_{nullptr};
  fulgur::nn::FSDPUnit<torch::nn::Linear> fc1_{nullptr};
  torch::nn::Dropout drop_fc_{nullptr};
  torch::nn::Linear fc2_{nullptr};
};

// ---------------------------------------------------------------------------
// The run. Every option (the Trainer's flags, the model's, the data's, and
// this program's own) comes from fulgur::CLI: the command line, YAML files
// (--config), and the config saved in a checkpoint being resumed.

struct ModelOptions {
  double lr = 1e-3;
  int64_t lr_step_size = 2;
  double lr_gamma = 0.1;
};

struct ProgramOptions {
  int threads = 0;
  double min_test_acc = 0.0;
  bool resolution_json = false;
  int64_t host_memory_cap_mb = 0;
};

int run(fulgur::CLI& cli, const ModelOptions& mo, const fashion_mnist::FashionMNISTOptions& data_options,
        const ProgramOptions& po) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  if (po.threads > 0) torch::set_num_threads(po.threads);
  fulgur::TrainerOptions options = cli.trainer_options();
  // Seed before building the model so its initial weights are reproducible too.
  if (options.seed) fulgur::seed_everything(*options.seed);

  const bool validates =
      data_options.val_size > 0 &&
      (options.limit_val_batches.is_fraction() ? options.limit_val_batches.fraction() > 0.0
                                               : options.limit_val_batches.count() > 0);
  if (options.enable_checkpointing && validates) {
    // Keep the best checkpoint by validation accuracy (and last.ckpt).
    // Recovery points every N steps too, when asked, and the best checked
    // at every epoch's end still.
    options.callbacks.push_back(std::make_shared<fulgur::ModelCheckpoint>(
        fulgur::ModelCheckpointOptions{.monitor = "val_acc",
                                       .mode = "max",
                                       .save_top_k = 1,
                                       .every_n_train_steps = options.every_n_train_steps,
                                       .every_n_epochs = 1}));
    options.every_n_train_steps = 0;  // the cadence is this callback's
  }
  // The layers and their parameter counts, at fit start.
  options.callbacks.push_back(std::make_shared<fulgur::ModelSummary>());

  fulgur::Trainer trainer(std::move(options));
  // With several ranks, only global rank 0 reports. (Under --strategy ddp
  // this process re-executes itself once per rank and only waits.)
  const auto* launcher = trainer.strategy().launcher();
  const bool reports = trainer.strategy().is_global_zero() &&
                       (launcher == nullptr || launcher->is_interactive_compatible());
  // What was chosen and why; the JSON of `fulgur resolve` on request.
  if (reports) std::cout << (po.resolution_json ? trainer.describe() : trainer.resolution().to_text()) << std::endl;

  FashionCNN model(mo.lr, mo.lr_step_size, mo.lr_gamma);
  fulgur::HParams hparams;
  hparams["model"] = std::string("FashionCNN");
  hparams["data_dir"] = data_options.data_dir;
  hparams["batch_size"] = data_options.batch_size;
  hparams["test_batch_size"] = data_options.test_batch_size;
  hparams["lr"] = mo.lr;
  hparams["lr_step_size"] = mo.lr_step_size;
  hparams["lr_gamma"] = mo.lr_gamma;
  hparams["val_size"] = data_options.val_size;
  hparams["max_epochs"] = cli.value("trainer.max_epochs");
  hparams["seed"] = cli.value("trainer.seed");
  model.save_hyperparameters(std::move(hparams));

  fashion_mnist::FashionMNISTDataModule data(data_options);

  const auto ran = cli.run(trainer, model, data);
  // fit tests the trained model afterwards; the other subcommands report
  // what they computed.
  fulgur::Metrics metrics;
  if (ran.fit) metrics = trainer.test(model, data);
  if (ran.metrics) metrics = *ran.metrics;
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const auto acc = metrics.find("test_acc");
  const bool below = po.min_test_acc > 0 && (acc == metrics.end() || acc->second < po.min_test_acc);
  if (!reports) return below ? 1 : 0;

  if (ran.fit) {
    std::cout << "\nstopped: " << ran.fit->stop_reason << " after " << ran.fit->epochs
              << " epochs, " << ran.fit->global_step << " steps\n";
  }
  for (const auto& [name, value] : metrics) {
    std::cout << name << "=" << std::fixed << std::setprecision(4) << value << "\n";
  }
  if (ran.fit && acc == metrics.end()) std::cout << "test_acc: not computed\n";
  if (ran.predictions) std::cout << "predicted " << ran.predictions->size() << " batches\n";
  std::cout << "time: " << std::fixed << std::setprecision(1) << seconds << " s\n";
  if (ran.fit) {
    if (const auto* checkpoint = trainer.checkpoint_callback()) {
      std::cout << "checkpoints: " << checkpoint->dirpath() << "\n";
    }
    if (!ran.fit->best_model_path.empty()) std::cout << "best: " << ran.fit->best_model_path << "\n";
    if (!ran.fit->last_model_path.empty()) std::cout << "last: " << ran.fit->last_model_path << "\n";
  }
  if (const auto log_dir = trainer.log_dir(); !log_dir.empty()) {
    if (std::ifstream(log_dir + "/metrics.csv")) std::cout << "metrics: " << log_dir << "/metrics.csv\n";
    // Drawn at the end of fit when gnuplot is installed.
    if (std::ifstream(log_dir + "/metrics.png")) {
      std::cout << "curves: " << log_dir << "/metrics.png\n";
    }
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(log_dir, ec)) {
      if (entry.path().filename().string().find("tfevents") != std::string::npos) {
        std::cout << "tensorboard: tensorboard --logdir " << log_dir << "\n";
        break;
      }
    }
    if (std::ifstream(log_dir + "/config.yaml")) std::cout << "config: " << log_dir << "/config.yaml\n";
  }
  std::cout << std::flush;

  if (below) {
    std::cerr << "fashion_mnist: test accuracy "
              << (acc == metrics.end() ? std::string("(none)") : std::to_string(acc->second))
              << " is below min_test_acc " << po.min_test_acc << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  fulgur::CLI cli({.program = "fashion_mnist",
                   .description = "Trains a small CNN on Fashion-MNIST with fulgur.",
                   .trainer_defaults = {.max_epochs = 3,
                                        .seed = 42,
                                        .default_root_dir = "runs/fashion_mnist",
                                        .logger = "csv,tensorboard"}});
  ModelOptions mo;
  cli.model()
      .add("lr", mo.lr, "Adam learning rate")
      .add("lr_step_size", mo.lr_step_size,
           "Multiply the learning rate by lr_gamma every N epochs (0: constant)")
      .add("lr_gamma", mo.lr_gamma, "Learning-rate decay factor");
  fashion_mnist::FashionMNISTOptions data_options;
  cli.data()
      .add("data_dir", data_options.data_dir,
           "Directory holding the four Fashion-MNIST *-ubyte.gz files")
      .add("batch_size", data_options.batch_size, "Training batch size")
      .add("test_batch_size", data_options.test_batch_size, "Validation and test batch size")
      .add("val_size", data_options.val_size,
           "Training images held out for validation (0: no validation)");
  ProgramOptions po;
  cli.program()
      .add("threads", po.threads, "torch::set_num_threads (0: LibTorch's default)")
      .add("min_test_acc", po.min_test_acc,
           "Exit with status 1 when the test accuracy is below this (0: off)")
      .add("resolution_json", po.resolution_json,
           "Print the Trainer's resolution as JSON (fulgur resolve's) instead of the summary")
      .add("host_memory_cap_mb", po.host_memory_cap_mb,
           "scale_batch_size on the CPU: MiB a trial's tensors may take (0: no cap)");
  if (auto status = cli.parse(argc, argv)) return *status;
  // The model's and program's own options, checked before anything runs (a
  // step size past LibTorch's unsigned would wrap to 0 and divide by it
  // when the scheduler first steps, after training).
  std::vector<std::string> problems;
  if (!(mo.lr > 0.0 && std::isfinite(mo.lr))) {
    problems.push_back(fulgur::str("--lr ", mo.lr, ": a learning rate > 0, e.g. 1e-3"));
  }
  if (mo.lr_step_size < 0 || mo.lr_step_size > std::numeric_limits<unsigned>::max()) {
    problems.push_back(fulgur::str("--lr_step_size ", mo.lr_step_size, ": epochs in 1..",
                                   std::numeric_limits<unsigned>::max(),
                                   ", or 0 for a constant rate"));
  }
  if (!(mo.lr_gamma > 0.0 && std::isfinite(mo.lr_gamma))) {
    problems.push_back(fulgur::str("--lr_gamma ", mo.lr_gamma, ": a factor > 0, e.g. 0.1"));
  }
  const int most_threads = 4 * std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (po.threads < 0 || po.threads > most_threads) {
    problems.push_back(fulgur::str("--threads ", po.threads, ": 0 (LibTorch's default) or 1..",
                                   most_threads, " (4 per core of this machine)"));
  }
  // In bytes, a 64-bit count.
  constexpr int64_t kMostCapMb = (int64_t{1} << 43) - 1;
  if (po.host_memory_cap_mb < 0 || po.host_memory_cap_mb > kMostCapMb) {
    problems.push_back(fulgur::str("--host_memory_cap_mb ", po.host_memory_cap_mb,
                                   ": MiB in 1..", kMostCapMb, ", or 0 for no cap"));
  }
  if (!problems.empty()) {
    std::cerr << "error: " << fulgur::join(problems, "; ") << "." << std::endl;
    return 2;
  }
  cli.batch_size_finder().host_memory_cap = po.host_memory_cap_mb * (int64_t{1} << 20);

  try {
    return run(cli, mo, data_options, po);
  } catch (const fulgur::ConfigError& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  } catch (const fulgur::CheckpointError& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << fulgur::error_message(e) << std::endl;
    return 1;
  }
}
