#include "fulgur/callbacks/model_checkpoint.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <tuple>

#include "fulgur/core/errors.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"
#include "strategies/strategy_driver.h"
#include "utilities/file_kind.h"

namespace fulgur {

namespace fs = std::filesystem;

namespace {

// A format of the template's fields, as Python's (Lightning's templates use
// them): [0][width][.precision] and f, e, g or d.
struct FormatSpec {
  bool zero = false;
  int width = 0;
  int precision = -1;
  char type = 'f';
};

std::optional<FormatSpec> parse_spec(const std::string& spec) {
  FormatSpec f;
  size_t i = 0;
  auto digits = [&](int& n, int most) {
    const size_t from = i;
    for (; i < spec.size() && std::isdigit(static_cast<unsigned char>(spec[i])) != 0; ++i) {
      n = n * 10 + (spec[i] - '0');
      if (n > most) return false;
    }
    return i > from;
  };
  if (i < spec.size() && spec[i] == '0') {
    f.zero = true;
    ++i;
  }
  if (i < spec.size() && spec[i] != '.' && std::isdigit(static_cast<unsigned char>(spec[i])) != 0 &&
      !digits(f.width, 64)) {
    return std::nullopt;
  }
  if (i < spec.size() && spec[i] == '.') {
    ++i;
    f.precision = 0;
    if (!digits(f.precision, 30)) return std::nullopt;
  }
  if (i + 1 != spec.size() || std::string("fegd").find(spec[i]) == std::string::npos) {
    return std::nullopt;
  }
  f.type = spec[i];
  if (f.type == 'd' && f.precision >= 0) return std::nullopt;
  return f;
}

bool format_spec_ok(const std::string& spec) { return parse_spec(spec).has_value(); }

std::string format_number(const std::string& spec, double value) {
  const FormatSpec f = *parse_spec(spec);  // checked when the template was given
  char out[512];                           // a double's 309 digits and 30 decimals fit
  const int p = f.precision < 0 ? 6 : f.precision;
  switch (f.type) {
    case 'd':
      if (!std::isfinite(value)) return std::isnan(value) ? "nan" : value > 0 ? "inf" : "-inf";
      std::snprintf(out, sizeof(out), f.zero ? "%0*lld" : "%*lld", f.width,
                    static_cast<long long>(std::llround(value)));
      break;
    case 'e':
      std::snprintf(out, sizeof(out), f.zero ? "%0*.*e" : "%*.*e", f.width, p, value);
      break;
    case 'g':
      std::snprintf(out, sizeof(out), f.zero ? "%0*.*g" : "%*.*g", f.width, p, value);
      break;
    default: std::snprintf(out, sizeof(out), f.zero ? "%0*.*f" : "%*.*f", f.width, p, value); break;
  }
  return out;
}

}  // namespace

ModelCheckpoint::ModelCheckpoint(ModelCheckpointOptions options) : options_(std::move(options)) {
  std::vector<std::string> problems;
  if (!options_.mode.is_valid()) {
    problems.push_back(
        str("mode=\"", options_.mode.text(), "\": pass ", options_.mode.spellings()));
  }
  if (options_.save_top_k < -1) {
    problems.push_back(
        str("save_top_k=", options_.save_top_k, ": pass -1 (keep all), 0 (none) or k >= 1"));
  }
  if (options_.every_n_train_steps < 0) {
    problems.push_back(str("every_n_train_steps=", options_.every_n_train_steps, ": must be >= 0"));
  }
  if (options_.every_n_epochs && *options_.every_n_epochs < 0) {
    problems.push_back(str("every_n_epochs=", *options_.every_n_epochs, ": must be >= 0"));
  }
  if (options_.filename.empty()) problems.push_back("filename=\"\": pass a file name template");
  name_parts_ = parse_name(options_.filename);
  // A '/' in the text (a metric's name in a {field} may hold one).
  if (std::any_of(name_parts_.begin(), name_parts_.end(), [](const NamePart& part) {
        return !part.field && part.text.find('/') != std::string::npos;
      })) {
    problems.push_back(str("filename=\"", options_.filename,
                           "\": a file name, not a path (a checkpoint written outside dirpath is "
                           "never removed by save_top_k). Put the directory in dirpath"));
  }
  if (options_.auto_insert_metric_name) {
    // "{name...}" becomes "name={name...}", as Lightning's.
    std::vector<NamePart> named;
    for (const NamePart& part : name_parts_) {
      if (part.field) {
        if (part.text.find('/') != std::string::npos) {
          problems.push_back(str("filename=\"", options_.filename,
                                 "\" with auto_insert_metric_name: {", part.text, "} would put \"",
                                 part.text,
                                 "=\" in the name, and its '/' would make a directory. Pass "
                                 "auto_insert_metric_name=false and write the name without '/' "
                                 "(e.g. \"val_loss={",
                                 part.text, "}\")"));
        }
        if (named.empty() || named.back().field) named.emplace_back();
        named.back().text += part.text + "=";
      }
      named.push_back(part);
    }
    name_parts_ = std::move(named);
  }
  for (const NamePart& part : name_parts_) {
    if (part.field && !part.spec.empty() && !format_spec_ok(part.spec)) {
      problems.push_back(str("filename=\"", options_.filename, "\": the format \"", part.spec,
                             "\" of {", part.text, ":", part.spec,
                             "} is not one of [0][width][.precision] followed by f, e, g or d "
                             "(e.g. {val_loss:.2f}, {epoch:03d})"));
    }
  }
  if (!problems.empty()) {
    throw ConfigError(str("ModelCheckpoint(", join(problems, "; "), ")."));
  }
  if (!options_.every_n_epochs) options_.every_n_epochs = options_.every_n_train_steps > 0 ? 0 : 1;
}

std::string ModelCheckpoint::state_key() const {
  return str("ModelCheckpoint{monitor=", options_.monitor, ",mode=", options_.mode.text(),
             ",every_n_train_steps=", options_.every_n_train_steps,
             ",every_n_epochs=", options_.every_n_epochs.value_or(0), "}");
}

void ModelCheckpoint::on_fit_start(Trainer& trainer, Module&) {
  if (trainer.global_step() == 0 && trainer.current_epoch() == 0) {
    // A fit from the start (a second fit of the same Trainer too): nothing
    // of an earlier fit is ranked, replaced or said to be saved at a step
    // (its saves were skipped as "already saved" and its scores competed);
    // a resumed fit has taken the checkpoint's ranking.
    best_model_path_.clear();
    best_model_score_.reset();
    last_model_path_.clear();
    top_k_.clear();
    latest_path_.clear();
    saved_at_.clear();
    noted_missing_.clear();
    last_saved_step_ = -1;
    validated_this_epoch_ = false;
    noted_no_validation_ = false;
    noted_rank_values_ = false;
  }
  dirpath_ = options_.dirpath.empty()
                 ? (fs::path(trainer.default_root_dir()) / "checkpoints").string()
                 : options_.dirpath;
  validation_ran_ = false;
  if (enabled(trainer)) {
    if (const std::string why = detail::unusable_directory(dirpath_).why; !why.empty()) {
      throw ConfigError(str("ModelCheckpoint: dirpath \"", dirpath_,
                            "\" cannot hold checkpoints: ", why,
                            ". Pass a dirpath (or default_root_dir) that is a directory or "
                            "can be made one."));
    }
  }
  // What saves killed mid-write left (a later save would remove it too,
  // but a run may end before its first save).
  std::error_code ec;
  if (enabled(trainer) && fs::is_directory(dirpath_, ec)) {
    detail::drive(trainer.strategy()).remove_stale_checkpoint_files(dirpath_);
  }
}

std::vector<ModelCheckpoint::NamePart> ModelCheckpoint::parse_name(
    const std::string& name_template) {
  const std::string& t = name_template;
  std::vector<NamePart> parts;
  for (size_t i = 0; i < t.size();) {
    if (t[i] == '{') {
      if (const size_t close = t.find('}', i); close != std::string::npos) {
        const std::string field = t.substr(i + 1, close - i - 1);
        const size_t colon = field.find(':');
        parts.push_back({field.substr(0, colon),
                         colon == std::string::npos ? "" : field.substr(colon + 1), true});
        i = close + 1;
        continue;
      }
    }
    if (parts.empty() || parts.back().field) parts.emplace_back();
    parts.back().text += t[i++];
  }
  return parts;
}

namespace {
// The shortest text that reads back to `value` ("100", "0.1", "1e-07").
std::string shortest_text(double value) {
  char text[64];
  const auto end = std::to_chars(text, text + sizeof text, value).ptr;
  return std::string(text, end);
}
}  // namespace

std::map<std::string, double> ModelCheckpoint::ranked_metrics(Trainer& trainer, bool& stopping) {
  std::vector<std::string> keys;
  if (!options_.monitor.empty()) keys.push_back(options_.monitor);
  for (const NamePart& part : name_parts_) {
    if (part.field && part.text != "epoch" && part.text != "step" &&
        std::find(keys.begin(), keys.end(), part.text) == keys.end()) {
      keys.push_back(part.text);
    }
  }
  const Metrics& local = trainer.callback_metrics();
  std::map<std::string, double> out;
  Strategy& strategy = trainer.strategy();
  stopping = trainer.should_stop();
  if (strategy.world_size() <= 1 || keys.empty()) {
    for (const std::string& key : keys) {
      if (auto it = local.find(key); it != local.end()) out.emplace(key, it->second);
    }
    return out;
  }
  // Whether each is there, and its value; then whether the rank has
  // asked to stop (agreed only after this batch: any rank's request stops).
  const size_t width = 2 * keys.size() + 1;
  at::Tensor mine = torch::zeros({static_cast<int64_t>(width)}, torch::kDouble);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (auto it = local.find(keys[i]); it != local.end()) {
      mine[static_cast<int64_t>(2 * i)] = 1.0;
      mine[static_cast<int64_t>(2 * i + 1)] = it->second;
    }
  }
  mine[static_cast<int64_t>(width - 1)] = stopping ? 1.0 : 0.0;
  const at::Tensor every = strategy.all_gather(mine).cpu().contiguous();
  const double* rows = every.data_ptr<double>();
  const int world = strategy.world_size();
  for (size_t i = 0; i < keys.size(); ++i) {
    if (rows[2 * i] != 0.0) out.emplace(keys[i], rows[2 * i + 1]);
  }
  for (int r = 0; r < world; ++r) {
    stopping = stopping || rows[static_cast<size_t>(r) * width + width - 1] != 0.0;
  }
  if (noted_rank_values_) return out;
  for (size_t i = 0; i < keys.size(); ++i) {
    std::vector<std::string> values;
    bool differ = false;
    const double* first = rows + 2 * i;
    for (int r = 0; r < world; ++r) {
      const double* row = rows + static_cast<size_t>(r) * width + 2 * i;
      values.push_back(row[0] != 0.0 ? shortest_text(row[1]) : std::string("none"));
      const bool same = row[0] == first[0] && (row[0] == 0.0 || row[1] == first[1] ||
                                               (std::isnan(row[1]) && std::isnan(first[1])));
      differ = differ || !same;
    }
    if (!differ) continue;
    noted_rank_values_ = true;
    if (strategy.is_global_zero()) {
      detail::print_note(str(
          "ModelCheckpoint(", keys[i] == options_.monitor ? "monitor" : "filename", "=\"",
          keys[i] == options_.monitor ? options_.monitor : options_.filename,
          "\"): the ranks' values of \"", keys[i], "\" differ at step ", trainer.global_step(),
          " (", by_rank(values, ": "),
          "): logged without sync_dist, each rank has its own. Checkpoints are ranked and named "
          "by global rank 0's on every rank, so that all keep the same ones. Log it with "
          "sync_dist=true to rank by the value over every rank."));
    }
    break;
  }
  return out;
}

