// File: fulgur/utilities/checksum.h
//
// Checksums for checkpoints: CRC32C (Castagnoli, as iSCSI, ext4 and
// RocksDB use) over a checkpoint's bytes, and CRC-32 (IEEE, as zip and gzip
// use) to find which record of a LibTorch archive is damaged. Both through
// Intel's ISA-L (libisal), which picks the fastest instructions the CPU has.
//
//   uint32_t crc = fulgur::crc32c(a.data(), a.size());
//   crc = fulgur::crc32c(b.data(), b.size(), crc);   // == crc32c of a + b
//   fulgur::crc32c_combine(crc_a, crc_b, b.size());   // the same, from the parts
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace fulgur {

/// CRC32C of `n` bytes, continuing `crc` (0 starts afresh); crc32c("123456789")
/// is 0xE3069283.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

/// The CRC32C of A followed by B, from crc32c(A), crc32c(B) and B's length
/// (pieces checksummed apart, or out of order, joined in order): about a
/// microsecond whatever the lengths.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

/// Bytes [pos, pos + length) of some data, and their CRC32C.
struct ChecksummedSpan {
  uint64_t pos = 0, length = 0;
  uint32_t crc = 0;
};

/// The CRC32C of bytes [0, size) from spans checksummed apart, in any
/// order, overlapping or not: joined in order; where spans overlap, the
/// first (by position, then the longest) counts and the rest of a later
/// one is treated as uncovered; what no span covers comes from
/// `checksum_range(pos, length, crc)` (the CRC32C of those bytes,
/// continuing `crc`). A span past `size` is ignored.
uint32_t crc32c_of_spans(
    std::vector<ChecksummedSpan> spans, uint64_t size,
    const std::function<uint32_t(uint64_t pos, uint64_t length, uint32_t crc)>& checksum_range);

/// CRC-32 (IEEE 802.3, the zip and gzip one) of `n` bytes, continuing `crc`;
/// crc32_ieee("123456789") is 0xCBF43926.
uint32_t crc32_ieee(const void* data, size_t n, uint32_t crc = 0);

}  // namespace fulgur
