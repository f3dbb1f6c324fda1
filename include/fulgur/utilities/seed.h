// File: fulgur/utilities/seed.h
#pragma once

#include <cstdint>

#include "fulgur/core/state_dict.h"

namespace fulgur {

/// Seeds every RNG a run uses: torch's CPU generator, every CUDA generator
/// (when CUDA is usable here: cuda_usable()) and the C library's rand().
void seed_everything(uint64_t seed);

/// Whether this process can use CUDA: LibTorch sees a GPU, and the process is
/// not a child forked (without exec) by a launcher. CUDA cannot be used in
/// such a child once its parent has initialised it ("CUDA error:
/// initialization error"), so there the CUDA generators are neither seeded
/// nor saved: ddp_fork is a CPU strategy.
bool cuda_usable();

namespace detail {
/// Called by the launchers in a forked child before it runs the rank.
void mark_forked_child();
/// A fit's backward ran in this process (the loops call the first; the
/// fork launcher asks: LibTorch 2.x refuses autograd in a child forked
/// from a process that has run it).
void note_autograd_used();
bool autograd_used();
}  // namespace detail

/// The state of every RNG seed_everything seeds, so a resumed run draws the
/// same random numbers as an uninterrupted one: "cpu" (the CPU generator's
/// state, a uint8 buffer), "cuda_count" (an int: the CUDA generators saved,
/// 0 where CUDA is not usable) and "cuda0" .. "cuda<count-1>" (buffers).
StateDict rng_state_dict();
/// Restores what rng_state_dict() returned: the CPU generator, and the CUDA
/// generators of the devices both runs have (none when cuda_count is
/// absent). CheckpointError when "cpu", or a CUDA state it counts, is
/// missing.
void load_rng_state_dict(const StateDict& state);

}  // namespace fulgur
