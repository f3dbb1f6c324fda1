#include "fulgur/loggers/csv_logger.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <type_traits>

#include <yaml-cpp/yaml.h>

#include "fulgur/core/errors.h"
#include "fulgur/loggers/plot.h"
#include "fulgur/trainer/flags.h"
#include "loggers/log_dir.h"
#include "utilities/durable_file.h"

namespace fulgur {

namespace fs = std::filesystem;

CSVLogger::CSVLogger(CSVLoggerOptions options)
    : VersionedLogger("CSVLogger", options.save_dir, options.name, options.version),
      options_(std::move(options)) {
  if (options_.flush_every < 1) {
    throw ConfigError(
        str("CSVLoggerOptions{.flush_every = ", options_.flush_every, "}: must be >= 1."));
  }
}

std::string CSVLogger::metrics_file() const {
  return (fs::path(log_dir()) / "metrics.csv").string();
}

namespace {

std::string os_reason() { return detail::os_reason(errno); }

void make_directory(const std::string& dir) { detail::make_log_directory(dir, "CSVLogger"); }

}  // namespace

namespace {
// A double as YAML reads it back exactly, and as a float (not an int or a
// string): the shortest digits that give it back, with a '.' in the
// mantissa (PyYAML reads "1e-05" as a string), and YAML's .inf and .nan.
std::string yaml_double(double v) {
  if (std::isnan(v)) return ".nan";
  if (std::isinf(v)) return v > 0 ? ".inf" : "-.inf";
  std::string text = number_text(v);
  const size_t e = text.find_first_of("eE");
  if (text.find('.') == std::string::npos)
    text.insert(e == std::string::npos ? text.size() : e, ".0");
  return text;
}
}  // namespace

void CSVLogger::log_hyperparams(const HParams& params) {
  make_directory(log_dir());
  // yaml-cpp quotes and escapes what needs it (a key with ": " or " #",
  // newlines and control characters in a value).
  YAML::Emitter out;
  out << YAML::BeginMap;
  for (const auto& [key, value] : params) {
    out << YAML::Key << key << YAML::Value;
    std::visit(
        [&out](const auto& v) {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, std::string>) {
            out << YAML::DoubleQuoted << v;  // never read as a number or a boolean
          } else if constexpr (std::is_same_v<T, double>) {
            out << yaml_double(v);
          } else {
            out << v;
          }
        },
        value);
  }
  out << YAML::EndMap;
  if (!out.good()) {
    throw ConfigError(str(
        "CSVLogger: the hyper-parameters cannot be written as YAML: ", out.GetLastError(), "."));
  }
  // Whole or not at all: a full disk keeps the previous file.
  const std::string path = (fs::path(log_dir()) / "hparams.yaml").string();
  if (std::string problem = detail::write_file_atomically(path, std::string(out.c_str()) + "\n");
      !problem.empty()) {
    throw ConfigError(
        str("CSVLogger: ", problem, ". Check that save_dir is writable and has space."));
  }
}

std::string CSVLogger::why_not_a_column(std::string_view name) {
  if (name.empty()) return "a column needs a name";
  if (name == "step") return "\"step\" is its first column, each row's step";
  const size_t bad = name.find_first_of(",\"\n\r");
  if (bad == std::string_view::npos) return "";
  const char c = name[bad];
  return str("it holds ",
             c == '\n'   ? "a line break"
             : c == '\r' ? "a carriage return"
             : c == ','  ? "a comma"
                         : "a double quote",
             ", and metrics.csv separates its columns with commas and its rows with line "
             "breaks, and reads no quoting");
}

void CSVLogger::log_metrics(const std::map<std::string, double>& metrics, int64_t step) {
  // Names the file cannot hold, before anything is kept.
  for (const auto& [name, _] : metrics) {
    if (const std::string why = why_not_a_column(name); !why.empty()) {
      throw ConfigError(str("CSVLogger.log_metrics: a metric named \"", name,
                            "\" cannot be a column of metrics.csv (", why,
                            "). Name it otherwise, e.g. with '_' or '/'."));
    }
  }
  for (const auto& [name, _] : metrics) {
    if (std::find(columns_.begin(), columns_.end(), name) == columns_.end()) {
      columns_.push_back(name);
    }
  }
  pending_.emplace_back(step, metrics);
  if (static_cast<int64_t>(pending_.size()) >= options_.flush_every) save();
}

