// Per-step overhead of fulgur's Trainer against a hand-written LibTorch loop
// doing the same work: the same model, data, optimizer and number of steps,
// run interleaved (A B A B ...) in one process so that a noisy machine
// affects both sides alike. Prints one JSON object per comparison.
//
// Heap allocations are counted too: this binary replaces the global
// operator new, and each side counts the allocations of its steady-state
// steps (from the second step to the last), so "extra_allocs_per_step" is
// what the framework allocates per step beyond the hand-written loop.
// (Tensor storage comes from c10's CPU allocator, not operator new; what is
// counted is every C++ object: TensorImpls, autograd nodes, strings, maps.)
//
//   overhead --model mlp --steps 2000 --reps 5
//   overhead --model cnn --steps 200 --reps 3
//   overhead --progress-bar     # fulgur's side draws its progress bar on a pseudo-
//                               # terminal at every step (train_loss on the bar)
#include <pty.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <new>
#include <optional>
#include <thread>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "benchmarks.h"
#include "fulgur/fulgur.h"
#include "stats.h"

// ---- Counting operator new (every form routes through these two).
namespace {
std::atomic<int64_t> g_allocations{0};
}  // namespace

void* operator new(std::size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t size, std::align_val_t align) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  std::size_t a = static_cast<std::size_t>(align);
  if (void* p = std::aligned_alloc(a, (size + a - 1) / a * a)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return operator new(size); }
void* operator new[](std::size_t size, std::align_val_t align) { return operator new(size, align); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace fulgur_bench::overhead {

namespace {

// Time and allocations of the steady-state steps of one run.
struct Measure {
  double us_per_step = 0;
  double allocs_per_step = 0;
};

struct Args {
  std::string model = "mlp";
  int64_t steps = 2000;
  int reps = 5;
  int64_t batch = 64;
  bool log_every_step = false;
  bool progress_bar = false;
};

torch::nn::Sequential make_net(const std::string& kind) {
  torch::manual_seed(0);
  if (kind == "cnn") {
    return torch::nn::Sequential(
        torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)), torch::nn::ReLU(),
        torch::nn::MaxPool2d(2), torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)),
        torch::nn::ReLU(), torch::nn::MaxPool2d(2), torch::nn::Flatten(),
        torch::nn::Linear(64 * 7 * 7, 128), torch::nn::ReLU(), torch::nn::Linear(128, 10));
  }
  return torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(784, 256), torch::nn::ReLU(),
                               torch::nn::Linear(256, 10));
}

struct Data {
  torch::Tensor x, y;
};

Data make_data(int64_t samples) {
  torch::manual_seed(1);
  return {torch::randn({samples, 1, 28, 28}), torch::randint(0, 10, {samples}, torch::kLong)};
}

// ---- A: the loop a LibTorch user writes by hand.
Measure hand_written(const Args& a, const Data& d) {
  auto net = make_net(a.model);
  torch::optim::SGD opt(net->parameters(), 0.01);
  const int64_t batches = d.x.size(0) / a.batch;
  auto start = Clock::now();
  int64_t allocs_start = 0;
  for (int64_t s = 0; s < a.steps; ++s) {
    int64_t b = s % batches;
    // Gather the batch as a loader does (a copy: steps may modify their
    // batch in place without touching the dataset).
    auto index = torch::arange(b * a.batch, (b + 1) * a.batch, torch::kLong);
    auto x = d.x.index_select(0, index);
    auto y = d.y.index_select(0, index);
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    opt.zero_grad();
    loss.backward();
    opt.step();
    if (s == 0) {  // exclude the first step (allocator warm-up) on both sides
      start = Clock::now();
      allocs_start = g_allocations.load();
    }
  }
  const auto steps = static_cast<double>(a.steps - 1);
  return {std::chrono::duration<double, std::micro>(Clock::now() - start).count() / steps,
          static_cast<double>(g_allocations.load() - allocs_start) / steps};
}

// ---- B: the same work as a fulgur Module under Trainer::fit.
struct Net : fulgur::Module {
  Net(const std::string& kind, bool prog_bar) : prog_bar(prog_bar) {
    net = register_module("net", make_net(kind));
  }
  torch::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    auto& [x, y] = batch.pair();
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    log("train_loss", loss, {.prog_bar = prog_bar});
    if (timing && global_step() == 1 && !started) {
      start = Clock::now();
      allocs_start = g_allocations.load();
      started = true;
    }
    return loss;
  }
  // The last step's optimizer step is where the hand-written loop's count
  // ends too; what follows (teardown, logger finalize) is once per fit.
  void on_train_batch_end(const at::Tensor&, const fulgur::Batch&, int64_t) override {
    end = Clock::now();
    allocs_end = g_allocations.load();
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(parameters(), 0.01)};
  }
  torch::nn::Sequential net{nullptr};
  bool prog_bar = false;
  bool timing = true;
  bool started = false;
  Clock::time_point start, end;
  int64_t allocs_start = 0, allocs_end = 0;
};

