// Moved to fulgur/distributed/launchers/subprocess_script.h (issue 31); this path keeps working.
#pragma once
#include "fulgur/distributed/launchers/subprocess_script.h"
