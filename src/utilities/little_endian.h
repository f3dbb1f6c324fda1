// Internal: integers as little-endian bytes, for the formats fulgur writes
// itself (the checkpoint footer, TensorBoard's record framing).
#pragma once

#include <cstdint>
#include <string>

namespace fulgur::detail {

/// Appends the low `bytes` bytes of `value`, least significant first.
inline void put_le(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
}

/// Reads `bytes` bytes at `p`, least significant first.
inline uint64_t get_le(const char* p, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) {
    value |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  }
  return value;
}

}  // namespace fulgur::detail
