// Private: Trainer option profiler = "pytorch". LibTorch's operator profiler
// (the Kineto collection of torch/csrc/autograd/profiler_kineto.h) records
// the fit's training batches [wait, wait + active), counted from the fit's
// first batch in this process (a resumed fit profiles its own first batches
// after the wait). Each batch is a "ProfilerStep#<batch>" span (the batch's
// number in that count, as torch.profiler numbers its steps) and the fit
// loop's phases are "fulgur::<phase>" spans inside it, so the trace shows
// which of the loop's phases an operator ran in.
//
// When the window closes (or the fit ends inside it) every rank writes
//   <dir>/fit-rank<R>.pt.trace.json   a Chrome/Perfetto trace
//   <dir>/fit-rank<R>.operators.txt   the operators that took the most time
// A LibTorch built with Kineto (Debian 13's 2.6, pytorch.org's) writes the
// trace itself (CUDA kernels and their launches on a GPU); one built
// without it (Debian 12's 1.13) records the host's operators all the same,
// and this file writes the trace from them. A
// write that fails is reported on stderr and the fit goes on: a profile is
// never worth a lost run. Not installed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "trainer/profiler.h"

namespace at {
struct RecordFunction;
}
namespace torch::autograd::profiler {
struct ProfilerResult;
}

namespace fulgur::detail {

/// One recorded event, as the table and the fallback trace read it.
struct OperatorRecord {
  std::string name;
  uint64_t thread = 0;
  bool on_device = false;   // a kernel or copy on an accelerator
  bool annotation = false;  // a user scope: ProfilerStep#, fulgur::<phase>
  double start_us = 0;
  double duration_us = 0;
};

/// One row of the operator table: an operator's calls, its own time on the
/// host (its span less the operators it called), its whole span on the
/// host, and its time on the device.
struct OperatorRow {
  std::string name;
  int64_t calls = 0;
  double self_us = 0;
  double total_us = 0;
  double device_us = 0;
};

/// The host operators and device kernels of `records`, one row per name,
/// the most expensive first (device time, then self time). Annotations
/// are left out, though the operators inside them keep their own time.
std::vector<OperatorRow> operator_rows(const std::vector<OperatorRecord>& records);

/// The rows as a text table: at most `limit` rows, then a line for the rest.
std::string operator_table(const std::vector<OperatorRow>& rows, size_t limit,
                           const std::string& title);

/// `records` as Chrome trace JSON (the "traceEvents" array of complete
/// events, a process per rank); false with `error` set if it could not be
/// written.
bool write_chrome_trace(const std::vector<OperatorRecord>& records, int rank,
                        const std::string& path, std::string& error);

class TorchProfiler final : public LoopProfiler {
 public:
  /// `dir`: where the files go; `rank`: this process's global rank (in the
  /// files' names); `cuda`: record CUDA activity too.
  TorchProfiler(int64_t wait, int64_t active, std::string dir, int rank, bool cuda);
  ~TorchProfiler() override;

  void begin(Phase phase) override;
  void end(Phase phase) override;
  void batch_begin() override;
  void batch_end() override;
  std::string finish() override;
  /// Stops a recording still running and drops it (the fit failed).
  void abandon() override;

 private:
  void start_recording();
  /// Stops the recording and writes the files; the table to print.
  std::string stop_recording();
  std::string write_profile(torch::autograd::profiler::ProfilerResult& result);
  void close_spans();
  /// Waits for the GPU's queued work (cuda_), noting a failure.
  void finish_gpu_work() const;

  int64_t wait_;
  int64_t active_;
  std::string dir_;
  std::string stem_;  // "<dir>/fit<N>-rank<k>", chosen at construction
  bool cuda_;
  int64_t batches_ = 0;   // training batches begun in this fit
  int64_t recorded_ = 0;  // of them, recorded
  bool recording_ = false;
  bool done_ = false;
  int rank_;
  std::string table_;    // once written
  std::string failure_;  // why LibTorch's profiler did not start
  // The open spans, innermost last: the batch's (phase kCount), then its
  // phases'.
  struct Span {
    Phase phase;
    std::unique_ptr<at::RecordFunction> record;
  };
  std::vector<Span> spans_;
};

}  // namespace fulgur::detail