std::string ModelCheckpoint::format_name(Trainer& trainer,
                                         const std::map<std::string, double>& metrics) {
  // Fills in {epoch}, {step} and {<metric>} (each with an optional format,
  // {val_loss:.2f}).
  std::string out;
  std::vector<std::string> missing;
  for (const NamePart& part : name_parts_) {
    const std::string& key = part.text;
    if (!part.field) {
      out += part.text;
    } else if (key == "epoch" || key == "step") {
      const int64_t n = key == "epoch" ? trainer.current_epoch() : trainer.global_step();
      out += part.spec.empty() ? std::to_string(n) : format_number(part.spec, n);
    } else if (auto it = metrics.find(key); it == metrics.end()) {
      missing.push_back(key);
      out += "nan";
    } else if (part.spec.empty()) {
      std::ostringstream v;
      v.precision(4);
      v << std::fixed << it->second;
      out += v.str();
    } else {
      out += format_number(part.spec, it->second);
    }
  }
  // A metric not logged (yet, or ever: a misspelt name) reads "nan", said
  // once per name.
  for (const std::string& key : missing) {
    if (!noted_missing_.insert(key).second || !trainer.strategy().is_global_zero()) continue;
    std::vector<std::string> names;
    for (const auto& [k, _] : trainer.callback_metrics()) names.push_back(k);
    detail::print_note(str("ModelCheckpoint(filename=\"", options_.filename, "\"): {", key,
                           "} is not a logged metric at step ", trainer.global_step(),
                           ", so the name reads \"nan\" there. Logged metrics: ",
                           names.empty() ? std::string("none") : join(names),
                           ". Log it, or use one of these names."));
  }
  return (fs::path(dirpath_) / (out + ".ckpt")).string();
}

