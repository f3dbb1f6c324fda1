// The checkpoints' checksums: the standard check values of both CRCs, and
// continuing a CRC over pieces equals one CRC over the whole.
#include "fulgur/utilities/checksum.h"

#include <gtest/gtest.h>

#include <algorithm>
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

// Spans read in any order, some twice, some overlapping partially, with
// gaps: joined, they give the CRC of the whole; a gap is asked for exactly
// once per uncovered stretch, and a span past the end is ignored.
TEST(Checksum, SpansCheckedApartJoinIntoTheWholesCrc) {
  std::mt19937 rng(3);
  std::vector<unsigned char> bytes(50000);
  for (auto& b : bytes) b = static_cast<unsigned char>(rng());
  const uint32_t whole = fulgur::crc32c(bytes.data(), bytes.size());
  auto span = [&](uint64_t pos, uint64_t length) {
    return fulgur::ChecksummedSpan{pos, length, fulgur::crc32c(bytes.data() + pos, length)};
  };
  uint64_t gap_bytes = 0;
  auto gaps = [&](uint64_t pos, uint64_t length, uint32_t crc) {
    gap_bytes += length;
    return fulgur::crc32c(bytes.data() + pos, length, crc);
  };
  // Headers, a record, the same record again, one overlapping its end, a
  // zero-length read, the directory at the end (read first), a span past
  // the end.
  const std::vector<fulgur::ChecksummedSpan> spans = {
      span(49000, 1000), span(0, 30), span(64, 20000), span(64, 20000), span(20000, 100),
      span(30000, 0), span(30000, 15000), {49990, 100, 0}};
  EXPECT_EQ(fulgur::crc32c_of_spans(spans, bytes.size(), gaps), whole);
  // Uncovered: 30..64, 20064..30000 (the overlapping span counts as not
  // there), 45000..49000.
  EXPECT_EQ(gap_bytes, uint64_t{(64 - 30) + (30000 - 20064) + (49000 - 45000)});
  // Random layouts.
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<fulgur::ChecksummedSpan> random;
    for (int i = 0; i < 12; ++i) {
      const uint64_t pos = rng() % bytes.size();
      random.push_back(span(pos, rng() % (bytes.size() - pos + 1)));
    }
    std::shuffle(random.begin(), random.end(), rng);
    EXPECT_EQ(fulgur::crc32c_of_spans(random, bytes.size(), gaps), whole) << trial;
  }
  // No span: the whole is one gap. A wrong span's CRC shows.
  EXPECT_EQ(fulgur::crc32c_of_spans({}, bytes.size(), gaps), whole);
  auto wrong = span(100, 50);
  wrong.crc ^= 1;
  EXPECT_NE(fulgur::crc32c_of_spans({wrong}, bytes.size(), gaps), whole);
}

}  // namespace
