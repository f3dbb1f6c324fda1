// File: fulgur/optim/state_dict.h
//
// An optimizer's state as a StateDict, and back: the layout of LibTorch's
// Optimizer::save (what checkpoints have held since format version 1):
//
//   pytorch_version  "1.5.0"
//   state            one section per parameter with state, under the key
//                    its parameter has in param_groups (Adam: step, exp_avg,
//                    exp_avg_sq[, max_exp_avg_sq]; SGD: momentum_buffer; ...)
//   param_groups     param_groups/size; param_groups/<i>: params/size,
//                    params/<j> (the keys), options (lr, betas, ...)
//   optimizer        "Adam", "AdamW", "SGD", "RMSprop" or "Adagrad" (fulgur's
//                    entry: Adam's and AdamW's entries are alike; a load
//                    into the other kind is refused, one without it is not)
//
// The state tensors of torch::optim's SGD, Adam, AdamW, RMSprop and Adagrad
// (and fulgur::optim's, which share them) go into the dict as they are, not
// copied; another optimizer (LBFGS, one of one's own) is saved and loaded
// through its own save()/load(), by way of an archive in memory.
//
// A load restores each parameter group's options too (LibTorch's
// Optimizer::load reads and drops them: a resumed schedule would go on from
// configure_optimizers' learning rate), and matches states to parameters by
// their positions in the dict's param_groups, never by parsing its keys, so
// a state saved with LibTorch 1.13 (keys "0x55d0...") loads into 2.x (keys
// "94371...") and back, also for an optimizer loaded through its own load().
#pragma once

#include <functional>
#include <string>

#include "fulgur/core/state_dict.h"

namespace torch::optim {
class Optimizer;
}

namespace fulgur {

/// Not const: while LibTorch serializes the parameter groups, the state map
/// is set aside (and always put back); not to be called while another
/// thread steps the optimizer.
StateDict optimizer_state_dict(torch::optim::Optimizer& optimizer);
/// Throws CheckpointError when `state` does not fit `optimizer` (another
/// number of parameter groups or of parameters in one, another optimizer's
/// state), naming what differs. The optimizer takes the dict's state
/// tensors as they are (as PyTorch's load_state_dict does on the same
/// device): a state loaded from a file is the optimizer's alone; to start
/// from another live optimizer's state without sharing it, clone its
/// tensors first (StateDict::transform_tensors).
void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const StateDict& state);
/// Throws CheckpointError when a parameter's state holds a per-element
/// tensor (Adam's moments, SGD's momentum, ...) of another shape than the
/// parameter's: the state of another parameter (configure_optimizers
/// listing them in another order, or another model), which the next step
/// would fail on naming neither. The message names the group, the
/// parameter (and `name_of` it, when that gives a name), the entry and both
/// shapes. For a state a strategy has finished loading: fsdp cuts a whole
/// state to its shards after load_optimizer_state_dict.
void check_optimizer_state_shapes(
    const torch::optim::Optimizer& optimizer,
    const std::function<std::string(const at::Tensor&)>& name_of = {});

}  // namespace fulgur
