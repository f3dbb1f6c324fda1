#pragma once
// What a path that is not a regular file is, in words, for the errors of
// the readers that refuse such paths by their type before opening them
// (checkpoints, config files): opening a FIFO could block for ever.

#include <sys/stat.h>

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

}  // namespace fulgur::detail
