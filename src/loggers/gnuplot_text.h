// Private: text put into a gnuplot program (file paths, titles, metric
// names), and gnuplot's output put into an error message. Not installed.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "fulgur/core/errors.h"

namespace fulgur::detail {

/// A gnuplot double-quoted string literal of `text`, byte for byte: `"` and
/// `\` escaped, and every byte gnuplot would act on written as an octal
/// escape: a backquote (gnuplot runs `command` even inside double quotes)
/// and the control characters (a newline would end the command and start
/// another). So a path or name can never become gnuplot code.
inline std::string gnuplot_quoted(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '`' || byte < 0x20 || byte == 0x7f) {
      char octal[5];
      std::snprintf(octal, sizeof octal, "\\%03o", byte);
      out += octal;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

/// What gnuplot printed, for an error message: its text up to a PNG it
/// wrote to its output (when it could not open the file), control bytes
/// left out, at most 2000 characters.
inline std::string gnuplot_said(const std::string& output) {
  const std::string text = output.substr(0, output.find("\x89PNG"));
  std::string out;
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '\n' || c == '\t' || (byte >= 0x20 && byte != 0x7f)) out += c;
    if (out.size() >= 2000) return out + "...";
  }
  return out;
}

/// Why what is at `png_path` must not be replaced by a picture, in a message
/// starting with `who`: a directory, a device, a FIFO or a socket, or a file
/// that is not a PNG (a run's metrics.csv passed as the output, say). ""
/// when nothing is there, or a PNG (whole or not) or an empty file is.
std::string not_a_picture_to_replace(const std::string& png_path, const std::string& who);

/// Why gnuplot could not write a picture at `path`, "" when it can: the
/// path is a directory, or its directory is missing or not writable
/// (checked first: gnuplot would write the PNG to its output instead).
/// Nothing is left behind by the check.
inline std::string unwritable(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return "it is a directory";
  fs::path dir = fs::path(path).parent_path();
  if (dir.empty()) dir = ".";
  if (!fs::is_directory(dir, ec)) {
    return str("its directory \"", dir.string(), "\" does not exist or is not a directory");
  }
  // Opened for writing as gnuplot will (created, then removed, when it is
  // not there yet; never truncated; a FIFO without a reader fails at once).
  const bool existed = fs::exists(path, ec);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0644);
  if (fd < 0) {
    const int err = errno;
    return str("it cannot be opened for writing (", std::strerror(err), ")");
  }
  ::close(fd);
  if (!existed) ::unlink(path.c_str());
  return "";
}

/// Runs gnuplot on `script`, whose `set output` is `tmp`
/// (temporary_path_for(png_path)), and puts the picture at `png_path` only
/// once gnuplot ended well and the PNG is whole (its IEND chunk last): a
/// failure, a timeout or a full disk keeps the picture that was there, and
/// removes `tmp`. Each message starts with `who` ("plot", "lr_find");
/// `not_installed` is the one for a machine without gnuplot. "" when drawn.
std::string run_gnuplot_to(const std::string& script, const std::string& tmp,
                           const std::string& png_path, const std::string& who,
                           const std::string& not_installed);

/// Why the file at `path` is no whole PNG ("is 4096 bytes and ends before
/// its last chunk"), "" when it is one.
std::string png_problem(const std::string& path);

}  // namespace fulgur::detail
