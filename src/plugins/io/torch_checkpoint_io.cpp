#include "fulgur/plugins/io/torch_checkpoint_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <torch/torch.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "fulgur/core/errors.h"

namespace fulgur {

namespace fs = std::filesystem;

namespace {
// Writes through a file descriptor so the bytes can be fsync'ed before the
// rename makes them visible under the final name.
class FileWriter {
 public:
  explicit FileWriter(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("cannot create");
  }
  ~FileWriter() {
    if (fd_ >= 0) ::close(fd_);
  }
  size_t write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    size_t left = n;
    while (left > 0) {
      ssize_t w = ::write(fd_, p, left);
      if (w < 0) {
        if (errno == EINTR) continue;
        fail("cannot write");
      }
      p += w;
      left -= static_cast<size_t>(w);
    }
    return n;
  }
  void close() {
    if (::fsync(fd_) != 0) fail("cannot flush");
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("cannot close");
  }

 private:
  [[noreturn]] void fail(const char* what) {
    throw CheckpointError(str("saving checkpoint: ", what, " \"", path_, "\": ",
                              std::strerror(errno), ". Check the directory exists, is writable "
                              "and has free space."));
  }
  std::string path_;
  int fd_ = -1;
};
}  // namespace

void TorchCheckpointIO::save_checkpoint(torch::serialize::OutputArchive& checkpoint,
                                        const std::string& path) {
  fs::path target(path);
  std::error_code ec;
  if (target.has_parent_path()) {
    fs::create_directories(target.parent_path(), ec);
    if (ec) {
      throw CheckpointError(str("saving checkpoint \"", path, "\": cannot create directory \"",
                                target.parent_path().string(), "\": ", ec.message(), "."));
    }
  }
  std::string tmp = str(path, ".tmp.", ::getpid());
  try {
    FileWriter writer(tmp);
    checkpoint.save_to([&](const void* data, size_t n) { return writer.write(data, n); });
    writer.close();
  } catch (...) {
    fs::remove(tmp, ec);
    throw;
  }
  fs::rename(tmp, target, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw CheckpointError(str("saving checkpoint: cannot move the complete file into place at \"",
                              path, "\": ", ec.message(), "."));
  }
}

void TorchCheckpointIO::load_checkpoint(const std::string& path,
                                        torch::serialize::InputArchive& checkpoint) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw CheckpointError(str("checkpoint \"", path, "\" does not exist. Check the path, or pass "
                              "ckpt_path=\"last\" to resume from the newest last.ckpt."));
  }
  if (fs::is_directory(path, ec)) {
    throw CheckpointError(str("checkpoint \"", path, "\" is a directory, not a checkpoint file."));
  }
  try {
    checkpoint.load_from(path);
  } catch (const c10::Error& e) {
    auto size = fs::file_size(path, ec);
    throw CheckpointError(str("checkpoint \"", path, "\" (", ec ? 0 : size,
                              " bytes) cannot be read: it is truncated or not a LibTorch archive (",
                              e.what_without_backtrace(), "). Use a complete checkpoint written "
                              "by fulgur."));
  }
}

void TorchCheckpointIO::remove_checkpoint(const std::string& path) {
  std::error_code ec;
  fs::remove(path, ec);
}

CheckpointIORegistry& checkpoint_io_registry() {
  static CheckpointIORegistry registry = [] {
    CheckpointIORegistry r("checkpoint_io");
    r.add("torch", "LibTorch archives, written atomically (tmp file, fsync, rename)",
          [] { return std::make_unique<TorchCheckpointIO>(); });
    return r;
  }();
  return registry;
}

}  // namespace fulgur