std::string ModelCheckpoint::unclaimed(const std::string& path, int64_t step,
                                       const std::string& replaced) const {
  // A checkpoint this callback keeps under that name from another step (a
  // template without {epoch} or {step}, or whose metric repeats) is not
  // written over: "-v1", "-v2", ... before ".ckpt", as Lightning names them.
  // The same step's is (a run resumed from before that step's save makes
  // it again, as the run never stopped made it), and so is the one this
  // save replaces (save_top_k=1), in place as before.
  auto taken = [&](const std::string& p) {
    if (p == replaced) return false;
    auto it = saved_at_.find(p);
    return it != saved_at_.end() && it->second != step;
  };
  if (!taken(path)) return path;
  const std::string stem = path.substr(0, path.size() - std::string(".ckpt").size());
  for (int64_t v = 1;; ++v) {
    std::string candidate = str(stem, "-v", v, ".ckpt");
    if (!taken(candidate)) return candidate;
  }
}

bool ModelCheckpoint::enabled(Trainer& trainer) const {
  return !trainer.sanity_checking() && trainer.options().fast_dev_run == 0 &&
         trainer.options().enable_checkpointing;
}

bool ModelCheckpoint::better(double candidate, double reference) const {
  if (std::isnan(candidate)) return false;
  if (std::isnan(reference)) return true;
  return options_.mode == CheckpointMode::kMin ? candidate < reference : candidate > reference;
}

