#include "fulgur/utilities/checksum.h"

#include <isa-l/crc.h>

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

uint32_t crc32_ieee(const void* data, size_t n, uint32_t crc) {
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), n);
}

}  // namespace fulgur
