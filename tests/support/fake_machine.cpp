#include "support/fake_machine.h"

#include "fulgur/accelerators/cuda.h"
#include "fulgur/core/errors.h"

namespace fulgur::test {

namespace {

// CUDAAccelerator's device parsing over a GPU count given here.
class FakeCUDAAccelerator : public CUDAAccelerator {
 public:
  explicit FakeCUDAAccelerator(int gpus) : gpus_(gpus) {}
  bool is_available() const override { return gpus_ > 0; }
  std::string unavailable_reason() const override {
    return gpus_ > 0 ? std::string() : "this (pretend) machine has no GPU";
  }
  int auto_device_count() const override { return gpus_; }
  void setup_device(c10::Device /*device*/) override {
    throw InternalError("FakeCUDAAccelerator: a pretend GPU cannot run anything");
  }

 private:
  int gpus_;
};

ConnectorContext pointing_at(const FakeMachine& m, std::map<std::string, std::string> env) {
  ConnectorContext c{EnvView(std::move(env))};
  c.accelerators = &m.accelerators;
  c.strategies = &m.strategies;
  c.precisions = &m.precisions;
  c.checkpoint_ios = &m.checkpoint_ios;
  c.cluster_environments = &m.cluster_environments;
  return c;
}

}  // namespace

FakeMachine::FakeMachine(int gpus, std::map<std::string, std::string> env)
    : accelerators(accelerator_registry()),
      strategies(strategy_registry()),
      precisions(precision_registry()),
      checkpoint_ios(checkpoint_io_registry()),
      cluster_environments(cluster_environment_registry()),
      context_(pointing_at(*this, std::move(env))) {
  accelerators.replace("cuda", str("a pretend CUDA with ", gpus, " GPU(s)"),
                       [gpus] { return std::make_unique<FakeCUDAAccelerator>(gpus); });
}

ConnectorContext FakeMachine::context(std::map<std::string, std::string> env) const {
  return pointing_at(*this, std::move(env));
}

}  // namespace fulgur::test
