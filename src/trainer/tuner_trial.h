// Private: marks the Tuner's trial fits (lr_find, scale_batch_size) on this
// thread. A trial runs with the finder's callback alone, as Lightning's do:
// the Module's configure_callbacks() are not added to it (an EarlyStopping
// of the Module's would otherwise judge, and keep state from, a sweep).
// Not installed.
#pragma once

namespace fulgur::detail {

class TunerTrial {
 public:
  TunerTrial();
  ~TunerTrial();
  TunerTrial(const TunerTrial&) = delete;
  TunerTrial& operator=(const TunerTrial&) = delete;
  /// A TunerTrial is alive on this thread.
  static bool active();
};

}  // namespace fulgur::detail
