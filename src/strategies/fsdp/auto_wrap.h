// Size-based auto-wrap for strategy = "fsdp" (FSDPOptions::auto_wrap_min_params):
// the layers held in a torch::nn::Sequential, at any depth, with at least
// that many parameters become units of sharding, as if each had been
// declared with fulgur::nn::FSDPUnit.
//
// A Sequential's forward runs its entries (AnyModule) in order, so an
// entry can be swapped for a unit around the same layer; the layer stays
// registered where it was, so the names (and checkpoints) do not change.
// While the units are in place, the Sequential's ptr(i), operator[] and
// at<T>(i) give the unit (an FSDPUnitBase whose held_module() is the
// layer); named_children() and named_modules() still give the layer.
// Sequentials held by a declared fulgur::nn::FSDPUnit are searched too.
// The layer types are those whose forward takes and returns one tensor:
// Linear, Conv1d/2d/3d, Embedding, BatchNorm1d/2d/3d, InstanceNorm1d/2d/3d,
// LayerNorm, GroupNorm. A layer held as a typed member (`torch::nn::Linear
// fc1;`) is called directly by its parent's forward and cannot be wrapped:
// declare it with fulgur::nn::FSDPUnit.
#pragma once

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fulgur/nn/fsdp_unit.h"

namespace fulgur::detail {

/// One Sequential entry made a unit.
struct AutoWrappedLayer {
  std::string name;        // the layer's name in the root module ("body.0")
  std::string type;        // its module name ("torch::nn::Linear")
  int64_t parameters = 0;  // how many elements its parameters have
  std::shared_ptr<nn::FSDPUnitBase> unit;
};

/// Wraps on construction, puts every original entry back on destruction.
class SequentialAutoWrap {
 public:
  SequentialAutoWrap(torch::nn::Module& root, int64_t min_parameters);
  ~SequentialAutoWrap();
  SequentialAutoWrap(const SequentialAutoWrap&) = delete;
  SequentialAutoWrap& operator=(const SequentialAutoWrap&) = delete;

  /// Sequential by Sequential, in the order of the root's named_modules().
  const std::vector<AutoWrappedLayer>& layers() const { return layers_; }
  /// "body.0 (torch::nn::Linear, 544 parameters), ...".
  std::string describe() const;

 private:
  struct Swapped {
    std::shared_ptr<torch::nn::SequentialImpl> sequential;
    size_t index;
    torch::nn::AnyModule original;
  };
  void wrap(torch::nn::Module& root, int64_t min_parameters);
  void restore();
  std::vector<AutoWrappedLayer> layers_;
  std::vector<Swapped> swapped_;
};

}  // namespace fulgur::detail
