// File: fulgur/loggers/plot.h
//
// Curves as pictures: the metrics.csv a CSVLogger writes, drawn as a PNG by
// gnuplot (Debian's gnuplot-nox; scripts/install-deps.sh installs it). One
// panel per metric against the optimizer step, the train_/val_/test_
// variants and the _step/_epoch aggregates of one metric in the same panel,
// axes labelled. The CSVLogger draws metrics.png next to metrics.csv at the
// end of fit; `fulgur plot RUN_DIR` draws it on demand.
#pragma once

#include <string>
#include <vector>

namespace fulgur {

/// The panel a metric goes to: "train_loss_epoch" → "loss".
std::string metric_panel(const std::string& metric);

/// The gnuplot program that draws `csv_path` into `png_path` (`title` on
/// top); ConfigError when the CSV cannot be read or holds no metric.
std::string gnuplot_script(const std::string& csv_path, const std::string& png_path,
                           const std::string& title);

/// The metrics.csv `path` names: the file itself, a version directory that
/// holds one, or a run's root (its newest fulgur_logs/version_N, or any
/// <name>/version_N below it). ConfigError saying where it looked.
std::string find_metrics_csv(const std::string& path);

/// Draws `csv_path` into `png_path` with gnuplot (bounded: 60 s). Returns ""
/// when done, else one line saying what is missing or went wrong (gnuplot
/// not installed: what to install), nothing thrown.
std::string plot_metrics(const std::string& csv_path, const std::string& png_path);

}  // namespace fulgur