namespace {

// Whether `path` lies directly in `dirpath` (where this run writes). A top-k
// list or latest path restored from a checkpoint of another run (copied, or
// resumed with another default_root_dir) names that run's files, which are
// never this run's to delete.
bool in_directory(const std::string& path, const std::string& dirpath) {
  std::error_code ec1, ec2;
  const fs::path file = fs::weakly_canonical(fs::path(path), ec1);
  const fs::path dir = fs::weakly_canonical(fs::path(dirpath), ec2);
  return !ec1 && !ec2 && file.parent_path() == dir;
}

}  // namespace

void ModelCheckpoint::save(Trainer& trainer) {
  if (!enabled(trainer)) return;
  if (last_saved_step_ == trainer.global_step()) return;  // already saved at this step
  last_saved_step_ = trainer.global_step();
  Strategy& strategy = trainer.strategy();

  if (options_.save_top_k != 0) {
    const int64_t step = trainer.global_step();
    std::string path;
    // A checkpoint records the ranking as it is with itself in it (what
    // ckpt_path="best" reads from the newest in a new process): the ranking
    // is updated first, and put back as it was if the save fails.
    const auto before =
        std::make_tuple(top_k_, latest_path_, best_model_path_, best_model_score_, saved_at_);
    bool stopping = false;
    const std::map<std::string, double> metrics = ranked_metrics(trainer, stopping);
    const auto save_ranked = [&] {
      try {
        trainer.save_checkpoint(path);
      } catch (...) {
        std::tie(top_k_, latest_path_, best_model_path_, best_model_score_, saved_at_) = before;
        throw;
      }
    };
    if (options_.monitor.empty()) {
      const std::string previous = latest_path_;
      const bool replaces = options_.save_top_k == 1 && !previous.empty();
      path = unclaimed(format_name(trainer, metrics), step, replaces ? previous : std::string());
      if (replaces && previous != path) saved_at_.erase(previous);
      saved_at_[path] = step;
      latest_path_ = path;
      best_model_path_ = path;
      save_ranked();
      if (replaces && previous != path && in_directory(previous, dirpath_)) {
        detail::drive(strategy).remove_checkpoint(previous);
      }
    } else {
      auto it = metrics.find(options_.monitor);
      if (it == metrics.end() && (stopping || (!validation_ran_ && trainer.fit_validates()))) {
        // A save before the fit's first validation (every N steps from the
        // start of a run; an epoch or a run that ends first: max_steps
        // within a val_check_interval), or a run that stops (request_stop, a
        // Timer) before the validation that logs the metric: nothing to
        // rank, but last.ckpt keeps the state, said once. (A fit without
        // validation, whose metric is missing, is told so below.)
        if (!validation_ran_ && !noted_no_validation_ && strategy.is_global_zero()) {
          noted_no_validation_ = true;
          detail::print_note(str("ModelCheckpoint(monitor=\"", options_.monitor,
                                 "\"): saving at step ", trainer.global_step(),
                                 " before any validation of this fit has run, so there is no \"",
                                 options_.monitor, "\" to rank by; ",
                                 options_.save_last ? "last.ckpt keeps the state."
                                                    : "nothing is saved (save_last is off)."));
        }
        if (options_.save_last) save_last(trainer);
        return;
      }
      if (it == metrics.end()) {
        std::vector<std::string> names;
        for (const auto& [k, _] : trainer.callback_metrics()) names.push_back(k);
        throw ConfigError(str(
            "ModelCheckpoint(monitor=\"", options_.monitor,
            "\"): no metric of that name was logged",
            strategy.world_size() > 1 ? " on global rank 0, whose values "
                                        "rank the checkpoints"
                                      : "",
            ". Logged metrics",
            strategy.world_size() > 1 ? str(" on rank ", strategy.global_rank()) : std::string(),
            ": ", names.empty() ? std::string("none") : join(names), ". Log it with log(\"",
            options_.monitor, "\", ...) or change monitor."));
      }
      double score = it->second;
      bool keep = options_.save_top_k == -1 ||
                  static_cast<int64_t>(top_k_.size()) < options_.save_top_k ||
                  better(score, top_k_.back().first);
      if (keep) {
        // A full list drops its worst for this one, whose name it may take.
        const bool full =
            options_.save_top_k > 0 && static_cast<int64_t>(top_k_.size()) >= options_.save_top_k;
        path = unclaimed(format_name(trainer, metrics), step,
                         full ? top_k_.back().second : std::string());
        saved_at_[path] = step;
        // The files that leave the list go once the checkpoint is saved.
        top_k_.erase(std::remove_if(top_k_.begin(), top_k_.end(),
                                    [&](const auto& e) { return e.second == path; }),
                     top_k_.end());
        top_k_.emplace_back(score, path);
        std::stable_sort(top_k_.begin(), top_k_.end(),
                         [&](const auto& a, const auto& b) { return better(a.first, b.first); });
        std::vector<std::string> evicted;
        while (options_.save_top_k > 0 &&
               static_cast<int64_t>(top_k_.size()) > options_.save_top_k) {
          evicted.push_back(top_k_.back().second);
          if (top_k_.back().second != path) saved_at_.erase(top_k_.back().second);
          top_k_.pop_back();
        }
        best_model_path_ = top_k_.front().second;
        best_model_score_ = top_k_.front().first;
        save_ranked();
        for (const std::string& file : evicted) {
          // Another run's file leaves the list but stays on disk.
          if (file != path && in_directory(file, dirpath_)) {
            detail::drive(strategy).remove_checkpoint(file);
          }
        }
      }
    }
  }
  if (options_.save_last) save_last(trainer);
}

