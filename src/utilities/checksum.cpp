#include "fulgur/utilities/checksum.h"

#include <isa-l/crc.h>

#include <algorithm>
#include <climits>

namespace fulgur {

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  // ISA-L's iSCSI CRC takes the register without the final inversion and an
  // int length: the standard CRC32C is ~crc32_iscsi(.., ~crc), in chunks.
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  unsigned int state = ~crc;
  while (n > 0) {
    const size_t chunk = n < static_cast<size_t>(INT_MAX) ? n : static_cast<size_t>(1) << 30;
    state = crc32_iscsi(p, static_cast<int>(chunk), state);
    p += chunk;
    n -= chunk;
  }
  return ~state;
}

namespace {

// Polynomials over GF(2) modulo CRC32C's, in the CRC's reflected order:
// bit 31 holds x^0, bit 0 holds x^31.
constexpr uint32_t kCastagnoliReflected = 0x82F63B78u;
constexpr uint32_t kOne = 1u << 31;  // x^0

uint32_t multiply_mod(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = kOne; bit != 0; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1u) ? (b >> 1) ^ kCastagnoliReflected : b >> 1;  // b *= x
  }
  return product;
}

// x^(2^k) mod P for k = 0..63.
struct PowersOfX {
  uint32_t x_to_2_to_the[64];
  PowersOfX() {
    x_to_2_to_the[0] = kOne >> 1;  // x^1
    for (int k = 1; k < 64; ++k) {
      x_to_2_to_the[k] = multiply_mod(x_to_2_to_the[k - 1], x_to_2_to_the[k - 1]);
    }
  }
};

}  // namespace

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  // Appending n bytes multiplies A's CRC register by x^(8n) mod P; the
  // initial and final inversions cancel between the two CRCs.
  static const PowersOfX powers;
  uint32_t shift = kOne;
  int k = 3;  // 8n = n * 2^3
  for (uint64_t n = length_b; n != 0; n >>= 1, ++k) {
    if (n & 1u) shift = multiply_mod(powers.x_to_2_to_the[k % 64], shift);
  }
  return multiply_mod(shift, crc_a) ^ crc_b;
}

uint32_t crc32c_of_spans(
    std::vector<ChecksummedSpan> spans, uint64_t size,
    const std::function<uint32_t(uint64_t pos, uint64_t length, uint32_t crc)>& checksum_range) {
  std::sort(spans.begin(), spans.end(), [](const ChecksummedSpan& a, const ChecksummedSpan& b) {
    return a.pos != b.pos ? a.pos < b.pos : a.length > b.length;
  });
  uint32_t crc = 0;
  uint64_t covered = 0;
  for (const ChecksummedSpan& span : spans) {
    if (span.pos < covered || span.pos > size || span.length > size - span.pos) continue;
    if (span.pos > covered) crc = checksum_range(covered, span.pos - covered, crc);
    crc = crc32c_combine(crc, span.crc, span.length);
    covered = span.pos + span.length;
  }
  if (covered < size) crc = checksum_range(covered, size - covered, crc);
  return crc;
}

uint32_t crc32_ieee(const void* data, size_t n, uint32_t crc) {
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), n);
}

}  // namespace fulgur
