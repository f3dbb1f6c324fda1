// LibTorch archives with a checksum: the archive's bytes, then a 32-byte
// footer holding their length and CRC32C. Written to a temporary file,
// flushed, renamed into place, and the directory flushed. Read with pread:
// the bytes are checksummed as LibTorch reads them (crc32c_of_spans joins
// the pieces), and nothing parsed is handed back before the checksum
// matches.
#include "utilities/little_endian.h"
#include "fulgur/plugins/io/torch_checkpoint_io.h"

#include <fcntl.h>
#include <isa-l/igzip_lib.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/csrc/jit/frontend/error_report.h>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <exception>
#include <functional>
#include <iostream>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "fulgur/core/errors.h"
#include "fulgur/plugins/io/async_checkpoint_io.h"
#include "fulgur/utilities/checksum.h"
#include "utilities/file_kind.h"
#include "utilities/durable_file.h"
#include "utilities/helper_thread.h"

namespace fulgur {

namespace fs = std::filesystem;

namespace {

// ---- The footer: magic, version, algorithm, data size, CRC32C of the data,
// and CRC32C of the footer's first 28 bytes (a damaged footer is told apart
// from damaged data).
constexpr char kMagic[8] = {'F', 'U', 'L', 'G', 'U', 'R', 'C', 'K'};
constexpr size_t kFooterSize = 32;
constexpr uint32_t kFooterVersion = 1;
constexpr uint32_t kAlgorithmCrc32c = 1;
constexpr const char* kIntegrityKey = TorchCheckpointIO::kIntegrityKey;

using detail::get_le;
using detail::HelperThread;
using detail::put_le;

std::string encode_footer(uint64_t data_size, uint32_t crc) {
  std::string footer(kMagic, sizeof(kMagic));
  put_le(footer, kFooterVersion, 4);
  put_le(footer, kAlgorithmCrc32c, 4);
  put_le(footer, data_size, 8);
  put_le(footer, crc, 4);
  put_le(footer, crc32c(footer.data(), footer.size()), 4);
  return footer;
}

// What the end of a file says about its data.
struct Verdict {
  bool has_footer = false;  // a footer whose own checksum holds
  uint64_t data_size = 0;   // with a footer: the archive's bytes
  std::string problem;      // with a footer: empty when the data verifies
  uint32_t expected = 0, actual = 0;
  bool newer = false;  // a footer this fulgur does not know: a newer one wrote it
};

// ---- Files.
// A checkpoint file opened for reading, read with pread (no copy of the
// whole file in memory). CheckpointError naming it, the operation and the
// OS reason; never opens what is not a regular file (a FIFO would block).
class CheckpointFile {
 public:
  explicit CheckpointFile(const std::string& path) : path_(path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      const int err = errno;
      if (err == ENOENT) {
        throw CheckpointError(str("checkpoint \"", path,
                                  "\" does not exist. Check the path, or "
                                  "pass ckpt_path=\"last\" to resume from the newest checkpoint."));
      }
      throw CheckpointError(
          str("checkpoint \"", path, "\": cannot look it up: ", std::strerror(err), "."));
    }
    if (S_ISDIR(st.st_mode) && ::access((path + "/manifest.txt").c_str(), F_OK) == 0) {
      throw CheckpointError(
          str("checkpoint \"", path,
              "\" is a sharded checkpoint: a directory of per-rank shards, written under strategy "
              "\"fsdp\" (or \"manual\") with state_dict_type \"sharded\". Resume it with that "
              "strategy and as many ranks as wrote it (its manifest.txt lists them; `fulgur "
              "checkpoint inspect` shows them), or make it one file that loads anywhere with "
              "`fulgur checkpoint consolidate ",
              path, " FILE` (fsdp)."));
    }
    if (!S_ISREG(st.st_mode)) {
      throw CheckpointError(str("checkpoint \"", path, "\" is ", detail::file_kind(st.st_mode),
                                ", not a checkpoint file. Pass the path of a .ckpt file."));
    }
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd_ < 0) {
      const int err = errno;
      throw CheckpointError(str("checkpoint \"", path,
                                "\": cannot open it for reading: ", std::strerror(err),
                                err == EACCES ? ". Give this user read permission on it (and "
                                                "search permission on its directories)."
                                              : "."));
    }
    // The size of what was opened (the path may have been replaced since).
    struct stat opened {};
    size_ = ::fstat(fd_, &opened) == 0 ? static_cast<uint64_t>(opened.st_size)
                                       : static_cast<uint64_t>(st.st_size);
  }
  ~CheckpointFile() { ::close(fd_); }
  CheckpointFile(const CheckpointFile&) = delete;
  CheckpointFile& operator=(const CheckpointFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  /// Exactly `n` bytes at `pos`, or CheckpointError.
  void read_at(uint64_t pos, void* buf, size_t n) const {
    auto* out = static_cast<char*>(buf);
    size_t done = 0;
    while (done < n) {
      const ssize_t got = ::pread(fd_, out + done, n - done, static_cast<off_t>(pos + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        const int err = got < 0 ? errno : 0;
        throw CheckpointError(str("checkpoint \"", path_, "\": cannot read it: ",
                                  err ? std::strerror(err) : "it shrank while being read", "."));
      }
      done += static_cast<size_t>(got);
    }
  }
  /// CRC32C of the `n` bytes at `pos`, continuing `crc`, read in pieces
  /// through one small buffer.
  uint32_t crc32c_of(uint64_t pos, uint64_t n, uint32_t crc = 0) const {
    return checksum_of(pos, n, crc, crc32c);
  }
  /// The zip format's CRC-32 of the `n` bytes at `pos`.
  uint32_t crc32_ieee_of(uint64_t pos, uint64_t n) const {
    return checksum_of(pos, n, 0, crc32_ieee);
  }

 private:
  uint32_t checksum_of(uint64_t pos, uint64_t n, uint32_t crc,
                       uint32_t (*checksum)(const void*, size_t, uint32_t)) const {
    std::vector<char> buf(std::min<uint64_t>(n, uint64_t{4} << 20));
    for (const uint64_t end = pos + n; pos < end;) {
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(buf.size(), end - pos));
      read_at(pos, buf.data(), chunk);
      crc = checksum(buf.data(), chunk, crc);
      pos += chunk;
    }
    return crc;
  }

  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// ---- The archive (a zip: LibTorch stores its records, deflates its
// TorchScript code, and follows each record's bytes with a data descriptor
// repeating its CRC-32 and sizes), read from its directory of records before
// LibTorch's reader is given it. That reader trusts the archive: a damaged
// directory, pickled description or code record can crash it, and a tensor
// record's size it never compares with the tensor's. So the directory, every
// record's header and descriptor, and the content of what it parses are
// checked first.
struct ZipRecord {
  std::string name;
  uint32_t crc = 0;         // of its content, as the directory states it
  bool deflated = false;    // method 8; else stored (method 0)
  bool descriptor = false;  // a data descriptor follows its bytes (flag bit 3)
  uint64_t header = 0;      // its local header's offset
  uint64_t compressed = 0;  // its bytes' length in the archive
  uint64_t size = 0;        // its content's length
};

// The records that the first `size` bytes of `file` list in their
// directory; or, in `problem`, the part of the archive found damaged.
struct ZipDirectory {
  std::vector<ZipRecord> records;
  std::string problem;
};

// A record's name inside the archive's folder ("data/3" of "archive/data/3").
std::string_view in_folder(const std::string& name) {
  const auto slash = name.find('/');
  return std::string_view(name).substr(slash == std::string::npos ? 0 : slash + 1);
}

// A record holding a tensor's bytes (LibTorch's reader copies them and
// parses nothing in them).
bool holds_tensor_bytes(const std::string& name) { return in_folder(name).rfind("data/", 0) == 0; }

std::string describe_record(const std::string& name) {
  const std::string_view record = in_folder(name);
  if (record == "data.pkl") {
    return "the archive's structure (record data.pkl: which tensors and values it holds)";
  }
  if (holds_tensor_bytes(name)) return str("the bytes of a tensor (record ", record, ")");
  return str("record ", record);
}

constexpr const char* kNoArchive =
    "no zip archive (it neither starts nor ends as one; LibTorch writes zip archives)";

ZipDirectory read_directory(const CheckpointFile& file, uint64_t size) {
  ZipDirectory dir;
  auto u16 = [](const char* p) { return get_le(p, 2); };
  auto u32 = [](const char* p) { return get_le(p, 4); };
  auto damaged = [&dir](std::string part) {
    dir.problem = std::move(part);
    return dir;
  };
  const std::string directory = "the archive's directory of records";
  // The end-of-central-directory record (22 bytes), searched back from the
  // end over the longest comment it can have.
  const uint64_t tail_size = std::min<uint64_t>(size, 22 + 65535 + 20);
  std::string tail(static_cast<size_t>(tail_size), '\0');
  file.read_at(size - tail_size, tail.data(), tail.size());
  size_t at = tail.size() < 22 ? 0 : tail.size() - 22 + 1;
  while (at > 0 && u32(tail.data() + at - 1) != 0x06054b50) --at;
  if (at == 0) {
    char head[4] = {};
    if (size >= 4) file.read_at(0, head, 4);
    return damaged(size >= 4 && u32(head) == 0x04034b50
                       ? "the archive's end (its directory of records is not there)"
                       : kNoArchive);
  }
  const char* const eocd = tail.data() + at - 1;
  uint64_t end_of_directory = size - tail_size + (at - 1);
  uint64_t count = u16(eocd + 10);
  uint64_t cd_size = u32(eocd + 12);
  uint64_t cd_offset = u32(eocd + 16);
  // The Zip64 locator (20 bytes) before it, where miniz looks for one: a
  // Zip64 end record (56 bytes) fits before that.
  if (end_of_directory >= 20 + 56 && at - 1 >= 20 && u32(eocd - 20) == 0x07064b50) {
    const uint64_t z64 = get_le(eocd - 20 + 8, 8);
    char record[56];
    if (z64 > end_of_directory - 20 - 56) return damaged(directory);
    file.read_at(z64, record, sizeof(record));
    if (u32(record) != 0x06064b50) return damaged(directory);
    count = get_le(record + 32, 8);
    cd_size = get_le(record + 40, 8);
    cd_offset = get_le(record + 48, 8);
    end_of_directory = z64;
  }
  // LibTorch writes the directory right before its end record, with at
  // least one record, each entry 46 bytes or more.
  if (count == 0 || cd_offset > end_of_directory || cd_size != end_of_directory - cd_offset ||
      count > cd_size / 46) {
    return damaged(directory);
  }
  std::string cd(static_cast<size_t>(cd_size), '\0');
  file.read_at(cd_offset, cd.data(), cd.size());
  size_t p = 0;  // into cd
  for (uint64_t i = 0; i < count; ++i) {
    const char* const entry = cd.data() + p;
    const uint64_t method = cd.size() - p >= 46 ? u16(entry + 10) : 1;
    if (cd.size() - p < 46 || u32(entry) != 0x02014b50 || (method != 0 && method != 8)) {
      return damaged(directory);
    }
    ZipRecord r;
    r.deflated = method == 8;
    r.descriptor = (u16(entry + 8) & 0x8) != 0;
    r.crc = static_cast<uint32_t>(u32(entry + 16));
    r.compressed = u32(entry + 20);
    r.size = u32(entry + 24);
    r.header = u32(entry + 42);
    const uint64_t name_len = u16(entry + 28), extra_len = u16(entry + 30);
    const uint64_t entry_len = 46 + name_len + extra_len + u16(entry + 32);
    if (cd.size() - p < entry_len) return damaged(directory);
    r.name.assign(entry + 46, name_len);
    // Zip64: the 32-bit fields that overflowed, in order, in the first
    // extra block 1 (as miniz reads them).
    for (uint64_t e = 46 + name_len; e + 4 <= 46 + name_len + extra_len;) {
      const uint64_t id = u16(entry + e), len = u16(entry + e + 2);
      if (46 + name_len + extra_len - (e + 4) < len) return damaged(directory);
      if (id == 0x0001) {
        uint64_t v = e + 4;
        for (uint64_t* field : {&r.size, &r.compressed, &r.header}) {
          if (*field != 0xFFFFFFFF) continue;
          if (e + 4 + len - v < 8) return damaged(directory);
          *field = get_le(entry + v, 8);
          v += 8;
        }
        break;
      }
      e += 4 + len;
    }
    p += static_cast<size_t>(entry_len);
    // Stored bytes are the content; deflate expands at most 1032:1, and
    // LibTorch never deflates a tensor's bytes (nor does ISA-L inflate past
    // 4 GiB here).
    const bool sizes_agree = r.deflated ? !holds_tensor_bytes(r.name) &&
                                              r.size / 1032 <= r.compressed && r.size <= UINT32_MAX
                                        : r.size == r.compressed;
    // Its header (30 bytes and more) and bytes lie before the directory.
    if (!sizes_agree || r.header > cd_offset || cd_offset - r.header < 30 ||
        cd_offset - r.header - 30 < r.compressed) {
      return damaged(directory);
    }
    dir.records.push_back(std::move(r));
  }
  if (p != cd.size()) return damaged(directory);
  return dir;
}

// Where `record`'s bytes start, from its local header, which must name it,
// leave its bytes before `end` and, with a data descriptor after them,
// repeat its CRC-32 and sizes there (a directory entry whose sizes or CRC
// were damaged disagrees with it); or, in `problem`, that they do not.
uint64_t record_start(const CheckpointFile& file, const ZipRecord& record, uint64_t end,
                      std::string& problem) {
  char header[30];
  file.read_at(record.header, header, sizeof(header));
  const uint64_t name_len = get_le(header + 26, 2), extra_len = get_le(header + 28, 2);
  const uint64_t start = record.header + 30 + name_len + extra_len;
  const auto damaged = [&] {
    problem = str("the header of ", describe_record(record.name));
    return start;
  };
  if (get_le(header, 4) != 0x04034b50 || start > end || end - start < record.compressed) {
    return damaged();
  }
  std::string name(static_cast<size_t>(name_len), '\0');
  file.read_at(record.header + 30, name.data(), name.size());
  if (name != record.name) return damaged();
  if (!record.descriptor) return start;
  // An optional signature, the CRC-32, then both sizes in 4 bytes each (8
  // in a Zip64 archive).
  const uint64_t at = start + record.compressed;
  char d[28] = {};
  file.read_at(at, d, static_cast<size_t>(std::min<uint64_t>(sizeof(d), end - at)));
  const char* v = get_le(d, 4) == 0x08074b50 ? d + 4 : d;
  const bool repeats =
      get_le(v, 4) == record.crc &&
      ((get_le(v + 4, 4) == record.compressed && get_le(v + 8, 4) == record.size) ||
       (get_le(v + 4, 8) == record.compressed && get_le(v + 12, 8) == record.size));
  return repeats ? start : damaged();
}

// Whether the deflated content of `record` (its bytes from `start`)
// inflates to its length, with its stated CRC-32 (without `has_crc`: only
// that it inflates). Read and inflated in pieces.
bool inflates_intact(const CheckpointFile& file, const ZipRecord& record, uint64_t start,
                     bool has_crc) {
  auto state = std::make_unique<inflate_state>();  // 85 KiB
  isal_inflate_init(state.get());
  state->crc_flag = ISAL_GZIP_NO_HDR;  // the gzip CRC is zip's CRC-32
  std::vector<uint8_t> in(static_cast<size_t>(std::min<uint64_t>(record.compressed, 1 << 20)));
  std::vector<uint8_t> out(64 << 10);
  uint64_t read = 0, inflated = 0;
  while (state->block_state != ISAL_BLOCK_FINISH) {
    if (state->avail_in == 0 && read < record.compressed) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(in.size(), record.compressed - read));
      file.read_at(start + read, in.data(), n);
      read += n;
      state->next_in = in.data();
      state->avail_in = static_cast<uint32_t>(n);
    }
    state->next_out = out.data();
    state->avail_out = static_cast<uint32_t>(out.size());
    if (isal_inflate(state.get()) != ISAL_DECOMP_OK) return false;
    inflated += out.size() - state->avail_out;
    if (inflated > record.size) return false;
    // The bytes ran out before the stream's end.
    const bool stuck = state->avail_in == 0 && read == record.compressed && state->avail_out > 0;
    if (stuck && state->block_state != ISAL_BLOCK_FINISH) return false;
  }
  return inflated == record.size && (!has_crc || state->crc == record.crc);
}

