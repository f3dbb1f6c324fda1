// File: fulgur/data/data_module.h
//
// A DataModule packages the data side of a run: download/prepare once,
// build the splits per stage, hand out the loaders. The Trainer calls
// prepare_data() (once per node, on local rank 0), then, once every rank has
// reached that point (a barrier), setup(stage) on every rank, then the loader
// it needs, then teardown(stage).
//
//   struct MyData : fulgur::DataModule {
//     void setup(fulgur::Stage stage) override { train_ = ...; }
//     std::shared_ptr<fulgur::DataLoader> train_dataloader() override {
//       return fulgur::make_data_loader(train_, {.batch_size = 64, .shuffle = true});
//     }
//   };
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace fulgur {

class DataLoader;
class DataModule;

namespace detail {
/// Private: the Trainer's way to set DataModule::current_epoch().
void set_loader_epoch(DataModule& data, int64_t epoch);
}  // namespace detail

/// What the Trainer is running.
enum class Stage { kFit, kValidate, kTest, kPredict };
const char* to_string(Stage stage);

class DataModule {
 public:
  virtual ~DataModule() = default;
  /// Downloads or unpacks data; called once per node before setup().
  virtual void prepare_data() {}
  /// Builds the datasets needed by `stage`; called on every process.
  virtual void setup(Stage /*stage*/) {}
  virtual void teardown(Stage /*stage*/) {}

  /// The loaders. The default of train_dataloader and predict_dataloader
  /// throws a ConfigError when the stage needs them; the others return null,
  /// which means "this stage has no data" (e.g. no validation).
  virtual std::shared_ptr<DataLoader> train_dataloader();
  virtual std::shared_ptr<DataLoader> val_dataloader() { return nullptr; }
  virtual std::shared_ptr<DataLoader> test_dataloader();
  virtual std::shared_ptr<DataLoader> predict_dataloader();

  /// The training loader's batch size, for Tuner::scale_batch_size (what
  /// Lightning's finder reads and sets as datamodule.batch_size):
  /// batch_size() returns it, set_batch_size(n) makes the next
  /// train_dataloader() batch n samples. The default has none (nullopt),
  /// and the finder refuses the module, saying to override both.
  virtual std::optional<int64_t> batch_size() const { return std::nullopt; }
  virtual void set_batch_size(int64_t /*batch_size*/) {}

  /// The training epoch the loaders are being made for, to read in the
  /// loader functions: 0 when a stage starts; with the Trainer's
  /// reload_dataloaders_every_n_epochs=N, the epoch of each reload (0, N,
  /// 2N, ...). A fit resumed in epoch E makes them for E rounded down to a
  /// multiple of N, the epoch at which the uninterrupted run made them, so
  /// it trains on the same data.
  int64_t current_epoch() const { return current_epoch_; }

 private:
  friend void detail::set_loader_epoch(DataModule& data, int64_t epoch);
  int64_t current_epoch_ = 0;
};

}  // namespace fulgur
