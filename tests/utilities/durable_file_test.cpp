// durable_file: a file is replaced whole or not at all (through a flushed
// temporary file beside it), a directory is put in place of another at once
// or with the old one set aside where no exchange exists, and a dead
// writer's leftovers are told from a live one's.
#include "utilities/durable_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <string>
#include <vector>

#include "fulgur/core/errors.h"
#include "support/run_in_child.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using fulgur::test::TempDir;

TEST(DurableFile, AFileIsReplacedWholeAndAFailureLeavesTheOldOneAndNoTemporary) {
  TempDir dir;
  const std::string path = dir.file("metrics.csv");
  ASSERT_EQ(fulgur::detail::write_file_atomically(path, "step,a\n"), "");
  ASSERT_EQ(fulgur::detail::write_file_atomically(path, "step,a,b\n1,2,3\n"), "");
  EXPECT_EQ(fulgur::test::read_text(path), "step,a,b\n1,2,3\n");
  EXPECT_EQ(fulgur::test::entries_of(dir.path()), std::vector<std::string>{"metrics.csv"});

  // A directory in the way: the rename fails, nothing is left.
  fs::create_directories(dir.file("taken"));
  const std::string problem = fulgur::detail::write_file_atomically(dir.file("taken"), "x");
  EXPECT_TRUE(fulgur::test::message_contains(problem, {"cannot rename", "taken", "Is a directory"}))
      << problem;
  EXPECT_EQ(fulgur::test::entries_of(dir.path()),
            (std::vector<std::string>{"metrics.csv", "taken"}));
  // A directory that does not exist: named, nothing made.
  EXPECT_TRUE(fulgur::test::message_contains(
      fulgur::detail::write_file_atomically(dir.file("none/metrics.csv"), "x"),
      {"cannot create", "none/metrics.csv.tmp.", "No such file or directory"}));
}

// On a full file system the write fails naming the reason, the old file
// keeps every byte, and the temporary file is gone.
TEST(DurableFile, AFullDiskKeepsTheOldFile) {
  TempDir dir;
  const auto r = fulgur::test::run_on_tmpfs(dir.path(), "64k", [&] {
    const std::string path = dir.file("metrics.csv");
    const std::string old(30000, 'a');
    if (!fulgur::detail::write_file_atomically(path, old).empty()) return 10;
    const std::string problem =
        fulgur::detail::write_file_atomically(path, std::string(60000, 'b'));
    if (!fulgur::test::message_contains(problem, {"metrics.csv.tmp.", "No space left on device"})) {
      return 11;
    }
    if (fulgur::test::read_text(path) != old) return 12;
    if (fulgur::test::entries_of(dir.path()) != std::vector<std::string>{"metrics.csv"}) return 13;
    return 0;
  });
  if (r.exit_code == fulgur::test::kCannotMountTmpfs) GTEST_SKIP() << "cannot mount a tmpfs here";
  EXPECT_EQ(r.exit_code, 0) << r.describe()
                            << " (10: the first write failed, 11: no or another error, 12: the "
                               "old file changed, 13: a file left behind)";
}

