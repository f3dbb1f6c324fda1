#include "trainer/torch_profiler.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <utility>

#include "fulgur/core/errors.h"
#include "utilities/durable_file.h"
#include "utilities/file_kind.h"
#include "utilities/json_text.h"

namespace fulgur::detail {

namespace {

namespace kineto = torch::autograd::profiler;
namespace impl = torch::profiler::impl;

// LibTorch 1.13 times its events in microseconds (startUs, durationUs);
// 2.x in nanoseconds (startNs, durationNs). Whichever the event has.
template <typename E>
auto start_us(const E& e, int) -> decltype(static_cast<double>(e.startNs()) / 1e3) {
  return static_cast<double>(e.startNs()) / 1e3;
}
template <typename E>
double start_us(const E& e, long) {
  return static_cast<double>(e.startUs());
}
template <typename E>
auto duration_us(const E& e, int) -> decltype(static_cast<double>(e.durationNs()) / 1e3) {
  return static_cast<double>(e.durationNs()) / 1e3;
}
template <typename E>
double duration_us(const E& e, long) {
  return static_cast<double>(e.durationUs());
}

// The span of each of the loop's phases in the trace. RecordFunction keeps
// the pointer of a const char* name, so these live for the program.
const char* span_name(LoopProfiler::Phase phase) {
  using P = LoopProfiler::Phase;
  switch (phase) {
    case P::kFetch: return "fulgur::fetch_batch";
    case P::kTrainingStep: return "fulgur::training_step";
    case P::kBackward: return "fulgur::backward";
    case P::kOptimizerStep: return "fulgur::optimizer_step";
    case P::kGraphStep: return "fulgur::cuda_graph_step";
    case P::kLogging: return "fulgur::logging";
    case P::kBatchEnd: return "fulgur::on_train_batch_end";
    case P::kValidation: return "fulgur::validation";
    case P::kEpochEnd: return "fulgur::epoch_end";
    case P::kCount: break;
  }
  return "fulgur::?";
}

std::vector<OperatorRecord> records_of(const kineto::ProfilerResult& result) {
  std::vector<OperatorRecord> records;
  records.reserve(result.events().size());
  for (const auto& e : result.events()) {
    OperatorRecord r;
    r.name = e.name();
    r.thread = e.startThreadId();
    r.on_device = e.deviceType() != c10::DeviceType::CPU;
    // Kineto repeats the user spans on the GPU's timeline (GPU user
    // annotations): spans too, not kernels.
    r.annotation = e.scope() == static_cast<uint8_t>(at::RecordScope::USER_SCOPE) ||
                   r.name.rfind("ProfilerStep#", 0) == 0 || r.name.rfind("fulgur::", 0) == 0;
    r.start_us = start_us(e, 0);
    r.duration_us = duration_us(e, 0);
    records.push_back(std::move(r));
  }
  return records;
}

bool write_text(const std::string& path, const std::string& text, std::string& error) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (out) out.write(text.data(), static_cast<std::streamsize>(text.size()));
  if (out) out.flush();
  if (!out) {
    error = str("could not write ", path, " (", std::strerror(errno), ")");
    return false;
  }
  return true;
}

}  // namespace