// An earlier fit of this logger (the same Trainer fitting again) has
// written its rows first: a resume reads them back from the file.
void CSVLogger::load_state_dict(const StateDict& state, int64_t step) {
  save();
  const std::string before = file_columns_ ? log_dir() : "";
  VersionedLogger::load_state_dict(state, step);
  if (!before.empty() && log_dir() != before) start_anew();  // another version
  // Continuing a run's file: the next save keeps its rows up to the step.
  reconcile_ = resume_step().has_value();
}

void CSVLogger::resume_without_state(int64_t step) {
  save();
  VersionedLogger::resume_without_state(step);
  // Another run: its first save writes the file anew, as a new logger's
  // does (with an explicit version, the same file, noting that it replaces
  // the rows there).
  start_anew();
  reconcile_ = false;
}

void CSVLogger::start_anew() {
  columns_.clear();
  file_columns_.reset();
  file_bytes_ = 0;
  file_rows_ = 0;
  rewrite_ = false;
}

namespace {
void write_row(std::ostream& out, const std::vector<std::string>& columns, int64_t step,
               const std::map<std::string, double>& row) {
  out << step;
  char buf[32];
  for (const auto& c : columns) {
    out << ',';
    auto it = row.find(c);
    if (it != row.end()) {
      // A value a float holds (most logged values: float tensors') in 9
      // digits, which read back as that float; any other double (a byte
      // count, a large counter) with the digits it needs to read back.
      const double v = it->second;
      if (!std::isfinite(v) || static_cast<double>(static_cast<float>(v)) == v) {
        std::snprintf(buf, sizeof buf, "%.9g", v);
      } else {
        std::snprintf(buf, sizeof buf, "%.15g", v);
        if (std::strtod(buf, nullptr) != v) std::snprintf(buf, sizeof buf, "%.17g", v);
      }
      out << buf;
    }
  }
  out << '\n';
}

// The cells of a line of metrics.csv.
std::vector<std::string> cells_of(const std::string& line) {
  std::vector<std::string> cells;
  std::stringstream in(line);
  std::string cell;
  while (std::getline(in, cell, ',')) cells.push_back(cell);
  if (!line.empty() && line.back() == ',') cells.emplace_back();
  return cells;
}

// Whether `cells` is a row under a header of `width` cells: a step, then
// numbers or empty cells.
bool is_row(const std::vector<std::string>& cells, size_t width, int64_t& step) {
  if (cells.empty() || cells.size() > width) return false;
  try {
    size_t used = 0;
    step = std::stoll(cells[0], &used);
    if (used != cells[0].size()) return false;
    for (size_t i = 1; i < cells.size(); ++i) {
      if (cells[i].empty()) continue;
      (void)std::stod(cells[i], &used);
      if (used != cells[i].size()) return false;
    }
  } catch (const std::exception&) {
    return false;
  }
  return true;
}
}  // namespace

CSVLogger::FileRows CSVLogger::read_previous_rows() {
  FileRows kept;
  int64_t later = 0;  // rows logged after the checkpoint by the run resumed from
  int64_t cut = 0;    // rows cut short by its interruption
  std::ifstream in(metrics_file());
  if (!in) return kept;
  std::string line;
  if (!std::getline(in, line)) {
    detail::print_note(str("CSVLogger: \"", metrics_file(),
                           "\" is empty: the rows of the run resumed from are not there; this "
                           "run's are written from here on."));
    return kept;
  }
  const std::vector<std::string> header = cells_of(line);
  if (header.empty() || header.front() != "step") {
    detail::print_note(str("CSVLogger: \"", metrics_file(),
                           "\" is not a metrics file this logger wrote (its first line does not "
                           "start with \"step\"); it is written anew with this run's rows."));
    return kept;
  }
  kept.columns.assign(header.begin() + 1, header.end());
  while (std::getline(in, line)) {
    int64_t step = 0;
    const std::vector<std::string> cells = cells_of(line);
    if (in.eof() || !is_row(cells, header.size(), step)) {
      ++cut;  // no newline, or not whole: a row cut by the interruption
      if (in.eof()) break;
    } else if (step <= *resume_step()) {
      // As written (the digits stay as they were), as wide as the header.
      kept.lines.push_back(line + std::string(header.size() - cells.size(), ','));
    } else {
      ++later;
    }
  }
  if (later > 0 || cut > 0) {
    std::string what;
    if (later > 0) {
      what = str(later, later == 1 ? " row" : " rows",
                 " after that step (logged by the run "
                 "resumed from after its checkpoint) ",
                 later == 1 ? "is" : "are", " dropped: this run logs those steps again");
    }
    if (cut > 0) {
      what += str(what.empty() ? "" : "; ", cut, cut == 1 ? " row" : " rows",
                  " cut short by its interruption ", cut == 1 ? "is" : "are", " dropped");
    }
    detail::print_note(str("CSVLogger: resumed at step ", *resume_step(), ": in \"", metrics_file(),
                           "\", ", what, "."));
  }
  return kept;
}

