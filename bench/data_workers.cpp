// Data loading with worker threads: a dataset whose samples each cost
// --sample-us of CPU time (a synthetic decode/augment), loaded
//   1. for one epoch by fulgur's DatasetLoader and by LibTorch's
//      torch::data::make_data_loader, with 0, 1 and 2 workers: samples/s;
//   2. under Trainer::fit of a 784-1024-1024-10 MLP: ms per training step
//      with 0, 1 and 2 workers, against the same steps on batches already
//      in memory (the step with no data cost).
// Interleaved over --reps; medians. One JSON line.
//
//   data_workers --samples 960 --batch 16 --sample-us 200 --reps 5
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "benchmarks.h"
#include "fulgur/fulgur.h"
#include "stats.h"

namespace fulgur_bench::data_workers {

namespace {

using fulgur_bench::median;
using fulgur_bench::seconds_since;

// Busy CPU work for `us` microseconds (no sleep: a decode costs a core).
float spin(int64_t us, int64_t seed) {
  const auto end = Clock::now() + std::chrono::microseconds(us);
  float acc = static_cast<float>(seed);
  while (Clock::now() < end) {
    for (int i = 0; i < 64; ++i) acc = acc * 1.0000001f + 0.5f;
  }
  return acc;
}

// One sample: a 784-value image and its label, after `us` of CPU work.
std::pair<at::Tensor, int64_t> make_sample(int64_t index, int64_t us) {
  const float base = spin(us, index);
  at::Tensor x = torch::rand({784}, fulgur::sample_generator(index)) + (base > 0 ? 0.0 : 1.0);
  return {x, index % 10};
}

class SlowDataset : public fulgur::Dataset {
 public:
  SlowDataset(int64_t n, int64_t us) : n_(n), us_(us) {}
  int64_t size() const override { return n_; }
  fulgur::Batch get_batch(const at::Tensor& indices) const override {
    std::vector<at::Tensor> xs;
    std::vector<int64_t> ys;
    const auto* p = indices.data_ptr<int64_t>();
    for (int64_t i = 0; i < indices.numel(); ++i) {
      auto [x, y] = make_sample(p[i], us_);
      xs.push_back(x);
      ys.push_back(y);
    }
    return fulgur::Batch(torch::stack(xs), torch::tensor(ys));
  }

 private:
  int64_t n_, us_;
};

struct TorchSlowDataset : torch::data::datasets::Dataset<TorchSlowDataset> {
  TorchSlowDataset(int64_t n, int64_t us) : n_(n), us_(us) {}
  torch::data::Example<> get(size_t index) override {
    auto [x, y] = make_sample(static_cast<int64_t>(index), us_);
    return {x, torch::tensor(y)};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(n_); }
  int64_t n_, us_;
};

double fulgur_epoch(int64_t n, int64_t batch, int64_t us, int64_t workers) {
  auto loader = fulgur::make_data_loader(std::make_shared<SlowDataset>(n, us),
                                         {.batch_size = batch, .num_workers = workers});
  const auto t = Clock::now();
  loader->start_epoch(0);
  int64_t seen = 0;
  while (auto b = loader->next()) seen += b->batch_size();
  return static_cast<double>(seen) / seconds_since(t);
}

double torch_epoch(int64_t n, int64_t batch, int64_t us, int64_t workers) {
  const auto t = Clock::now();
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      TorchSlowDataset(n, us).map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions().batch_size(static_cast<size_t>(batch)).workers(
          static_cast<size_t>(workers)));
  int64_t seen = 0;
  for (auto& b : *loader) seen += b.data.size(0);
  return static_cast<double>(seen) / seconds_since(t);
}

class MLP : public fulgur::Module {
 public:
  MLP() : fulgur::Module("MLP") {
    net_ = register_module("net", torch::nn::Sequential(torch::nn::Linear(784, 1024), torch::nn::ReLU(),
                                                        torch::nn::Linear(1024, 1024), torch::nn::ReLU(),
                                                        torch::nn::Linear(1024, 10)));
  }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    auto& [x, y] = batch.pair();
    return torch::nn::functional::cross_entropy(net_->forward(x), y);
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return fulgur::OptimizerConfig(
        std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.01)));
  }

 private:
  torch::nn::Sequential net_{nullptr};
};

// ms per optimizer step of fit over `loader` (one epoch).
double fit_ms_per_step(std::shared_ptr<fulgur::DataLoader> loader, int64_t steps) {
  MLP model;
  fulgur::Trainer trainer({.accelerator = "cpu",
                           .max_epochs = 1,
                           .num_sanity_val_steps = 0,
                           .enable_checkpointing = false,
                           .enable_progress_bar = false,
                           .logger = false});
  const auto t = Clock::now();
  trainer.fit(model, std::move(loader));
  return 1e3 * seconds_since(t) / static_cast<double>(steps);
}

}  // namespace

int run(int argc, char** argv) {
  int64_t samples = 960, batch = 16, us = 200, reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int64_t value = std::stoll(argv[i + 1]);
    if (flag == "--samples") samples = value;
    else if (flag == "--batch") batch = value;
    else if (flag == "--sample-us") us = value;
    else if (flag == "--reps") reps = value;
    else {
      std::fprintf(stderr, "data_workers: unknown flag %s (--samples, --batch, --sample-us, --reps)\n",
                   flag.c_str());
      return 2;
    }
  }
  const std::vector<int64_t> worker_counts = {0, 1, 2};
  std::vector<std::vector<double>> f_rate(3), t_rate(3), step(3);
  std::vector<double> free_step;
  const int64_t steps = (samples + batch - 1) / batch;
  // The same batches, already in memory: the step with no data cost.
  std::vector<fulgur::Batch> in_memory;
  {
    SlowDataset ds(samples, 0);
    for (int64_t b = 0; b < steps; ++b) {
      in_memory.push_back(ds.get_batch(torch::arange(b * batch, std::min(samples, (b + 1) * batch))));
    }
  }
  auto memory = std::make_shared<std::vector<fulgur::Batch>>(in_memory);
  for (int64_t r = 0; r < reps; ++r) {
    for (size_t k = 0; k < worker_counts.size(); ++k) {
      f_rate[k].push_back(fulgur_epoch(samples, batch, us, worker_counts[k]));
      t_rate[k].push_back(torch_epoch(samples, batch, us, worker_counts[k]));
      step[k].push_back(fit_ms_per_step(
          fulgur::make_data_loader(std::make_shared<SlowDataset>(samples, us),
                                   {.batch_size = batch, .num_workers = worker_counts[k]}),
          steps));
    }
    free_step.push_back(fit_ms_per_step(fulgur::make_iterable_loader(memory), steps));
  }
  std::printf(
      "{\"benchmark\": \"data_workers\", \"samples\": %lld, \"batch\": %lld, \"sample_us\": %lld, "
      "\"reps\": %lld, \"fulgur_samples_per_s\": [%.0f, %.0f, %.0f], "
      "\"torch_samples_per_s\": [%.0f, %.0f, %.0f], \"fit_ms_per_step\": [%.2f, %.2f, %.2f], "
      "\"fit_ms_per_step_in_memory\": %.2f}\n",
      static_cast<long long>(samples), static_cast<long long>(batch), static_cast<long long>(us),
      static_cast<long long>(reps), median(f_rate[0]), median(f_rate[1]), median(f_rate[2]),
      median(t_rate[0]), median(t_rate[1]), median(t_rate[2]), median(step[0]), median(step[1]),
      median(step[2]), median(free_step));
  return 0;
}

}  // namespace fulgur_bench::data_workers
