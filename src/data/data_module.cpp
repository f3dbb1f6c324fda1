#include "fulgur/data/data_module.h"

#include "fulgur/core/errors.h"
#include "fulgur/data/data_loader.h"

namespace fulgur {

const char* to_string(Stage stage) {
  switch (stage) {
    case Stage::kFit: return "fit";
    case Stage::kValidate: return "validate";
    case Stage::kTest: return "test";
    case Stage::kPredict: return "predict";
  }
  return "?";
}

std::shared_ptr<DataLoader> DataModule::train_dataloader() {
  throw ConfigError(
      "Trainer.fit(datamodule): the DataModule does not override train_dataloader(). "
      "Override it to return the training loader.");
}

std::shared_ptr<DataLoader> DataModule::test_dataloader() {
  throw ConfigError(
      "Trainer.test(datamodule): the DataModule does not override test_dataloader(). "
      "Override it to return the test loader.");
}

std::shared_ptr<DataLoader> DataModule::predict_dataloader() {
  throw ConfigError(
      "Trainer.predict(datamodule): the DataModule does not override predict_dataloader(). "
      "Override it to return the loader to predict on.");
}

}  // namespace fulgur

namespace fulgur::detail {

void set_loader_epoch(DataModule& data, int64_t epoch) { data.current_epoch_ = epoch; }

}  // namespace fulgur::detail
