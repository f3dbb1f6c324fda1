// fulgur's training step on a GPU against the loop one writes by hand in
// LibTorch, for the models of issue 30 (and the main job's CNN): µs per
// optimizer step over --steps steps after --warmup steps, every variant of a
// model run once per repetition, interleaved (the order rotates each
// repetition), medians over --reps repetitions. Variants:
//   loop, resident   hand-written LibTorch loop, batches already on the GPU
//   loop, copied     the same loop moving each batch with .to(device)
//   fulgur           Trainer::fit with torch::optim::SGD (defaults: pinned
//                    batches copied on a side stream one step ahead, log()
//                    without read-back)
//   fulgur, foreach  the same with fulgur::optim::SGD (multi-tensor steps)
//   fulgur, graph    the same with cuda_graph=true (steps replayed; not
//                    for 16-mixed, whose loss scaler a graph cannot hold)
// All use SGD (momentum 0.9) and the model's precision (fp32, bf16-mixed
// through autocast, or 16-mixed: float16 autocast and a dynamic loss
// scaler, in the hand-written loop fulgur::GradScaler with torch::optim's
// SGD, which reads the scaler's verdict each step as PyTorch's GradScaler
// does; with fulgur::optim the kernel reads it); the data are CPU tensors (page-locked for fulgur's
// loader, as its pin_memory default makes them; pageable for the copying
// loop, as such a loop is usually written), the same for every variant.
//
//   fulgur_bench gpu [--steps 200] [--warmup 20] [--reps 3]
//                    [--models mlp,cnn,cnn_bf16,cnn_fp16,mlp4096_bf16,main_cnn]
//                    [--markdown FILE] [--device cuda|cpu]
// On a machine without a GPU, --device cpu runs every variant but the graph
// one, and no 16-mixed model (a smoke run: the test suite's).
#include <CLI/CLI.hpp>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks.h"
#include "fulgur/fulgur.h"
#include "fulgur/optim/optimizers.h"
#include "fulgur/utilities/torch_compat.h"
#include "stats.h"

namespace fulgur_bench::gpu {

namespace {

using fulgur_bench::Clock;
using fulgur_bench::median;
using fulgur_bench::seconds_since;

struct ModelSpec {
  std::string name;
  std::string description;
  int64_t batch = 64;
  std::vector<int64_t> input;  // one sample's shape
  std::string precision = "32-true";  // or "bf16-mixed", "16-mixed"
  std::function<torch::nn::Sequential()> make;
};

torch::nn::Sequential mlp(std::vector<int64_t> widths) {
  torch::nn::Sequential net;
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    net->push_back(torch::nn::Linear(widths[i], widths[i + 1]));
    if (i + 2 < widths.size()) net->push_back(torch::nn::ReLU());
  }
  return net;
}

torch::nn::Sequential small_cnn() {
  return torch::nn::Sequential(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3)), torch::nn::ReLU(),
      torch::nn::MaxPool2d(2), torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3)),
      torch::nn::ReLU(), torch::nn::MaxPool2d(2), torch::nn::Flatten(),
      torch::nn::Linear(64 * 5 * 5, 128), torch::nn::ReLU(), torch::nn::Linear(128, 10));
}

/// The main job's network (examples/fashion_mnist): two conv blocks with
/// batch norm and dropout, then two linear layers.
torch::nn::Sequential main_cnn() {
  return torch::nn::Sequential(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)),
      torch::nn::BatchNorm2d(32), torch::nn::ReLU(), torch::nn::MaxPool2d(2),
      torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)),
      torch::nn::BatchNorm2d(64), torch::nn::ReLU(), torch::nn::MaxPool2d(2),
      torch::nn::Flatten(), torch::nn::Dropout(0.25), torch::nn::Linear(64 * 7 * 7, 128),
      torch::nn::ReLU(), torch::nn::Linear(128, 10));
}

