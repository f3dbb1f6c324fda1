// Moved to fulgur/distributed/launchers/launcher.h (issue 31); this path keeps working.
#pragma once
#include "fulgur/distributed/launchers/launcher.h"