CSVLogger::FileRows CSVLogger::read_written_rows() const {
  // The file as this logger last completed it: what a failed append left
  // after that is not read.
  FileRows kept;
  kept.columns.assign(columns_.begin(),
                      columns_.begin() + static_cast<std::ptrdiff_t>(*file_columns_));
  std::ifstream in(metrics_file(), std::ios::binary);
  std::string text(static_cast<size_t>(file_bytes_), '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (static_cast<uintmax_t>(in.gcount()) < file_bytes_) {
    detail::print_note(str("CSVLogger: \"", metrics_file(),
                           "\" is shorter than this logger wrote it (removed or cut by another "
                           "program?): it is written anew with the rows still there."));
    text.resize(static_cast<size_t>(in.gcount()));
    text.resize(text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1);
  }
  size_t at = text.find('\n');  // after the header
  while (at != std::string::npos && at + 1 < text.size()) {
    const size_t end = text.find('\n', at + 1);
    kept.lines.push_back(text.substr(at + 1, end - at - 1));
    at = end;
  }
  return kept;
}

void CSVLogger::save() {
  const bool wider = file_columns_ && *file_columns_ != columns_.size();
  if (pending_.empty() && !wider && !rewrite_ && !reconcile_) return;
  make_directory(log_dir());
  const auto path = metrics_file();
  errno = 0;
  if (!file_columns_ || wider || rewrite_ || reconcile_) {
    // The whole file anew (a first save, a wider header, a resume, or after
    // a failed append), replacing the old one whole: a full disk keeps it
    // as it was. The rows kept from it are its lines as they were, widened
    // with empty cells for the new columns (new columns come last).
    FileRows kept;
    if (reconcile_) {
      kept = read_previous_rows();
    } else if (file_columns_) {
      kept = read_written_rows();
    } else {
      // A version given explicitly may hold another run's rows.
      std::error_code ec;
      if (fs::is_regular_file(path, ec) && fs::file_size(path, ec) > 0 && !ec) {
        detail::print_note(str("CSVLogger: \"", path,
                               "\" holds the rows of an earlier run of this version; they are "
                               "replaced by this run's. Pass another version (or none: the next "
                               "free one) to keep them."));
      }
    }
    std::vector<std::string> columns = kept.columns;
    for (const auto& c : columns_) {
      if (std::find(columns.begin(), columns.end(), c) == columns.end()) columns.push_back(c);
    }
    const std::string widen(columns.size() - kept.columns.size(), ',');
    std::ostringstream out;
    out << "step";
    for (const auto& c : columns) out << ',' << c;
    out << '\n';
    for (const auto& line : kept.lines) out << line << widen << '\n';
    for (const auto& [step, row] : pending_) write_row(out, columns, step, row);
    const std::string text = out.str();
    if (std::string problem = detail::write_file_atomically(path, text); !problem.empty()) {
      throw ConfigError(str("CSVLogger: ", problem,
                            ". Check that save_dir is writable and has space; the rows stay "
                            "pending and are written by the next save."));
    }
    columns_ = std::move(columns);
    file_columns_ = columns_.size();
    file_bytes_ = text.size();
    file_rows_ = static_cast<int64_t>(kept.lines.size());
    rewrite_ = reconcile_ = false;
  } else {
    std::ostringstream rows;
    for (const auto& [step, row] : pending_) write_row(rows, columns_, step, row);
    const std::string text = rows.str();
    std::ofstream out(path, std::ios::app | std::ios::binary);
    out << text;
    out.flush();
    if (!out) {
      // Part of a row may have gone in: the next save writes the file anew
      // from what was there before this append.
      rewrite_ = true;
      throw ConfigError(str("CSVLogger: cannot append to \"", path, "\": ", os_reason(),
                            ". Check that save_dir is writable and has space; the rows stay "
                            "pending and are written by the next save."));
    }
    file_bytes_ += text.size();
  }
  file_rows_ += static_cast<int64_t>(pending_.size());
  pending_.clear();
}

void CSVLogger::finalize() {
  save();
  if (!options_.plot || file_rows_ == 0) return;
  const std::string png = (std::filesystem::path(log_dir()) / "metrics.png").string();
  if (const std::string problem = plot_metrics(metrics_file(), png); !problem.empty()) {
    detail::print_note(str("CSVLogger: ", problem));
  }
}

}  // namespace fulgur
