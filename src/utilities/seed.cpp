#include "fulgur/utilities/seed.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <mutex>

namespace fulgur {

namespace {
std::atomic<bool> forked_child{false};
std::atomic<bool> ran_autograd{false};
}  // namespace

void detail::mark_forked_child() { forked_child = true; }

void detail::note_autograd_used() { ran_autograd.store(true, std::memory_order_relaxed); }

bool detail::autograd_used() { return ran_autograd.load(std::memory_order_relaxed); }

bool cuda_usable() { return !forked_child && torch::cuda::is_available(); }

void seed_everything(uint64_t seed) {
  if (cuda_usable()) {
    torch::manual_seed(seed);  // the CPU generator and every CUDA one
  } else {
    // torch::manual_seed would also seed the CUDA generators LibTorch
    // counts, which fails in a forked child of a process that used CUDA.
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_current_seed(seed);
  }
  std::srand(static_cast<unsigned>(seed));
}

namespace {
at::Tensor get_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
void set_state(at::Generator& gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}
}  // namespace

StateDict rng_state_dict() {
  StateDict state;
  state.set_buffer("cpu", get_state(at::detail::getDefaultCPUGenerator()));
  int64_t cuda_devices = cuda_usable() ? torch::cuda::device_count() : 0;
  state.set("cuda_count", cuda_devices);
  for (int64_t i = 0; i < cuda_devices; ++i) {
    auto gen = at::globalContext().defaultGenerator(
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
    state.set_buffer("cuda" + std::to_string(i), get_state(gen));
  }
  return state;
}

void load_rng_state_dict(const StateDict& state) {
  const at::Tensor cpu = state.tensor("cpu");
  at::Generator cpu_gen = at::detail::getDefaultCPUGenerator();
  set_state(cpu_gen, cpu);
  if (!state.contains("cuda_count")) return;
  const int64_t count = state.integer("cuda_count");
  int64_t here = cuda_usable() ? torch::cuda::device_count() : 0;
  for (int64_t i = 0; i < std::min(count, here); ++i) {
    const at::Tensor saved = state.tensor("cuda" + std::to_string(i));
    auto gen = at::globalContext().defaultGenerator(
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
    set_state(gen, saved);
  }
}

}  // namespace fulgur
