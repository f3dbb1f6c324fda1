#include "fulgur/callbacks/on_exception_checkpoint.h"

#include <torch/torch.h>

#include <filesystem>
#include <iostream>

#include "fulgur/callbacks/model_checkpoint.h"
#include "fulgur/core/errors.h"
#include "fulgur/plugins/environments/cluster_environment.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"
#include "strategies/strategy_driver.h"

namespace fulgur {

OnExceptionCheckpoint::OnExceptionCheckpoint(OnExceptionCheckpointOptions options)
    : options_(std::move(options)) {
  if (options_.filename.empty()) {
    throw ConfigError("OnExceptionCheckpoint(filename=\"\"): pass a file name.");
  }
}

void OnExceptionCheckpoint::on_fit_start(Trainer&, Module&) { in_fit_ = true; }
void OnExceptionCheckpoint::on_fit_end(Trainer&, Module&) { in_fit_ = false; }

void OnExceptionCheckpoint::on_exception(Trainer& trainer, Module&, const std::exception& error) {
  // Only once fit has started: an error before (a bad flag, a missing
  // file) leaves no training state worth saving.
  if (!in_fit_) return;
  in_fit_ = false;
  std::string dir = options_.dirpath;
  if (dir.empty()) {
    const ModelCheckpoint* mc = trainer.checkpoint_callback();
    dir = mc && !mc->dirpath().empty()
              ? mc->dirpath()
              : (std::filesystem::path(trainer.default_root_dir()) / "checkpoints").string();
  }
  const std::string path = (std::filesystem::path(dir) / (options_.filename + ".ckpt")).string();
  std::string first_line = error.what();
  first_line = first_line.substr(0, first_line.find('\n'));
  Strategy& strategy = trainer.strategy();
  detail::StrategyDriver driver(strategy);
  if (driver.checkpoint_is_collective() &&
      !driver.peers_arrive(str("on_exception/", strategy.cluster_environment().restart_count(),
                                 "/", trainer.global_step()),
                             options_.peer_timeout)) {
    detail::print_note(
        str("OnExceptionCheckpoint: not saving \"", path, "\" on rank ", strategy.global_rank(),
            ": strategy \"", strategy.name(),
            "\" saves with every rank, and not every rank reached "
            "this point within ",
            options_.peer_timeout.count() / 1000.0,
            " s (the error was not every rank's; the others wait in another collective). Resume "
            "from the last checkpoint. Error: ",
            first_line));
    return;
  }
  try {
    trainer.save_checkpoint(path);
    if (driver.is_checkpoint_writer()) saved_path_ = path;
    if (trainer.strategy().is_global_zero()) {
      detail::print_note(str("OnExceptionCheckpoint: saved \"", path, "\" at epoch ",
                             trainer.current_epoch(), ", step ", trainer.global_step(),
                             " after: ", first_line));
    }
  } catch (const std::exception& e) {
    detail::print_note(str("OnExceptionCheckpoint: could not save \"", path, "\": ", e.what()));
  }
}

}  // namespace fulgur