// The first damaged part of the archive in the first `size` bytes of
// `file`: its directory of records, a record's header or descriptor, or
// the content of a record LibTorch's reader parses (all but tensors' bytes)
// against its CRC-32 or, with `tensors`, of every record. Empty when none
// is. (A writer that computed no CRC-32 stores 0 for every record: then
// only the structure is checked, and a stored record's content is not.)
std::string damaged_record(const CheckpointFile& file, uint64_t size, bool tensors) {
  const ZipDirectory dir = read_directory(file, size);
  if (!dir.problem.empty()) return dir.problem;
  const bool has_crcs = std::any_of(dir.records.begin(), dir.records.end(),
                                    [](const ZipRecord& r) { return r.crc != 0; });
  for (const ZipRecord& r : dir.records) {
    std::string problem;
    const uint64_t start = record_start(file, r, size, problem);
    if (!problem.empty()) return problem;
    if (!tensors && holds_tensor_bytes(r.name)) continue;
    const bool intact = r.deflated ? inflates_intact(file, r, start, has_crcs)
                                   : !has_crcs || file.crc32_ieee_of(start, r.size) == r.crc;
    if (!intact)
      return str(describe_record(r.name), ", which does not match the CRC-32 stored with it");
  }
  return {};
}

// What the end of a file says about its data, from its footer alone (the
// data's checksum is judge_data's).
Verdict check_footer(const CheckpointFile& file) {
  Verdict v;
  if (file.size() < kFooterSize) return v;
  char f[kFooterSize];
  file.read_at(file.size() - kFooterSize, f, kFooterSize);
  if (std::memcmp(f, kMagic, sizeof(kMagic)) != 0) return v;
  if (static_cast<uint32_t>(get_le(f + 28, 4)) != crc32c(f, 28)) return v;
  v.has_footer = true;
  const uint64_t version = get_le(f + 8, 4);
  const uint64_t algorithm = get_le(f + 12, 4);
  v.data_size = get_le(f + 16, 8);
  v.expected = static_cast<uint32_t>(get_le(f + 24, 4));
  if (version != kFooterVersion || algorithm != kAlgorithmCrc32c) {
    v.newer = true;
    v.problem = str("its checksum footer has version ", version, " and algorithm ", algorithm,
                    ", which this fulgur does not know (a newer fulgur wrote it)");
  } else if (v.data_size != file.size() - kFooterSize) {
    v.problem = str("it holds ", file.size() - kFooterSize, " bytes of data but was written with ",
                    v.data_size, " (cut short, or bytes were inserted)");
  }
  v.actual = v.expected;  // until judge_data is given the data's
  return v;
}