// A pseudo-terminal whose output a thread reads and drops: the progress
// bar draws as on a terminal (the costly path) whatever stderr is.
struct PseudoTerminal {
  PseudoTerminal() {
    if (::openpty(&master, &slave, nullptr, nullptr, nullptr) != 0) {
      std::perror("overhead: openpty");
      std::exit(2);
    }
    out = ::fdopen(slave, "w");
    reader = std::thread([fd = master] {
      char buf[4096];
      while (::read(fd, buf, sizeof buf) > 0) {
      }
    });
  }
  ~PseudoTerminal() {
    std::fclose(out);  // the reader sees EOF (EIO) once the slave closes
    reader.join();
    ::close(master);
  }
  int master = -1, slave = -1;
  std::FILE* out = nullptr;
  std::thread reader;
};

Measure with_fulgur(const Args& a, const Data& d, const std::string& root) {
  Net model(a.model, a.progress_bar);
  auto loader = fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(d.x, d.y),
                                         {.batch_size = a.batch});
  std::optional<PseudoTerminal> terminal;
  std::vector<std::shared_ptr<fulgur::Callback>> callbacks;
  if (a.progress_bar) {
    // Redrawn at every step (refresh 0 ms): the bar's cost at its worst.
    terminal.emplace();
    callbacks.push_back(std::make_shared<fulgur::ProgressBar>(0, terminal->out));
  }
  fulgur::Trainer trainer({.accelerator = "cpu",
                           .max_steps = a.steps,
                           .num_sanity_val_steps = 0,
                           .default_root_dir = root,
                           .enable_checkpointing = false,
                           .enable_progress_bar = false,
                           .log_every_n_steps = a.log_every_step ? 1 : 50,
                           .callbacks = callbacks});
  trainer.fit(model, loader);
  const auto steps = static_cast<double>(a.steps - 1);
  return {std::chrono::duration<double, std::micro>(model.end - model.start).count() / steps,
          static_cast<double>(model.allocs_end - model.allocs_start) / steps};
}

using fulgur_bench::median;

}  // namespace

int run(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "overhead: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--model")
      a.model = next();
    else if (arg == "--steps")
      a.steps = std::stoll(next());
    else if (arg == "--reps")
      a.reps = std::stoi(next());
    else if (arg == "--batch")
      a.batch = std::stoll(next());
    else if (arg == "--log-every-step")
      a.log_every_step = true;
    else if (arg == "--progress-bar")
      a.progress_bar = true;
    else {
      std::fprintf(stderr,
                   "overhead: unknown argument %s\nusage: overhead [--model mlp|cnn] [--steps N] "
                   "[--reps N] [--batch N] [--log-every-step] [--progress-bar]\n",
                   arg.c_str());
      return 2;
    }
  }
  if (a.steps < 2 || a.reps < 1 || (a.model != "mlp" && a.model != "cnn")) {
    std::fprintf(stderr, "overhead: need --steps >= 2, --reps >= 1, --model mlp|cnn\n");
    return 2;
  }
  torch::set_num_threads(1);
  // Both sides with the same malloc settings: fit() tunes the host allocator
  // for the whole process (fulgur/utilities/host_allocator.h), and would
  // otherwise do it only after the first hand-written repetition.
  fulgur::tune_host_allocator();
  auto data = make_data(std::min<int64_t>(a.steps, 500) * a.batch);
  std::string root =
      std::filesystem::temp_directory_path() / ("fulgur_bench_" + std::to_string(::getpid()));
  std::vector<double> hand, fulgur_us, hand_allocs, fulgur_allocs;
  for (int r = 0; r < a.reps; ++r) {  // interleaved: A B A B ...
    auto h = hand_written(a, data);
    auto f = with_fulgur(a, data, root);
    hand.push_back(h.us_per_step);
    hand_allocs.push_back(h.allocs_per_step);
    fulgur_us.push_back(f.us_per_step);
    fulgur_allocs.push_back(f.allocs_per_step);
  }
  std::filesystem::remove_all(root);
  double h = median(hand), f = median(fulgur_us);
  double ha = median(hand_allocs), fa = median(fulgur_allocs);
  std::printf(
      "{\"benchmark\": \"step_overhead_%s%s%s\", \"steps\": %lld, \"reps\": %d, "
      "\"reference_us_per_step\": %.2f, \"fulgur_us_per_step\": %.2f, \"ratio\": %.4f, "
      "\"overhead_us_per_step\": %.2f, \"reference_allocs_per_step\": %.2f, "
      "\"fulgur_allocs_per_step\": %.2f, \"extra_allocs_per_step\": %.2f}\n",
      a.model.c_str(), a.log_every_step ? "_log_every_step" : "",
      a.progress_bar ? "_progress_bar" : "", static_cast<long long>(a.steps), a.reps, h, f, f / h,
      f - h, ha, fa, fa - ha);
  return 0;
}

}  // namespace fulgur_bench::overhead