void ModelCheckpoint::save_last(Trainer& trainer) {
  if (!enabled(trainer)) return;
  last_model_path_ = (fs::path(dirpath_) / "last.ckpt").string();
  trainer.save_checkpoint(last_model_path_);
}

void ModelCheckpoint::on_train_batch_end(Trainer& trainer, Module&, const at::Tensor&, const Batch&,
                                         int64_t) {
  int64_t n = options_.every_n_train_steps;
  if (n > 0 && trainer.global_step() > 0 && trainer.global_step() % n == 0) save(trainer);
}

bool ModelCheckpoint::ranks_at_each_validation(const Trainer& trainer) const {
  if (options_.monitor.empty() || !trainer.fit_validates()) return false;
  const TrainerOptions& o = trainer.options();
  const BatchLimit& interval = o.val_check_interval;
  const bool once_at_epoch_end =
      o.check_val_every_n_epoch == 1 &&
      ((interval.is_fraction() && interval.fraction() >= 1.0) ||
       (!interval.is_fraction() && interval.count() == trainer.num_training_batches()));
  return !once_at_epoch_end;
}

void ModelCheckpoint::on_validation_end(Trainer& trainer, Module&) {
  // A monitored metric usually comes from validation: the epoch's checkpoint
  // is taken once the end-of-epoch validation has produced it, or each
  // validation's where they run within epochs or every N-th epoch (see
  // ranks_at_each_validation). A standalone Trainer::validate saves nothing.
  if (trainer.stage() != Stage::kFit || trainer.sanity_checking()) return;
  validation_ran_ = true;
  if (options_.monitor.empty()) return;
  int64_t n = options_.every_n_epochs.value_or(1);
  bool epoch_due = n > 0 && (trainer.current_epoch() + 1) % n == 0;
  bool at_epoch_end = trainer.num_training_batches() < 0 ||
                      trainer.batch_idx() + 1 >= trainer.num_training_batches();
  if (epoch_due && (at_epoch_end || ranks_at_each_validation(trainer))) {
    // Before the save, which holds it: a resume from it (which goes on
    // after this hook) rewrites last.ckpt at the epoch's end, as below.
    validated_this_epoch_ = true;
    save(trainer);
  }
}

