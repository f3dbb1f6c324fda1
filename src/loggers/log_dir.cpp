#include "loggers/log_dir.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <system_error>

#include "fulgur/core/errors.h"
#include "fulgur/loggers/logger.h"
#include "utilities/file_kind.h"

namespace fulgur::detail {

namespace fs = std::filesystem;

namespace {

// N of "version_N", or nothing.
std::optional<int64_t> version_number(const std::string& dir_name) {
  const std::string prefix = "version_";
  if (dir_name.rfind(prefix, 0) != 0 || dir_name.size() == prefix.size()) return std::nullopt;
  int64_t n = 0;
  for (size_t i = prefix.size(); i < dir_name.size(); ++i) {
    const char c = dir_name[i];
    if (c < '0' || c > '9' || n > (INT64_MAX - 9) / 10) return std::nullopt;
    n = n * 10 + (c - '0');
  }
  return n;
}

}  // namespace

std::string os_reason(int err) { return err != 0 ? std::strerror(err) : "unknown reason"; }

std::string versions_root(const std::string& save_dir, const std::string& name) {
  return (fs::path(save_dir.empty() ? "." : save_dir) / name).string();
}

int64_t next_free_version(const std::string& root) {
  int64_t next = 0;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return 0;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    if (auto n = version_number(entry.path().filename().string())) next = std::max(next, *n + 1);
  }
  return next;
}

void make_log_directory(const std::string& dir, const std::string& logger) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    // A file on the way is named: "Not a directory" alone does not say which.
    const UnusableDirectory unusable = unusable_directory(dir);
    throw ConfigError(
        str(logger, ": cannot create the log directory \"", dir,
            "\": ", unusable.why.empty() ? ec.message() : unusable.why,
            unusable.in_the_way ? ". Move it away" : ". Make its parent writable by this user",
            ", or log elsewhere (the logger's save_dir, or the Trainer's "
            "default_root_dir)."));
  }
}

std::optional<int64_t> resumed_version(const std::string& previous_dir, const std::string& root,
                                       const std::string& logger) {
  if (previous_dir.empty()) return std::nullopt;
  const fs::path previous(previous_dir);
  std::error_code ec1, ec2;
  const fs::path parent = fs::weakly_canonical(fs::absolute(previous).parent_path(), ec1);
  const fs::path here = fs::weakly_canonical(fs::absolute(root), ec2);
  const auto n = version_number(previous.filename().string());
  if (!ec1 && !ec2 && n && parent == here) return n;
  detail::print_note(
      str(logger, ": the checkpoint's run logged to \"", previous_dir,
          "\", which is not a version directory under \"", root,
          "\"; this run logs to a new version there and leaves those logs as they are."));
  return std::nullopt;
}

}  // namespace fulgur::detail

namespace fulgur {

namespace fs = std::filesystem;

VersionedLogger::VersionedLogger(std::string kind, std::string save_dir, std::string name,
                                 std::optional<int64_t> version)
    : kind_(std::move(kind)),
      save_dir_(std::move(save_dir)),
      name_(std::move(name)),
      explicit_version_(version),
      version_(version) {
  if (version && *version < 0) {
    throw ConfigError(str(kind_, "Options{.version = ", *version,
                          "}: must be >= 0, or unset for the next free one."));
  }
}

std::string VersionedLogger::log_dir() const {
  const std::string root = detail::versions_root(save_dir_, name_);
  if (!version_) version_ = detail::next_free_version(root);
  return (fs::path(root) / ("version_" + std::to_string(*version_))).string();
}

std::string VersionedLogger::state_key() const {
  return str(kind_, "{", detail::versions_root(save_dir_, name_), "}");
}

namespace {
// `path` absolute, its links resolved; as given when that fails.
std::string canonical_text(const std::string& path) {
  std::error_code ec;
  fs::path whole = fs::absolute(path, ec);
  if (!ec) whole = fs::weakly_canonical(whole, ec);
  return ec ? path : whole.string();
}
}  // namespace

std::string VersionedLogger::files_key() const {
  return str(kind_, "{", canonical_text(detail::versions_root(save_dir_, name_)), "}");
}

// log_dir (string): the version directory it writes to, absolute (a
// relative one would name another run's directory when resumed from
// elsewhere). Optional on load (none, or not a string: the logger picks a
// version of its own).
StateDict VersionedLogger::state_dict() const {
  StateDict state;
  state.set("log_dir", canonical_text(log_dir()));
  return state;
}

void VersionedLogger::load_state_dict(const StateDict& state, int64_t step) {
  resume_step_.reset();  // an earlier fit's resume of this logger is not this one's
  const c10::IValue* dir = state.find("log_dir");
  if (dir == nullptr || !dir->isString()) return;
  const auto version =
      explicit_version_
          ? explicit_version_
          : detail::resumed_version(dir->toStringRef(), detail::versions_root(save_dir_, name_),
                                    kind_);
  if (!version) {
    // A version of its own: a new one when an earlier fit of this logger
    // wrote into the one it chose.
    choose_version_again();
    return;
  }
  version_ = version;
  resume_step_ = step;
}

void VersionedLogger::resume_without_state(int64_t /*step*/) {
  resume_step_.reset();
  choose_version_again();
}

void VersionedLogger::choose_version_again() {
  if (explicit_version_ || !version_) return;
  // Chosen now, before any logger of the run creates its directory: the
  // run's loggers under the same root choose the same one.
  version_.reset();
  (void)log_dir();
}

void VersionedLogger::follow_log_dir(const std::string& dir) {
  if (explicit_version_) return;
  if (auto version = detail::version_number(fs::path(dir).filename().string())) {
    version_ = version;
  }
}

}  // namespace fulgur
