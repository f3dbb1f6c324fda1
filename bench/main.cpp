// fulgur's benchmarks as one program: `fulgur_bench <benchmark> [options]`.
// One program instead of one per benchmark: each translation unit pays ~9 s
// of CPU to load LibTorch's precompiled headers and each program a link, and
// the benchmarks share most of their template instantiations (the test
// command builds them all, so that they cannot rot). bench/run.sh runs them.
#include <cstdio>
#include <cstring>

#include "benchmarks.h"

namespace {

struct Benchmark {
  const char* name;
  int (*run)(int argc, char** argv);
  const char* what;
};

constexpr Benchmark kBenchmarks[] = {
    {"overhead", fulgur_bench::overhead::run,
     "per-step time and allocations of Trainer::fit against a hand-written loop"},
    {"optimizers", fulgur_bench::optimizers::run,
     "fulgur::optim's multi-tensor steps against torch::optim's"},
    {"gpu", fulgur_bench::gpu::run, "a training step on a GPU, fulgur against hand-written loops"},
    {"checkpoint", fulgur_bench::checkpoint::run,
     "checkpoint save and load against LibTorch's archives"},
    {"startup", fulgur_bench::startup::run,
     "process start to the first optimizer step (run by bench/startup.py)"},
    {"restart", fulgur_bench::restart::run,
     "a killed rank's restart to its first step (run by bench/restart.py)"},
    {"ddp", fulgur_bench::ddp::run, "data-parallel throughput, one side per run (under torchrun)"},
    {"fsdp", fulgur_bench::fsdp::run,
     "sharded data parallel, memory and throughput (run by bench/fsdp.py)"},
    {"data_workers", fulgur_bench::data_workers::run,
     "loader worker threads against LibTorch's data loader"},
    {"activations", fulgur_bench::activations::run, "activation checkpointing, memory and time"},
};

void list(std::FILE* to) {
  std::fprintf(
      to, "usage: fulgur_bench <benchmark> [options]   (each bench/<benchmark>.cpp lists them)\n");
  for (const Benchmark& b : kBenchmarks) std::fprintf(to, "  %-13s %s\n", b.name, b.what);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "fulgur_bench: name a benchmark\n");
    list(stderr);
    return 2;
  }
  if (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    list(stdout);
    return 0;
  }
  for (const Benchmark& b : kBenchmarks) {
    if (std::strcmp(argv[1], b.name) == 0) return b.run(argc - 1, argv + 1);
  }
  std::fprintf(stderr, "fulgur_bench: no benchmark named \"%s\"\n", argv[1]);
  list(stderr);
  return 2;
}
