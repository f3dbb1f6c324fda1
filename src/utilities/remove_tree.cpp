#include "utilities/remove_tree.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace fulgur::detail {

namespace {

/// Removes `name` (relative to the directory `at`); returns 0 or the first errno.
int remove_at(int at, const char* name, std::uintmax_t& removed) {
  struct stat st {};
  if (::fstatat(at, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return errno == ENOENT ? 0 : errno;
  if (S_ISDIR(st.st_mode)) {
    const int fd = ::openat(at, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT ? 0 : errno;
    DIR* dir = ::fdopendir(fd);
    if (dir == nullptr) {
      const int err = errno;
      ::close(fd);
      return err;
    }
    int first = 0;
    while (const dirent* entry = ::readdir(dir)) {
      if (std::strcmp(entry->d_name, ".") == 0 || std::strcmp(entry->d_name, "..") == 0) continue;
      const int err = remove_at(::dirfd(dir), entry->d_name, removed);
      if (err != 0 && first == 0) first = err;
    }
    ::closedir(dir);
    if (first != 0) return first;
    if (::unlinkat(at, name, AT_REMOVEDIR) != 0) return errno == ENOENT ? 0 : errno;
  } else if (::unlinkat(at, name, 0) != 0) {
    return errno == ENOENT ? 0 : errno;
  }
  ++removed;
  return 0;
}

}  // namespace

std::uintmax_t remove_tree(const std::string& path, std::error_code& ec) {
  ec.clear();
  std::uintmax_t removed = 0;
  if (const int err = remove_at(AT_FDCWD, path.c_str(), removed); err != 0) {
    ec = std::error_code(err, std::generic_category());
  }
  return removed;
}

}  // namespace fulgur::detail
