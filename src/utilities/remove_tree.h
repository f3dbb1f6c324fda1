#pragma once
// Removing a directory tree without std::filesystem::remove_all: a pip
// wheel's libtorch.so exports the remove_all of the static libstdc++fs it
// was built with, a program can bind to it, and that copy jumped to address 0
// (seen with torch 2.11: every TempDir, and a sharded checkpoint's top-k
// eviction, crashed).

#include <cstdint>
#include <string>
#include <system_error>

namespace fulgur::detail {

/// Removes `path` and, when it is a directory, everything under it, never
/// following a symbolic link (a link is removed, not what it points to).
/// Returns how many entries were removed. A path that does not exist is no
/// error; otherwise `ec` holds the first failure (what could be removed is).
std::uintmax_t remove_tree(const std::string& path, std::error_code& ec);

}  // namespace fulgur::detail