// A directory put in place of another: with the exchange and without it
// (the old one set aside, then removed), over a directory, over a file and
// where nothing was; an interrupted replacement without the exchange is
// put back by restore_previous.
TEST(DurableFile, ADirectoryReplacesWhatIsAtItsPathWithOrWithoutAnExchange) {
  for (const bool exchange : {true, false}) {
    SCOPED_TRACE(exchange ? "with RENAME_EXCHANGE" : "without it");
    TempDir dir;
    const std::string path = dir.file("last.ckpt");
    auto staged = [&](const std::string& content) {
      const std::string staging = fulgur::detail::temporary_path_for(path);
      fs::create_directories(staging);
      fulgur::test::write_text(staging + "/manifest.txt", content);
      return staging;
    };
    ASSERT_EQ(fulgur::detail::replace_path(staged("one"), path, exchange), "");
    EXPECT_EQ(fulgur::test::read_text(path + "/manifest.txt"), "one");
    ASSERT_EQ(fulgur::detail::replace_path(staged("two"), path, exchange), "");
    EXPECT_EQ(fulgur::test::read_text(path + "/manifest.txt"), "two");
    EXPECT_EQ(fulgur::test::entries_of(dir.path()), std::vector<std::string>{"last.ckpt"});

    fs::remove_all(path);
    fulgur::test::write_text(path, "a single-file checkpoint");
    ASSERT_EQ(fulgur::detail::replace_path(staged("three"), path, exchange), "");
    EXPECT_EQ(fulgur::test::read_text(path + "/manifest.txt"), "three");
    EXPECT_EQ(fulgur::test::entries_of(dir.path()), std::vector<std::string>{"last.ckpt"});
  }

  TempDir dir;
  const std::string path = dir.file("last.ckpt");
  fs::create_directories(fulgur::detail::previous_path(path));
  fulgur::test::write_text(fulgur::detail::previous_path(path) + "/manifest.txt", "kept");
  EXPECT_TRUE(fulgur::detail::restore_previous(path));
  EXPECT_EQ(fulgur::test::read_text(path + "/manifest.txt"), "kept");
  EXPECT_EQ(fulgur::test::entries_of(dir.path()), std::vector<std::string>{"last.ckpt"});
  EXPECT_FALSE(fulgur::detail::restore_previous(path));  // nothing set aside
  // Where both are there, the replacement completed: nothing is put back.
  fs::create_directories(fulgur::detail::previous_path(path));
  EXPECT_FALSE(fulgur::detail::restore_previous(path));
  EXPECT_EQ(fulgur::test::read_text(path + "/manifest.txt"), "kept");
}

TEST(DurableFile, ADeadWritersTemporaryIsToldFromALiveOnesAndAnotherMachines) {
  const std::string host = fulgur::detail::this_host();
  EXPECT_FALSE(host.empty());
  const std::string own = fs::path(fulgur::detail::temporary_path_for("/x/last.ckpt")).filename();
  EXPECT_EQ(own, fulgur::str("last.ckpt.tmp.", ::getpid(), ".", host));
  EXPECT_FALSE(fulgur::detail::is_dead_writers_temporary(own));  // this process runs
  // A child that has ended (and been reaped): its pid runs no process.
  const pid_t pid = fulgur::test::dead_pid();
  const std::string dead = fulgur::str("last.ckpt.tmp.", pid, ".", host);
  EXPECT_TRUE(fulgur::detail::is_dead_writers_temporary(dead));
  EXPECT_TRUE(fulgur::detail::is_dead_writers_temporary(fulgur::str("last.ckpt.tmp.", pid)));
  EXPECT_FALSE(fulgur::detail::is_dead_writers_temporary(
      fulgur::str("last.ckpt.tmp.", pid, ".another-machine")));
  for (const char* name : {"last.ckpt", "last.ckpt.tmp.", "last.ckpt.tmp.12x.h", "a.tmp.1234567890"}) {
    EXPECT_FALSE(fulgur::detail::is_dead_writers_temporary(name)) << name;
  }
}

TEST(DurableFile, DirectoriesAreCreatedWithTheirParentsOrTheObstacleIsNamed) {
  TempDir dir;
  EXPECT_EQ(fulgur::detail::create_directories_durably(dir.file("a/b/c")), "");
  EXPECT_TRUE(fs::is_directory(dir.file("a/b/c")));
  EXPECT_EQ(fulgur::detail::create_directories_durably(dir.file("a/b/c")), "");  // there already
  fulgur::test::write_text(dir.file("file"), "");
  int error = 0;
  const std::string problem =
      fulgur::detail::create_directories_durably(dir.file("file/checkpoints"), &error);
  EXPECT_TRUE(fulgur::test::message_contains(problem, {"cannot create directory", "file/checkpoints",
                                                       "Not a directory"}))
      << problem;
  EXPECT_EQ(error, ENOTDIR);
}

}  // namespace
