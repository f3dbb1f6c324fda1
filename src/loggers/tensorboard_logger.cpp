// TensorBoard's event files, encoded here: the few protobuf fields of
// tensorflow.Event, Summary, HistogramProto and the HParams plugin's
// messages that a training run needs (field numbers from TensorFlow's
// event.proto and summary.proto and TensorBoard's hparams protos), in
// TFRecord framing.
#include "fulgur/loggers/tensorboard_logger.h"

#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "fulgur/core/errors.h"
#include "fulgur/utilities/checksum.h"
#include "loggers/log_dir.h"
#include "utilities/little_endian.h"

namespace fulgur {

namespace {

// One protobuf message being encoded (proto3 wire format).
class Message {
 public:
  Message& varint(int field, uint64_t value) {
    key(field, 0);
    put_varint(value);
    return *this;
  }
  Message& f64(int field, double value) {
    key(field, 1);
    put_fixed(value);
    return *this;
  }
  Message& f32(int field, float value) {
    key(field, 5);
    put_fixed(value);
    return *this;
  }
  Message& bytes(int field, std::string_view value) {
    key(field, 2);
    put_varint(value.size());
    out_.append(value);
    return *this;
  }
  Message& message(int field, const Message& m) { return bytes(field, m.out_); }
  Message& packed_f64(int field, const std::vector<double>& values) {
    key(field, 2);
    put_varint(values.size() * sizeof(double));
    for (double v : values) put_fixed(v);
    return *this;
  }
  const std::string& data() const { return out_; }

 private:
  void key(int field, int wire_type) {
    put_varint((static_cast<uint64_t>(field) << 3) | wire_type);
  }
  void put_varint(uint64_t v) {
    while (v >= 0x80) {
      out_.push_back(static_cast<char>((v & 0x7f) | 0x80));
      v >>= 7;
    }
    out_.push_back(static_cast<char>(v));
  }
  template <typename T>
  void put_fixed(T value) {  // little-endian, as the wire format is
    static_assert(sizeof(T) == 4 || sizeof(T) == 8);
    using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
    U bits;
    std::memcpy(&bits, &value, sizeof bits);
    for (size_t i = 0; i < sizeof bits; ++i) out_.push_back(static_cast<char>(bits >> (8 * i)));
  }

