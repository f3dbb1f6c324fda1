// A recommendation model whose embedding tables are sharded across ranks by
// the Module itself, trained with strategy = "manual".
//
//   sharded_embeddings --devices 2            # 2 ranks, each owns half of every table
//   sharded_embeddings --devices 1            # the same model, unsharded
//   sharded_embeddings --help                 # every option
//
// The command line is fulgur::CLI's: every Trainer flag (--trainer.max_epochs,
// or --max_epochs where the name is unique), the model's (--rows, --dim,
// --lr) and the data's (--active_ids, --samples, --batch) options, YAML
// config files, and a checkpoint's own config when resuming (--ckpt_path).
//
// Model: two sparse features (user id, item id), each with a table of
// --rows x --dim (200k x 64 by default), row-sharded: rank k owns rows
// [k*R, (k+1)*R) of both tables, R = ceil(rows / world). A dense MLP on the
// two concatenated embeddings is replicated and kept in sync with fulgur's
// GradientReducer, driven by the Module for that sub-module only.
//
// Lookup, all-gather based: every rank gathers the ids of every rank's batch
// (world x B ids), looks up the rows it owns (zeros elsewhere), and one
// differentiable all-reduce sums the partial embeddings, so every rank holds
// every rank's embeddings and keeps its own slice. In backward that
// all-reduce sums the gradients of every rank, so each owner receives the
// gradient of its rows from every rank's loss. This costs world x B x dim
// floats per feature per step, against B x dim for an all-to-all; it needs
// only all-gather and all-reduce, which every c10d backend has, and for a few
// ranks it is the simpler choice. The Module normalises its own gradients:
// the loss is each rank's mean, the reducer averages the dense gradients,
// and the table gradients (summed over ranks by the all-reduce) are divided
// by the world size, which makes 2 ranks x batch B train exactly like 1 x 2B.
//
// The data are synthetic interactions generated from the sample index.
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>

#include "fulgur/fulgur.h"

namespace {

// The model's, the data's and the program's own options (the Trainer's are
// fulgur::CLI's).
struct Args {
  int64_t rows = 200000;
  int64_t dim = 64;
  double lr = 1.0;
  int64_t active_ids = 1000;
  int64_t samples = 32768;
  int64_t batch = 256;
  std::string dump;
  double min_improvement = 0.0;
};

// Sample i: a user and an item among `active` ids spread over the table, and
// a click label that depends on both through their groups.
std::pair<at::Tensor, at::Tensor> make_data(const Args& a) {
  auto i = torch::arange(a.samples, torch::kLong);
  const int64_t stride = std::max<int64_t>(1, a.rows / a.active_ids);
  auto user = ((i * 7919 + 11) % a.active_ids) * stride;
  auto item = ((i * 104729 + 17) % a.active_ids) * stride;
  auto label = (((user / stride) % 7 + (item / stride) % 5) % 3 == 0).to(torch::kFloat);
  return {torch::stack({user, item, i}, 1), label};
}

class ShardedRecommender : public fulgur::Module {
 public:
  explicit ShardedRecommender(const Args& a) : fulgur::Module("ShardedRecommender"), a_(a) {
    mlp_ =
        register_module("mlp", torch::nn::Sequential(torch::nn::Linear(2 * a.dim, 64),
                                                     torch::nn::ReLU(), torch::nn::Linear(64, 1)));
    // The dense layers start from a fixed seed on every rank.
    torch::NoGradGuard no_grad;
    for (auto& p : mlp_->parameters()) {
      p.copy_(torch::sin(torch::arange(p.numel(), torch::kFloat) * 0.37 + 0.2).reshape(p.sizes()) *
              0.1);
    }
  }

