// Fashion-MNIST from the gzip IDX files of Debian's `dataset-fashion-mnist`
// package, as in-memory tensors and as a fulgur::DataModule.
//
//   FashionMNISTDataModule data({.batch_size = 128, .val_size = 5000});
//   trainer.fit(model, data);
//   trainer.test(model, data);
//
// Every failure (missing file, bad magic number, wrong dimensions, truncated
// or corrupt file) throws fulgur::ConfigError naming the file and the fix.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "fulgur/data/data_loader.h"
#include "fulgur/data/data_module.h"
#include "fulgur/data/dataset.h"

namespace fashion_mnist {

/// Where Debian's dataset-fashion-mnist package installs the files.
inline constexpr const char* kDefaultDataDir = "/usr/share/datasets/fashion-mnist";

/// Normalisation of the pixel values (mean and std of the training set).
inline constexpr double kMean = 0.2860;
inline constexpr double kStd = 0.3530;

/// One split: images float32 [N, 1, 28, 28] (normalised), labels int64 [N].
struct Split {
  torch::Tensor images;
  torch::Tensor labels;
};

/// Reads an IDX3 image file (magic 2051): uint8 [N, 1, 28, 28].
torch::Tensor read_idx_images(const std::string& path);
/// Reads an IDX1 label file (magic 2049): uint8 [N], every value < 10.
torch::Tensor read_idx_labels(const std::string& path);

/// Loads the training (60000) or test (10000) split from `data_dir`,
/// normalised with kMean/kStd.
Split load_split(const std::string& data_dir, bool train);

struct FashionMNISTOptions {
  std::string data_dir = kDefaultDataDir;
  int64_t batch_size = 128;
  /// Training images held out for validation (the last `val_size` of the 60000);
  /// 0: no validation.
  int64_t val_size = 5000;
  /// Shuffle seed of the training loader; unset: the Trainer's seed.
  std::optional<uint64_t> seed = std::nullopt;
  /// Batch size of the validation and test loaders.
  int64_t test_batch_size = 1000;
};

class FashionMNISTDataModule : public fulgur::DataModule {
 public:
  /// Throws ConfigError on a batch size < 1 or a negative val_size.
  explicit FashionMNISTDataModule(FashionMNISTOptions options = {});

  /// Checks that the four files exist (a clear error before any training).
  void prepare_data() override;
  void setup(fulgur::Stage stage) override;

  std::shared_ptr<fulgur::DataLoader> train_dataloader() override;
  std::shared_ptr<fulgur::DataLoader> val_dataloader() override;
  std::shared_ptr<fulgur::DataLoader> test_dataloader() override;

  /// The training batch size, for the batch-size finder (scale_batch_size).
  std::optional<int64_t> batch_size() const override { return options_.batch_size; }
  void set_batch_size(int64_t batch_size) override { options_.batch_size = batch_size; }

  const FashionMNISTOptions& options() const { return options_; }

 private:
  void require(const std::shared_ptr<fulgur::TensorDataset>& dataset, const char* loader) const;

  FashionMNISTOptions options_;
  std::shared_ptr<fulgur::TensorDataset> train_;
  std::shared_ptr<fulgur::TensorDataset> val_;
  std::shared_ptr<fulgur::TensorDataset> test_;
};

}  // namespace fashion_mnist
