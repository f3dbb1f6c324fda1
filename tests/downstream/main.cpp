// Fits a one-layer model for one epoch through an installed fulgur.
// Exits 0 when the Trainer took at least one optimizer step.
#include <torch/torch.h>

#include <iostream>
#include <memory>

#include "fulgur/fulgur.h"

namespace {

struct Regressor : fulgur::Module {
  torch::nn::Linear fc{nullptr};

  Regressor() : fulgur::Module("Regressor") { fc = register_module("fc", torch::nn::Linear(4, 1)); }

  torch::Tensor training_step(fulgur::Batch& batch, int64_t /*batch_idx*/) override {
    auto& [x, y] = batch.pair();
    auto loss = torch::mse_loss(fc(x), y);
    log("train_loss", loss.detach());
    return loss;
  }

  fulgur::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.1))};
  }
};

}  // namespace

int main() {
  try {
    torch::manual_seed(0);
    auto x = torch::randn({64, 4});
    auto y = x.sum(1, /*keepdim=*/true);
    auto loader = fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(x, y),
                                           {.batch_size = 16, .shuffle = true});

    Regressor model;
    fulgur::Trainer trainer({.max_epochs = 1,
                             .enable_checkpointing = false,
                             .enable_progress_bar = false,
                             .logger = false});
    const auto result = trainer.fit(model, loader);

    std::cout << "downstream: global_step=" << trainer.global_step() << " train_loss="
              << (result.metrics.count("train_loss") ? result.metrics.at("train_loss") : -1.0)
              << "\n";
    return trainer.global_step() > 0 && result.global_step > 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "downstream: " << e.what() << "\n";
    return 1;
  }
}