void ModelCheckpoint::on_train_epoch_end(Trainer& trainer, Module&) {
  int64_t n = options_.every_n_epochs.value_or(1);
  bool due = n > 0 && (trainer.current_epoch() + 1) % n == 0;
  bool saved_by_validation = validated_this_epoch_;
  validated_this_epoch_ = false;
  if (!due) return;
  if (ranks_at_each_validation(trainer)) {
    // Nothing to rank: last.ckpt records the completed epoch.
    if (options_.save_last) save_last(trainer);
  } else if (!saved_by_validation) {
    save(trainer);
  } else if (options_.save_last) {
    // Rewrite last.ckpt now, so that it records the completed epoch.
    save_last(trainer);
  }
}

// validated_this_epoch (bool: the epoch's last validation offered its save),
// best_model_path, best_model_score (NaN: none), latest_path, dirpath,
// last_model_path (strings; the score a double), and the kept checkpoints as
// two parallel lists, top_k_scores (doubles) and top_k_paths (strings). Each
// optional on load.
StateDict ModelCheckpoint::state_dict() const {
  StateDict state;
  state.set("best_model_path", best_model_path_);
  state.set("best_model_score", best_model_score_.value_or(std::nan("")));
  state.set("latest_path", latest_path_);
  // Where it wrote: a resumed fit recomputes dirpath at on_fit_start; a
  // forking launcher's caller gets the rank's values with them.
  state.set("dirpath", dirpath_);
  state.set("last_model_path", last_model_path_);
  c10::List<double> scores;
  c10::List<std::string> paths;
  for (const auto& [s, p] : top_k_) {
    scores.push_back(s);
    paths.push_back(p);
  }
  state.set("top_k_scores", scores);
  state.set("top_k_paths", paths);
  // The step it saved at (this one, in its own checkpoints): a run resumed
  // from it does not save that step again (say after the validation of the
  // same step), as the run never stopped did not.
  state.set("last_saved_step", last_saved_step_);
  c10::List<std::string> saved_paths;
  c10::List<int64_t> saved_steps;
  for (const auto& [p, s] : saved_at_) {
    saved_paths.push_back(p);
    saved_steps.push_back(s);
  }
  state.set("saved_paths", saved_paths);
  state.set("saved_steps", saved_steps);
  state.set("validated_this_epoch", validated_this_epoch_);
  return state;
}

