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
//       build/bench/fulgur_bench ddp --impl fulgur --steps 200
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <variant>

#include "benchmarks.h"
#include "fulgur/fulgur.h"
#include "stats.h"

namespace fulgur_bench::ddp {

namespace {

struct Args {
  std::string impl = "fulgur";
  int64_t steps = 200;
  int64_t warmup = 20;
  int64_t batch = 64;
  double bucket_mb = 25.0;  // fulgur's DDPOptions::bucket_cap_mb
};

// Bytes this process's network namespace has sent on its interfaces other
// than the loopback (/proc/self/net/dev): what the ranks of a node exchange
// with other nodes.
double bytes_sent_off_loopback() {
  std::FILE* f = std::fopen("/proc/self/net/dev", "r");
  if (f == nullptr) return 0;
  char line[512];
  double total = 0;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    char name[64];
    double rx[8], tx;
    if (std::sscanf(line, " %63[^:]: %lf %lf %lf %lf %lf %lf %lf %lf %lf", name, &rx[0], &rx[1],
                    &rx[2], &rx[3], &rx[4], &rx[5], &rx[6], &rx[7], &tx) == 10 &&
        std::strcmp(name, "lo") != 0) {
      total += tx;
    }
  }
  std::fclose(f);
  return total;
}

double gradient_bytes(const torch::nn::Module& net) {
  double bytes = 0;
  for (const auto& p : net.parameters()) bytes += static_cast<double>(p.numel() * p.element_size());
  return bytes;
}

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

// `sent`: bytes sent off the loopback during the timed steps (rank 0's node).
void report(const Args& a, int world, double seconds, double sent, double grad_bytes) {
  double samples = static_cast<double>(a.steps * a.batch * world);
  std::printf(
      "{\"benchmark\": \"ddp_mlp_784_1024_1024_10\", \"impl\": \"%s\", \"world_size\": %d, "
      "\"steps\": %lld, \"batch_per_rank\": %lld, \"bucket_mb\": %g, \"samples_per_s\": %.1f, "
      "\"sent_bytes_per_step\": %.0f, \"gradient_bytes\": %.0f}\n",
      a.impl.c_str(), world, static_cast<long long>(a.steps), static_cast<long long>(a.batch),
      a.impl == "fulgur" ? a.bucket_mb : 0.0, samples / seconds,
      sent / static_cast<double>(a.steps), grad_bytes);
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
  double sent_at_start = 0;
  explicit Timer(const Args& a) : args(a) {}
  std::string state_key() const override { return "Timer"; }
  void on_train_batch_start(fulgur::Trainer&, fulgur::Module&, const fulgur::Batch&,
                            int64_t idx) override {
    if (idx == args.warmup) {
      start = Clock::now();
      sent_at_start = bytes_sent_off_loopback();
    }
  }
  void on_train_end(fulgur::Trainer& trainer, fulgur::Module& module) override {
    double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    double sent = bytes_sent_off_loopback() - sent_at_start;
    if (trainer.strategy().is_global_zero()) {
      report(args, trainer.strategy().world_size(), seconds, sent, gradient_bytes(module));
    }
  }
};

int run_fulgur(const Args& a) {
  const int world = env_int("WORLD_SIZE", 1);
  auto [x, y] = make_data((a.steps + a.warmup) * a.batch * world);
  auto loader = fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(x, y),
                                         {.batch_size = a.batch});
  Net model;
  const int local = env_int("LOCAL_WORLD_SIZE", 1);
  std::variant<std::string, std::shared_ptr<fulgur::Strategy>> strategy =
      std::string("single_device");
  if (world > 1) {
    fulgur::DDPOptions options;
    options.bucket_cap_mb = a.bucket_mb;
    strategy = std::make_shared<fulgur::DDPStrategy>(options);
  }
  fulgur::Trainer trainer({.accelerator = "cpu",
                           .strategy = strategy,
                           .devices = local,
                           .num_nodes = world / local,
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
  double sent_at_start = 0;
  for (int64_t step = 0; step < a.steps + a.warmup; ++step) {
    if (step == a.warmup) {
      start = Clock::now();
      sent_at_start = bytes_sent_off_loopback();
    }
    // This rank's share of the global batch, gathered like a loader does.
    auto idx = torch::arange((step * o.world_size) * a.batch, (step * o.world_size + 1) * a.batch,
                             torch::kLong) +
               o.rank * a.batch;
    auto bx = x.index_select(0, idx);
    auto by = y.index_select(0, idx);
    sgd.zero_grad();
    torch::cross_entropy_loss(net->forward(bx), by).backward();
    for (auto& p : net->parameters()) {
      group->all_reduce_(p.mutable_grad(), fulgur::ReduceOp::kSum);
      p.mutable_grad().div_(o.world_size);
    }
    sgd.step();
  }
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  double sent = bytes_sent_off_loopback() - sent_at_start;
  if (o.rank == 0) report(a, o.world_size, seconds, sent, gradient_bytes(*net));
  return 0;
}

}  // namespace

int run(int argc, char** argv) {
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
    else if (!std::strcmp(argv[i], "--bucket-mb"))
      a.bucket_mb = std::atof(argv[i + 1]);
    else {
      std::fprintf(stderr,
                   "usage: %s --impl fulgur|naive [--steps N] [--warmup N] [--batch N] "
                   "[--bucket-mb MB]\n",
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

}  // namespace fulgur_bench::ddp
