// File: fulgur/callbacks/callback.h
//
// A Callback observes and steers a run from outside the Module: checkpoints,
// progress output, early stopping. Hooks are called after the Module's hook
// of the same name. A callback with state (best score, ...) saves it through
// save_state/load_state under its state_key(), so a resumed run continues
// with it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize
namespace torch::optim {
class Optimizer;
}

namespace fulgur {

class Batch;
class Module;
class Trainer;

class Callback {
 public:
  virtual ~Callback() = default;

  /// Identifies this callback's state in a checkpoint; unique per run.
  virtual std::string state_key() const = 0;

  virtual void on_fit_start(Trainer&, Module&) {}
  virtual void on_fit_end(Trainer&, Module&) {}
  virtual void on_train_start(Trainer&, Module&) {}
  virtual void on_train_end(Trainer&, Module&) {}
  virtual void on_train_epoch_start(Trainer&, Module&) {}
  virtual void on_train_epoch_end(Trainer&, Module&) {}
  virtual void on_train_batch_start(Trainer&, Module&, const Batch&, int64_t /*batch_idx*/) {}
  virtual void on_train_batch_end(Trainer&, Module&, const at::Tensor& /*loss*/, const Batch&,
                                  int64_t /*batch_idx*/) {}
  virtual void on_validation_start(Trainer&, Module&) {}
  virtual void on_validation_end(Trainer&, Module&) {}
  virtual void on_validation_epoch_end(Trainer&, Module&) {}
  virtual void on_validation_batch_end(Trainer&, Module&, const Batch&, int64_t) {}
  virtual void on_test_epoch_end(Trainer&, Module&) {}
  virtual void on_test_batch_end(Trainer&, Module&, const Batch&, int64_t) {}
  virtual void on_predict_batch_end(Trainer&, Module&, const Batch&, int64_t) {}
  virtual void on_before_optimizer_step(Trainer&, Module&, torch::optim::Optimizer&) {}
  virtual void on_exception(Trainer&, Module&, const std::exception&) {}

  virtual void save_state(torch::serialize::OutputArchive&) const {}
  virtual void load_state(torch::serialize::InputArchive&) {}
};

}  // namespace fulgur