void ModelCheckpoint::load_state_dict(const StateDict& state) {
  if (state.contains("best_model_path")) best_model_path_ = state.string("best_model_path");
  if (state.contains("best_model_score")) {
    const double score = state.real("best_model_score");
    if (!std::isnan(score)) best_model_score_ = score;
  }
  if (state.contains("latest_path")) latest_path_ = state.string("latest_path");
  if (state.contains("dirpath")) dirpath_ = state.string("dirpath");
  if (state.contains("last_model_path")) last_model_path_ = state.string("last_model_path");
  if (state.contains("last_saved_step")) last_saved_step_ = state.integer("last_saved_step");
  if (state.contains("validated_this_epoch")) {
    validated_this_epoch_ = state.boolean("validated_this_epoch");
  }
  if (state.contains("top_k_scores") && state.contains("top_k_paths")) {
    const std::vector<double> scores = state.reals("top_k_scores");
    const std::vector<std::string> paths = state.strings("top_k_paths");
    std::vector<std::pair<double, std::string>> top_k;
    for (size_t i = 0; i < scores.size() && i < paths.size(); ++i) {
      top_k.emplace_back(scores[i], paths[i]);
    }
    top_k_ = std::move(top_k);
  }
  // The names kept and the steps they were saved at. A checkpoint written
  // before they were recorded: its kept names, from unknown steps (never
  // written over).
  saved_at_.clear();
  if (state.contains("saved_paths") && state.contains("saved_steps")) {
    const std::vector<std::string> paths = state.strings("saved_paths");
    const std::vector<int64_t> steps = state.integers("saved_steps");
    for (size_t i = 0; i < paths.size() && i < steps.size(); ++i) saved_at_[paths[i]] = steps[i];
  } else {
    for (const auto& [score, p] : top_k_) saved_at_.emplace(p, -1);
    if (!latest_path_.empty()) saved_at_.emplace(latest_path_, -1);
  }
}

}  // namespace fulgur