// The data's CRC32C, `actual`, against the footer's (a footer that holds,
// with no problem found yet).
void judge_data(uint32_t actual, Verdict& v) {
  v.actual = actual;
  if (v.actual != v.expected) {
    v.problem = str("its content does not match the CRC32C written with it (expected 0x", std::hex,
                    v.expected, ", got 0x", v.actual, std::dec, ")");
  }
}

Verdict check(const CheckpointFile& file) {
  Verdict v = check_footer(file);
  if (v.has_footer && v.problem.empty()) judge_data(file.crc32c_of(0, v.data_size), v);
  return v;
}

// A failed verification in one sentence: a content mismatch names the
// damaged part (the file is read whole for that).
std::string explained(const Verdict& v, const CheckpointFile& file) {
  if (v.actual == v.expected) return v.problem;
  const std::string part = damaged_record(file, v.data_size, true);
  return str(
      v.problem, "; the damage is in ",
      part.empty() ? "the archive's headers or padding (every record's bytes are intact)" : part);
}

// The reads of a verified load: the bytes LibTorch reads are checksummed
// where they land, right after they are read, while they are still in the
// processor's cache, so the file is read once (bytes read twice are
// counted on one of the reads). A large read is split in two: the helper
// thread reads and checksums one half while this thread does the other,
// and the read returns when both are done (LibTorch's buffer is never
// touched after). A separate checksum pass over the file,
// even on a second thread beside the parse, read everything twice: 0.8-0.9x
// of LibTorch's own load at 1 GB on 2 cores. The pieces' CRCs are joined
// in file order; what LibTorch never read (zip headers, padding, a rest
// left by a failed parse) is read apart.
class VerifyingReader {
 public:
  VerifyingReader(const CheckpointFile& file, uint64_t size) : file_(file), size_(size) {}

