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

namespace fulgur {

/// CRC32C of `n` bytes, continuing `crc` (0 starts afresh); crc32c("123456789")
/// is 0xE3069283.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

/// The CRC32C of A followed by B, from crc32c(A), crc32c(B) and B's length
/// (pieces checksummed apart, or out of order, joined in order): about a
/// microsecond whatever the lengths.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

/// CRC-32 (IEEE 802.3, the zip and gzip one) of `n` bytes, continuing `crc`;
/// crc32_ieee("123456789") is 0xCBF43926.
uint32_t crc32_ieee(const void* data, size_t n, uint32_t crc = 0);

}  // namespace fulgur
