#include "fulgur/loggers/csv_logger.h"

#include <filesystem>
#include <iostream>

#include "fulgur/loggers/plot.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "fulgur/core/errors.h"

namespace fulgur {

namespace fs = std::filesystem;

CSVLogger::CSVLogger(CSVLoggerOptions options) : options_(std::move(options)) {
  if (options_.flush_every < 1) {
    throw ConfigError(
        str("CSVLoggerOptions{.flush_every = ", options_.flush_every, "}: must be >= 1."));
  }
  version_ = options_.version;
}

void CSVLogger::resolve_version() const {
  if (version_) return;
  // The next free version_N under save_dir/name.
  fs::path root = fs::path(options_.save_dir.empty() ? "." : options_.save_dir) / options_.name;
  int64_t next = 0;
  std::error_code ec;
  if (fs::is_directory(root, ec)) {
    for (const auto& entry : fs::directory_iterator(root, ec)) {
      auto name = entry.path().filename().string();
      if (name.rfind("version_", 0) == 0) {
        try {
          next = std::max<int64_t>(next, std::stoll(name.substr(8)) + 1);
        } catch (const std::exception&) {
        }
      }
    }
  }
  version_ = next;
}

std::string CSVLogger::log_dir() const {
  resolve_version();
  fs::path root = fs::path(options_.save_dir.empty() ? "." : options_.save_dir) / options_.name;
  return (root / ("version_" + std::to_string(*version_))).string();
}

std::string CSVLogger::metrics_file() const {
  return (fs::path(log_dir()) / "metrics.csv").string();
}

namespace {

// The OS's reason for the last failed open or write, for an error message.
std::string os_reason() { return errno != 0 ? std::strerror(errno) : "unknown reason"; }

// `dir` and its parents; ConfigError naming it, the OS reason and a way out.
void make_directory(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    throw ConfigError(str("CSVLogger: cannot create the log directory \"", dir,
                          "\": ", ec.message(),
                          ". Make its parent writable by this user, or log elsewhere "
                          "(CSVLoggerOptions save_dir, or the Trainer's default_root_dir)."));
  }
}

}  // namespace

void CSVLogger::log_hyperparams(const HParams& params) {
  make_directory(log_dir());
  errno = 0;
  std::ofstream out(fs::path(log_dir()) / "hparams.yaml");
  if (params.empty()) out << "{}\n";
  for (const auto& [key, value] : params) {
    if (std::holds_alternative<std::string>(value)) {
      // Quote strings so YAML never reads them as numbers or booleans.
      std::string escaped;
      for (char c : std::get<std::string>(value)) {
        if (c == '"' || c == '\\') escaped += '\\';
        escaped += c;
      }
      out << key << ": \"" << escaped << "\"\n";
    } else {
      out << key << ": " << to_string(value) << "\n";
    }
  }
  out.flush();
  if (!out) {
    throw ConfigError(str("CSVLogger: cannot write \"", log_dir(), "/hparams.yaml\": ", os_reason(),
                          ". Check that save_dir is writable and has space."));
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
      std::snprintf(buf, sizeof buf, "%.9g", it->second);
      out << buf;
    }
  }
  out << '\n';
}
}  // namespace

void CSVLogger::save() {
  if (pending_.empty() && !header_changed_) return;
  make_directory(log_dir());
  auto path = metrics_file();
  errno = 0;
  if (header_changed_ || !header_written_) {
    // A new column: rewrite the whole file with the wider header.
    std::ofstream out(path, std::ios::trunc);
    out << "step";
    for (const auto& c : columns_) out << ',' << c;
    out << '\n';
    for (const auto& [step, row] : written_) write_row(out, columns_, step, row);
    for (const auto& [step, row] : pending_) write_row(out, columns_, step, row);
    out.flush();
    if (!out) {
      throw ConfigError(str("CSVLogger: cannot write \"", path, "\": ", os_reason(),
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
    std::cerr << "fulgur: CSVLogger: " << problem << std::endl;
  }
}

}  // namespace fulgur
