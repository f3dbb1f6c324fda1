// The program the `manual` strategy tests launch. Its Module owns its
// parallelism: a sharded parameter (rank k owns rows [k*R, (k+1)*R)) built in
// configure_model() once the process group exists, and a small replicated
// layer deliberately left unsynchronised, so a test can see that the
// strategy neither wraps the module nor averages its gradients. It records
// every device move the Trainer asks of it. A callback runs a collective.
//
//   fulgur_manual_worker --devices 2 --steps 6 --out dir [--ckpt-root dir] [--resume last]
#include <CLI/CLI.hpp>
#include <sys/resource.h>
#include <torch/torch.h>

#include <csignal>
#include <cstdio>
#include <iostream>

#include "fulgur/fulgur.h"

namespace {

struct Args {
  std::string devices = "2";
  int64_t steps = 6;
  int64_t rows_per_rank = 5;
  std::string out;
  std::string ckpt_root;
  std::string resume;
  double timeout_s = 60;
  // "R:S:SIG": rank R raises signal SIG before global step S of the first
  // attempt (a scheduler's preemption signal, delivered to one rank).
  std::string raise_at;
  // "R:BYTES": rank R may write no file larger than BYTES (RLIMIT_FSIZE, set
  // once its group exists): its checkpoint shard fails with "File too large".
  std::string file_size_limit;
};

struct ShardedModel : fulgur::Module {
  int64_t rows_per_rank;
  std::string raise_at;
  std::string file_size_limit;
  torch::nn::Linear fc{nullptr};
  at::Tensor table;  // this rank's rows, created in configure_model()
  int to_calls = 0;

  explicit ShardedModel(int64_t rows) : rows_per_rank(rows) {
    fc = register_module("fc", torch::nn::Linear(4, 1));
  }

  // Every device move the Trainer could ask for.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking) override {
    ++to_calls;
    fulgur::Module::to(device, dtype, non_blocking);
  }
  void to(torch::Dtype dtype, bool non_blocking) override {
    ++to_calls;
    fulgur::Module::to(dtype, non_blocking);
  }
  void to(torch::Device device, bool non_blocking) override {
    ++to_calls;
    fulgur::Module::to(device, non_blocking);
  }

  void configure_model() override {
    if (table.defined()) return;
    // The process group exists: the shard's rows depend on the rank.
    auto& strategy = trainer().strategy();
    const int rank = strategy.global_rank();
    auto init = torch::arange(rows_per_rank, torch::kFloat).unsqueeze(1) * 0.01 + rank;
    table = register_parameter("table", init.repeat({1, 4}));
    // A collective from the hook, proving the group is usable here.
    auto ranks = strategy.all_reduce(torch::ones({1}), fulgur::ReduceOp::kSum);
    std::cout << "RESULT rank" << rank << "_configure_model_world=" << ranks.item<float>()
              << std::endl;
    int limited = -1;
    long long bytes = 0;
    if (std::sscanf(file_size_limit.c_str(), "%d:%lld", &limited, &bytes) == 2 && limited == rank) {
      std::signal(SIGXFSZ, SIG_IGN);  // the write fails with EFBIG instead
      const rlimit limit{static_cast<rlim_t>(bytes), static_cast<rlim_t>(bytes)};
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) std::perror("setrlimit");
    }
  }

  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    int r = -1, sig = 0;
    long long step = -1;
    if (!raise_at.empty() && std::sscanf(raise_at.c_str(), "%d:%lld:%d", &r, &step, &sig) == 3 &&
        r == trainer().strategy().global_rank() && step == trainer().global_step() &&
        trainer().strategy().cluster_environment().restart_count() == 0) {
      std::cout << "rank " << r << " receives signal " << sig << " before step " << step
                << std::endl;
      std::raise(sig);
    }
    auto& [x, y] = batch.pair();
    // Each rank's rows enter the loss through its own shard only.
    auto shard_term = table.sum(0).unsqueeze(0) * 0.001;
    auto pred = fc(x + shard_term);
    return torch::mse_loss(pred, y);
  }

  fulgur::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(parameters(), 0.1)};
  }
};

// A collective from a callback: every rank contributes rank + 1.
struct RankSumCallback : fulgur::Callback {
  std::string state_key() const override { return "RankSumCallback"; }
  void on_train_epoch_end(fulgur::Trainer& trainer, fulgur::Module&) override {
    auto& s = trainer.strategy();
    auto sum = s.all_reduce(torch::full({1}, static_cast<float>(s.global_rank() + 1)),
                            fulgur::ReduceOp::kSum);
    std::cout << "RESULT rank" << s.global_rank() << "_callback_sum=" << sum.item<float>()
              << std::endl;
  }
};

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"fulgur manual-strategy test worker"};
  app.add_option("--devices", a.devices);
  app.add_option("--steps", a.steps);
  app.add_option("--rows-per-rank", a.rows_per_rank);
  app.add_option("--out", a.out);
  app.add_option("--ckpt-root", a.ckpt_root);
  app.add_option("--resume", a.resume);
  app.add_option("--timeout", a.timeout_s);
  app.add_option("--raise", a.raise_at);
  app.add_option("--file-size-limit", a.file_size_limit);
  CLI11_PARSE(app, argc, argv);
  try {
    torch::manual_seed(3);
    ShardedModel model(a.rows_per_rank);
    model.raise_at = a.raise_at;
    model.file_size_limit = a.file_size_limit;
    // 64 samples whose values depend only on their index.
    auto idx = torch::arange(64, torch::kFloat).unsqueeze(1);
    auto x = torch::sin(idx * torch::arange(1, 5, torch::kFloat) * 0.3);
    auto y = x.sum(1, true) * 0.5 + 0.1;
    auto loader =
        fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(x, y), {.batch_size = 4});
    fulgur::ManualOptions manual;
    manual.process_group_timeout =
        std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
    fulgur::TrainerOptions options;
    options.accelerator = "cpu";
    options.strategy = std::make_shared<fulgur::ManualStrategy>(manual);
    options.devices = fulgur::DevicesSpec(a.devices);
    options.max_steps = a.steps;
    options.enable_progress_bar = false;
    options.logger = false;
    options.enable_checkpointing = !a.ckpt_root.empty();
    options.default_root_dir = a.ckpt_root.empty() ? "." : a.ckpt_root;
    options.callbacks = {std::make_shared<RankSumCallback>()};
    fulgur::Trainer trainer(options);
    trainer.fit(model, loader, nullptr, fulgur::FitOptions{.ckpt_path = a.resume});
    const int rank = trainer.strategy().global_rank();
    std::cout << "RESULT rank" << rank << "_to_calls=" << model.to_calls << "\n"
              << "RESULT rank" << rank << "_fc_sum=" << model.fc->weight.sum().item<double>()
              << "\n"
              << "RESULT rank" << rank << "_global_step=" << trainer.global_step() << std::endl;
    if (!a.out.empty()) {
      std::vector<at::Tensor> params;
      for (auto& p : model.parameters()) params.push_back(p.detach().clone());
      torch::save(params, a.out + "/rank-" + std::to_string(rank) + ".pt");
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ERROR " << e.what() << std::endl;
    return 1;
  }
}
