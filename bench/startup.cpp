// Startup: from process start to the first optimizer step of a tiny model.
// bench/startup.py starts this program and measures, against the clock it
// read just before starting it, the CLOCK_REALTIME this program prints when
// its first optimizer step is done.
//
//   startup --impl noop          loads LibTorch and exits (the floor)
//   startup --impl hand          a hand-written LibTorch loop, one step
//   startup --impl fulgur [--devices 2]   Trainer::fit, one step (2: its launcher)
#include <torch/torch.h>

#include <cstdio>
#include <ctime>
#include <string>

#include "benchmarks.h"
#include "fulgur/fulgur.h"
#include "stats.h"

namespace fulgur_bench::startup {

namespace {

void report(const char* impl, int rank) {
  std::printf("{\"startup\": \"%s\", \"rank\": %d, \"first_step_ns\": %lld}\n", impl, rank,
              now_ns());
  std::fflush(stdout);
}

torch::nn::Sequential make_net() {
  return torch::nn::Sequential(torch::nn::Linear(784, 256), torch::nn::ReLU(),
                               torch::nn::Linear(256, 10));
}

struct Tiny : fulgur::Module {
  torch::nn::Sequential net{nullptr};
  Tiny() { net = register_module("net", make_net()); }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    auto& [x, y] = batch.pair();
    return torch::nn::functional::cross_entropy(net->forward(x), y);
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(parameters(), 0.01)};
  }
};

struct ReportFirstStep : fulgur::Callback {
  std::string state_key() const override { return "ReportFirstStep"; }
  void on_train_batch_end(fulgur::Trainer& trainer, fulgur::Module&, const at::Tensor&,
                          const fulgur::Batch&, int64_t) override {
    if (trainer.global_step() == 1) report("fulgur", trainer.strategy().global_rank());
  }
};

}  // namespace

int run(int argc, char** argv) {
  std::string impl = "fulgur", devices = "1", root = "/tmp/fulgur_bench_startup";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--impl")
      impl = argv[i + 1];
    else if (flag == "--devices")
      devices = argv[i + 1];
    else if (flag == "--root")
      root = argv[i + 1];
    else {
      std::fprintf(stderr,
                   "startup: unknown flag %s (--impl noop|hand|fulgur, --devices N, --root DIR)\n",
                   flag.c_str());
      return 2;
    }
  }
  torch::set_num_threads(1);
  auto x = torch::randn({64, 784});
  auto y = torch::randint(0, 10, {64}, torch::kLong);
  if (impl == "noop") {
    report("noop", 0);
    return 0;
  }
  if (impl == "hand") {
    auto net = make_net();
    torch::optim::SGD opt(net->parameters(), 0.01);
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    opt.zero_grad();
    loss.backward();
    opt.step();
    report("hand", 0);
    return 0;
  }
  Tiny model;
  auto loader = fulgur::make_data_loader(
      std::make_shared<fulgur::TensorDataset>(x.repeat({4, 1}), y.repeat({4})), {.batch_size = 64});
  fulgur::Trainer trainer({.accelerator = "cpu",
                           .devices = fulgur::DevicesSpec(devices),
                           .max_steps = 1,
                           .num_sanity_val_steps = 0,
                           .default_root_dir = root,
                           .enable_checkpointing = false,
                           .enable_progress_bar = false,
                           .logger = false,
                           .callbacks = {std::make_shared<ReportFirstStep>()}});
  trainer.fit(model, loader);
  return 0;
}

}  // namespace fulgur_bench::startup