std::vector<OperatorRow> operator_rows(const std::vector<OperatorRecord>& records) {
  std::map<std::string, OperatorRow> by_name;
  // Host events nest per thread: an operator's self time is its span less
  // the spans of the events directly inside it.
  std::map<uint64_t, std::vector<const OperatorRecord*>> by_thread;
  for (const auto& r : records) {
    if (r.on_device) {
      if (r.annotation) continue;
      OperatorRow& row = by_name[r.name];
      ++row.calls;
      row.device_us += r.duration_us;
    } else {
      by_thread[r.thread].push_back(&r);
    }
  }
  for (auto& [thread, events] : by_thread) {
    std::stable_sort(events.begin(), events.end(), [](const auto* a, const auto* b) {
      if (a->start_us != b->start_us) return a->start_us < b->start_us;
      return a->duration_us > b->duration_us;  // the enclosing one first
    });
    struct Open {
      const OperatorRecord* record;
      double children_us;
    };
    std::vector<Open> stack;
    auto close = [&](const Open& open) {
      if (open.record->annotation) return;
      OperatorRow& row = by_name[open.record->name];
      ++row.calls;
      row.total_us += open.record->duration_us;
      row.self_us += std::max(0.0, open.record->duration_us - open.children_us);
    };
    for (const OperatorRecord* r : events) {
      while (!stack.empty() &&
             r->start_us >= stack.back().record->start_us + stack.back().record->duration_us) {
        close(stack.back());
        stack.pop_back();
      }
      if (!stack.empty()) stack.back().children_us += r->duration_us;
      stack.push_back({r, 0.0});
    }
    while (!stack.empty()) {
      close(stack.back());
      stack.pop_back();
    }
  }
  std::vector<OperatorRow> rows;
  rows.reserve(by_name.size());
  for (auto& [name, row] : by_name) {
    row.name = name;
    rows.push_back(std::move(row));
  }
  std::stable_sort(rows.begin(), rows.end(), [](const OperatorRow& a, const OperatorRow& b) {
    if (a.device_us != b.device_us) return a.device_us > b.device_us;
    return a.self_us > b.self_us;
  });
  return rows;
}

std::string operator_table(const std::vector<OperatorRow>& rows, size_t limit,
                           const std::string& title) {
  double self_sum = 0;
  double device_sum = 0;
  for (const auto& row : rows) {
    self_sum += row.self_us;
    device_sum += row.device_us;
  }
  const bool device = device_sum > 0;
  std::string out = title + "\n";
  char line[256];
  if (device) {
    std::snprintf(line, sizeof line, "  %-44s %8s %11s %11s %7s %11s %7s\n", "operator", "calls",
                  "self ms", "total ms", "self %", "device ms", "dev %");
  } else {
    std::snprintf(line, sizeof line, "  %-44s %8s %11s %11s %7s %11s\n", "operator", "calls",
                  "self ms", "total ms", "self %", "mean us");
  }
  out += line;
  auto percent = [](double part, double whole) { return whole > 0 ? 100 * part / whole : 0.0; };
  const size_t shown = std::min(limit, rows.size());
  for (size_t i = 0; i < shown; ++i) {
    const OperatorRow& r = rows[i];
    std::string name = r.name;
    if (name.size() > 44) {
      name.resize(41);
      name += "...";
    }
    if (device) {
      std::snprintf(line, sizeof line, "  %-44s %8lld %11.3f %11.3f %6.1f%% %11.3f %6.1f%%\n",
                    name.c_str(), static_cast<long long>(r.calls), r.self_us / 1e3,
                    r.total_us / 1e3, percent(r.self_us, self_sum), r.device_us / 1e3,
                    percent(r.device_us, device_sum));
    } else {
      std::snprintf(line, sizeof line, "  %-44s %8lld %11.3f %11.3f %6.1f%% %11.1f\n", name.c_str(),
                    static_cast<long long>(r.calls), r.self_us / 1e3, r.total_us / 1e3,
                    percent(r.self_us, self_sum),
                    r.calls > 0 ? r.total_us / static_cast<double>(r.calls) : 0.0);
    }
    out += line;
  }
  if (rows.size() > shown) {
    double rest = 0;
    for (size_t i = shown; i < rows.size(); ++i) rest += rows[i].self_us;
    std::snprintf(line, sizeof line, "  (%zu more operators: %.3f ms self, %.1f%%)\n",
                  rows.size() - shown, rest / 1e3, percent(rest, self_sum));
    out += line;
  }
  std::snprintf(line, sizeof line, "  %-44s %8s %11.3f\n", "all operators, self", "",
                self_sum / 1e3);
  out += line;
  return out;
}

