// File: fulgur/utilities/seed.h
#pragma once

#include <cstdint>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

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
}  // namespace detail

/// Saves / restores the state of every RNG seed_everything seeds, so a
/// resumed run draws the same random numbers as an uninterrupted one.
void save_rng_states(torch::serialize::OutputArchive& archive);
void load_rng_states(torch::serialize::InputArchive& archive);

}  // namespace fulgur
