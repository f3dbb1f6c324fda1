// Data-parallel training throughput, one side per run, started by torchrun
// (so every side is launched the same way):
//   --impl fulgur  Trainer with strategy "ddp" (bucketed, overlapped reducer)
//   --impl naive   hand-written LibTorch loop: backward, then one all-reduce
//                  per parameter, then the step (what C++ users write today)
// The Python peer (PyTorch's DistributedDataParallel) is bench/ddp_peer.py.
// Global rank 0 prints one JSON object: samples per second over the timed
// steps (all ranks together).
//
//   torchrun --standalone --nproc_per_node 2 --no_python
//       build/bench/fulgur_bench_ddp --impl fulgur --steps 200
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fulgur/fulgur.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string impl = "fulgur";
  int64_t steps = 200;
  int64_t warmup = 20;
  int64_t batch = 64;
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

// 784-1024-1024-10, the model; the same initial weights everywhere.
torch::nn::Sequential make_net() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(784, 1024), torch::nn::ReLU(),
                               torch::nn::Linear(1024, 1024), torch::nn::ReLU(),
                               torch::nn::Linear(1024, 10));
}

// Enough distinct batches per rank for the run, in memory.
std::pair<torch::Tensor, torch::Tensor> make_data(int64_t samples) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  return {torch::randn({samples, 784}, gen), torch::randint(0, 10, {samples}, gen)};
}

void report(const Args& a, int world, double seconds) {
  double samples = static_cast<double>(a.steps * a.batch * world);
  std::printf(
      "{\"benchmark\": \"ddp_mlp_784_1024_1024_10\", \"impl\": \"%s\", \"world_size\": %d, "
      "\"steps\": %lld, \"batch_per_rank\": %lld, \"samples_per_s\": %.1f}\n",
      a.impl.c_str(), world, static_cast<long long>(a.steps), static_cast<long long>(a.batch),
      samples / seconds);
  std::fflush(stdout);
}

struct Net : fulgur::Module {
  torch::nn::Sequential net{nullptr};
  Net() { net = register_module("net", make_net()); }
  torch::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    auto& [x, y] = batch.pair();
    return torch::cross_entropy_loss(net->forward(x), y);
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(parameters(), 0.01)};
  }
};

// Times the steps after the warm-up, on every rank; rank 0 reports.
struct Timer : fulgur::Callback {
  const Args& args;
  Clock::time_point start;
  explicit Timer(const Args& a) : args(a) {}
  std::string state_key() const override { return "Timer"; }
  void on_train_batch_start(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch&,
                            int64_t idx) override {
    if (idx == args.warmup) start = Clock::now();
  }
  void on_train_end(fulgur::Trainer& trainer, fulgur::Module&) override {
    double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (trainer.strategy().is_global_zero()) report(args, trainer.strategy().world_size(), seconds);
  }
};

int run_fulgur(const Args& a) {
  const int world = env_int("WORLD_SIZE", 1);
  auto [x, y] = make_data((a.steps + a.warmup) * a.batch * world);
  auto loader = fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(x, y),
                                         {.batch_size = a.batch});
  Net model;
  fulgur::Trainer trainer({.accelerator = "cpu",
                           .strategy = world > 1 ? "ddp" : "single_device",
                           .devices = env_int("LOCAL_WORLD_SIZE", 1),
                           .max_steps = a.steps + a.warmup,
                           .enable_checkpointing = false,
                           .enable_progress_bar = false,
                           .logger = false,
                           .callbacks = {std::make_shared<Timer>(a)}});
  trainer.fit(model, loader);
  return 0;
}

int run_naive(const Args& a) {
  fulgur::ProcessGroupOptions o;
  o.main_address = std::getenv("MASTER_ADDR") ? std::getenv("MASTER_ADDR") : "127.0.0.1";
  o.main_port = env_int("MASTER_PORT", 29500);
  o.world_size = env_int("WORLD_SIZE", 1);
  o.rank = env_int("RANK", 0);
  auto group = fulgur::ProcessGroup::connect(o);
  auto net = make_net();
  for (auto& p : net->parameters()) group->broadcast_(p, 0);
  torch::optim::SGD sgd(net->parameters(), 0.01);
  auto [x, y] = make_data((a.steps + a.warmup) * a.batch * o.world_size);
  Clock::time_point start;
  for (int64_t step = 0; step < a.steps + a.warmup; ++step) {
    if (step == a.warmup) start = Clock::now();
    // This rank's share of the global batch, gathered like a loader does.
    auto idx = torch::arange((step * o.world_size) * a.batch, (step * o.world_size + 1) * a.batch,
                             torch::kLong) +
               o.rank * a.batch;
    auto bx = x.index_select(0, idx);
    auto by = y.index_select(0, idx);
    sgd.zero_grad();
    torch::cross_entropy_loss(net->forward(bx), by).backward();
    for (auto& p : net->parameters()) {
      group->all_reduce_(p.mutable_grad(), fulgur::ReduceOp::Sum);
      p.mutable_grad().div_(o.world_size);
    }
    sgd.step();
  }
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (o.rank == 0) report(a, o.world_size, seconds);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--impl"))
      a.impl = argv[i + 1];
    else if (!std::strcmp(argv[i], "--steps"))
      a.steps = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--warmup"))
      a.warmup = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--batch"))
      a.batch = std::atoll(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s --impl fulgur|naive [--steps N] [--warmup N] [--batch N]\n",
                   argv[0]);
      return 2;
    }
  }
  torch::set_num_threads(1);
  try {
    if (a.impl == "fulgur") return run_fulgur(a);
    if (a.impl == "naive") return run_naive(a);
    std::fprintf(stderr, "--impl %s: expected fulgur or naive\n", a.impl.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
