// remove_tree: what std::filesystem::remove_all does, without it (see
// src/utilities/remove_tree.h for why), and never through a symbolic link.
#include "utilities/remove_tree.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using fulgur::detail::remove_tree;
using fulgur::test::TempDir;

TEST(RemoveTree, RemovesNestedDirectoriesAndFilesAndCountsThem) {
  TempDir dir;
  const fs::path root = fs::path(dir.path()) / "run";
  fs::create_directories(root / "a" / "b");
  fulgur::test::write_text((root / "x.ckpt").string(), "x");
  fulgur::test::write_text((root / "a" / "b" / "y").string(), "y");
  std::error_code ec;
  EXPECT_EQ(remove_tree(root.string(), ec), 5u);  // run, x.ckpt, a, b, y
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_FALSE(fs::exists(root));
}

TEST(RemoveTree, AMissingPathIsNoError) {
  TempDir dir;
  std::error_code ec;
  EXPECT_EQ(remove_tree(dir.file("absent"), ec), 0u);
  EXPECT_FALSE(ec) << ec.message();
}

TEST(RemoveTree, RemovesALinkNotWhatItPointsTo) {
  TempDir dir;
  const fs::path kept = fs::path(dir.path()) / "kept";
  fs::create_directories(kept);
  fulgur::test::write_text((kept / "best.ckpt").string(), "keep me");
  const fs::path root = fs::path(dir.path()) / "run";
  fs::create_directories(root);
  fs::create_directory_symlink(kept, root / "link");
  std::error_code ec;
  EXPECT_EQ(remove_tree(root.string(), ec), 2u);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_FALSE(fs::exists(root));
  EXPECT_TRUE(fs::exists(kept / "best.ckpt"));
}

TEST(RemoveTree, AnEntryThatCannotBeRemovedIsReportedAndTheRestGoes) {
  TempDir dir;
  const fs::path root = fs::path(dir.path()) / "run";
  fs::create_directories(root / "locked");
  fulgur::test::write_text((root / "locked" / "f").string(), "f");
  fulgur::test::write_text((root / "free").string(), "g");
  // What remove_tree must do as a user who may not write into locked/.
  const auto attempt = [&root]() -> int {
    std::error_code ec;
    remove_tree(root.string(), ec);
    if (ec != std::errc::permission_denied) return 1;
    if (fs::exists(root / "free")) return 2;
    if (!fs::exists(root / "locked" / "f")) return 3;
    return 0;
  };
  int result = 0;
  if (::geteuid() != 0) {
    ASSERT_EQ(::chmod((root / "locked").c_str(), 0500), 0);
    result = attempt();
  } else {
    // Root removes anything: the attempt runs as nobody, in a child, on a
    // tree nobody owns.
    ASSERT_EQ(::chmod(dir.path().c_str(), 0711), 0);
    for (const fs::path& p : {root, root / "locked", root / "locked" / "f", root / "free"}) {
      ASSERT_EQ(::chown(p.c_str(), 65534, 65534), 0) << p;
    }
    ASSERT_EQ(::chmod((root / "locked").c_str(), 0500), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(9);
      ::_exit(attempt());
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    if (WEXITSTATUS(status) == 9) GTEST_SKIP() << "cannot switch to user nobody here";
    result = WEXITSTATUS(status);
  }
  EXPECT_EQ(result, 0) << "1: not reported as permission denied; 2: free was not removed; "
                          "3: the locked file went";
  ::chmod((root / "locked").c_str(), 0700);
}

}  // namespace
