#include "fulgur/loggers/plot.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

#include "core/run_program.h"
#include "loggers/gnuplot_text.h"
#include "utilities/durable_file.h"
#include "utilities/file_kind.h"
#include "fulgur/core/errors.h"

namespace fulgur {

namespace {

std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> cells;
  std::string cell;
  for (char c : line) {
    if (c == ',') {
      cells.push_back(cell);
      cell.clear();
    } else if (c != '\r') {
      cell += c;
    }
  }
  cells.push_back(cell);
  return cells;
}

// Underscores are subscripts in gnuplot's enhanced text: shown as written.
std::string gnuplot_label(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '_' || c == '^' || c == '{' || c == '}' || c == '@' || c == '&') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

std::string metric_panel(const std::string& metric) {
  std::string name = metric;
  for (const char* prefix : {"train_", "val_", "test_"}) {
    if (name.rfind(prefix, 0) == 0 && name.size() > std::strlen(prefix)) {
      name = name.substr(std::strlen(prefix));
      break;
    }
  }
  for (const char* suffix : {"_step", "_epoch"}) {
    const size_t n = std::strlen(suffix);
    if (name.size() > n && name.compare(name.size() - n, n, suffix) == 0) {
      name = name.substr(0, name.size() - n);
      break;
    }
  }
  return name;
}

std::string gnuplot_script(const std::string& csv_path, const std::string& png_path,
                           const std::string& title) {
  std::ifstream in(csv_path);
  if (!in) {
    throw ConfigError(str("plot: cannot read \"", csv_path, "\": ", std::strerror(errno),
                          ". Pass a CSVLogger's metrics.csv or its run directory."));
  }
  std::string line;
  if (!std::getline(in, line)) {
    throw ConfigError(str("plot: \"", csv_path, "\" is empty: no metric was logged."));
  }
  const std::vector<std::string> header = split_csv_line(line);
  if (header.empty() || header[0] != "step") {
    throw ConfigError(str("plot: \"", csv_path,
                          "\" is not a CSVLogger's metrics.csv (its first column is \"",
                          header.empty() ? "" : header[0], "\", not \"step\")."));
  }
  // Each metric's (step, value) points, in file order.
  std::vector<std::vector<std::pair<double, double>>> points(header.size());
  // Per column, the values gnuplot cannot draw: nan, infinities, and
  // magnitudes past DBL_MAX/4 (gnuplot takes those past DBL_MAX/2 as
  // undefined, and a panel from -DBL_MAX/2 to DBL_MAX/2 overflows its
  // range; a panel of only those made it fail). Left out, and counted in
  // the series' key: a run that diverged shows it did.
  constexpr double kLargestDrawn = std::numeric_limits<double>::max() / 4;
  std::vector<int64_t> undrawn(header.size(), 0);
  int64_t row = 1;
  while (std::getline(in, line)) {
    ++row;
    if (line.empty()) continue;
    const auto cells = split_csv_line(line);
    char* end = nullptr;
    const double step = std::strtod(cells[0].c_str(), &end);
    if (cells[0].empty() || *end != '\0' || !std::isfinite(step)) {
      throw ConfigError(str("plot: \"", csv_path, "\" line ", row, ": the step \"", cells[0],
                            "\" is not a number."));
    }
    for (size_t c = 1; c < cells.size() && c < header.size(); ++c) {
      if (cells[c].empty()) continue;
      const double v = std::strtod(cells[c].c_str(), &end);
      if (*end != '\0') continue;
      if (std::isfinite(v) && std::fabs(v) <= kLargestDrawn) {
        points[c].emplace_back(step, v);
      } else {
        ++undrawn[c];
      }
    }
  }
  // Panels in the order their first metric appears; "epoch" is the x axis's
  // companion, not a curve.
  std::vector<std::string> panels;
  std::map<std::string, std::vector<size_t>> members;
  std::vector<std::string> none_drawn;  // metrics of undrawable values only
  for (size_t c = 1; c < header.size(); ++c) {
    if (header[c] == "epoch") continue;
    if (points[c].empty()) {
      if (undrawn[c] > 0) none_drawn.push_back(header[c]);
      continue;
    }
    const std::string panel = metric_panel(header[c]);
    if (!members.count(panel)) panels.push_back(panel);
    members[panel].push_back(c);
  }
  // The loss first: what a reader looks for.
  std::stable_partition(panels.begin(), panels.end(),
                        [](const std::string& p) { return p.find("loss") != std::string::npos; });
  if (panels.empty()) {
    throw ConfigError(
        str("plot: \"", csv_path, "\" holds no metric value to draw",
            none_drawn.empty()
                ? std::string()
                : str(" (", join(none_drawn), none_drawn.size() == 1 ? " holds" : " hold",
                      " only nan, infinities or values past +-4.4e307)"),
            "."));
  }
  // A picture is at most 32767 pixels high (Cairo's limit): 86 rows of
  // panels, in 2 columns, or 4 where there are more; the first 344 are
  // drawn and the title says how many were left out.
  constexpr size_t kMostRows = 86, kMostCols = 4;
  std::string left_out;
  if (panels.size() > kMostRows * kMostCols) {
    left_out = str(" (the first ", kMostRows * kMostCols, " of ", panels.size(), " panels)");
    panels.resize(kMostRows * kMostCols);
  }
  if (!none_drawn.empty()) {
    // A few names; a title is one line.
    std::vector<std::string> named(none_drawn.begin(),
                                   none_drawn.begin() + std::min<long>(3, std::ssize(none_drawn)));
    if (none_drawn.size() > named.size()) {
      named.push_back(str(none_drawn.size() - named.size(), " more"));
    }
    left_out += str(" (no value to draw: ", join(named), ")");
  }
  const size_t cols = std::min<size_t>(
      panels.size(), std::max<size_t>(2, (panels.size() + kMostRows - 1) / kMostRows));
  const size_t rows = (panels.size() + cols - 1) / cols;
  std::ostringstream s;
  s.precision(10);
  // The data of the panels drawn only.
  for (const auto& panel : panels) {
    for (const size_t c : members[panel]) {
      s << "$m" << c << " << EOD\n";
      for (const auto& [x, y] : points[c]) s << x << ' ' << y << '\n';
      s << "EOD\n";
    }
  }
  s << "set terminal pngcairo size " << 560 * cols << "," << 380 * rows
    << " enhanced font \"DejaVu Sans,10\"\n"
    << "set output " << detail::gnuplot_quoted(png_path) << "\n"
    << "set multiplot layout " << rows << "," << cols << " title "
    << detail::gnuplot_quoted(gnuplot_label(title + left_out)) << " font \",12\"\n"
    << "set grid\nset bmargin 5\nset key outside bottom center horizontal\nset xlabel \"optimizer "
       "step\" offset 0,0.5\n";
  for (const auto& panel : panels) {
    s << "set title " << detail::gnuplot_quoted(gnuplot_label(panel)) << "\nset ylabel "
      << detail::gnuplot_quoted(gnuplot_label(panel)) << "\n";
    s << "plot ";
    const auto& cols_of = members[panel];
    for (size_t i = 0; i < cols_of.size(); ++i) {
      const size_t c = cols_of[i];
      // Sparse series (once per epoch) get points to stay visible.
      const char* style = points[c].size() <= 50 ? "linespoints pt 7 ps 0.6" : "lines";
      const std::string key = undrawn[c] == 0 ? header[c]
                                              : str(header[c], " (", undrawn[c],
                                                    " not drawn: nan, inf or past +-4.4e307)");
      s << (i ? ", " : "") << "$m" << c << " using 1:2 with " << style << " lw 1.5 title "
        << detail::gnuplot_quoted(gnuplot_label(key));
    }
    s << "\n";
  }
  s << "unset multiplot\nset output\n";
  return s.str();
}

std::string find_metrics_csv(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return path;
  if (!fs::is_directory(path, ec)) {
    struct stat st {};
    const bool there = ::stat(path.c_str(), &st) == 0;
    const int err = errno;
    throw ConfigError(str(
        "plot: \"", path, "\" ",
        there ? str("is ", detail::file_kind(st.st_mode), ", neither a metrics.csv nor a directory")
        : err == ENOENT ? std::string("does not exist")
                        : str("cannot be looked up: ", std::strerror(err)),
        ". Pass a CSVLogger's metrics.csv, its version directory, or the run's default_root_dir."));
  }
  if (fs::is_regular_file(fs::path(path) / "metrics.csv", ec)) {
    return (fs::path(path) / "metrics.csv").string();
  }
  // A run's root: <name>/version_N/metrics.csv, the highest N of the first
  // logger directory that has one (fulgur_logs first).
  std::vector<fs::path> names = {fs::path(path) / "fulgur_logs"};
  for (const auto& entry : fs::directory_iterator(path, ec)) {
    if (entry.is_directory(ec) && entry.path().filename() != "fulgur_logs") {
      names.push_back(entry.path());
    }
  }
  for (const auto& name : names) {
    long best = -1;
    fs::path found;
    for (const auto& entry : fs::directory_iterator(name, ec)) {
      const std::string dir = entry.path().filename().string();
      if (dir.rfind("version_", 0) != 0) continue;
      char* end = nullptr;
      const long n = std::strtol(dir.c_str() + 8, &end, 10);
      if (*end == '\0' && n > best && fs::is_regular_file(entry.path() / "metrics.csv", ec)) {
        best = n;
        found = entry.path() / "metrics.csv";
      }
    }
    if (best >= 0) return found.string();
  }
  throw ConfigError(str("plot: no metrics.csv in \"", path,
                        "\", nor in a <logger>/version_N directory below it. Pass a CSVLogger's "
                        "metrics.csv, its version directory, or the run's default_root_dir."));
}

std::string plot_metrics(const std::string& csv_path, const std::string& png_path) {
  // Drawn beside png_path first, and put there once whole.
  const std::string tmp = detail::temporary_path_for(png_path);
  std::string script;
  try {
    const auto dir = std::filesystem::path(csv_path).parent_path();
    script = gnuplot_script(csv_path, tmp,
                            dir.filename().string().empty()
                                ? csv_path
                                : (dir.parent_path().filename() / dir.filename()).string());
  } catch (const std::exception& e) {
    return e.what();
  }
  if (std::string problem = detail::not_a_picture_to_replace(png_path, "plot"); !problem.empty()) {
    return problem;
  }
  if (std::string problem = detail::unwritable(png_path); !problem.empty()) {
    return str("plot: cannot write \"", png_path, "\": ", problem,
               ". Pass an output path in a directory this user can write.");
  }
  return detail::run_gnuplot_to(
      script, tmp, png_path, "plot",
      str("plot: gnuplot is not installed, so there is no picture of \"", csv_path,
          "\": apt install gnuplot-nox (scripts/install-deps.sh installs it), then run `fulgur "
          "plot ",
          std::filesystem::path(csv_path).parent_path().string(), "`."));
}

namespace detail {

namespace {
constexpr unsigned char kPngSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
}  // namespace

std::string png_problem(const std::string& path) {
  // An IEND chunk: no data, its type, its CRC.
  static constexpr unsigned char kEnd[12] = {0,   0,   0,    0,    'I',  'E',
                                             'N', 'D', 0xae, 0x42, 0x60, 0x82};
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return "cannot be read";
  const auto size = static_cast<int64_t>(in.tellg());
  unsigned char head[8] = {}, tail[12] = {};
  if (size >= 8) {
    in.seekg(0);
    in.read(reinterpret_cast<char*>(head), 8);
  }
  if (size < 20 || !in || std::memcmp(head, kPngSignature, 8) != 0) {
    return str("is ", size, " bytes and no PNG");
  }
  in.seekg(size - 12);
  in.read(reinterpret_cast<char*>(tail), 12);
  if (!in || std::memcmp(tail, kEnd, 12) != 0) {
    return str("is ", size, " bytes and ends before its last chunk");
  }
  return "";
}

std::string not_a_picture_to_replace(const std::string& png_path, const std::string& who) {
  struct stat st {};
  if (::stat(png_path.c_str(), &st) != 0) return "";
  const auto refused = [&](const std::string& what) {
    return str(who, ": \"", png_path, "\" ", what,
               ", and is left as it is. Pass the path of a .png file (one that is not there yet, "
               "or a picture to replace).");
  };
  if (!S_ISREG(st.st_mode)) return refused(str("is ", file_kind(st.st_mode)));
  if (st.st_size == 0) return "";
  char head[8] = {};
  std::ifstream in(png_path, std::ios::binary);
  if (in.read(head, sizeof(head)) && std::memcmp(head, kPngSignature, sizeof(head)) == 0) {
    return "";
  }
  return refused(str("holds ", st.st_size, " bytes that are no PNG picture"));
}

std::string run_gnuplot_to(const std::string& script, const std::string& tmp,
                           const std::string& png_path, const std::string& who,
                           const std::string& not_installed) {
  const auto ran = run_program({"gnuplot"}, script, std::chrono::seconds(60));
  const auto failed = [&](std::string problem) {
    ::unlink(tmp.c_str());
    return problem;
  };
  if (ran.spawn_error != 0) return failed(not_installed);
  if (ran.timed_out) {
    return failed(str(who, ": gnuplot did not finish in 60 s drawing \"", png_path, "\"."));
  }
  std::error_code ec;
  if (!ran.succeeded() || !std::filesystem::exists(tmp, ec)) {
    return failed(str(who, ": gnuplot failed drawing \"", png_path,
                      "\": ", ran.output.empty() ? ran.how_it_ended() : gnuplot_said(ran.output)));
  }
  if (const std::string problem = png_problem(tmp); !problem.empty()) {
    return failed(str(who, ": the picture gnuplot drew of \"", png_path, "\" ", problem,
                      ": its disk is full, or gnuplot could not finish writing it. Free space "
                      "and draw it again; a picture that was there is kept."));
  }
  if (std::string problem = rename_into_place(tmp, png_path); !problem.empty()) {
    return failed(str(who, ": ", problem, "."));
  }
  return "";
}

}  // namespace detail
}  // namespace fulgur
