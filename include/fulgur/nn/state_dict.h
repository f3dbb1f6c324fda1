// File: fulgur/nn/state_dict.h
//
// A module's parameters and buffers as a StateDict, and back, in the layout
// of nn::Module::save (what checkpoints have held since format version 1):
// an entry per parameter and buffer of the module itself (buffers marked
// as such), a section per submodule, under their registered names.
// Submodules that are not serializable (torch::nn::Functional) have none.
//
//   fulgur::StateDict weights = fulgur::module_state_dict(model);
//   fulgur::load_module_state_dict(other, weights);   // same architecture
#pragma once

#include "fulgur/core/state_dict.h"

namespace torch::nn {
class Module;
}

namespace fulgur {

/// The module's tensors themselves, not copies: a save writes what they
/// hold when it is written (AsyncCheckpointIO snapshots them first).
StateDict module_state_dict(const torch::nn::Module& module);
/// Copies `state` into the module's parameters and buffers in place (so
/// optimizers holding them stay valid), strictly: every parameter and
/// buffer must be there with the same shape and dtype, and nothing else
/// may. Throws CheckpointError naming the first difference, before any
/// tensor is changed. A tensor of the same shape in another floating
/// dtype is said to be kPrecisionChanged, naming the precision that keeps
/// the checkpoint's dtype.
void load_module_state_dict(torch::nn::Module& module, const StateDict& state);
inline constexpr const char* kPrecisionChanged = "saved under another precision";

}  // namespace fulgur
