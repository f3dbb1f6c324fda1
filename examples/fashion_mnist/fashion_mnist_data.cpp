#include "fashion_mnist_data.h"

#include <torch/torch.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "fulgur/fulgur.h"

namespace fashion_mnist {
namespace {

using fulgur::ConfigError;
using fulgur::str;

constexpr uint32_t kImagesMagic = 2051;  // 0x00000803: unsigned byte, 3 dimensions
constexpr uint32_t kLabelsMagic = 2049;  // 0x00000801: unsigned byte, 1 dimension
constexpr uint32_t kRows = 28;
constexpr uint32_t kCols = 28;
constexpr uint32_t kNumClasses = 10;
// Far above Fashion-MNIST's 60000; guards the allocation against a corrupt header.
constexpr uint32_t kMaxItems = 10'000'000;

constexpr const char* kInstallHint =
    "Install it with scripts/install-deps.sh (Debian package dataset-fashion-mnist), "
    "or pass --data-dir DIR naming a directory that holds train-images-idx3-ubyte.gz, "
    "train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz";

constexpr const char* kReinstallHint =
    "The file is damaged: reinstall it with `apt-get install --reinstall dataset-fashion-mnist`, "
    "or pass --data-dir DIR naming a directory with intact copies";

// A gzip file read with zlib; every error names the file.
class GzFile {
 public:
  explicit GzFile(std::string path) : path_(std::move(path)) {
    std::error_code ec;
    if (!std::filesystem::exists(path_, ec)) {
      throw ConfigError(
          str("FashionMNIST(", path_, "): the file does not exist. ", kInstallHint, "."));
    }
    if (std::filesystem::is_directory(path_, ec)) {
      throw ConfigError(str("FashionMNIST(", path_, "): is a directory, not a gzip IDX file. ",
                            kInstallHint, "."));
    }
    errno = 0;
    file_ = gzopen(path_.c_str(), "rb");
    if (file_ == nullptr) {
      const char* reason = errno != 0 ? std::strerror(errno) : "zlib could not open it";
      throw ConfigError(str("FashionMNIST(", path_, "): cannot open the file: ", reason,
                            ". Check its permissions, or pass --data-dir DIR naming a readable "
                            "copy."));
    }
  }
  ~GzFile() {
    if (file_ != nullptr) gzclose(file_);
  }
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;

  const std::string& path() const { return path_; }

  // Reads exactly `size` bytes of `what`; throws on a short read or a zlib error.
  void read(void* destination, size_t size, const char* what) {
    auto* out = static_cast<unsigned char*>(destination);
    size_t done = 0;
    while (done < size) {
      const auto chunk = static_cast<unsigned>(std::min<size_t>(size - done, size_t{1} << 30));
      const int got = gzread(file_, out + done, chunk);
      if (got < 0) {
        int code = Z_OK;
        const char* message = gzerror(file_, &code);
        throw ConfigError(str("FashionMNIST(", path_, "): reading ", what, " failed after ", done,
                              " of ", size, " bytes: ", message ? message : "zlib error",
                              " (truncated or corrupt gzip data). ", kReinstallHint, "."));
      }
      if (got == 0) {
        throw ConfigError(str("FashionMNIST(", path_, "): the file is truncated: ", what, " needs ",
                              size, " bytes but only ", done, " could be read. ", kReinstallHint,
                              "."));
      }
      done += static_cast<size_t>(got);
    }
  }

  // A big-endian 32-bit integer, as IDX headers store them.
  uint32_t read_u32(const char* what) {
    unsigned char b[4];
    read(b, sizeof b, what);
    return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
  }

