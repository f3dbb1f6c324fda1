#include "fulgur/utilities/seed.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <mutex>

namespace fulgur {

namespace {
std::atomic<bool> forked_child{false};
}  // namespace

void detail::mark_forked_child() { forked_child = true; }

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

void save_rng_states(torch::serialize::OutputArchive& archive) {
  archive.write("cpu", get_state(at::detail::getDefaultCPUGenerator()), /*is_buffer=*/true);
  int64_t cuda_devices = cuda_usable() ? torch::cuda::device_count() : 0;
  archive.write("cuda_count", c10::IValue(cuda_devices));
  for (int64_t i = 0; i < cuda_devices; ++i) {
    auto gen = at::globalContext().defaultGenerator(
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
    archive.write("cuda" + std::to_string(i), get_state(gen), /*is_buffer=*/true);
  }
}

void load_rng_states(torch::serialize::InputArchive& archive) {
  at::Tensor cpu;
  archive.read("cpu", cpu, /*is_buffer=*/true);
  at::Generator cpu_gen = at::detail::getDefaultCPUGenerator();
  set_state(cpu_gen, cpu);
  c10::IValue count;
  if (!archive.try_read("cuda_count", count)) return;
  int64_t here = cuda_usable() ? torch::cuda::device_count() : 0;
  for (int64_t i = 0; i < std::min(count.toInt(), here); ++i) {
    at::Tensor state;
    archive.read("cuda" + std::to_string(i), state, /*is_buffer=*/true);
    auto gen = at::globalContext().defaultGenerator(
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
    set_state(gen, state);
  }
}

}  // namespace fulgur
