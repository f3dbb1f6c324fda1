// The built-in loggers, registered in one place.
#include "fulgur/loggers/csv_logger.h"
#include "fulgur/loggers/logger.h"
#include "fulgur/loggers/tensorboard_logger.h"

namespace fulgur {

LoggerRegistry& logger_registry() {
  static LoggerRegistry registry = [] {
    LoggerRegistry r("logger");
    r.add("csv", "metrics.csv, hparams.yaml and metrics.png (CSVLogger)",
          [](const std::string& root) {
            return std::make_unique<CSVLogger>(CSVLoggerOptions{.save_dir = root});
          });
    r.add("tensorboard", "TensorBoard event files (TensorBoardLogger)",
          [](const std::string& root) {
            return std::make_unique<TensorBoardLogger>(TensorBoardLoggerOptions{.save_dir = root});
          });
    return r;
  }();
  return registry;
}

}  // namespace fulgur
