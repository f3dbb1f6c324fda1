// Moved to fulgur/distributed/gradient_reducer.h (issue 31); this path keeps working.
#pragma once
#include "fulgur/distributed/gradient_reducer.h"