  /// Exactly `n` bytes at `pos` into `buf`; CheckpointError when the file
  /// cannot be read.
  void read(uint64_t pos, void* buf, size_t n) {
    auto* out = static_cast<char*>(buf);
    if (n < kSplitAbove) {
      read_and_checksum({pos, n, 0}, out, spans_);
      return;
    }
    const size_t half = (n / 2) & ~size_t{4095};
    helper_.post([this, pos, half, n, out] {
      read_and_checksum({pos + half, n - half, 0}, out + half, helper_spans_);
    });
    std::exception_ptr error;
    try {
      read_and_checksum({pos, half, 0}, out, spans_);
    } catch (...) {
      error = std::current_exception();
    }
    helper_.wait();  // first: `buf` is LibTorch's again once this returns
    if (error) std::rethrow_exception(error);
  }

  /// The CRC32C of the first `size` bytes, once the parse is over.
  uint32_t crc32c_of_data() {
    spans_.insert(spans_.end(), helper_spans_.begin(), helper_spans_.end());
    return crc32c_of_spans(std::move(spans_), size_,
                           [this](uint64_t pos, uint64_t length, uint32_t crc) {
                             return file_.crc32c_of(pos, length, crc);
                           });
  }

 private:
  // Reads of 1 MiB and more are split; each half is read in pieces of
  // 256 KiB, each checksummed while it is in its core's cache.
  static constexpr size_t kSplitAbove = size_t{1} << 20;
  static constexpr size_t kPiece = size_t{256} << 10;
  using Span = ChecksummedSpan;

