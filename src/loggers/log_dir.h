// Internal: the version directories loggers write into, shared by
// CSVLogger and TensorBoardLogger so that both land in the same
// `<save_dir>/<name>/version_<N>` and a resumed run continues its own.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace fulgur::detail {

/// `<save_dir>/<name>` ("." when save_dir is empty).
std::string versions_root(const std::string& save_dir, const std::string& name);

/// The OS's reason for a failed open or write (`err` is an errno value).
std::string os_reason(int err);

/// The next free N of `version_N` under `root` (0 when there is none).
int64_t next_free_version(const std::string& root);

/// Creates `dir` and its parents; ConfigError naming `logger`, the
/// directory, the OS's reason and a way out.
void make_log_directory(const std::string& dir, const std::string& logger);

/// The version a resumed run continues: N when `previous_dir` (a log_dir()
/// saved in the checkpoint) is `<root>/version_N`; otherwise nothing, after
/// a note on stderr naming both (the checkpoint came from another place,
/// and its logs are left as they are).
std::optional<int64_t> resumed_version(const std::string& previous_dir, const std::string& root,
                                       const std::string& logger);

}  // namespace fulgur::detail
