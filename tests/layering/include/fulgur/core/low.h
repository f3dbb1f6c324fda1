// A fixture of tests/CMakeLists.txt's layering_check_finds_upward_includes:
// a core/ header that includes the trainer.
#pragma once
#include "fulgur/core/errors.h"
#include "fulgur/trainer/trainer.h"
