// `fulgur checkpoint inspect PATH`: what a checkpoint holds, and whether it
// verifies. Part of the `fulgur` program.
#pragma once

#include <ostream>
#include <string>

namespace fulgur_cli {

/// Prints the checkpoint at `path` (a file, or a directory of per-rank
/// shards) to `out`: its size and checksum, format and fulgur version,
/// progress, and its sections (module tensors with dtype, shape and size;
/// optimizers; schedulers; callbacks; RNG states; hyper-parameters).
/// Returns 0 when every file verifies (a file from before checksums: 0,
/// marked unverified), 1 when one is corrupt or unreadable (the reason on
/// `out` too).
int inspect_checkpoint(const std::string& path, std::ostream& out);

}  // namespace fulgur_cli
