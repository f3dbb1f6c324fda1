// Hooks for a fulgur::nn::FSDPUnit (declared or auto-wrapped) that count
// its forwards and record how many tensors each returned.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <vector>

#include "fulgur/nn/fsdp_unit.h"

namespace fulgur::test {

struct UnitHooksRecorder : fulgur::nn::UnitHooks {
  int before = 0, after = 0;
  std::vector<size_t> outputs;  // per forward: the tensors it returned
  void before_forward() override { ++before; }
  void after_forward(const std::vector<at::Tensor>& tensors) override {
    ++after;
    outputs.push_back(tensors.size());
  }
};

}  // namespace fulgur::test
