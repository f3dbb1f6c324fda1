// The checkpoints' checksums: the standard check values of both CRCs, and
// continuing a CRC over pieces equals one CRC over the whole.
#include "fulgur/utilities/checksum.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

TEST(Checksum, CheckValuesOfBothCrcs) {
  const char* check = "123456789";  // the catalogue's check input
  EXPECT_EQ(fulgur::crc32c(check, std::strlen(check)), 0xE3069283u);
  EXPECT_EQ(fulgur::crc32_ieee(check, std::strlen(check)), 0xCBF43926u);
  EXPECT_EQ(fulgur::crc32c(check, 0), 0u);
  EXPECT_EQ(fulgur::crc32_ieee(check, 0), 0u);
}

TEST(Checksum, ContinuingOverPiecesEqualsTheWhole) {
  std::mt19937 rng(7);
  std::vector<unsigned char> bytes(100003);  // odd length: tails of every width
  for (auto& b : bytes) b = static_cast<unsigned char>(rng());
  const uint32_t whole_c = fulgur::crc32c(bytes.data(), bytes.size());
  const uint32_t whole_i = fulgur::crc32_ieee(bytes.data(), bytes.size());
  for (size_t cut : {size_t{1}, size_t{7}, size_t{4096}, bytes.size() - 1}) {
    EXPECT_EQ(
        fulgur::crc32c(bytes.data() + cut, bytes.size() - cut, fulgur::crc32c(bytes.data(), cut)),
        whole_c)
        << cut;
    EXPECT_EQ(fulgur::crc32_ieee(bytes.data() + cut, bytes.size() - cut,
                                 fulgur::crc32_ieee(bytes.data(), cut)),
              whole_i)
        << cut;
  }
  // One flipped bit changes both.
  bytes[5000] ^= 0x10;
  EXPECT_NE(fulgur::crc32c(bytes.data(), bytes.size()), whole_c);
  EXPECT_NE(fulgur::crc32_ieee(bytes.data(), bytes.size()), whole_i);
}

}  // namespace
