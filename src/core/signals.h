// Private: signals in messages and as exit statuses, for the launchers'
// supervisor and the Trainer's preemption path alike. Not installed.
#pragma once

#include <signal.h>

namespace fulgur::detail {

/// "SIGTERM", "SIGUSR1", ... ("a signal" for others), for messages.
const char* signal_name(int signal);

/// Ends this process by `signal` with its default action (so its exit
/// status is 128 + signal), after flushing standard output and error.
[[noreturn]] void end_by_signal(int signal);

}  // namespace fulgur::detail
