// A fixture of layering_check_finds_upward_includes: a strategy that
// includes a private trainer header.
#include "fulgur/strategies/strategy.h"
#include "trainer/trainer_impl.h"