  // Runs once the process group exists, before a checkpoint is restored:
  // builds this rank's shards and the reducer of the replicated part.
  void configure_model() override {
    if (user_shard_.defined()) return;
    group_ = process_group();  // a clear error under a strategy without one
    world_ = trainer().strategy().world_size();
    rank_ = trainer().strategy().global_rank();
    rows_per_rank_ = (a_.rows + world_ - 1) / world_;
    row_begin_ = rank_ * rows_per_rank_;
    // Initial rows are a function of the global row index, so a shard holds
    // exactly the rows of the unsharded table.
    auto rows = torch::arange(row_begin_, row_begin_ + rows_per_rank_, torch::kFloat).unsqueeze(1);
    auto cols = torch::arange(a_.dim, torch::kFloat).unsqueeze(0);
    user_shard_ =
        register_parameter("user_table_shard", torch::sin(rows * 0.013 + cols * 0.7) * 0.1);
    item_shard_ =
        register_parameter("item_table_shard", torch::cos(rows * 0.017 + cols * 0.3) * 0.1);
    std::vector<std::pair<std::string, at::Tensor>> dense;
    for (auto& p : mlp_->named_parameters()) dense.emplace_back("mlp." + p.key(), p.value());
    reducer_ = std::make_unique<fulgur::GradientReducer>(std::move(dense), group_);
  }

  at::Tensor forward(const at::Tensor& ids) {
    auto user = lookup(user_shard_, ids.select(1, 0));
    auto item = lookup(item_shard_, ids.select(1, 1));
    return mlp_->forward(torch::cat({user, item}, 1)).squeeze(1);
  }

  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    auto& [ids, label] = batch.pair();
    auto logits = forward(ids);
    if (!a_.dump.empty() && trainer().global_step() == 0) {
      torch::save(std::vector<at::Tensor>{ids.select(1, 2).clone(), logits.detach().clone()},
                  a_.dump + "/first-logits-rank-" + std::to_string(rank_) + ".pt");
    }
    auto loss = torch::binary_cross_entropy_with_logits(logits, label);
    log("train_loss", loss,
        {.on_step = false, .on_epoch = true, .prog_bar = true, .sync_dist = true});
    return loss;
  }

  void on_before_backward(const at::Tensor&) override { reducer_->prepare_for_backward(); }

  void on_after_backward() override {
    reducer_->finalize_backward();  // dense gradients: the mean over ranks
    // Table gradients arrived summed over every rank's loss: make them the
    // gradient of the mean loss.
    torch::NoGradGuard no_grad;
    for (auto* shard : {&user_shard_, &item_shard_}) {
      if (shard->grad().defined()) shard->mutable_grad().div_(world_);
    }
  }

  fulgur::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(parameters(), a_.lr)};
  }

  int world() const { return world_; }
  int rank() const { return rank_; }

 private:
  // Every rank's ids -> this rank's rows -> summed over ranks -> own slice.
  at::Tensor lookup(const at::Tensor& shard, const at::Tensor& ids) {
    const int64_t b = ids.size(0);
    at::Tensor all_ids = group_->all_gather(ids.contiguous()).reshape({-1});  // [world * b]
    at::Tensor local = all_ids - row_begin_;
    at::Tensor owned = (local >= 0).logical_and(local < rows_per_rank_);
    at::Tensor rows = torch::embedding(shard, local.clamp(0, rows_per_rank_ - 1));
    at::Tensor partial = rows * owned.unsqueeze(1).to(rows.scalar_type());
    at::Tensor full = fulgur::nn::all_reduce_sum(partial, group_);
    return full.narrow(0, rank_ * b, b);
  }

  const Args& a_;
  torch::nn::Sequential mlp_{nullptr};
  at::Tensor user_shard_, item_shard_;
  std::shared_ptr<fulgur::ProcessGroup> group_;
  std::unique_ptr<fulgur::GradientReducer> reducer_;
  int world_ = 1;
  int rank_ = 0;
  int64_t rows_per_rank_ = 0;
  int64_t row_begin_ = 0;
};

