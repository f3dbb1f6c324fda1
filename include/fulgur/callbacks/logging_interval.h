// File: fulgur/callbacks/logging_interval.h
//
// When a callback acts: after every training step ("step") or at the end of
// every training epoch ("epoch").
#pragma once

#include <utility>

#include "fulgur/core/choice.h"

namespace fulgur {

enum class LoggingInterval { kStep, kEpoch };
template <>
struct ChoiceNames<LoggingInterval> {
  static constexpr std::pair<LoggingInterval, const char*> kNames[] = {
      {LoggingInterval::kStep, "step"}, {LoggingInterval::kEpoch, "epoch"}};
};

}  // namespace fulgur
