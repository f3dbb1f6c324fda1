// Private: reading a small text file that a user or a launcher names (a
// --config file, LSF's rank file, a sharded checkpoint's manifest) through
// one checked open: the path's type first (a directory, FIFO, device or
// socket is refused without being opened, so nothing can block), then a
// non-blocking open, the type and size again on what was opened (the path
// may have changed in between), and a read of at most `max_bytes` (so
// /dev/zero or a huge file cannot fill the memory). The caller words the
// error: the path, what was found, and what to do.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace fulgur::detail {

struct SmallFileRead {
  enum class Problem { kNone, kMissing, kNotRegular, kTooLarge, kCannotOpen, kCannotRead };
  Problem problem = Problem::kNone;
  /// kNone: the file's bytes.
  std::string text;
  /// kNotRegular: what the path is (file_kind).
  mode_t mode = 0;
  /// kTooLarge: its size (at least).
  uint64_t size = 0;
  /// kMissing, kCannotOpen, kCannotRead: errno.
  int error = 0;
  bool ok() const { return problem == Problem::kNone; }
  /// The problem as a phrase after the path: "does not exist", "is a
  /// directory", "is 3.0 MiB, more than the 65536 bytes such a file may
  /// have", "cannot be opened for reading: Permission denied", ...
  std::string describe(uint64_t max_bytes) const;
};

SmallFileRead read_small_file(const std::string& path, uint64_t max_bytes);

/// "512 bytes", "3.2 MiB".
std::string size_text(uint64_t bytes);

}  // namespace fulgur::detail
