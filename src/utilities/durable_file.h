// Private: files that are replaced whole or not at all. A checkpoint's
// manifest, a logger's metrics.csv, a plot: each is written to a temporary
// file beside its path ("<path>.tmp.<pid>.<host>", the name a CheckpointIO's
// temporary file has), flushed, and renamed into place, so that a reader
// (and a crash, and a full disk) sees the old file or the new one, never a
// part of one.
#pragma once

#include <string>
#include <string_view>

namespace fulgur::detail {

/// This machine's name, as temporary files record their writer's
/// ("localhost" when it has none).
std::string this_host();

/// "<path>.tmp.<pid>.<host>" of this process.
std::string temporary_path_for(const std::string& path);

/// Whether `name` (a file name, no directory) is "<anything>.tmp.<pid>.<host>"
/// (or fulgur 0.1's "<anything>.tmp.<pid>") of a process of this machine
/// that no longer runs: what an interrupted write left. Another machine's
/// (a shared file system) and a live process's never are.
bool is_dead_writers_temporary(const std::string& name);

/// fsync of the directory `dir`: what was created or renamed in it is
/// durable once it returns. 0, or the errno of the fsync (a file system
/// that cannot flush directories, EINVAL, and a directory this process
/// cannot open count as 0, as they did for checkpoints).
int flush_directory(const std::string& dir);

/// Writes `bytes` to `path` through its temporary file, flushed (fsync),
/// renamed into place, and the directory flushed. Returns "" when done;
/// otherwise what failed ("cannot write \"<tmp>\": No space left on
/// device"), with the temporary file removed and `path` as it was.
std::string write_file_atomically(const std::string& path, std::string_view bytes);

/// Renames `from` to `to`, replacing `to` as it is, then flushes the
/// directory of `to`: "" or what failed. For a file written elsewhere
/// (a plot program's output) whose content was checked first.
std::string rename_into_place(const std::string& from, const std::string& to);

/// Creates `dir` and its missing parents, each made durable (its parent
/// flushed). "" or what failed ("cannot create directory \"<d>\": ..."),
/// its errno in `error` when given.
std::string create_directories_durably(const std::string& dir, int* error = nullptr);

/// Puts `replacement` (a directory or file, beside `path` on its file
/// system) at `path` in place of what is there. Where the file system can
/// exchange two names at once (renameat2's RENAME_EXCHANGE: Linux's local
/// file systems) `path` never lacks a whole entry, and what it held is then
/// removed. Elsewhere (NFS, or `exchange` false) what `path` held moves to
/// previous_path(path) first and is removed once `replacement` took its
/// place: a crash between the two renames leaves it whole there, which
/// restore_previous puts back. The directory is flushed. "" or what failed
/// (then `path` holds what it held, and `replacement` is left).
std::string replace_path(const std::string& replacement, const std::string& path,
                         bool exchange = true);

/// "<path>.previous".
std::string previous_path(const std::string& path);

/// Where a replace_path stopped between its two renames (nothing at `path`,
/// previous_path(path) there): renames it back. Whether it did.
bool restore_previous(const std::string& path);

}  // namespace fulgur::detail
