// Moved to fulgur/distributed/process_group.h (issue 31); this path keeps working.
#pragma once
#include "fulgur/distributed/process_group.h"
