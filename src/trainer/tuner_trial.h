// Private: marks the Tuner's trial fits (lr_find, scale_batch_size) on this
// thread. A trial runs with the finder's callback alone, as Lightning's do:
// the Module's configure_callbacks() are not added to it (an EarlyStopping
// of the Module's would otherwise judge, and keep state from, a sweep).
// Not installed.
// A trial's fit does not take the checkpoint a restarted job
// (restart_count() > 0) resumes its fit from.
#pragma once

#include <functional>

namespace fulgur {
class Module;
}

namespace fulgur::detail {

class TunerTrial {
 public:
  /// `configured`: called by the trial's fit right after the module's
  /// configure_model(), before the strategy moves or converts anything
  /// (the Tuner keeps what that built, to put it back after the trial).
  explicit TunerTrial(std::function<void(Module&)> configured = {});
  ~TunerTrial();
  TunerTrial(const TunerTrial&) = delete;
  TunerTrial& operator=(const TunerTrial&) = delete;
  /// A TunerTrial is alive on this thread.
  static bool active();
  /// The innermost trial's `configured`, if any (the Trainer calls it).
  static void module_configured(Module& module);

 private:
  std::function<void(Module&)> configured_;
  TunerTrial* outer_;
};

}  // namespace fulgur::detail