  void read_and_checksum(Span span, char* out, std::vector<Span>& spans) const {
    for (size_t done = 0; done < span.length; done += kPiece) {
      const size_t piece = static_cast<size_t>(std::min<uint64_t>(kPiece, span.length - done));
      file_.read_at(span.pos + done, out + done, piece);
      span.crc = crc32c(out + done, piece, span.crc);
    }
    spans.push_back(span);
  }

  const CheckpointFile& file_;
  const uint64_t size_;
  std::vector<Span> spans_;         // this thread's
  std::vector<Span> helper_spans_;  // the helper's, read here between jobs
  HelperThread helper_;             // last: stopped before the spans go
};

// `archive` loaded from the first `size` bytes of `file`, read as LibTorch
// asks for them (through `verifier` when there is one). A failed read is
// rethrown after LibTorch's reader has given up (an exception must not
// cross its C code). Every tensor is loaded into host memory, whatever
// device it was saved from: a checkpoint written on a GPU loads where no
// GPU is (`fulgur checkpoint inspect` on a laptop, a resume on the CPU), and
// nothing reaches a device before the file's checksum is known; what loads
// it copies each tensor to the device of what it restores (parameters,
// optimizer state, averages, metric states, the loss scale).
void load_archive(const CheckpointFile& file, uint64_t size,
                  torch::serialize::InputArchive& archive, VerifyingReader* verifier = nullptr) {
  std::exception_ptr read_error;  // a CheckpointError, out of memory, no thread
  try {
    archive.load_from(
        [&](uint64_t pos, void* buf, size_t n) -> size_t {
          if (pos >= size || read_error) return 0;
          const size_t take = static_cast<size_t>(std::min<uint64_t>(n, size - pos));
          try {
            if (verifier != nullptr) {
              verifier->read(pos, buf, take);
            } else {
              file.read_at(pos, buf, take);
            }
          } catch (...) {
            read_error = std::current_exception();
            return 0;
          }
          return take;
        },
        [size]() -> size_t { return static_cast<size_t>(size); }, torch::Device(torch::kCPU));
  } catch (const std::exception&) {
    if (read_error) std::rethrow_exception(read_error);
    throw;
  }
}

// Whether `error`, thrown by a load, is LibTorch's reader refusing what it
// was given (c10::Error, or the TorchScript compiler's error report for a
// code record), rather than fulgur's own (a read that failed) or the
// machine's (out of memory, no thread).
bool is_readers_refusal(const std::exception& error) {
  return dynamic_cast<const c10::Error*>(&error) != nullptr ||
         dynamic_cast<const torch::jit::ErrorReport*>(&error) != nullptr;
}