bool write_chrome_trace(const std::vector<OperatorRecord>& records, int rank,
                        const std::string& path, std::string& error) {
  const long pid = static_cast<long>(::getpid());
  std::string out = "{\"schemaVersion\": 1, \"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  out += str("{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": ", pid,
             ", \"tid\": 0, \"args\": {\"name\": \"fulgur rank ", rank, "\"}}");
  char number[64];
  for (const auto& r : records) {
    out += ",\n{\"ph\": \"X\", \"cat\": ";
    out += r.on_device ? "\"kernel\"" : r.annotation ? "\"user_annotation\"" : "\"cpu_op\"";
    out += ", \"name\": ";
    append_json_string(out, r.name);
    std::snprintf(number, sizeof number, "%.3f", r.start_us);
    out += str(", \"pid\": ", pid, ", \"tid\": ", r.thread, ", \"ts\": ", number);
    std::snprintf(number, sizeof number, "%.3f", r.duration_us);
    out += str(", \"dur\": ", number, "}");
  }
  out += "\n]}\n";
  return write_text(path, out, error);
}

TorchProfiler::TorchProfiler(int64_t wait, int64_t active, std::string dir, int rank, bool cuda)
    : wait_(wait), active_(active), dir_(std::move(dir)), cuda_(cuda), rank_(rank) {
  // A later fit writing here (a second fit of the Trainer; runs without a
  // logger share default_root_dir/profiler) takes the next name no rank's
  // file has (fit-rank<k>, fit2-rank<k>, ...), chosen as the fit starts,
  // before any rank of it writes: every rank of one fit takes the same.
  std::set<std::string> taken;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const auto dash = name.find("-rank");
    if (name.rfind("fit", 0) == 0 && dash != std::string::npos) taken.insert(name.substr(0, dash));
  }
  for (int64_t n = 1;; ++n) {
    const std::string fit = str("fit", n == 1 ? std::string() : std::to_string(n));
    if (taken.count(fit) == 0) {
      stem_ = str(dir_, "/", fit, "-rank", rank_);
      break;
    }
  }
}

TorchProfiler::~TorchProfiler() {
  try {
    abandon();
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor lets go quietly
  }
}

void TorchProfiler::begin(Phase phase) {
  if (!recording_) return;
  auto record = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (record->isActive()) record->before(span_name(phase));
  spans_.push_back({phase, std::move(record)});
}

void TorchProfiler::end(Phase phase) {
  // A phase that began before the recording has no span of its own.
  if (!recording_ || spans_.empty() || spans_.back().phase != phase) return;
  spans_.back().record->end();
  spans_.pop_back();
}

void TorchProfiler::batch_begin() {
  if (!done_ && !recording_ && batches_ == wait_) start_recording();
  const int64_t batch = batches_++;
  if (!recording_) return;
  auto record = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (record->isActive()) record->before(str("ProfilerStep#", batch));
  spans_.push_back({Phase::kCount, std::move(record)});
}

void TorchProfiler::batch_end() {
  if (!recording_) return;
  close_spans();
  if (++recorded_ == active_) table_ = stop_recording();
}

