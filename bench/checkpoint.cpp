// Checkpoint speed: a training state (parameters + SGD momentum, half each)
// of --mb megabytes saved and loaded through fulgur's TorchCheckpointIO (the
// state the Trainer hands it, written as a LibTorch archive to a temporary
// file, fsync'ed, renamed into place) against LibTorch alone doing the
// same: an archive of the same layout saved
// with OutputArchive::save_to (as torch::save does), with and without an
// fsync (the same durability as fulgur's), and loaded with
// InputArchive::load_from into the same module and optimizer.
// Interleaved over --reps, after --warmup repetitions whose times are
// dropped (on a virtual machine the first gigabytes a process touches cost
// a fault in the host each: the first loads took 2-3 s for 1 GB here,
// later ones 0.11-0.19 s); medians in MB/s. The loads are timed twice:
// between the saves of each repetition, and then alone, back to back; their
// ratios compare the loads made in the same position of a pair
// (crossover_ratio).
// Every timed operation starts after a sync(), so that no side pays for the
// write-back of another's unflushed data. Loads read from the page cache (the file was just
// written), so they measure verification and deserialisation, not disk.
//
//   checkpoint --mb 100 --reps 5 --warmup 2 --dir /tmp
#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "benchmarks.h"
#include "fulgur/fulgur.h"
#include "stats.h"

