#pragma once
// What a path that is not a regular file is, in words, for the errors of
// the readers that refuse such paths by their type before opening them
// (checkpoints, config files): opening a FIFO could block for ever.

#include <sys/stat.h>

#include <filesystem>
#include <string>
#include <system_error>

#include "fulgur/core/errors.h"

namespace fulgur::detail {

/// "a directory", "a FIFO (named pipe)", ... for a stat() mode.
inline const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

/// Why a path cannot be a directory to write in: `why` says it ("\"/a/b\"
/// is a file"), empty when it is a directory or is not there yet;
/// `in_the_way` when the cause is something there that is not a directory
/// (to be moved away), not a part that cannot be looked up.
struct UnusableDirectory {
  std::string why;
  bool in_the_way = false;
};

inline UnusableDirectory unusable_directory(const std::string& dir) {
  namespace fs = std::filesystem;
  for (fs::path at = dir; !at.empty(); at = at.parent_path()) {
    std::error_code ec;
    const fs::file_status status = fs::status(at, ec);
    if (fs::is_directory(status)) return {};
    if (fs::exists(status)) {
      return {str("\"", at.string(), "\" is ",
                  fs::is_regular_file(status) ? "a file" : "not a directory"),
              true};
    }
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory) {
      return {str("\"", at.string(), "\" cannot be looked up (", ec.message(), ")"), false};
    }
    if (at == at.parent_path()) break;
  }
  return {};
}

}  // namespace fulgur::detail
