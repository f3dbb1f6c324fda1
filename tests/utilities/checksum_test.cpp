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

TEST(Checksum, CombiningPiecesChecksummedApartEqualsTheWhole) {
  std::mt19937 rng(11);
  std::vector<unsigned char> bytes(300007);
  for (auto& b : bytes) b = static_cast<unsigned char>(rng());
  const uint32_t whole = fulgur::crc32c(bytes.data(), bytes.size());
  for (size_t cut : {size_t{0}, size_t{1}, size_t{4095}, size_t{65536}, bytes.size()}) {
    const uint32_t a = fulgur::crc32c(bytes.data(), cut);
    const uint32_t b = fulgur::crc32c(bytes.data() + cut, bytes.size() - cut);
    EXPECT_EQ(fulgur::crc32c_combine(a, b, bytes.size() - cut), whole) << cut;
  }
  // Three pieces joined left to right.
  const uint32_t p1 = fulgur::crc32c(bytes.data(), 1000);
  const uint32_t p2 = fulgur::crc32c(bytes.data() + 1000, 200000);
  const uint32_t p3 = fulgur::crc32c(bytes.data() + 201000, bytes.size() - 201000);
  EXPECT_EQ(fulgur::crc32c_combine(fulgur::crc32c_combine(p1, p2, 200000), p3,
                                   bytes.size() - 201000),
            whole);
  // The wrong length (or order) gives another CRC.
  EXPECT_NE(fulgur::crc32c_combine(p1, p2, 199999), fulgur::crc32c(bytes.data(), 201000));
  EXPECT_NE(fulgur::crc32c_combine(p2, p1, 1000), fulgur::crc32c(bytes.data(), 201000));
  // Lengths past 4 GiB: 65 pieces of 64 MiB, joined one by one, and all
  // but the first joined as one 4 GiB piece.
  std::vector<unsigned char> piece(size_t{64} << 20);
  for (size_t i = 0; i < piece.size(); i += 4093) piece[i] = static_cast<unsigned char>(i);
  const uint32_t one = fulgur::crc32c(piece.data(), piece.size());
  uint32_t continued = 0, combined = 0, rest = 0;
  for (int i = 0; i < 65; ++i) {
    continued = fulgur::crc32c(piece.data(), piece.size(), continued);
    combined = i == 0 ? one : fulgur::crc32c_combine(combined, one, piece.size());
    if (i > 0) rest = fulgur::crc32c(piece.data(), piece.size(), rest);
  }
  EXPECT_EQ(combined, continued);
  EXPECT_EQ(fulgur::crc32c_combine(one, rest, uint64_t{64} << 26), continued);
  EXPECT_EQ(fulgur::crc32c_combine(continued, p3, bytes.size() - 201000),
            fulgur::crc32c(bytes.data() + 201000, bytes.size() - 201000, continued));
}

}  // namespace
