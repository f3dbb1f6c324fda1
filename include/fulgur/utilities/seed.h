// File: fulgur/utilities/seed.h
#pragma once

#include <cstdint>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace fulgur {

/// Seeds every RNG a run uses: torch's CPU generator, every CUDA generator
/// (when available) and the C library's rand().
void seed_everything(uint64_t seed);

/// Saves / restores the state of every RNG seed_everything seeds, so a
/// resumed run draws the same random numbers as an uninterrupted one.
void save_rng_states(torch::serialize::OutputArchive& archive);
void load_rng_states(torch::serialize::InputArchive& archive);

}  // namespace fulgur
