// File: fulgur/core/interval.h
//
// When something happens in training: after every optimizer step ("step") or
// at the end of every training epoch ("epoch"). A scheduler steps at one
// (SchedulerConfig::interval); LearningRateMonitor logs and Timer checks at
// one.
#pragma once

#include <utility>

#include "fulgur/core/choice.h"

namespace fulgur {

enum class Interval { kStep, kEpoch };
template <>
struct ChoiceNames<Interval> {
  static constexpr std::pair<Interval, const char*> kNames[] = {{Interval::kStep, "step"},
                                                                {Interval::kEpoch, "epoch"}};
};

}  // namespace fulgur
