// One optimizer step of a model with many parameter tensors: fulgur::optim's
// multi-tensor SGD (momentum) and Adam against torch::optim's, on the same
// parameters and gradients, timed interleaved (A B A B ...) in one process.
// Prints one JSON object per optimizer: µs per step (medians over the
// repetitions; the order alternates: A B, B A, ...), their ratio, the ATen operators one step calls
// (top-level: what the optimizer launches itself; all: with the per-tensor operators a CPU
// multi-tensor operator runs inside), and whether the two sides' parameters ended bit-identical.
//
//   optimizers --tensors 50 --width 64 --steps 500 --reps 7 [--device cuda]
// On a GPU (--device cuda) the ATen operator counts are the launches the
// step makes from the host (a multi-tensor operator launches one kernel per
// chunk of tensors), and the parameters are equal within float rounding.
#include <ATen/record_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "benchmarks.h"
#include "fulgur/fulgur.h"
#include "stats.h"

namespace fulgur_bench::optimizers {

namespace {

using TensorVector = std::vector<at::Tensor>;

// ---- Counting ATen operator calls (a RecordFunction callback).
int64_t g_top_level_ops = 0;
int64_t g_all_ops = 0;
thread_local int g_depth = 0;

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction&) {
  ++g_all_ops;
  if (g_depth++ == 0) ++g_top_level_ops;
  return nullptr;
}
void on_op_end(const at::RecordFunction&, at::ObserverContext*) { --g_depth; }

struct OpCount {
  int64_t top_level = 0;
  int64_t all = 0;
};

OpCount count_ops(const std::function<void()>& fn) {
  g_top_level_ops = g_all_ops = 0;
  auto handle = at::addGlobalCallback(
      at::RecordFunctionCallback(&on_op_start, &on_op_end).scopes({at::RecordScope::FUNCTION}));
  fn();
  at::removeCallback(handle);
  return {g_top_level_ops, g_all_ops};
}

/// `tensors` parameters: weights [width, width] and biases [width] of
/// tensors / 2 linear layers, with fixed gradients (an optimizer does not
/// change them; every step sees the same).
TensorVector make_parameters(int tensors, int64_t width, c10::Device device) {
  torch::manual_seed(0);
  TensorVector params;
  for (int i = 0; i < tensors; ++i) {
    auto p = (i % 2 == 0 ? torch::randn({width, width}) : torch::randn({width}))
                 .to(device)
                 .requires_grad_();
    p.mutable_grad() = torch::randn(p.sizes()).to(device);
    params.push_back(p);
  }
  return params;
}

struct Side {
  TensorVector params;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::vector<double> us_per_step;
};

double time_steps(torch::optim::Optimizer& optimizer, int steps, c10::Device device) {
  sync_device(device);
  auto t0 = fulgur_bench::Clock::now();
  for (int s = 0; s < steps; ++s) optimizer.step();
  sync_device(device);
  return fulgur_bench::seconds_since(t0) * 1e6 / steps;
}

template <class Fulgur, class Torch, class Options>
void compare(const char* name, const Options& options, int tensors, int64_t width, int steps,
             int reps, c10::Device device) {
  Side ours{make_parameters(tensors, width, device), nullptr, {}};
  Side theirs{make_parameters(tensors, width, device), nullptr, {}};
  ours.optimizer = std::make_unique<Fulgur>(ours.params, options);
  theirs.optimizer = std::make_unique<Torch>(theirs.params, options);
  // Warm-up: creates the state (a step of its own), then a few steps.
  for (int s = 0; s < 5; ++s) {
    ours.optimizer->step();
    theirs.optimizer->step();
  }
  const OpCount ours_ops = count_ops([&] { ours.optimizer->step(); });
  const OpCount theirs_ops = count_ops([&] { theirs.optimizer->step(); });
  // A B, then B A: neither side always runs first.
  for (int r = 0; r < reps; ++r) {
    Side& first = r % 2 == 0 ? ours : theirs;
    Side& second = r % 2 == 0 ? theirs : ours;
    first.us_per_step.push_back(time_steps(*first.optimizer, steps, device));
    second.us_per_step.push_back(time_steps(*second.optimizer, steps, device));
  }
  bool identical = true;
  double max_diff = 0;
  for (size_t i = 0; i < ours.params.size(); ++i) {
    identical = identical && torch::equal(ours.params[i], theirs.params[i]);
    max_diff = std::max(max_diff, (ours.params[i] - theirs.params[i]).abs().max().item<double>());
  }
  int64_t numel = 0;
  for (const auto& p : ours.params) numel += p.numel();
  const double f = fulgur_bench::median(ours.us_per_step);
  const double t = fulgur_bench::median(theirs.us_per_step);
  std::printf(
      "{\"benchmark\": \"optimizer_step_%s\", \"tensors\": %d, \"parameters\": %lld, "
      "\"steps\": %d, \"reps\": %d, \"torch_us_per_step\": %.2f, \"fulgur_us_per_step\": %.2f, "
      "\"fulgur_over_torch\": %.3f, \"torch_ops_per_step\": %lld, \"fulgur_ops_per_step\": %lld, "
      "\"torch_ops_per_step_all\": %lld, \"fulgur_ops_per_step_all\": %lld, "
      "\"bit_identical\": %s, \"max_abs_diff\": %.3g, \"device\": \"%s\"}\n",
      name, tensors, static_cast<long long>(numel), steps, reps, t, f, f / t,
      static_cast<long long>(theirs_ops.top_level), static_cast<long long>(ours_ops.top_level),
      static_cast<long long>(theirs_ops.all), static_cast<long long>(ours_ops.all),
      identical ? "true" : "false", max_diff, device.str().c_str());
  std::fflush(stdout);
}

}  // namespace

int run(int argc, char** argv) {
  int tensors = 50;
  int64_t width = 64;
  int steps = 500;
  int reps = 7;
  std::string device_name = "cpu";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--tensors")
      tensors = std::stoi(argv[i + 1]);
    else if (flag == "--width")
      width = std::stoll(argv[i + 1]);
    else if (flag == "--steps")
      steps = std::stoi(argv[i + 1]);
    else if (flag == "--reps")
      reps = std::stoi(argv[i + 1]);
    else if (flag == "--device")
      device_name = argv[i + 1];
    else {
      std::fprintf(stderr,
                   "optimizers: unknown flag %s (--tensors N, --width N, --steps N, --reps N, "
                   "--device cpu|cuda)\n",
                   flag.c_str());
      return 2;
    }
  }
  if (device_name != "cpu" && device_name != "cuda") {
    std::fprintf(stderr, "optimizers: --device %s: pass cpu or cuda\n", device_name.c_str());
    return 2;
  }
  const c10::Device device(device_name == "cuda" ? c10::kCUDA : c10::kCPU);
  torch::set_num_threads(1);
  compare<fulgur::optim::SGD, torch::optim::SGD>(
      "sgd_momentum", torch::optim::SGDOptions(0.01).momentum(0.9), tensors, width, steps, reps,
      device);
  compare<fulgur::optim::Adam, torch::optim::Adam>("adam", torch::optim::AdamOptions(1e-3), tensors,
                                                   width, steps, reps, device);
  return 0;
}

}  // namespace fulgur_bench::optimizers
