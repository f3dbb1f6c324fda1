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

void CSVLogger::log_metrics(const std::map<std::string, double>& metrics, int64_t step) {
  for (const auto& [name, _] : metrics) {
    if (std::find(columns_.begin(), columns_.end(), name) == columns_.end()) {
      columns_.push_back(name);
      header_changed_ = true;
    }
  }
  pending_.emplace_back(step, metrics);
  if (static_cast<int64_t>(pending_.size()) >= options_.flush_every) save();
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
}  // namespace

void CSVLogger::read_previous_rows() {
  std::ifstream in(metrics_file());
  std::string line;
  if (!in) return;
  if (!std::getline(in, line)) {
    detail::print_note(str("CSVLogger: \"", metrics_file(),
                           "\" is empty: the rows of the run resumed from are not there; this "
                           "run's are written from here on."));
    return;
  }
  std::vector<std::string> header;
  {
    std::stringstream cells(line);
    std::string cell;
    while (std::getline(cells, cell, ',')) header.push_back(cell);
  }
  if (header.empty() || header.front() != "step") {
    detail::print_note(str("CSVLogger: \"", metrics_file(),
                           "\" is not a metrics file this logger wrote (its first line does not "
                           "start with \"step\"); it is written anew with this run's rows."));
    return;
  }
  std::vector<std::string> columns(header.begin() + 1, header.end());
  for (const auto& c : columns_) {
    if (std::find(columns.begin(), columns.end(), c) == columns.end()) columns.push_back(c);
  }
  std::vector<std::pair<int64_t, std::map<std::string, double>>> rows;
  int64_t later = 0;  // rows the run resumed from logged after the checkpoint
  int64_t cut = 0;    // rows cut short by its interruption
  while (std::getline(in, line)) {
    if (in.eof()) {  // no newline: a row cut by the interruption
      ++cut;
      break;
    }
    std::stringstream cells(line);
    std::string cell;
    std::map<std::string, double> row;
    int64_t step = 0;
    bool ok = static_cast<bool>(std::getline(cells, cell, ','));
    try {
      if (ok) step = std::stoll(cell);
      for (size_t i = 1; ok && i < header.size() && std::getline(cells, cell, ','); ++i) {
        if (!cell.empty()) row[header[i]] = std::stod(cell);
      }
    } catch (const std::exception&) {
      ok = false;  // a row cut by the interruption
    }
    if (!ok) {
      ++cut;
    } else if (step <= *resume_step()) {
      rows.emplace_back(step, std::move(row));
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
  columns_ = std::move(columns);
  rows.insert(rows.end(), std::make_move_iterator(written_.begin()),
              std::make_move_iterator(written_.end()));
  written_ = std::move(rows);
}

void CSVLogger::save() {
  if (pending_.empty() && !header_changed_) return;
  make_directory(log_dir());
  if (resume_step() && !previous_rows_read_) {
    read_previous_rows();
    previous_rows_read_ = true;
    header_changed_ = true;  // rewrite: the file holds only the kept rows
  }
  auto path = metrics_file();
  if (!header_written_ && !resume_step()) {
    // A version given explicitly may hold another run's rows.
    std::error_code ec;
    if (fs::is_regular_file(path, ec) && fs::file_size(path, ec) > 0 && !ec) {
      detail::print_note(str("CSVLogger: \"", path,
                             "\" holds the rows of an earlier run of this version; they are "
                             "replaced by this run's. Pass another version (or none: the next "
                             "free one) to keep them."));
    }
  }
  errno = 0;
  if (header_changed_ || !header_written_) {
    // A new column: the whole file anew with the wider header, replacing
    // the old one whole (a full disk keeps it as it was).
    std::ostringstream out;
    out << "step";
    for (const auto& c : columns_) out << ',' << c;
    out << '\n';
    for (const auto& [step, row] : written_) write_row(out, columns_, step, row);
    for (const auto& [step, row] : pending_) write_row(out, columns_, step, row);
    if (std::string problem = detail::write_file_atomically(path, out.str()); !problem.empty()) {
      throw ConfigError(str("CSVLogger: ", problem,
                            ". Check that save_dir is writable and has space; the rows stay "
                            "pending and are written by the next save."));
    }
    header_written_ = true;
    header_changed_ = false;
  } else {
    std::ofstream out(path, std::ios::app);
    for (const auto& [step, row] : pending_) write_row(out, columns_, step, row);
    out.flush();
    if (!out) {
      // Part of a row may have gone in: the next save writes the file anew.
      header_changed_ = true;
      throw ConfigError(str("CSVLogger: cannot append to \"", path, "\": ", os_reason(),
                            ". Check that save_dir is writable and has space; the rows stay "
                            "pending and are written by the next save."));
    }
  }
  for (auto& r : pending_) written_.push_back(std::move(r));
  pending_.clear();
}

void CSVLogger::finalize() {
  save();
  if (!options_.plot || written_.empty()) return;
  const std::string png = (std::filesystem::path(log_dir()) / "metrics.png").string();
  if (const std::string problem = plot_metrics(metrics_file(), png); !problem.empty()) {
    detail::print_note(str("CSVLogger: ", problem));
  }
}

}  // namespace fulgur
