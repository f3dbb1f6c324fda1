// The README's first example, compiled so that it cannot rot. Keep the two
// in sync (tests/readme_example_test.cmake checks they are identical).
#include <torch/torch.h>

#include <iostream>

#include "fulgur/fulgur.h"

struct Regressor : fulgur::Module {
  torch::nn::Linear fc{nullptr};
  Regressor() { fc = register_module("fc", torch::nn::Linear(4, 1)); }

  torch::Tensor training_step(fulgur::Batch& batch, int64_t /*batch_idx*/) override {
    auto& [x, y] = batch.pair();
    auto loss = torch::mse_loss(fc(x), y);
    log("train_loss", loss, {.prog_bar = true});
    return loss;
  }

  fulgur::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(parameters(), 0.1)};
  }
};

int main() {
  auto x = torch::randn({256, 4});
  auto y = x.sum(1, /*keepdim=*/true);
  auto train = fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(x, y),
                                        {.batch_size = 32, .shuffle = true});
  Regressor model;
  fulgur::Trainer trainer({.max_epochs = 5, .seed = 42});
  auto result = trainer.fit(model, train);
  std::cout << "train_loss " << result.metrics.at("train_loss") << ", saved "
            << result.last_model_path << "\n";
}