namespace fulgur_bench::checkpoint {

namespace {

using fulgur_bench::median;
using fulgur_bench::seconds_since;

// Parameters of 4 MiB each adding up to half the state.
struct State : torch::nn::Module {
  std::vector<at::Tensor> params;
  explicit State(int64_t param_bytes) {
    const int64_t per = 1 << 20;  // floats per tensor: 4 MiB
    const int64_t n = std::max<int64_t>(1, param_bytes / (per * 4));
    for (int64_t i = 0; i < n; ++i) {
      params.push_back(register_parameter("p" + std::to_string(i), torch::randn({per})));
    }
  }
};

// fulgur ÷ LibTorch of two series of loads made in pairs whose order
// alternates (fulgur first in the pairs where (i + warmup) is even): each
// side compared with the other in the same position of the pair, and the
// two positions' ratios averaged geometrically. The first load of a pair
// gets memory untouched lately, so the median of a mix of both positions
// jumps between runs (0.85-1.04 at 100 MB).
double crossover_ratio(const std::vector<double>& fulgur, const std::vector<double>& libtorch,
                       int warmup) {
  std::vector<double> f_first, f_second, r_first, r_second;
  for (size_t i = 0; i < fulgur.size() && i < libtorch.size(); ++i) {
    const bool fulgur_first = (i + static_cast<size_t>(warmup)) % 2 == 0;
    (fulgur_first ? f_first : f_second).push_back(fulgur[i]);
    (fulgur_first ? r_second : r_first).push_back(libtorch[i]);
  }
  if (f_first.empty() || f_second.empty()) return median(fulgur) / median(libtorch);
  return std::sqrt(median(f_first) / median(r_first) * (median(f_second) / median(r_second)));
}

void fsync_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

}  // namespace

int run(int argc, char** argv) {
  int64_t mb = 100;
  int reps = 5;
  int warmup = 2;
  std::string dir = std::filesystem::temp_directory_path().string();
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--mb")
      mb = std::stoll(argv[i + 1]);
    else if (flag == "--reps")
      reps = std::stoi(argv[i + 1]);
    else if (flag == "--warmup")
      warmup = std::stoi(argv[i + 1]);
    else if (flag == "--dir")
      dir = argv[i + 1];
    else {
      std::fprintf(stderr,
                   "checkpoint: unknown flag %s (--mb N, --reps N, --warmup N, --dir DIR)\n",
                   flag.c_str());
      return 2;
    }
  }
  torch::set_num_threads(1);
  torch::manual_seed(0);
  auto state = std::make_shared<State>(mb * 1000 * 1000 / 2);
  torch::optim::SGD sgd(state->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  for (auto& p : state->parameters()) p.mutable_grad() = torch::ones_like(p);
  sgd.step();  // creates the momentum buffers
  std::vector<at::Tensor> tensors;
  for (auto& p : state->parameters()) tensors.push_back(p.detach());
  for (auto& [key, s] : sgd.state()) {
    tensors.push_back(static_cast<torch::optim::SGDParamState&>(*s).momentum_buffer());
  }
  double bytes = 0;
  for (auto& t : tensors) bytes += static_cast<double>(t.numel() * t.element_size());
  const double megabytes = bytes / 1e6;

  const std::string base =
      (std::filesystem::path(dir) / ("fulgur_bench_ckpt_" + std::to_string(::getpid()))).string();
  const std::string f_path = base + ".fulgur.ckpt", r_path = base + ".torch.pt",
                    s_path = base + ".torch_fsync.pt";
  fulgur::TorchCheckpointIO io;
  std::vector<double> f_save, r_save, s_save, f_load, r_load;
  // The training stall of a save: how long save_checkpoint keeps the
  // caller, synchronous (the whole save) and asynchronous (the snapshot;
  // the write goes on in the background and is waited for untimed).
  const std::string a_path = base + ".async.ckpt";
  fulgur::AsyncCheckpointIO async_io;
  std::vector<double> sync_stall, async_stall;
  // The state as the Trainer's checkpoint holds it (fulgur's saves), and as
  // LibTorch's own archive of the same layout (LibTorch's saves).
  auto state_dict = [&] {
    fulgur::StateDict root;
    root.set_section("state_dict", fulgur::module_state_dict(*state));
    root.set_section("optimizer_states", fulgur::optimizer_state_dict(sgd));
    return root;
  };
  auto archive = [&] {
    torch::serialize::OutputArchive root, module, optimizer;
    state->save(module);
    sgd.save(optimizer);
    root.write("state_dict", module);
    root.write("optimizer_states", optimizer);
    return root;
  };
  // Seconds `save` takes with that state (or archive), from a clean page
  // cache.
  auto time_save = [&](const std::function<void(fulgur::StateDict&)>& save) {
    ::sync();
    auto t = Clock::now();
    auto root = state_dict();
    save(root);
    return seconds_since(t);
  };
  auto time_torch_save = [&](const std::function<void(torch::serialize::OutputArchive&)>& save) {
    ::sync();
    auto t = Clock::now();
    auto root = archive();
    save(root);
    return seconds_since(t);
  };
  // MB/s of a load, the state restored from it.
  auto time_load = [&] {
    ::sync();
    auto t = Clock::now();
    const fulgur::StateDict root = io.load_checkpoint(f_path);
    fulgur::load_module_state_dict(*state, root.section_at("state_dict"));
    fulgur::load_optimizer_state_dict(sgd, root.section_at("optimizer_states"));
    return megabytes / seconds_since(t);
  };
  auto time_torch_load = [&] {
    ::sync();
    auto t = Clock::now();
    torch::serialize::InputArchive root, module, optimizer;
    root.load_from(r_path);
    root.read("state_dict", module);
    root.read("optimizer_states", optimizer);
    state->load(module);
    sgd.load(optimizer);
    return megabytes / seconds_since(t);
  };
  {
    // The first save sizes the snapshot buffer; the timed ones reuse it.
    auto root = state_dict();
    async_io.save_checkpoint(root, a_path);
    async_io.wait_until_durable();
  }
  // One load of each checkpoint, in an order alternating with `r`.
  auto load_pair = [&](int r, std::vector<double>& fulgur, std::vector<double>& libtorch) {
    auto fulgur_load = [&] {
      fulgur.push_back(time_load());
    };
    auto libtorch_load = [&] {
      libtorch.push_back(time_torch_load());
    };
    if (r % 2 == 0) {
      fulgur_load();
      libtorch_load();
    } else {
      libtorch_load();
      fulgur_load();
    }
  };
  std::vector<double> f_load_alone, r_load_alone;
  for (int r = 0; r < warmup + reps; ++r) {
    const double sync_seconds = time_save([&](auto& root) { io.save_checkpoint(root, f_path); });
    f_save.push_back(megabytes / sync_seconds);
    sync_stall.push_back(sync_seconds);
    async_stall.push_back(time_save([&](auto& root) { async_io.save_checkpoint(root, a_path); }));
    async_io.wait_until_durable();
    r_save.push_back(megabytes / time_torch_save([&](auto& root) { root.save_to(r_path); }));
    s_save.push_back(megabytes / time_torch_save([&](auto& root) {
                       root.save_to(s_path);
                       fsync_file(s_path);
                     }));
    // The loads, in alternating order: the first load after the saves
    // gets memory the process has not touched lately (on a virtual machine,
    // fresh pages cost a fault in the host), the second the pages the first
    // just freed.
    load_pair(r, f_load, r_load);
  }
  // Loads alone, back to back (after the same warm-up): without the saves'
  // churn of memory and page cache between them, the loads' own cost.
  for (int r = 0; r < warmup + reps; ++r) load_pair(r, f_load_alone, r_load_alone);
  for (auto* timings : {&f_save, &r_save, &s_save, &f_load, &r_load, &f_load_alone,
                        &r_load_alone, &sync_stall, &async_stall}) {
    timings->erase(timings->begin(), timings->begin() + warmup);
  }
  for (const auto& p : {f_path, r_path, s_path, a_path}) std::filesystem::remove(p);
  std::printf(
      "{\"benchmark\": \"checkpoint_%lldMB\", \"megabytes\": %.1f, \"reps\": %d, \"warmup\": %d, "
      "\"fulgur_save_mb_s\": %.1f, \"torch_save_mb_s\": %.1f, \"torch_save_fsync_mb_s\": %.1f, "
      "\"fulgur_load_mb_s\": %.1f, \"torch_load_mb_s\": %.1f, "
      "\"save_ratio_vs_torch_save_fsync\": %.3f, \"load_ratio\": %.3f, "
      "\"fulgur_load_alone_mb_s\": %.1f, \"torch_load_alone_mb_s\": %.1f, "
      "\"load_alone_ratio\": %.3f, "
      "\"sync_stall_ms\": %.1f, \"async_stall_ms\": %.1f, \"async_stall_ratio\": %.3f, "
      "\"async_buffer_over_state\": %.3f}\n",
      static_cast<long long>(mb), megabytes, reps, warmup, median(f_save), median(r_save),
      median(s_save), median(f_load), median(r_load), median(f_save) / median(s_save),
      crossover_ratio(f_load, r_load, warmup), median(f_load_alone), median(r_load_alone),
      crossover_ratio(f_load_alone, r_load_alone, warmup), 1e3 * median(sync_stall),
      1e3 * median(async_stall),
      median(async_stall) / median(sync_stall),
      static_cast<double>(async_io.snapshot_bytes()) / bytes);
  return 0;
}

}  // namespace fulgur_bench::checkpoint
