// read_small_file: a small file a user or a launcher names is read whole;
// what is not a regular file is refused by its type without being opened
// (a FIFO would block, /dev/zero would fill the memory), a file over the
// cap is refused by its size, and each problem is worded for the caller.
#include "utilities/small_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "support/test_support.h"

namespace {

using fulgur::detail::read_small_file;
using Problem = fulgur::detail::SmallFileRead::Problem;
using fulgur::test::TempDir;

TEST(SmallFile, AFileWithinTheCapIsReadWhole) {
  TempDir dir;
  fulgur::test::write_text(dir.file("a.txt"), std::string("one\ntwo\0three", 13));
  auto r = read_small_file(dir.file("a.txt"), 13);
  ASSERT_TRUE(r.ok()) << r.describe(13);
  EXPECT_EQ(r.text, std::string("one\ntwo\0three", 13));
  fulgur::test::write_text(dir.file("empty"), "");
  EXPECT_EQ(read_small_file(dir.file("empty"), 10).text, "");
}

TEST(SmallFile, WhatIsNotARegularFileIsRefusedUnopenedAndNamed) {
  TempDir dir;
  const std::string fifo = dir.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const auto& [path, kind] : std::vector<std::pair<std::string, std::string>>{
           {fifo, "is a FIFO (named pipe), not a regular file"},
           {"/dev/zero", "is a character device, not a regular file"},
           {dir.path(), "is a directory, not a regular file"}}) {
    auto r = read_small_file(path, 1 << 20);  // a FIFO would block here if opened
    EXPECT_EQ(r.problem, Problem::kNotRegular) << path;
    EXPECT_EQ(r.describe(1 << 20), kind) << path;
    EXPECT_TRUE(r.text.empty());
  }
}

TEST(SmallFile, AFileOverTheCapIsRefusedBySizeAndAMissingOneSaysSo) {
  TempDir dir;
  // A sparse file of 64 MiB: its size is refused before a byte is read.
  {
    std::ofstream out(dir.file("big"));
  }
  std::filesystem::resize_file(dir.file("big"), uint64_t{64} << 20);
  auto big = read_small_file(dir.file("big"), 1024);
  EXPECT_EQ(big.problem, Problem::kTooLarge);
  EXPECT_EQ(big.describe(1024), "is 64.0 MiB, more than the 1024 bytes such a file may have");
  fulgur::test::write_text(dir.file("five"), "12345");
  EXPECT_EQ(read_small_file(dir.file("five"), 4).problem, Problem::kTooLarge);
  EXPECT_EQ(read_small_file(dir.file("five"), 4).describe(4),
            "is 5 bytes, more than the 4 bytes such a file may have");

  auto missing = read_small_file(dir.file("nothing"), 10);
  EXPECT_EQ(missing.problem, Problem::kMissing);
  EXPECT_EQ(missing.describe(10), "does not exist");
}

}  // namespace