// A file without a checksum footer: one written before checksums (fulgur
// 0.1) loads into `archive`, unverified, when every record matches its
// CRC-32, LibTorch reads it and it lacks the marker of a footer written.
// What is wrong with it otherwise; CheckpointError for a file that is no
// archive at all.
std::string load_unverified(const CheckpointFile& file, torch::serialize::InputArchive& archive) {
  if (const std::string part = damaged_record(file, file.size(), true); part == kNoArchive) {
    // Not damage: no checkpoint at all (a config file, a log); no earlier
    // checkpoint is offered in its place.
    throw CheckpointError(str("\"", file.path(),
                              "\" is not a checkpoint: it has no checksum footer and is ", part,
                              " (", file.size(),
                              " bytes). Pass a checkpoint file written by fulgur (a .ckpt under "
                              "<default_root_dir>/checkpoints)."));
  } else if (!part.empty()) {
    return str("it has no checksum footer and fulgur cannot read it: the damage is in ", part,
               " (it is truncated, damaged, or not a checkpoint; ", file.size(), " bytes)");
  }
  try {
    load_archive(file, file.size(), archive);
  } catch (const std::exception& e) {
    if (!is_readers_refusal(e)) throw;
    return str("it has no checksum footer and LibTorch cannot read it (", error_message(e),
               "): it is truncated, damaged at its end, or not a checkpoint (", file.size(),
               " bytes)");
  }
  c10::IValue marker;
  if (archive.try_read(kIntegrityKey, marker)) {
    return "its checksum footer is missing or damaged (the file was cut short or overwritten at "
           "its end)";
  }
  return {};
}

// The newest other *.ckpt of `path`'s directory whose checksum verifies;
// empty when there is none.
std::string newest_valid_sibling(const std::string& path) {
  std::error_code ec;
  const fs::path self = fs::weakly_canonical(path, ec);
  const fs::path dir = fs::path(path).has_parent_path() ? fs::path(path).parent_path() : ".";
  for (const auto& candidate : checkpoints_newest_first(dir.string())) {
    if (!fs::is_regular_file(candidate, ec) || fs::weakly_canonical(candidate, ec) == self) {
      continue;
    }
    try {
      const Verdict v = check(CheckpointFile(candidate));
      if (v.has_footer && v.problem.empty()) return candidate;
    } catch (const CheckpointError&) {
      // Unreadable: not an alternative.
    }
  }
  return {};
}

[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  // A shard of a sharded checkpoint (a directory with ShardedCheckpoint's
  // manifest.txt): the files beside it are the same checkpoint's shards,
  // never an earlier checkpoint.
  const fs::path dir = fs::path(path).has_parent_path() ? fs::path(path).parent_path() : ".";
  std::error_code ec;
  if (fs::path(path).filename().string().rfind("rank-", 0) == 0 &&
      fs::exists(dir / "manifest.txt", ec)) {
    throw CheckpointError(str("checkpoint \"", path, "\" is corrupt: ", what,
                              ". The file is corrupt; use an earlier checkpoint (this one is "
                              "a shard of the sharded checkpoint \"",
                              dir.string(), "\", which cannot load without it)."));
  }
  const std::string alternative = newest_valid_sibling(path);
  throw CheckpointError(str("checkpoint \"", path, "\" is corrupt: ", what,
                            ". The file is corrupt; use an earlier "
                            "checkpoint",
                            alternative.empty()
                                ? std::string(" (no other checkpoint in its directory verifies).")
                                : str(": \"", alternative,
                                      "\" is the newest other one in its "
                                      "directory that verifies.")));
}

// ---- Writing: through a file descriptor, computing the CRC on the way. A
// failure is remembered, not thrown: LibTorch's writer must finish normally
// (an exception inside it ends the process), and the caller throws after.
class ChecksummingWriter {
 public:
  explicit ChecksummingWriter(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("create");
  }
  ~ChecksummingWriter() {
    if (fd_ >= 0) ::close(fd_);
  }
  /// The archive's bytes: written and checksummed. A large write is
  /// checksummed on the helper thread while this one copies it into the
  /// page cache (an inline CRC32C was 4% of a 1 GB save here).
  size_t write(const void* data, size_t n) {
    if (n < kChecksumBesideAbove) {
      if (!write_raw(data, n)) return n;
      crc_ = crc32c(data, n, crc_);
    } else {
      uint32_t crc = 0;
      helper_.post([&crc, data, n] { crc = crc32c(data, n); });
      const bool written = write_raw(data, n);
      helper_.wait();
      if (!written) return n;
      crc_ = crc32c_combine(crc_, crc, n);
    }
    size_ += n;
    return n;
  }
  void finish() {
    if (error_ == 0) {
      const std::string footer = encode_footer(size_, crc_);
      write_raw(footer.data(), footer.size());  // not part of the checksummed data
    }
    if (error_ == 0 && ::fsync(fd_) != 0) fail("flush (fsync)");
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0 && error_ == 0) fail("close");
  }
  int error() const { return error_; }
  const char* failed_operation() const { return operation_; }

 private:
  // False once a write failed (then nothing more is written).
  bool write_raw(const void* data, size_t n) {
    if (error_ != 0) return false;
    const char* p = static_cast<const char*>(data);
    size_t left = n;
    while (left > 0) {
      const ssize_t w = ::write(fd_, p, left);
      if (w < 0) {
        if (errno == EINTR) continue;
        fail("write");
        return false;
      }
      p += w;
      left -= static_cast<size_t>(w);
    }
    return true;
  }
  void fail(const char* operation) {
    if (error_ != 0) return;
    error_ = errno != 0 ? errno : EIO;
    operation_ = operation;
  }
  static constexpr size_t kChecksumBesideAbove = size_t{1} << 20;
  std::string path_;
  int fd_ = -1;
  int error_ = 0;
  const char* operation_ = "";
  uint32_t crc_ = 0;
  uint64_t size_ = 0;
  HelperThread helper_;
};

