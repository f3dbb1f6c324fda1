// File: fulgur/core/gradient_clipping.h
//
// How gradients are clipped (Trainer option gradient_clip_algorithm,
// Module::clip_gradients): scale every gradient so that their total 2-norm
// is at most the value ("norm"), or clamp each element to +-the value
// ("value").
#pragma once

#include <utility>

#include "fulgur/core/choice.h"

namespace fulgur {

enum class GradientClipAlgorithm { kNorm, kValue };
template <>
struct ChoiceNames<GradientClipAlgorithm> {
  static constexpr std::pair<GradientClipAlgorithm, const char*> kNames[] = {
      {GradientClipAlgorithm::kNorm, "norm"}, {GradientClipAlgorithm::kValue, "value"}};
};

}  // namespace fulgur