  std::string out_;
};

// tensorflow.Event's fields.
constexpr int kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5,
              kEventSessionLog = 7;
// tensorflow.Summary and Summary.Value.
constexpr int kSummaryValue = 1;
constexpr int kValueTag = 1, kValueSimpleValue = 2, kValueHisto = 5, kValueTensor = 8,
              kValueMetadata = 9;
constexpr int kSessionLogStart = 1;  // SessionLog.SessionStatus START
// tensorboard.hparams.HParamsPluginData.
constexpr int kPluginSessionStart = 3, kPluginSessionEnd = 4;

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

Message event_at(int64_t step) {
  Message e;
  e.f64(kEventWallTime, wall_time());
  if (step != 0) e.varint(kEventStep, static_cast<uint64_t>(step));
  return e;
}

Message summary_event(int64_t step, const Message& summary) {
  return event_at(step).message(kEventSummary, summary);
}

// A Summary.Value of the HParams plugin: `content` is an HParamsPluginData.
Message hparams_summary(const char* tag, const Message& plugin_data) {
  Message plugin;
  plugin.bytes(1, "hparams").message(2, plugin_data);  // PluginData{plugin_name, content}
  Message metadata;
  metadata.message(1, plugin);  // SummaryMetadata.plugin_data
  Message null_tensor;          // a float scalar 0, as TensorBoard's own writer puts here
  null_tensor.varint(1, 1).message(2, Message()).bytes(5, std::string(4, '\0'));
  Message value;
  value.bytes(kValueTag, tag).message(kValueMetadata, metadata).message(kValueTensor, null_tensor);
  Message summary;
  summary.message(kSummaryValue, value);
  return summary;
}

// TFRecord's CRC: CRC32C, rotated and offset so that a CRC of data holding
// CRCs stays well distributed.
uint32_t masked_crc(const void* data, size_t n) {
  const uint32_t crc = crc32c(data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

// length (u64), masked CRC of the length (u32), data, masked CRC of the data (u32).
void append_record(std::string& out, const std::string& data) {
  using detail::put_le;
  std::string length;
  put_le(length, data.size(), 8);
  out += length;
  put_le(out, masked_crc(length.data(), length.size()), 4);
  out += data;
  put_le(out, masked_crc(data.data(), data.size()), 4);
}

}  // namespace

TensorBoardLogger::TensorBoardLogger(TensorBoardLoggerOptions options)
    : VersionedLogger("TensorBoardLogger", options.save_dir, options.name, options.version),
      options_(std::move(options)) {
  if (options_.flush_every < 1) {
    throw ConfigError(
        str("TensorBoardLoggerOptions{.flush_every = ", options_.flush_every, "}: must be >= 1."));
  }
  if (options_.max_file_bytes < 1) {
    throw ConfigError(str("TensorBoardLoggerOptions{.max_file_bytes = ", options_.max_file_bytes,
                          "}: must be >= 1 (a new event file is opened past it)."));
  }
}

TensorBoardLogger::~TensorBoardLogger() {
  try {
    save();
  } catch (const std::exception& e) {
    detail::print_note(e.what());
  }
  if (fd_ >= 0) ::close(fd_);
}

void TensorBoardLogger::open_file() {
  const std::string dir = log_dir();
  detail::make_log_directory(dir, "TensorBoardLogger");
  char host[256] = "localhost";
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "localhost");
  char name[400];
  // The time first, zero-padded, then the host, pid and a sequence number
  // of this process (two loggers may open files in the same second):
  // TensorBoard reads a directory's files in name order.
  static std::atomic<int> opened_in_process{0};
  std::snprintf(name, sizeof name, "events.out.tfevents.%010lld.%s.%d.%06d",
                static_cast<long long>(std::time(nullptr)), host, static_cast<int>(::getpid()),
                opened_in_process++);
  const std::string path = (std::filesystem::path(dir) / name).string();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw ConfigError(str("TensorBoardLogger: cannot create the event file \"", path,
                          "\": ", detail::os_reason(errno),
                          ". Check that the log directory is writable and has space."));
  }
  fd_ = fd;
  file_ = path;
  file_bytes_ = 0;
  // Every event file starts with its format version.
  Message version = event_at(0);
  version.bytes(kEventFileVersion, "brain.Event:2");
  append_record(pending_, version.data());
  if (start_pending_) append_start();
  ++files_opened_;
}

void TensorBoardLogger::append_start() {
  // Resumed at step s: TensorBoard drops the interrupted run's events after
  // s, in this file and the earlier ones (those at s were logged before the
  // checkpoint was taken, or are logged again identically).
  Message log;
  log.varint(1, kSessionLogStart);
  append_record(pending_, event_at(*resume_step() + 1).message(kEventSessionLog, log).data());
  ++pending_events_;
  start_pending_ = false;
}

void TensorBoardLogger::load_state_dict(const StateDict& state, int64_t step) {
  const std::string dir = fd_ >= 0 ? log_dir() : "";
  VersionedLogger::load_state_dict(state, step);
  continue_in(dir);
}

void TensorBoardLogger::resume_without_state(int64_t step) {
  const std::string dir = fd_ >= 0 ? log_dir() : "";
  VersionedLogger::resume_without_state(step);
  continue_in(dir);
}

void TensorBoardLogger::continue_in(const std::string& dir_before) {
  if (fd_ >= 0 && log_dir() != dir_before) {
    // An earlier fit's file, in a directory this run does not continue.
    save();
    ::close(fd_);
    fd_ = -1;
  }
  start_pending_ = resume_step().has_value();
  if (start_pending_ && fd_ >= 0) append_start();
}

void TensorBoardLogger::add_event(const std::string& event) {
  if (fd_ < 0) open_file();
  append_record(pending_, event);
  if (++pending_events_ >= options_.flush_every) save();
}

void TensorBoardLogger::save() {
  if (fd_ < 0 || pending_.empty()) return;
  size_t done = 0;
  while (done < pending_.size()) {
    const ssize_t n = ::write(fd_, pending_.data() + done, pending_.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      pending_.erase(0, done);
      file_bytes_ += static_cast<int64_t>(done);
      throw ConfigError(str("TensorBoardLogger: cannot write to \"", file_,
                            "\": ", detail::os_reason(err),
                            ". Check that the log directory has space; the events not written "
                            "stay pending and are written by the next save."));
    }
    done += static_cast<size_t>(n);
  }
  file_bytes_ += static_cast<int64_t>(pending_.size());
  pending_.clear();
  pending_events_ = 0;
  if (file_bytes_ >= options_.max_file_bytes) {
    ::close(fd_);
    fd_ = -1;  // the next event opens the next file
  }
}

void TensorBoardLogger::log_hyperparams(const HParams& params) {
  Message start;
  for (const auto& [key, value] : params) {
    Message v;  // google.protobuf.Value
    if (const auto* b = std::get_if<bool>(&value)) {
      v.varint(4, *b ? 1 : 0);
    } else if (const auto* i = std::get_if<int64_t>(&value)) {
      v.f64(2, static_cast<double>(*i));
    } else if (const auto* d = std::get_if<double>(&value)) {
      v.f64(2, *d);
    } else {
      v.bytes(3, std::get<std::string>(value));
    }
    Message entry;  // map<string, Value> entry
    entry.bytes(1, key).message(2, v);
    start.message(1, entry);
  }
  start.f64(5, wall_time());  // start_time_secs
  Message plugin_data;
  plugin_data.message(kPluginSessionStart, start);
  add_event(summary_event(0, hparams_summary("_hparams_/session_start_info", plugin_data)).data());
}

void TensorBoardLogger::log_metrics(const std::map<std::string, double>& metrics, int64_t step) {
  if (metrics.empty()) return;
  Message summary;
  for (const auto& [tag, value] : metrics) {
    Message v;
    v.bytes(kValueTag, tag).f32(kValueSimpleValue, static_cast<float>(value));
    summary.message(kSummaryValue, v);
  }
  add_event(summary_event(step, summary).data());
}

void TensorBoardLogger::log_parameters(const Module& module, int64_t step) {
  if (!options_.log_histograms) return;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    log_histogram("parameters/" + item.key(), item.value(), step);
  }
}