std::string advice_for(int err) {
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return " Free space on its file system (or raise the quota), or save elsewhere "
             "(ModelCheckpoint dirpath, default_root_dir).";
    case EACCES:
    case EPERM:
    case EROFS:
      return " Make the directory writable by this user, or save elsewhere (ModelCheckpoint "
             "dirpath, default_root_dir).";
    default: return "";
  }
}

// Drops the page cache of the checkpoint a save is about to replace (its
// data stays on disk, untouched). The new file's pages then reuse that
// memory instead of taking fresh pages: on a virtual machine that hands
// free memory back to its host (free page reporting, ballooning), a fresh
// page costs a fault in the host, and writing 1 GB next to a cached 1 GB
// checkpoint took 3-4 s instead of 1 s here. torch::save's O_TRUNC frees
// the old pages the same way; a rename-into-place save must ask for it.
void release_cached_pages(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return;
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// fsync of directory `dir`, for the save of checkpoint `path`: what was
// renamed or created in it is durable once this returns. A file system
// that cannot flush directories (EINVAL) is taken as it is.
void flush_directory(const std::string& dir, const std::string& path) {
  if (const int err = detail::flush_directory(dir); err != 0) {
    throw CheckpointError(str("saving checkpoint \"", path, "\": cannot flush its directory \"",
                              dir, "\" (fsync): ", std::strerror(err), "."));
  }
}

}  // namespace

void TorchCheckpointIO::save_checkpoint(StateDict& checkpoint, const std::string& path) {
  torch::serialize::OutputArchive archive;
  write_archive(checkpoint, archive);
  // Marks the archive as written with a footer: one that lost its footer
  // is then told apart from one written before checksums.
  archive.write(kIntegrityKey, c10::IValue(std::string("crc32c footer v1")));
  write_atomically(path, [&](const ByteSink& sink) { archive.save_to(sink); });
}

void TorchCheckpointIO::write_atomically(const std::string& path,
                                         const std::function<void(const ByteSink&)>& produce) {
  const fs::path target(path);
  std::error_code ec;
  if (target.has_parent_path()) {
    // The directories this save creates are durable too.
    int err = 0;
    if (std::string problem =
            detail::create_directories_durably(target.parent_path().string(), &err);
        !problem.empty()) {
      throw CheckpointError(
          str("saving checkpoint \"", path, "\": ", problem, ".", advice_for(err)));
    }
  }
  const std::string tmp = detail::temporary_path_for(path);
  auto fail = [&](const char* operation, int err, const std::string& file) {
    fs::remove(tmp, ec);
    throw CheckpointError(str("saving checkpoint \"", path, "\": cannot ", operation, " \"", file,
                              "\": ", std::strerror(err),
                              ". The partial file was removed; the "
                              "previous checkpoint at this path (if any) is untouched.",
                              advice_for(err)));
  };
  release_cached_pages(path);
  {
    ChecksummingWriter writer(tmp);
    if (writer.error() == 0) {
      observe(SaveStep::kCreated);
      int64_t chunk = 0;
      produce([&](const void* data, size_t n) {
        const size_t written = writer.write(data, n);
        observe(SaveStep::kWrote, chunk++);
        return written;
      });
    }
    writer.finish();
    if (writer.error() != 0) fail(writer.failed_operation(), writer.error(), tmp);
  }
  observe(SaveStep::kFlushed);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename into place", errno, tmp);
  observe(SaveStep::kRenamed);
  // The rename is durable only once the directory is.
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";
  flush_directory(dir, path);
  observe(SaveStep::kDirectoryFlushed);
  remove_stale_files(dir);
}

void TorchCheckpointIO::remove_stale_files(const std::string& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    // "<name>.tmp.<pid>.<host>" of a dead writer of this machine (a live
    // writer's file stays, and another machine's, which cannot be checked).
    std::error_code type_ec;
    if (it->is_directory(type_ec)) continue;
    if (!detail::is_dead_writers_temporary(it->path().filename().string())) continue;
    std::error_code remove_ec;
    fs::remove(it->path(), remove_ec);
  }
}

