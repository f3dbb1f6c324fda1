#include "utilities/small_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iomanip>
#include <sstream>

#include "fulgur/core/errors.h"
#include "utilities/file_kind.h"

namespace fulgur::detail {

std::string size_text(uint64_t bytes) {
  if (bytes < (uint64_t{1} << 20)) return str(bytes, " bytes");
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return out.str();
}

std::string SmallFileRead::describe(uint64_t max_bytes) const {
  switch (problem) {
    case Problem::kNone: return "was read";
    case Problem::kMissing:
      return error == ENOENT ? std::string("does not exist")
                             : str("cannot be looked up: ", std::strerror(error));
    case Problem::kNotRegular: return str("is ", file_kind(mode), ", not a regular file");
    case Problem::kTooLarge:
      return str("is ", size_text(size), ", more than the ", max_bytes,
                 " bytes such a file may have");
    case Problem::kCannotOpen: return str("cannot be opened for reading: ", std::strerror(error));
    case Problem::kCannotRead: return str("cannot be read: ", std::strerror(error));
  }
  return "cannot be read";
}

SmallFileRead read_small_file(const std::string& path, uint64_t max_bytes) {
  SmallFileRead r;
  auto fail = [&r](SmallFileRead::Problem problem) {
    r.problem = problem;
    r.text.clear();
    return r;
  };
  // The type and size, of the path and again of what was opened.
  auto refused = [&r, max_bytes](const struct stat& st) {
    if (!S_ISREG(st.st_mode)) {
      r.mode = st.st_mode;
      r.problem = SmallFileRead::Problem::kNotRegular;
    } else if (static_cast<uint64_t>(st.st_size) > max_bytes) {
      r.size = static_cast<uint64_t>(st.st_size);
      r.problem = SmallFileRead::Problem::kTooLarge;
    }
    return !r.ok();
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    r.error = errno;
    return fail(SmallFileRead::Problem::kMissing);
  }
  if (refused(st)) return r;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    r.error = errno;
    return fail(SmallFileRead::Problem::kCannotOpen);
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat opened {};
  if (::fstat(fd, &opened) != 0) {
    r.error = errno;
    return fail(SmallFileRead::Problem::kCannotRead);
  }
  if (refused(opened)) return r;
  // One byte past the cap tells a file that grew since.
  r.text.assign(static_cast<size_t>(max_bytes) + 1, '\0');
  size_t done = 0;
  while (done < r.text.size()) {
    const ssize_t got = ::read(fd, r.text.data() + done, r.text.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      r.error = errno;
      return fail(SmallFileRead::Problem::kCannotRead);
    }
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  if (done > max_bytes) {
    r.size = done;
    return fail(SmallFileRead::Problem::kTooLarge);
  }
  r.text.resize(done);
  return r;
}

}  // namespace fulgur::detail