// The loss of every epoch, as every rank agrees on it (sync_dist).
struct EpochLosses : fulgur::Callback {
  std::vector<double> losses;
  std::vector<int64_t> epochs;
  std::string state_key() const override { return "EpochLosses"; }
  void on_train_epoch_end(fulgur::Trainer& trainer, fulgur::Module&) override {
    auto it = trainer.callback_metrics().find("train_loss");
    if (it != trainer.callback_metrics().end()) {
      losses.push_back(it->second);
      epochs.push_back(trainer.current_epoch());
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  fulgur::TrainerOptions defaults;
  defaults.accelerator = "cpu";
  defaults.strategy = "manual";
  defaults.devices = 2;
  defaults.max_epochs = 5;
  defaults.enable_progress_bar = false;
  defaults.default_root_dir = "runs/sharded_embeddings";
  fulgur::CLI cli({.program = "sharded_embeddings",
                   .description = "A recommendation model with embedding tables sharded across "
                                  "ranks (strategy manual: the Module shards itself)",
                   .trainer_defaults = defaults});
  Args a;
  cli.model()
      .add("rows", a.rows, "Rows of each embedding table")
      .add("dim", a.dim, "Embedding width")
      .add("lr", a.lr, "SGD learning rate");
  cli.data()
      .add("active_ids", a.active_ids, "Distinct ids the data use per feature")
      .add("samples", a.samples, "Synthetic interactions")
      .add("batch", a.batch, "Batch size per rank");
  cli.program()
      .add("dump", a.dump, "Write each rank's final parameters and first logits here")
      .add("min_improvement", a.min_improvement,
           "Exit 1 unless the last epoch's loss is this much below the first's");
  if (auto status = cli.parse(argc, argv)) return *status;
  std::vector<std::string> problems;
  if (a.rows < 1) problems.push_back(fulgur::str("--rows ", a.rows, ": must be >= 1"));
  if (a.dim < 1) problems.push_back(fulgur::str("--dim ", a.dim, ": must be >= 1"));
  if (!(a.lr > 0.0 && std::isfinite(a.lr))) {
    problems.push_back(fulgur::str("--lr ", a.lr, ": a learning rate > 0, e.g. 0.5"));
  }
  if (a.active_ids < 1) {
    problems.push_back(fulgur::str("--active_ids ", a.active_ids, ": must be >= 1"));
  }
  if (!problems.empty()) {
    std::cerr << "error: " << fulgur::join(problems, "; ") << "." << std::endl;
    return 2;
  }
  try {
    const auto start = std::chrono::steady_clock::now();
    ShardedRecommender model(a);
    auto [ids, labels] = make_data(a);
    auto loader = fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(ids, labels),
                                           {.batch_size = a.batch});
    auto losses = std::make_shared<EpochLosses>();
    fulgur::TrainerOptions options = cli.trainer_options();
    options.callbacks.push_back(losses);
    fulgur::Trainer trainer(options);
    trainer.fit(model, loader, nullptr, fulgur::FitOptions{.ckpt_path = cli.ckpt_path()});

    if (!a.dump.empty()) {
      std::vector<at::Tensor> params;
      for (auto& p : model.named_parameters()) params.push_back(p.value().detach().clone());
      torch::save(params, a.dump + "/params-rank-" + std::to_string(model.rank()) + ".pt");
    }
    if (trainer.strategy().is_global_zero()) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::cout << "world_size=" << model.world() << " epochs=" << losses->losses.size()
                << " steps=" << trainer.global_step() << " time=" << seconds << "s\n";
      for (size_t e = 0; e < losses->losses.size(); ++e) {
        std::cout << "epoch " << losses->epochs[e] << " train_loss=" << losses->losses[e] << "\n";
      }
      if (!losses->losses.empty()) {
        std::cout << "RESULT first_loss=" << losses->losses.front() << "\n"
                  << "RESULT last_loss=" << losses->losses.back() << "\n";
      }
      std::cout << "checkpoints: "
                << (std::filesystem::path(options.default_root_dir) / "checkpoints").string()
                << " (one shard per rank in each)" << std::endl;
      if (a.min_improvement > 0 && losses->losses.size() >= 2 &&
          losses->losses.front() - losses->losses.back() < a.min_improvement) {
        std::cerr << "the loss fell by less than " << a.min_improvement << std::endl;
        return 1;
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "sharded_embeddings: " << fulgur::error_message(e) << std::endl;
    return 1;
  }
}