StateDict TorchCheckpointIO::load_checkpoint(const std::string& path) {
  torch::serialize::InputArchive checkpoint;
  // The archive's state, less this IO's marker.
  auto state_of = [&checkpoint, &path] {
    try {
      StateDict state = read_archive(checkpoint);
      state.erase(kIntegrityKey);
      return state;
    } catch (const CheckpointError& e) {
      throw CheckpointError(str("checkpoint \"", path, "\": ", e.what()));
    }
  };
  const CheckpointFile file(path);
  Verdict v = check_footer(file);
  if (v.has_footer && v.newer) {
    // Not damage: a format this fulgur cannot read.
    throw CheckpointError(str("checkpoint \"", path, "\" cannot be read by this fulgur (",
                              FULGUR_VERSION, "): ", v.problem,
                              ". Load it with the fulgur that wrote it, or a newer one; the file "
                              "itself is not known to be damaged."));
  }
  if (v.has_footer && !v.problem.empty()) corrupt(path, explained(v, file));
  if (!v.has_footer) {
    if (const std::string problem = load_unverified(file, checkpoint); !problem.empty()) {
      corrupt(path, problem);
    }
    detail::print_note(str("checkpoint \"", path,
                           "\" has no checksum (written before fulgur 0.2); loaded without "
                           "verifying it. Save it again to add one."));
    return state_of();
  }
  // What LibTorch's reader parses (the directory of records, the pickled
  // description, code) is checked against the archive's own CRC-32s first:
  // damage there could crash the reader. Where it is damaged, the file's
  // checksum says whether the file is (a writer whose archive fulgur does
  // not know is trusted once its checksum holds).
  if (const std::string part = damaged_record(file, v.data_size, false); !part.empty()) {
    judge_data(file.crc32c_of(0, v.data_size), v);
    if (!v.problem.empty()) corrupt(path, str(v.problem, "; the damage is in ", part));
  }
  // The rest (the tensors' bytes) is checksummed as LibTorch reads it
  // (VerifyingReader): a load takes about the parse's time. Nothing parsed
  // is handed back before the checksum matches, so the module is never
  // touched by unverified data.
  std::exception_ptr parse_error;
  VerifyingReader reader(file, v.data_size);
  try {
    load_archive(file, v.data_size, checkpoint, &reader);
  } catch (...) {
    parse_error = std::current_exception();
  }
  try {
    judge_data(reader.crc32c_of_data(), v);
  } catch (...) {
    checkpoint = torch::serialize::InputArchive();
    throw;
  }
  if (!v.problem.empty()) {
    checkpoint = torch::serialize::InputArchive();
    corrupt(path, explained(v, file));
  }
  if (parse_error) {
    try {
      std::rethrow_exception(parse_error);
    } catch (const std::exception& e) {
      if (!is_readers_refusal(e)) throw;
      throw CheckpointError(str("checkpoint \"", path,
                                "\" verifies against its checksum but "
                                "LibTorch cannot read it (",
                                error_message(e),
                                "): it was not written by fulgur's checkpoint IO. Pass a "
                                "checkpoint written by fulgur."));
    }
  }
  return state_of();
}

std::string TorchCheckpointIO::verify(const std::string& path) {
  try {
    const CheckpointFile file(path);
    const Verdict v = check(file);
    if (v.has_footer) return v.problem.empty() ? std::string() : explained(v, file);
    torch::serialize::InputArchive archive;
    return load_unverified(file, archive);
  } catch (const CheckpointError& e) {
    return e.what();
  }
}

FileFingerprint TorchCheckpointIO::fingerprint(const std::string& path) {
  const CheckpointFile file(path);
  const Verdict v = check_footer(file);
  if (!v.has_footer || !v.problem.empty()) return {file.size(), file.crc32c_of(0, file.size())};
  // The data's CRC32C is in the footer; the file's joins the footer's bytes.
  char footer[kFooterSize];
  file.read_at(file.size() - kFooterSize, footer, kFooterSize);
  return {file.size(), crc32c_combine(v.expected, crc32c(footer, kFooterSize), kFooterSize)};
}

bool TorchCheckpointIO::has_checksum(const std::string& path) {
  try {
    return check_footer(CheckpointFile(path)).has_footer;  // the footer alone
  } catch (const CheckpointError&) {
    return false;
  }
}

void TorchCheckpointIO::remove_checkpoint(const std::string& path) {
  std::error_code ec;
  fs::remove(path, ec);
}

std::vector<std::string> checkpoints_newest_first(const std::string& dir) {
  std::vector<std::pair<fs::file_time_type, fs::path>> found;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() != ".ckpt") continue;
    std::error_code time_ec;
    const auto written = fs::last_write_time(it->path(), time_ec);
    if (!time_ec) found.emplace_back(written, it->path());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
    if (a.first != b.first) return a.first > b.first;
    const bool a_last = a.second.filename() == "last.ckpt";
    const bool b_last = b.second.filename() == "last.ckpt";
    return a_last != b_last ? a_last : a.second < b.second;
  });
  std::vector<std::string> paths;
  for (const auto& [_, path] : found) paths.push_back(path.string());
  return paths;
}

std::string CheckpointIO::verify(const std::string& path) {
  try {
    (void)load_checkpoint(path);
    return {};
  } catch (const std::exception& e) {
    return error_message(e);
  }
}

FileFingerprint CheckpointIO::fingerprint(const std::string& path) {
  const CheckpointFile file(path);
  return {file.size(), file.crc32c_of(0, file.size())};
}

CheckpointIORegistry& checkpoint_io_registry() {
  static CheckpointIORegistry registry = [] {
    CheckpointIORegistry r("checkpoint_io");
    r.add("torch",
          "LibTorch archives with a CRC32C footer, verified on load; written "
          "atomically (tmp file, fsync, rename, directory fsync)",
          [] { return std::make_unique<TorchCheckpointIO>(); });
    r.add("async",
          "the torch checkpoint IO written on a background thread: the checkpoint is "
          "serialized into a reused buffer at the save point and written while training goes "
          "on (one save in flight; errors raised at the next step; fit waits for the last)",
          [] { return std::make_unique<AsyncCheckpointIO>(); });
    return r;
  }();
  return registry;
}

}  // namespace fulgur
