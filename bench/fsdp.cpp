// Sharded data parallel, memory and throughput: an MLP of `--layers` square
// layers of `--width` (4096 x 3: 50.3 M parameters), each layer a
// fulgur::nn::FSDPUnit, trained with Adam in fp32 on 2 ranks (the Trainer's
// own popen launcher) under `--strategy` ddp, fsdp_shard_grad_op or fsdp.
// Global rank 0 prints one JSON object: samples per second over the timed
// steps, and the bytes a rank holds for the model state, counted from the
// tensors (parameters, shards, gradients, optimizer state) after an
// optimizer step, the most full-parameter bytes held at once (fsdp) and
// the process's peak RSS. bench/fsdp.py runs the strategies interleaved
// and compares with the ZeRO formula.
//
//   build/bench/fulgur_bench fsdp --strategy fsdp --width 4096 --layers 3 --steps 6
#include <sys/resource.h>
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "benchmarks.h"
#include "fulgur/fulgur.h"
#include "stats.h"

namespace fulgur_bench::fsdp {

namespace {

struct Args {
  std::string strategy = "fsdp";
  int64_t width = 4096;
  int64_t layers = 3;
  int64_t steps = 6;
  int64_t warmup = 2;
  int64_t batch = 16;
  int devices = 2;
  bool prefetch = false;  // FSDPOptions::prefetch
};

struct Mlp : fulgur::Module {
  std::vector<fulgur::nn::FSDPUnit<torch::nn::Linear>> layers;
  int64_t numel = 0;  // counted whole (under fsdp the units are released later)
  explicit Mlp(const Args& a) {
    torch::manual_seed(0);
    for (int64_t i = 0; i < a.layers; ++i) {
      layers.push_back(register_module("fc" + std::to_string(i),
                                       fulgur::nn::FSDPUnit(torch::nn::Linear(a.width, a.width))));
    }
    for (const auto& p : parameters()) numel += p.numel();
  }
  torch::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    auto& [x, y] = batch.pair();
    at::Tensor h = x;
    for (size_t i = 0; i < layers.size(); ++i) {
      h = layers[i](h);
      if (i + 1 < layers.size()) h = torch::relu(h);
    }
    return torch::cross_entropy_loss(h, y);
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::Adam>(parameters(), 1e-4)};
  }
};

int64_t bytes_of(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

// DDP's model state: every parameter, its gradient and Adam's two moments.
fulgur::FSDPStrategy::Memory ddp_memory(const Mlp& model, const torch::optim::Optimizer& adam) {
  fulgur::FSDPStrategy::Memory m;
  for (const auto& p : model.parameters()) {
    m.parameters += bytes_of(p);
    m.gradients += bytes_of(p.grad());
  }
  m.optimizer_state = fulgur::optimizer_state_bytes(adam);
  return m;
}

struct Probe : fulgur::Callback {
  const Args& args;
  Clock::time_point start;
  fulgur::FSDPStrategy::Memory after_step;
  explicit Probe(const Args& a) : args(a) {}
  std::string state_key() const override { return "Probe"; }
  void on_train_batch_start(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch&,
                            int64_t idx) override {
    if (idx == args.warmup) start = Clock::now();
  }
  void on_train_batch_end(fulgur::Trainer& trainer, fulgur::Module& module, const at::Tensor&,
                          const fulgur::Batch&, int64_t) override {
    if (auto* fsdp = dynamic_cast<fulgur::FSDPStrategy*>(&trainer.strategy())) {
      after_step = fsdp->memory();
    } else {
      after_step = ddp_memory(static_cast<Mlp&>(module), *module.optimizers().front());
    }
  }
  void on_train_end(fulgur::Trainer& trainer, fulgur::Module& module) override {
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    auto& strategy = trainer.strategy();
    auto* fsdp = dynamic_cast<fulgur::FSDPStrategy*>(&strategy);
    const int64_t parameters = static_cast<Mlp&>(module).numel;
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    if (!strategy.is_global_zero()) return;
    std::printf(
        "{\"benchmark\": \"fsdp_mlp\", \"strategy\": \"%s\", \"world_size\": %d, \"width\": "
        "%lld, \"layers\": %lld, \"parameters\": %lld, \"steps\": %lld, \"batch_per_rank\": "
        "%lld, \"samples_per_s\": %.2f, \"parameter_bytes\": %lld, \"shard_bytes\": %lld, "
        "\"gradient_bytes\": %lld, \"optimizer_state_bytes\": %lld, \"state_bytes\": %lld, "
        "\"peak_parameter_bytes\": %lld, \"peak_rss_bytes\": %lld}\n",
        args.strategy.c_str(), strategy.world_size(), static_cast<long long>(args.width),
        static_cast<long long>(args.layers), static_cast<long long>(parameters),
        static_cast<long long>(args.steps), static_cast<long long>(args.batch),
        static_cast<double>(args.steps * args.batch * strategy.world_size()) / seconds,
        static_cast<long long>(after_step.parameters), static_cast<long long>(after_step.shards),
        static_cast<long long>(after_step.gradients),
        static_cast<long long>(after_step.optimizer_state),
        static_cast<long long>(after_step.total()),
        static_cast<long long>(fsdp ? fsdp->peak_parameter_bytes() : after_step.parameters),
        static_cast<long long>(usage.ru_maxrss) * 1024);
    std::fflush(stdout);
  }
};

}  // namespace

int run(int argc, char** argv) {
  Args a;
  CLI::App app("fulgur_bench fsdp: one strategy on 2 ranks; bench/fsdp.py compares them");
  app.add_option("--strategy", a.strategy, "ddp, fsdp_shard_grad_op or fsdp");
  app.add_option("--width", a.width);
  app.add_option("--layers", a.layers);
  app.add_option("--steps", a.steps, "timed steps");
  app.add_option("--warmup", a.warmup, "untimed steps first");
  app.add_option("--batch", a.batch, "per rank");
  app.add_option("--devices", a.devices);
  app.add_flag("--prefetch", a.prefetch, "fsdp: prefetch the next unit, overlap reduce-scatters");
  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(1);
    const int64_t samples = (a.steps + a.warmup) * a.batch * a.devices;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
    auto x = torch::randn({samples, a.width}, gen);
    auto y = torch::randint(0, a.width, {samples}, gen);
    auto loader = fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(x, y),
                                           {.batch_size = a.batch});
    Mlp model(a);
    auto probe = std::make_shared<Probe>(a);
    std::variant<std::string, std::shared_ptr<fulgur::Strategy>> strategy = a.strategy;
    if (a.prefetch) {
      auto named = fulgur::strategy_registry().create(a.strategy);
      if (auto* fsdp = dynamic_cast<fulgur::FSDPStrategy*>(named.get())) {
        fulgur::FSDPOptions options = fsdp->options();
        options.prefetch = true;
        strategy = std::make_shared<fulgur::FSDPStrategy>(options, a.strategy);
      }
    }
    fulgur::Trainer trainer({.accelerator = "cpu",
                             .strategy = strategy,
                             .devices = a.devices,
                             .max_steps = a.steps + a.warmup,
                             .enable_checkpointing = false,
                             .enable_progress_bar = false,
                             .logger = false,
                             .callbacks = {probe}});
    trainer.fit(model, loader);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace fulgur_bench::fsdp