std::vector<ModelSpec> all_models() {
  return {
      {"mlp", "MLP 784-256-10, batch 64, fp32", 64, {784}, "32-true",
       [] { return mlp({784, 256, 10}); }},
      {"cnn", "CNN (2 conv + 2 fc), batch 64, fp32", 64, {1, 28, 28}, "32-true", small_cnn},
      {"cnn_bf16", "same CNN, bf16-mixed", 64, {1, 28, 28}, "bf16-mixed", small_cnn},
      {"cnn_fp16", "same CNN, 16-mixed (loss scaler)", 64, {1, 28, 28}, "16-mixed", small_cnn},
      {"mlp4096_bf16", "MLP 4x4096 (in 4096), batch 512, bf16-mixed", 512, {4096}, "bf16-mixed",
       [] { return mlp({4096, 4096, 4096, 4096, 4096, 10}); }},
      {"main_cnn", "main job's CNN (BatchNorm, dropout), batch 64, fp32", 64, {1, 28, 28},
       "32-true", main_cnn},
  };
}

constexpr int64_t kDistinctBatches = 16;

/// kDistinctBatches batches of random inputs and labels, on the CPU
/// (page-locked when `pinned`), handed out in a cycle: the loader's batch i
/// is a view of stored batch i mod kDistinctBatches (no gather, no copy).
class CycledData : public fulgur::Dataset {
 public:
  CycledData(const ModelSpec& spec, int64_t total_batches, bool pinned)
      : batch_(spec.batch), total_(total_batches * spec.batch) {
    torch::manual_seed(0);
    std::vector<int64_t> shape = {kDistinctBatches * spec.batch};
    shape.insert(shape.end(), spec.input.begin(), spec.input.end());
    x_ = torch::randn(shape);
    y_ = torch::randint(0, 10, {kDistinctBatches * spec.batch}, torch::kLong);
    if (pinned) {
      x_ = x_.pin_memory();
      y_ = y_.pin_memory();
    }
  }
  int64_t size() const override { return total_; }
  fulgur::Batch get_batch(const at::Tensor& indices) const override {
    const int64_t b = (indices[0].item<int64_t>() / batch_) % kDistinctBatches;
    return {x_.narrow(0, b * batch_, batch_), y_.narrow(0, b * batch_, batch_)};
  }
  fulgur::Batch stored(int64_t b) const {
    return {x_.narrow(0, b * batch_, batch_).clone(), y_.narrow(0, b * batch_, batch_).clone()};
  }

 private:
  int64_t batch_, total_;
  at::Tensor x_, y_;
};

/// The hand-written loop: zero_grad, forward (autocast for the mixed
/// precisions), loss, backward (scaled for 16-mixed), step (through the
/// loss scaler for 16-mixed). µs per step over `steps` after `warmup`.
double hand_loop(const ModelSpec& spec, c10::Device device, bool resident, int64_t warmup,
                 int64_t steps) {
  torch::manual_seed(1);
  auto net = spec.make();
  net->to(device);
  net->train();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  fulgur::GradScaler scaler;
  const bool scaled = spec.precision == "16-mixed";
  CycledData data(spec, kDistinctBatches, /*pinned=*/false);
  std::vector<fulgur::Batch> batches;
  for (int64_t b = 0; b < kDistinctBatches; ++b) {
    batches.push_back(resident ? data.stored(b).to(device) : data.stored(b));
  }
  Clock::time_point start;
  for (int64_t i = 0; i < warmup + steps; ++i) {
    if (i == warmup) {
      sync_device(device);
      start = Clock::now();
    }
    const auto& batch = batches[static_cast<size_t>(i % kDistinctBatches)];
    at::Tensor x = batch.pair().first, y = batch.pair().second;
    if (!resident) {
      x = x.to(device);
      y = y.to(device);
    }
    opt.zero_grad();
    at::Tensor loss;
    if (spec.precision != "32-true") {
      fulgur::compat::set_autocast_dtype(device.type(), scaled ? at::kHalf : at::kBFloat16);
      fulgur::compat::set_autocast_enabled(device.type(), true);
      loss = torch::cross_entropy_loss(net->forward(x), y);
      fulgur::compat::set_autocast_enabled(device.type(), false);
      at::autocast::clear_cache();
    } else {
      loss = torch::cross_entropy_loss(net->forward(x), y);
    }
    if (scaled) {
      scaler.scale(loss).backward();
      scaler.step(opt);
      scaler.update();
    } else {
      loss.backward();
      opt.step();
    }
  }
  sync_device(device);
  return seconds_since(start) * 1e6 / static_cast<double>(steps);
}

