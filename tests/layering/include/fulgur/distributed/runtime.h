// A fixture of layering_check_finds_upward_includes: the distributed
// runtime including the Module and a strategy.
#pragma once
#include <fulgur/core/module.h>
#include "fulgur/core/errors.h"
#include "fulgur/strategies/strategy.h"
