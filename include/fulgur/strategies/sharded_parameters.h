// Moved to fulgur/distributed/sharded_parameters.h (issue 31); this path keeps working.
#pragma once
#include "fulgur/distributed/sharded_parameters.h"