class BenchModule : public fulgur::Module {
 public:
  BenchModule(const ModelSpec& spec, bool foreach_optim)
      : fulgur::Module("BenchModule"), foreach_(foreach_optim) {
    torch::manual_seed(1);
    net = register_module("net", spec.make());
  }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    auto& [x, y] = batch.pair();
    auto loss = torch::cross_entropy_loss(net->forward(x), y);
    log("train_loss", loss);
    return loss;
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    const auto options = torch::optim::SGDOptions(0.01).momentum(0.9);
    if (foreach_) {
      return fulgur::OptimizerConfig(std::make_shared<fulgur::optim::SGD>(parameters(), options));
    }
    return fulgur::OptimizerConfig(std::make_shared<torch::optim::SGD>(parameters(), options));
  }
  torch::nn::Sequential net{nullptr};

 private:
  bool foreach_;
};

/// Times the steps warmup .. warmup + steps of a fit.
class StepTimer : public fulgur::Callback {
 public:
  StepTimer(int64_t warmup, int64_t steps, c10::Device device)
      : warmup_(warmup), steps_(steps), device_(device) {}
  std::string state_key() const override { return "StepTimer"; }
  void on_train_batch_start(fulgur::Trainer& trainer, fulgur::Module&, const fulgur::Batch&,
                            int64_t) override {
    if (trainer.global_step() == warmup_) {
      sync_device(device_);
      start_ = Clock::now();
    }
  }
  void on_train_batch_end(fulgur::Trainer& trainer, fulgur::Module&, const at::Tensor&,
                          const fulgur::Batch&, int64_t) override {
    if (trainer.global_step() == warmup_ + steps_) {
      sync_device(device_);
      us_per_step = seconds_since(start_) * 1e6 / static_cast<double>(steps_);
    }
  }
  double us_per_step = 0;

 private:
  int64_t warmup_, steps_;
  c10::Device device_;
  Clock::time_point start_;
};

