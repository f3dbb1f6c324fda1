// Restart: the time from a rank's death to the first optimizer step after
// fulgur's launcher started the ranks again (Trainer max_restarts=1), with
// a checkpoint every 4 steps. Two ranks (`ddp`, the subprocess-script
// launcher); rank 1 is SIGKILLed before step --kill-step of the first
// attempt. The state holds --state-mb megabytes of parameters (and as much
// SGD momentum) besides a small MLP, to show what the checkpoint load adds.
//
// Prints one JSON line with, in CLOCK_REALTIME nanoseconds: the kill, the
// restarted rank 0's process start (from /proc), the end of its checkpoint
// restore (on_fit_start) and its first optimizer step; bench/restart.py
// turns them into durations.
//
//   restart --state-mb 256 --root /tmp/fulgur_bench_restart
#include <torch/torch.h>

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <sstream>
#include <string>

#include "benchmarks.h"
#include "fulgur/fulgur.h"
#include "stats.h"

namespace fulgur_bench::restart {

namespace {

// When this process started, in CLOCK_REALTIME nanoseconds.
long long process_start_ns() {
  std::ifstream stat("/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  std::istringstream fields(text.substr(text.rfind(')') + 2));
  std::string field;
  unsigned long long start_ticks = 0;
  for (int i = 3; fields >> field; ++i) {
    if (i == 22) {
      start_ticks = std::stoull(field);
      break;
    }
  }
  timespec boot{}, real{};
  clock_gettime(CLOCK_BOOTTIME, &boot);
  clock_gettime(CLOCK_REALTIME, &real);
  const long long boot_ns = static_cast<long long>(boot.tv_sec) * 1000000000LL + boot.tv_nsec;
  const long long real_ns = static_cast<long long>(real.tv_sec) * 1000000000LL + real.tv_nsec;
  const long long tick_ns = 1000000000LL / ::sysconf(_SC_CLK_TCK);
  return real_ns - boot_ns + static_cast<long long>(start_ticks) * tick_ns;
}

void stamp(const char* what, long long ns) {
  std::printf("{\"restart_stamp\": \"%s\", \"ns\": %lld}\n", what, ns);
  std::fflush(stdout);
}

struct Model : fulgur::Module {
  torch::nn::Sequential net{nullptr};
  at::Tensor state;
  int64_t kill_step;
  Model(int64_t state_mb, int64_t kill) : kill_step(kill) {
    net =
        register_module("net", torch::nn::Sequential(torch::nn::Linear(784, 256), torch::nn::ReLU(),
                                                     torch::nn::Linear(256, 10)));
    state = register_parameter("state", torch::zeros({std::max<int64_t>(state_mb, 1) << 18}));
  }
  int attempt() { return trainer().strategy().cluster_environment().restart_count(); }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    if (trainer().strategy().global_rank() == 1 && attempt() == 0 &&
        trainer().global_step() == kill_step) {
      stamp("kill", now_ns());
      std::raise(SIGKILL);
    }
    auto& [x, y] = batch.pair();
    // The big parameter takes part (a gradient, momentum) at little cost.
    return torch::nn::functional::cross_entropy(net->forward(x), y) + state[0] * 0.0;
  }
  void on_fit_start() override {
    if (attempt() > 0 && trainer().strategy().is_global_zero()) {
      stamp("started", process_start_ns());
      stamp("restored", now_ns());
    }
  }
  bool reported = false;
  void on_train_batch_end(const at::Tensor&, const fulgur::Batch&, int64_t) override {
    if (attempt() > 0 && !reported && trainer().strategy().is_global_zero()) {
      reported = true;
      stamp("first_step", now_ns());
    }
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(parameters(),
                                                torch::optim::SGDOptions(0.01).momentum(0.9))};
  }
};

}  // namespace

int run(int argc, char** argv) {
  int64_t state_mb = 1, kill_step = 10;
  std::string root = "/tmp/fulgur_bench_restart";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--state-mb") {
      state_mb = std::stoll(value);
    } else if (flag == "--kill-step") {
      kill_step = std::stoll(value);
    } else if (flag == "--root") {
      root = value;
    } else {
      std::fprintf(stderr, "restart: unknown flag %s (--state-mb, --kill-step, --root)\n",
                   flag.c_str());
      return 2;
    }
  }
  torch::manual_seed(0);
  auto x = torch::randn({2048, 784});
  auto y = torch::randint(0, 10, {2048});
  auto data =
      fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(x, y), {.batch_size = 64});
  Model model(state_mb, kill_step);
  fulgur::Trainer trainer({.strategy = "ddp",
                           .devices = 2,
                           .max_steps = kill_step + 4,
                           .default_root_dir = root,
                           .enable_progress_bar = false,
                           .logger = false,
                           .max_restarts = 1,
                           .every_n_train_steps = 4});
  trainer.fit(model, data);
  return 0;
}

}  // namespace fulgur_bench::restart