void TorchProfiler::start_recording() {
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  if (cuda_) activities.insert(impl::ActivityType::CUDA);
  auto enable = [&]() -> std::string {
    try {
      kineto::prepareProfiler(config, activities);
      kineto::enableProfiler(config, activities);
      return "";
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
  };
  std::string error;
  if (impl::profilerEnabled()) {
    // LibTorch 1.13 refuses a second profiler on a thread; 2.6 starts it
    // over the first, whose recording ours would then end: never start.
    error =
        "another profiler already records this thread: the program's own, or a library's; stop "
        "it before fit, or pass profiler=\"none\"";
  } else {
    error = enable();
    if (!error.empty() && cuda_) {
      // A LibTorch that cannot trace CUDA activity still records the host.
      print_note(str("profiler=pytorch: LibTorch's profiler did not start with CUDA activity (",
                     error, "); trying the host's operators only."));
      activities.erase(impl::ActivityType::CUDA);
      error = enable();
    }
  }
  if (!error.empty()) {
    // The fit goes on without a profile, and says so.
    failure_ = str("LibTorch's profiler did not start (", error, ")");
    print_note(str("profiler=pytorch: ", failure_, "; the fit goes on without a profile."));
    done_ = true;
    return;
  }
  recording_ = true;
}

void TorchProfiler::close_spans() {
  while (!spans_.empty()) {
    spans_.back().record->end();
    spans_.pop_back();
  }
}

void TorchProfiler::finish_gpu_work() const {
  if (!cuda_) return;
  try {
    torch::cuda::synchronize();
  } catch (const std::exception& e) {
    // A GPU in error (an illegal address, a device assert) fails every
    // call; the profiler still stops, without the last kernels.
    print_note(str("profiler=pytorch: waiting for the GPU failed (", error_message(e),
                   "); the trace may lack the last recorded batch's kernels."));
  }
}

std::string TorchProfiler::stop_recording() {
  close_spans();
  // The recorded batches' kernels run after the host has queued them: the
  // GPU finishes them before the profiler stops, or they are missing.
  finish_gpu_work();
  std::unique_ptr<kineto::ProfilerResult> result;
  try {
    result = kineto::disableProfiler();
  } catch (const std::exception& e) {
    recording_ = false;
    done_ = true;
    failure_ = str("LibTorch's profiler failed to stop (", e.what(), ")");
    print_note(str("profiler=pytorch: ", failure_, "; the fit goes on without a profile."));
    return "";
  }
  recording_ = false;
  done_ = true;
  // Whatever goes wrong from here costs the profile, never the fit.
  try {
    return write_profile(*result);
  } catch (const std::exception& e) {
    print_note(str("profiler=pytorch: writing the profile failed (", e.what(),
                   "); the fit goes on without it."));
    return "";
  }
}

std::string TorchProfiler::write_profile(kineto::ProfilerResult& result) {
  const std::vector<OperatorRecord> records = records_of(result);
  const std::vector<OperatorRow> rows = operator_rows(records);
  const std::string trace = stem_ + ".pt.trace.json";
  const std::string table_path = stem_ + ".operators.txt";
  const std::string title = str("profiler (pytorch): rank ", rank_, ", training batches ", wait_,
                                "..", wait_ + recorded_ - 1, " of the fit (", records.size(),
                                " events); the operators that took the most time");
  const std::string table = operator_table(rows, 25, title);

  std::string error;
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) {
    const std::string why = detail::unusable_directory(dir_).why;
    error = str("could not create ", dir_, " (", why.empty() ? ec.message() : why, ")");
  } else {
    // Kineto writes its own trace (with the device's kernels); without
    // Kineto, LibTorch refuses and the trace is written from the records.
    // Written beside its name and renamed, as the table: a fit killed or a
    // disk filled as they are written leaves no cut file under the name.
    const std::string partial = trace + ".partial";
    bool saved = false;
    try {
      result.save(partial);
      saved = true;
    } catch (const c10::Error&) {
      saved = false;
    }
    if ((saved || write_chrome_trace(records, rank_, partial, error)) && error.empty()) {
      std::filesystem::rename(partial, trace, ec);
      if (ec) error = str("could not write ", trace, " (", ec.message(), ")");
    }
    if (!error.empty()) {
      std::filesystem::remove(partial, ec);
    } else if (std::string problem = detail::write_file_atomically(table_path, table);
               !problem.empty()) {
      error = problem;
    }
  }
  if (!error.empty()) {
    print_note(str("profiler=pytorch: ", error,
                   "; the fit goes on without it. Pass default_root_dir= a directory where it "
                   "can be written, with room for the trace."));
    return table;
  }
  return str(table, "  trace: ", trace, "\n  table: ", table_path, "\n");
}

std::string TorchProfiler::finish() {
  if (recording_) table_ = stop_recording();
  if (!failure_.empty()) return str("profiler (pytorch): recorded nothing: ", failure_, ".\n");
  if (!done_) {
    return str("profiler (pytorch): recorded nothing: the fit ran ", batches_,
               " training batches, and recording starts after profiler_wait=", wait_,
               ". Pass a smaller profiler_wait.\n");
  }
  return table_;
}

void TorchProfiler::abandon() {
  if (!recording_) return;
  recording_ = false;
  done_ = true;
  // Called while an exception unwinds: nothing may escape.
  try {
    close_spans();
    finish_gpu_work();
    kineto::disableProfiler();
  } catch (const std::exception& e) {
    print_note(
        str("profiler=pytorch: stopping LibTorch's profiler after the failed fit failed "
            "too: ",
            e.what()));
  }
}

}  // namespace fulgur::detail