double fulgur_fit(const ModelSpec& spec, c10::Device device, bool foreach_optim, bool graph,
                  int64_t warmup, int64_t steps) {
  BenchModule module(spec, foreach_optim);
  auto timer = std::make_shared<StepTimer>(warmup, steps, device);
  fulgur::TrainerOptions options{.accelerator = device.is_cuda() ? "cuda" : "cpu",
                                 .devices = 1,
                                 .max_steps = warmup + steps,
                                 .enable_checkpointing = false,
                                 .enable_progress_bar = false,
                                 .logger = false};
  options.precision = spec.precision;
  options.cuda_graph = graph;
  options.num_sanity_val_steps = 0;
  options.callbacks = {timer};
  fulgur::Trainer trainer(options);
  auto data = std::make_shared<CycledData>(spec, warmup + steps, device.is_cuda());
  trainer.fit(module, fulgur::make_data_loader(data, {.batch_size = spec.batch}));
  return timer->us_per_step;
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{"fulgur's training step on a GPU against a hand-written LibTorch loop"};
  int64_t steps = 200, warmup = 20, reps = 3;
  std::string models_arg = "mlp,cnn,cnn_bf16,cnn_fp16,mlp4096_bf16,main_cnn";
  std::string markdown, device_arg = "cuda";
  app.add_option("--steps", steps, "timed steps per run")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "steps before timing")->check(CLI::NonNegativeNumber);
  app.add_option("--reps", reps, "repetitions (medians)")->check(CLI::PositiveNumber);
  app.add_option("--models", models_arg,
                 "comma-separated: mlp,cnn,cnn_bf16,cnn_fp16,mlp4096_bf16,main_cnn");
  app.add_option("--markdown", markdown, "also write the table to this file");
  app.add_option("--device", device_arg, "cuda or cpu (a smoke run)")
      ->check(CLI::IsMember({"cuda", "cpu"}));
  CLI11_PARSE(app, argc, argv);
  const c10::Device device(device_arg == "cuda" ? c10::kCUDA : c10::kCPU, 0);
  if (device.is_cuda() && !torch::cuda::is_available()) {
    std::fprintf(stderr, "fulgur_bench gpu: no CUDA device here; pass --device cpu for a smoke run\n");
    return 2;
  }
  std::vector<ModelSpec> models;
  for (const auto& spec : all_models()) {
    if (("," + models_arg + ",").find("," + spec.name + ",") == std::string::npos) continue;
    if (spec.precision == "16-mixed" && !device.is_cuda()) {
      std::fprintf(stderr, "fulgur_bench gpu: %s left out: 16-mixed runs on CUDA only\n",
                   spec.name.c_str());
      continue;
    }
    models.push_back(spec);
  }
  if (models.empty()) {
    std::fprintf(stderr, "fulgur_bench gpu: --models %s names none of mlp, cnn, cnn_bf16, "
                 "cnn_fp16, mlp4096_bf16, main_cnn that runs here\n", models_arg.c_str());
    return 2;
  }
  const std::vector<std::string> variants = {"loop, resident", "loop, copied", "fulgur",
                                             "fulgur, foreach", "fulgur, graph"};
  auto run = [&](const ModelSpec& spec, const std::string& v) -> double {
    if (v == "loop, resident") return hand_loop(spec, device, true, warmup, steps);
    if (v == "loop, copied") return hand_loop(spec, device, false, warmup, steps);
    if (v == "fulgur") return fulgur_fit(spec, device, false, false, warmup, steps);
    if (v == "fulgur, foreach") return fulgur_fit(spec, device, true, false, warmup, steps);
    return fulgur_fit(spec, device, true, true, warmup, steps);
  };
  std::map<std::string, std::map<std::string, std::vector<double>>> us;
  for (int64_t rep = 0; rep < reps; ++rep) {
    for (const auto& spec : models) {
      for (size_t k = 0; k < variants.size(); ++k) {
        const auto& v = variants[(k + static_cast<size_t>(rep)) % variants.size()];
        if (v == "fulgur, graph" && (!device.is_cuda() || spec.precision == "16-mixed")) continue;
        us[spec.name][v].push_back(run(spec, v));
        std::fprintf(stderr, "rep %lld  %-14s %-16s %9.1f us/step\n", static_cast<long long>(rep),
                     spec.name.c_str(), v.c_str(), us[spec.name][v].back());
      }
    }
  }
  std::ostringstream table;
  table << "| model | loop, data resident | loop, batch copied | fulgur | fulgur, "
           "fulgur::optim | fulgur, cuda_graph | fulgur / resident loop | cuda_graph / resident "
           "loop |\n|---|---|---|---|---|---|---|---|\n";
  for (const auto& spec : models) {
    auto med = [&](const std::string& v) {
      auto it = us[spec.name].find(v);
      return it == us[spec.name].end() ? 0.0 : median(it->second);
    };
    // A variant not run (a graph for 16-mixed, or on the CPU): "-".
    auto cell = [](double value, const char* format) {
      if (value <= 0) return std::string("-");
      char text[32];
      std::snprintf(text, sizeof text, format, value);
      return std::string(text);
    };
    const double resident = med("loop, resident");
    table << "| " << spec.description << " | " << cell(resident, "%.0f") << " | "
          << cell(med("loop, copied"), "%.0f") << " | " << cell(med("fulgur"), "%.0f") << " | "
          << cell(med("fulgur, foreach"), "%.0f") << " | " << cell(med("fulgur, graph"), "%.0f")
          << " | " << cell(med("fulgur") / resident, "%.2f") << " | "
          << cell(med("fulgur, graph") / resident, "%.2f") << " |\n";
    std::printf("{\"model\": \"%s\", \"loop_resident_us\": %.1f, \"loop_copied_us\": %.1f, "
                "\"fulgur_us\": %.1f, \"fulgur_foreach_us\": %.1f, \"fulgur_graph_us\": %.1f}\n",
                spec.name.c_str(), resident, med("loop, copied"), med("fulgur"),
                med("fulgur, foreach"), med("fulgur, graph"));
  }
  std::printf("\nµs per step, medians of %lld repetitions of %lld steps after %lld warm-up "
              "steps:\n\n%s",
              static_cast<long long>(reps), static_cast<long long>(steps),
              static_cast<long long>(warmup), table.str().c_str());
  if (!markdown.empty()) {
    std::ofstream out(markdown);
    out << table.str();
  }
  return 0;
}

}  // namespace fulgur_bench::gpu
