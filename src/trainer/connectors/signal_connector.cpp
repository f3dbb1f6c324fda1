#include "trainer/connectors/signal_connector.h"

#include <atomic>

namespace fulgur::detail {

namespace {

std::atomic<int> g_received{0};

extern "C" void record_signal(int sig) {
  int none = 0;
  g_received.compare_exchange_strong(none, sig);
}

}  // namespace

SignalConnector::~SignalConnector() { disarm(); }

void SignalConnector::arm(const std::vector<int>& signals) {
  disarm();
  g_received.store(0);
  for (int sig : signals) {
    struct sigaction action {};
    action.sa_handler = record_signal;
    sigemptyset(&action.sa_mask);
    // Interrupted system calls resume: the loop reads the flag at its own
    // pace, never in the middle of a write.
    action.sa_flags = SA_RESTART;
    Saved saved{sig, {}};
    if (::sigaction(sig, &action, &saved.action) == 0) saved_.push_back(saved);
  }
}

void SignalConnector::disarm() {
  for (const auto& s : saved_) ::sigaction(s.signal, &s.action, nullptr);
  saved_.clear();
}

int SignalConnector::received() const { return armed() ? g_received.load() : 0; }

}  // namespace fulgur::detail
