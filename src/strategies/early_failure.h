// Private: a rank's failure before it joined its ranks' rendezvous, told to
// the ranks that wait there for it (ProcessGroup::
// announce_failure_before_joining) by the Trainer (a failed construction, a
// stage that failed before its group existed) and fulgur::CLI (a
// configuration that does not parse on this rank). Not installed.
#pragma once

#include <string>

namespace fulgur {
class ClusterEnvironment;
}

namespace fulgur::detail {

/// Where `env` says this process is one of several ranks started by
/// someone else (srun, mpirun, by hand): tells the others that it failed
/// with `what`. Once per process; never throws.
void announce_failure_before_joining(const ClusterEnvironment& env, const std::string& what);
/// The same, with the cluster environment the process's variables select.
void announce_failure_before_joining(const std::string& what);

/// While one lives on this thread, neither of the above tells anyone: for
/// a Trainer made only to check options (fulgur::CLI's), whose caller
/// reports the failure itself.
class NoFailureAnnouncement {
 public:
  NoFailureAnnouncement();
  ~NoFailureAnnouncement();
  NoFailureAnnouncement(const NoFailureAnnouncement&) = delete;
  NoFailureAnnouncement& operator=(const NoFailureAnnouncement&) = delete;
};

}  // namespace fulgur::detail