 private:
  std::string path_;
  gzFile file_ = nullptr;
};

void check_magic(const GzFile& file, uint32_t magic, uint32_t expected, const char* kind) {
  if (magic == expected) return;
  throw ConfigError(str("FashionMNIST(", file.path(), "): bad magic number ", magic, " (expected ",
                        expected, " for an IDX ", kind, " file); this is not a Fashion-MNIST ",
                        kind, " file. ", kReinstallHint, "."));
}

void check_count(const GzFile& file, uint32_t count, const char* what) {
  if (count > 0 && count <= kMaxItems) return;
  throw ConfigError(str("FashionMNIST(", file.path(), "): the header announces ", count, " ", what,
                        ", expected between 1 and ", kMaxItems, ". ", kReinstallHint, "."));
}

std::string file_in(const std::string& dir, const char* name) {
  return (std::filesystem::path(dir) / name).string();
}

void check_dataset(const FashionMNISTOptions& o) {
  if (o.batch_size < 1 || o.test_batch_size < 1) {
    throw ConfigError(str("FashionMNISTDataModule(batch_size=", o.batch_size,
                          ", test_batch_size=", o.test_batch_size,
                          "): batch sizes must be >= 1. Pass a positive --batch-size."));
  }
  if (o.val_size < 0) {
    throw ConfigError(str("FashionMNISTDataModule(val_size=", o.val_size,
                          "): val_size must be >= 0. Pass 0 to train without validation, or "
                          "the number of training images to hold out."));
  }
}

}  // namespace

torch::Tensor read_idx_images(const std::string& path) {
  GzFile file(path);
  check_magic(file, file.read_u32("the magic number"), kImagesMagic, "images");
  const uint32_t count = file.read_u32("the image count");
  check_count(file, count, "images");
  const uint32_t rows = file.read_u32("the row count");
  const uint32_t cols = file.read_u32("the column count");
  if (rows != kRows || cols != kCols) {
    throw ConfigError(str("FashionMNIST(", path, "): images are ", rows, "x", cols, ", expected ",
                          kRows, "x", kCols, ". ", kReinstallHint, "."));
  }
  auto images = torch::empty({static_cast<int64_t>(count), 1, kRows, kCols}, torch::kUInt8);
  file.read(images.data_ptr<uint8_t>(), static_cast<size_t>(images.numel()), "the pixels");
  return images;
}

torch::Tensor read_idx_labels(const std::string& path) {
  GzFile file(path);
  check_magic(file, file.read_u32("the magic number"), kLabelsMagic, "labels");
  const uint32_t count = file.read_u32("the label count");
  check_count(file, count, "labels");
  auto labels = torch::empty({static_cast<int64_t>(count)}, torch::kUInt8);
  file.read(labels.data_ptr<uint8_t>(), static_cast<size_t>(count), "the labels");
  const auto max_label = labels.max().item<int64_t>();
  if (max_label >= kNumClasses) {
    throw ConfigError(str("FashionMNIST(", path, "): found label ", max_label, ", expected 0..",
                          kNumClasses - 1, ". ", kReinstallHint, "."));
  }
  return labels;
}

Split load_split(const std::string& data_dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  const std::string images_path = file_in(data_dir, (prefix + "-images-idx3-ubyte.gz").c_str());
  const std::string labels_path = file_in(data_dir, (prefix + "-labels-idx1-ubyte.gz").c_str());
  auto images = read_idx_images(images_path);
  auto labels = read_idx_labels(labels_path);
  if (images.size(0) != labels.size(0)) {
    throw ConfigError(str("FashionMNIST(", data_dir, "): ", images_path, " holds ", images.size(0),
                          " images but ", labels_path, " holds ", labels.size(0),
                          " labels; the files do not belong together. ", kReinstallHint, "."));
  }
  Split split;
  split.images = images.to(torch::kFloat32).div_(255.0).sub_(kMean).div_(kStd);
  split.labels = labels.to(torch::kInt64);
  return split;
}

FashionMNISTDataModule::FashionMNISTDataModule(FashionMNISTOptions options)
    : options_(std::move(options)) {
  check_dataset(options_);
}

void FashionMNISTDataModule::prepare_data() {
  for (const char* name : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                           "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}) {
    const std::string path = file_in(options_.data_dir, name);
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) {
      throw ConfigError(str("FashionMNIST(data_dir=", options_.data_dir, "): ", path,
                            " does not exist. ", kInstallHint, "."));
    }
  }
}

void FashionMNISTDataModule::setup(fulgur::Stage stage) {
  using fulgur::Stage;
  if ((stage == Stage::kFit || stage == Stage::kValidate) && !train_) {
    auto split = load_split(options_.data_dir, /*train=*/true);
    const int64_t total = split.images.size(0);
    if (options_.val_size >= total) {
      throw ConfigError(str("FashionMNISTDataModule(val_size=", options_.val_size,
                            "): the training set has only ", total,
                            " images, so nothing would be left to train on. Pass a smaller "
                            "--val-size (0 turns validation off)."));
    }
    const int64_t n_train = total - options_.val_size;
    if (options_.batch_size > n_train) {
      // One batch of the whole set: its activations alone take gigabytes
      // (the kernel killed such a run for its memory).
      throw ConfigError(str("FashionMNISTDataModule(batch_size=", options_.batch_size,
                            "): more than the ", n_train,
                            " training images, so one batch would be the whole set. Pass a "
                            "--batch_size of at most ",
                            n_train, " (e.g. 64)."));
    }
    // A deterministic split: the first n_train images train, the rest validate.
    train_ = std::make_shared<fulgur::TensorDataset>(split.images.narrow(0, 0, n_train),
                                                     split.labels.narrow(0, 0, n_train));
    if (options_.val_size > 0) {
      val_ = std::make_shared<fulgur::TensorDataset>(
          split.images.narrow(0, n_train, options_.val_size),
          split.labels.narrow(0, n_train, options_.val_size));
    }
  }
  if (stage == Stage::kTest && !test_) {
    auto split = load_split(options_.data_dir, /*train=*/false);
    test_ = std::make_shared<fulgur::TensorDataset>(split.images, split.labels);
  }
}

void FashionMNISTDataModule::require(const std::shared_ptr<fulgur::TensorDataset>& dataset,
                                     const char* loader) const {
  if (dataset) return;
  throw ConfigError(str("FashionMNISTDataModule.", loader,
                        "(): called before setup() built the split. Call setup(stage) first "
                        "(the Trainer does)."));
}

std::shared_ptr<fulgur::DataLoader> FashionMNISTDataModule::train_dataloader() {
  require(train_, "train_dataloader");
  return fulgur::make_data_loader(
      train_, {.batch_size = options_.batch_size, .shuffle = true, .seed = options_.seed});
}

std::shared_ptr<fulgur::DataLoader> FashionMNISTDataModule::val_dataloader() {
  if (options_.val_size == 0) return nullptr;  // no validation
  require(val_, "val_dataloader");
  return fulgur::make_data_loader(val_, {.batch_size = options_.test_batch_size});
}

std::shared_ptr<fulgur::DataLoader> FashionMNISTDataModule::test_dataloader() {
  require(test_, "test_dataloader");
  return fulgur::make_data_loader(test_, {.batch_size = options_.test_batch_size});
}

}  // namespace fashion_mnist
