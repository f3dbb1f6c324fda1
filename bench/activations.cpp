// Activation checkpointing, memory and time: a deep MLP of `--layers` blocks
// (Linear(w, 4w), GELU, Linear(4w, w), GELU: a transformer's MLP), SGD, one
// process, trained plain and with each block a fulgur::nn::Checkpoint. Each
// measurement runs in a child process of its own (so that its peak RSS is its
// own): after a warm-up step, with the gradients allocated, the peak RSS is
// reset (/proc/self/clear_refs) and `--steps` steps run; the activation memory
// is the peak RSS over those steps minus the RSS before them. The variants
// alternate, `--reps` times; medians. One JSON object, then a Markdown table.
//
//   build/bench/fulgur_bench activations --layers 16 --width 512 --batch 128 --steps 5 --reps 3
#include <fcntl.h>
#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "benchmarks.h"
#include "fulgur/fulgur.h"
#include "stats.h"

namespace fulgur_bench::activations {

namespace {

using fulgur_bench::Clock;
using fulgur_bench::median;
using fulgur_bench::seconds_since;

struct Args {
  int64_t layers = 16;
  int64_t width = 512;
  int64_t batch = 128;
  int64_t steps = 5;
  int reps = 3;
};

// A /proc/self/status field in kB, as MB.
double status_mb(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::stod(line.substr(std::strlen(field))) / 1024.0;
  }
  return -1;
}

// One block: a transformer's MLP.
struct BlockImpl : torch::nn::Module {
  torch::nn::Linear up{nullptr}, down{nullptr};
  explicit BlockImpl(int64_t width) {
    up = register_module("up", torch::nn::Linear(width, 4 * width));
    down = register_module("down", torch::nn::Linear(4 * width, width));
  }
  at::Tensor forward(const at::Tensor& x) {
    return torch::gelu(down(torch::gelu(up(x))));
  }
};
TORCH_MODULE(Block);

struct Measure {
  double activation_mb = 0;
  double ms_per_step = 0;
  double loss = 0;
};

Measure run(const Args& a, bool checkpointed) {
  // Freed blocks go back to the system at once: RSS follows what is live.
  ::mallopt(M_MMAP_THRESHOLD, 128 * 1024);
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int64_t i = 0; i < a.layers; ++i) {
    Block block(a.width);
    if (checkpointed) {
      model->push_back(fulgur::nn::Checkpoint(block));
    } else {
      model->push_back(block);
    }
  }
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(1e-3));
  const auto x = torch::randn({a.batch, a.width});
  const auto y = torch::randn({a.batch, a.width});
  auto step = [&] {
    for (auto& p : model->parameters()) {
      if (p.grad().defined()) p.grad().zero_();  // kept allocated: not activation memory
    }
    auto loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    optimizer.step();
    return loss.item<double>();
  };
  step();  // warm-up: gradients and LibTorch's own buffers allocated
  const double before = status_mb("VmRSS:");
  { std::ofstream("/proc/self/clear_refs") << "5"; }  // resets VmHWM to the current RSS
  Measure m;
  const auto t0 = Clock::now();
  for (int64_t s = 0; s < a.steps; ++s) m.loss = step();
  m.ms_per_step = seconds_since(t0) * 1000.0 / static_cast<double>(a.steps);
  m.activation_mb = status_mb("VmHWM:") - before;
  return m;
}

// run() in a child process; its numbers come back through a pipe.
Measure in_child(const Args& a, bool checkpointed) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    Measure m = run(a, checkpointed);
    char line[128];
    const int n = std::snprintf(line, sizeof line, "%.3f %.3f %.9g\n", m.activation_mb,
                                m.ms_per_step, m.loss);
    if (::write(fds[1], line, static_cast<size_t>(n)) != n) ::_exit(1);
    ::_exit(0);
  }
  ::close(fds[1]);
  char buf[128] = {};
  const ssize_t n = ::read(fds[0], buf, sizeof buf - 1);
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  Measure m;
  if (n <= 0 || std::sscanf(buf, "%lf %lf %lf", &m.activation_mb, &m.ms_per_step, &m.loss) != 3) {
    throw std::runtime_error("a measurement's child process failed");
  }
  return m;
}

}  // namespace

int run(int argc, char** argv) {
  Args a;
  CLI::App app{"fulgur bench: activation checkpointing, memory and step time"};
  app.add_option("--layers", a.layers)->check(CLI::PositiveNumber);
  app.add_option("--width", a.width)->check(CLI::PositiveNumber);
  app.add_option("--batch", a.batch)->check(CLI::PositiveNumber);
  app.add_option("--steps", a.steps)->check(CLI::PositiveNumber);
  app.add_option("--reps", a.reps)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  std::vector<double> mb[2], ms[2];
  double loss[2] = {0, 0};
  for (int r = 0; r < a.reps; ++r) {
    for (int k = 0; k < 2; ++k) {
      const bool checkpointed = (k + r) % 2 == 1;  // alternate which goes first
      const Measure m = in_child(a, checkpointed);
      mb[checkpointed].push_back(m.activation_mb);
      ms[checkpointed].push_back(m.ms_per_step);
      loss[checkpointed] = m.loss;
    }
  }
  const double plain_mb = median(mb[0]), ckpt_mb = median(mb[1]);
  const double plain_ms = median(ms[0]), ckpt_ms = median(ms[1]);
  std::printf(
      "{\"layers\": %lld, \"width\": %lld, \"batch\": %lld, \"threads\": %d, "
      "\"plain_activation_mb\": %.1f, \"checkpointed_activation_mb\": %.1f, "
      "\"memory_ratio\": %.3f, \"plain_ms_per_step\": %.1f, \"checkpointed_ms_per_step\": %.1f, "
      "\"time_ratio\": %.3f, \"same_loss\": %s}\n",
      static_cast<long long>(a.layers), static_cast<long long>(a.width),
      static_cast<long long>(a.batch), at::get_num_threads(), plain_mb, ckpt_mb,
      ckpt_mb / plain_mb, plain_ms, ckpt_ms, ckpt_ms / plain_ms,
      loss[0] == loss[1] ? "true" : "false");
  std::printf("\n| variant | activation MB (peak RSS over the steps − RSS before) | ms per step |\n");
  std::printf("|---|---|---|\n");
  std::printf("| plain | %.1f | %.1f |\n", plain_mb, plain_ms);
  std::printf("| each block a `fulgur::nn::Checkpoint` | %.1f (%.2fx) | %.1f (%.2fx) |\n", ckpt_mb,
              ckpt_mb / plain_mb, ckpt_ms, ckpt_ms / plain_ms);
  return 0;
}

}  // namespace fulgur_bench::activations