void TensorBoardLogger::log_histogram(const std::string& tag, const at::Tensor& values,
                                      int64_t step) {
  if (!values.defined()) return;
  if (!values.is_floating_point()) {
    throw ConfigError(str("TensorBoardLogger.log_histogram(\"", tag, "\"): the tensor is ",
                          std::string(c10::toString(values.scalar_type())),
                          "; pass a floating-point tensor."));
  }
  at::Tensor flat = values.detach().to(torch::kCPU, torch::kDouble).flatten();
  flat = flat.masked_select(torch::isfinite(flat));  // NaN and inf have no bucket
  const int64_t n = flat.numel();
  if (n == 0) return;
  const double lo = flat.min().item<double>();
  const double hi = flat.max().item<double>();
  const int64_t bins = lo == hi ? 1 : std::min<int64_t>(30, std::max<int64_t>(1, n));
  const at::Tensor counts = torch::histc(flat, bins, lo, hi);
  std::vector<double> limits(static_cast<size_t>(bins)), buckets(static_cast<size_t>(bins));
  const auto* c = counts.data_ptr<double>();
  for (int64_t i = 0; i < bins; ++i) {
    limits[static_cast<size_t>(i)] =
        i + 1 == bins ? hi
                      : lo + (hi - lo) * static_cast<double>(i + 1) / static_cast<double>(bins);
    buckets[static_cast<size_t>(i)] = c[i];
  }
  Message histo;  // HistogramProto
  histo.f64(1, lo)
      .f64(2, hi)
      .f64(3, static_cast<double>(n))
      .f64(4, flat.sum().item<double>())
      .f64(5, flat.square().sum().item<double>())
      .packed_f64(6, limits)
      .packed_f64(7, buckets);
  Message v;
  v.bytes(kValueTag, tag).message(kValueHisto, histo);
  Message summary;
  summary.message(kSummaryValue, v);
  add_event(summary_event(step, summary).data());
}

void TensorBoardLogger::log_run_status(RunStatus status) {
  if (files_opened_ == 0) return;  // nothing was logged: no run to end
  Message end;
  // tensorboard.hparams.Status: SUCCESS 1, FAILURE 2, RUNNING 3.
  end.varint(1, status == RunStatus::kSuccess ? 1 : status == RunStatus::kFailed ? 2 : 3);
  end.f64(2, wall_time());
  Message plugin_data;
  plugin_data.message(kPluginSessionEnd, end);
  add_event(summary_event(0, hparams_summary("_hparams_/session_end_info", plugin_data)).data());
}

void TensorBoardLogger::finalize() {
  start_pending_ = false;  // a resumed fit that logged nothing: the next fit's is not
  save();
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

}  // namespace fulgur
