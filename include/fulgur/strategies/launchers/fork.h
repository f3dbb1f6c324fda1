// Moved to fulgur/distributed/launchers/fork.h (issue 31); this path keeps working.
#pragma once
#include "fulgur/distributed/launchers/fork.h"
