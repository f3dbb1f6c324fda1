#include "trainer/connectors/signal_connector.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <iostream>

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

const char* signal_name(int signal) {
  switch (signal) {
    case SIGKILL: return "SIGKILL";
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGSEGV: return "SIGSEGV";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGPIPE: return "SIGPIPE";
    case SIGHUP: return "SIGHUP";
    case SIGQUIT: return "SIGQUIT";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    case SIGXCPU: return "SIGXCPU";
    default: return "a signal";
  }
}

void end_by_signal(int signal) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  struct sigaction action {};
  action.sa_handler = SIG_DFL;
  sigemptyset(&action.sa_mask);
  ::sigaction(signal, &action, nullptr);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, signal);
  ::sigprocmask(SIG_UNBLOCK, &set, nullptr);
  ::raise(signal);
  ::_exit(128 + signal);
}

}  // namespace fulgur::detail
