#include "utilities/durable_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "fulgur/core/errors.h"
#include "utilities/remove_tree.h"

namespace fulgur::detail {

std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

std::string temporary_path_for(const std::string& path) {
  return str(path, ".tmp.", ::getpid(), ".", this_host());
}

bool is_dead_writers_temporary(const std::string& name) {
  const auto at = name.rfind(".tmp.");
  if (at == std::string::npos) return false;
  const std::string rest = name.substr(at + 5);
  const auto dot = rest.find('.');
  const std::string pid_text = rest.substr(0, dot);
  if (pid_text.empty() || pid_text.size() > 9 ||
      !std::all_of(pid_text.begin(), pid_text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  // Another machine's writer cannot be checked from here; a live writer
  // (or one this process may not signal) is not dead.
  if (dot != std::string::npos && rest.substr(dot + 1) != this_host()) return false;
  const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
  return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH;
}

int flush_directory(const std::string& dir) {
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return 0;  // not to be opened (no read permission): left as it is
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  return rc != 0 && err != EINVAL ? err : 0;
}

namespace {

std::string directory_of(const std::string& path) {
  const std::filesystem::path p(path);
  return p.has_parent_path() ? p.parent_path().string() : ".";
}

}  // namespace

std::string write_file_atomically(const std::string& path, std::string_view bytes) {
  const std::string tmp = temporary_path_for(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return str("cannot create \"", tmp, "\": ", std::strerror(errno));
  auto fail = [&](const char* what) {
    const int err = errno != 0 ? errno : EIO;
    ::close(fd);
    ::unlink(tmp.c_str());
    return str("cannot ", what, " \"", tmp, "\": ", std::strerror(err));
  };
  size_t done = 0;
  while (done < bytes.size()) {
    errno = 0;
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return fail("write");
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) return fail("flush (fsync)");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return str("cannot close \"", tmp, "\": ", std::strerror(err));
  }
  if (std::string problem = rename_into_place(tmp, path); !problem.empty()) {
    ::unlink(tmp.c_str());
    return problem;
  }
  return {};
}

std::string rename_into_place(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return str("cannot rename \"", from, "\" to \"", to, "\": ", std::strerror(errno));
  }
  if (const int err = flush_directory(directory_of(to)); err != 0) {
    return str("cannot flush the directory of \"", to, "\" (fsync): ", std::strerror(err));
  }
  return {};
}

std::string create_directories_durably(const std::string& dir, int* error) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> created;  // deepest first
  for (fs::path d = dir; !d.empty() && !fs::exists(d, ec); d = d.parent_path()) {
    created.push_back(d);
    if (d == d.parent_path()) break;
  }
  fs::create_directories(dir, ec);
  if (ec) {
    if (error != nullptr) *error = ec.value();
    return str("cannot create directory \"", dir, "\": ", ec.message());
  }
  for (const auto& d : created) {
    if (const int err = flush_directory(directory_of(d.string())); err != 0) {
      if (error != nullptr) *error = err;
      return str("cannot flush the directory of \"", d.string(), "\" (fsync): ", std::strerror(err));
    }
  }
  return {};
}

std::string previous_path(const std::string& path) { return path + ".previous"; }

namespace {

bool is_there(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

}  // namespace

std::string replace_path(const std::string& replacement, const std::string& path,
                         bool exchange) {
  if (!is_there(path)) return rename_into_place(replacement, path);
  if (exchange && ::renameat2(AT_FDCWD, replacement.c_str(), AT_FDCWD, path.c_str(),
                              RENAME_EXCHANGE) == 0) {
    // `replacement` now names what `path` held.
    std::error_code ec;
    remove_tree(replacement, ec);
    if (const int err = flush_directory(directory_of(path)); err != 0) {
      return str("cannot flush the directory of \"", path, "\" (fsync): ", std::strerror(err));
    }
    return {};
  }
  if (exchange && errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP) {
    return str("cannot exchange \"", replacement, "\" with \"", path, "\": ", std::strerror(errno));
  }
  // No exchange here: the old one aside first (an older one already
  // there is from a replacement that completed but was not cleared).
  const std::string previous = previous_path(path);
  std::error_code ec;
  remove_tree(previous, ec);
  if (::rename(path.c_str(), previous.c_str()) != 0) {
    return str("cannot rename \"", path, "\" to \"", previous, "\": ", std::strerror(errno));
  }
  if (::rename(replacement.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::rename(previous.c_str(), path.c_str());
    return str("cannot rename \"", replacement, "\" to \"", path, "\": ", std::strerror(err));
  }
  if (const int err = flush_directory(directory_of(path)); err != 0) {
    return str("cannot flush the directory of \"", path, "\" (fsync): ", std::strerror(err));
  }
  remove_tree(previous, ec);
  return {};
}

bool restore_previous(const std::string& path) {
  const std::string previous = previous_path(path);
  if (is_there(path) || !is_there(previous)) return false;
  if (::rename(previous.c_str(), path.c_str()) != 0) return false;
  flush_directory(directory_of(path));
  return true;
}

}  // namespace fulgur::detail
