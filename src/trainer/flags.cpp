// The connector's flags from command-line text: one table of names, every
// problem collected, integers checked for range (never clamped).
#include "fulgur/trainer/flags.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <type_traits>

#include "fulgur/core/errors.h"
#include "fulgur/plugins/environments/cluster_environment.h"
#include "fulgur/plugins/io/checkpoint_io.h"
#include "fulgur/plugins/precision/precision.h"
#include "fulgur/strategies/strategy.h"

namespace fulgur {

ParsedInt parse_int(const std::string& text, long long min, long long max) {
  ParsedInt result;
  size_t i = 0;
  const bool negative = !text.empty() && text[0] == '-';
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) i = 1;
  if (i == text.size()) return result;
  // Accumulate the magnitude as unsigned, so that any digit string either
  // fits or is known not to, whatever its length.
  unsigned long long magnitude = 0;
  bool overflow = false;
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (c < '0' || c > '9') return result;
    const unsigned digit = static_cast<unsigned>(c - '0');
    if (magnitude > (ULLONG_MAX - digit) / 10) {
      overflow = true;
    } else {
      magnitude = magnitude * 10 + digit;
    }
  }
  result.ok = true;
  const unsigned long long limit =
      negative ? static_cast<unsigned long long>(LLONG_MAX) + 1 : LLONG_MAX;
  if (overflow || magnitude > limit) {
    result.out_of_range = true;
    return result;
  }
  const long long value = negative ? (magnitude == static_cast<unsigned long long>(LLONG_MAX) + 1
                                          ? LLONG_MIN
                                          : -static_cast<long long>(magnitude))
                                   : static_cast<long long>(magnitude);
  if (value < min || value > max) {
    result.out_of_range = true;
    return result;
  }
  result.value = value;
  return result;
}

std::optional<bool> parse_bool(const std::string& text) {
  if (text == "true" || text == "True" || text == "1") return true;
  if (text == "false" || text == "False" || text == "0") return false;
  return std::nullopt;
}

namespace {

// `text` read as a number written in full (no leading space, no trailing
// text): kRead with `value`, or why not (a number past a double's range:
// `value` is what strtod made of it, HUGE_VAL or a tiny one).
enum class DoubleRead { kRead, kNotANumber, kOutOfRange };
DoubleRead read_double(const std::string& text, double& value) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) {
    return DoubleRead::kNotANumber;
  }
  char* end = nullptr;
  errno = 0;
  value = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || std::isnan(value)) return DoubleRead::kNotANumber;
  return errno == ERANGE ? DoubleRead::kOutOfRange : DoubleRead::kRead;
}

}  // namespace

std::optional<double> parse_double(const std::string& text) {
  double value = 0;
  if (read_double(text, value) != DoubleRead::kRead) return std::nullopt;
  return value;
}

std::string not_a_double(const std::string& text) {
  double value = 0;
  if (read_double(text, value) != DoubleRead::kOutOfRange) return "not a number";
  return std::fabs(value) > 1 ? "a number too large for a double (at most about 1.8e308)"
                              : "a number too close to 0 for a double (from about 2.2e-308, or 0)";
}

std::string number_text(double value) {
  // The shortest text that reads back to the same double.
  for (int digits = 1; digits < 17; ++digits) {
    std::ostringstream shorter;
    shorter << std::setprecision(digits) << value;
    if (std::strtod(shorter.str().c_str(), nullptr) == value) return shorter.str();
  }
  std::ostringstream out;
  out << std::setprecision(17) << value;
  return out.str();
}

std::string flag_key(std::string_view name) {
  std::string flag(name);
  while (!flag.empty() && flag.front() == '-') flag.erase(flag.begin());
  std::replace(flag.begin(), flag.end(), '-', '_');
  return flag;
}

namespace {

bool is_none(const std::string& text) {
  return text == "none" || text == "None" || text == "null" || text == "~";
}

std::string seconds_string(std::chrono::milliseconds ms) {
  return number_text(static_cast<double>(ms.count()) / 1000.0);
}

// Setters for the common kinds of field. Each returns "" or the problem.
using Set = std::function<std::string(TrainerOptions&, const std::string&)>;

template <class T>
Set set_bool(T TrainerOptions::*field) {
  return [field](TrainerOptions& o, const std::string& text) -> std::string {
    const auto value = parse_bool(text);
    if (!value) return "pass true or false.";
    o.*field = *value;
    return "";
  };
}

template <class T>
Set set_int(T TrainerOptions::*field, long long min, const char* example) {
  return [field, min, example](TrainerOptions& o, const std::string& text) -> std::string {
    const ParsedInt n = parse_int(text, min, std::numeric_limits<T>::max());
    if (!n.ok) return str("not an integer. Pass e.g. ", example, ".");
    if (n.out_of_range) {
      return str("out of range (at least ", min, ", at most ", std::numeric_limits<T>::max(),
                 "). Pass e.g. ", example, ".");
    }
    o.*field = static_cast<T>(n.value);
    return "";
  };
}

Set set_optional_int(std::optional<int64_t> TrainerOptions::*field, long long min,
                     const char* example) {
  return [field, min, example](TrainerOptions& o, const std::string& text) -> std::string {
    if (is_none(text)) {
      o.*field = std::nullopt;
      return "";
    }
    const ParsedInt n = parse_int(text, min, std::numeric_limits<int64_t>::max());
    if (!n.ok || n.out_of_range) {
      return str(n.ok ? "out of range" : "not an integer", ". Pass an integer >= ", min,
                 " (e.g. ", example, ") or none.");
    }
    o.*field = n.value;
    return "";
  };
}

template <class T>
std::string get_int(const TrainerOptions& o, T TrainerOptions::*field) {
  return std::to_string(o.*field);
}

// "10" → ten batches; "0.25" → a fraction of the loader.
Set set_batch_limit(BatchLimit TrainerOptions::*field) {
  return [field](TrainerOptions& o, const std::string& text) -> std::string {
    if (text.find_first_of(".eE") != std::string::npos) {
      const auto value = parse_double(text);
      if (!value) {
        return str(not_a_double(text), ". Pass a count of batches (10) or a fraction (0.25).");
      }
      o.*field = BatchLimit(*value);
      return "";
    }
    const ParsedInt n = parse_int(text, 0, std::numeric_limits<int64_t>::max());
    if (!n.ok || n.out_of_range) {
      return "not a count of batches >= 0 or a fraction. Pass e.g. 10, or 0.25.";
    }
    o.*field = BatchLimit(static_cast<long long>(n.value));
    return "";
  };
}

Set set_seconds(std::chrono::milliseconds TrainerOptions::*field) {
  return [field](TrainerOptions& o, const std::string& text) -> std::string {
    const auto value = parse_double(text);
    if (!value) return str(not_a_double(text), ". Pass a number of seconds >= 0.");
    if (*value < 0 || *value > 1e12) return "not a number of seconds from 0 to 1e12.";
    if (*value > 0 && *value < 0.001) {
      // It would round to 0 ms, which turns the watch off.
      return "under a millisecond (0.001), the finest it counts; 0 turns it off. Pass e.g. 60, "
             "or 0.";
    }
    o.*field = std::chrono::milliseconds(std::llround(*value * 1000));
    return "";
  };
}

template <class Object>
std::string name_or_text(const std::variant<std::string, std::shared_ptr<Object>>& value) {
  if (const auto* text = std::get_if<std::string>(&value)) return *text;
  const auto& object = std::get<std::shared_ptr<Object>>(value);
  return object ? std::string(object->name()) : "null";
}

std::string plugin_text(const Plugin& plugin) {
  return std::visit(
      [](const auto& p) -> std::string {
        if constexpr (std::is_same_v<std::decay_t<decltype(p)>, std::string>) {
          return p;
        } else {
          return p ? std::string(p->name()) : "null";
        }
      },
      plugin);
}

std::vector<TrainerFlag> make_flags() {
  using O = TrainerOptions;
  std::vector<TrainerFlag> f;
  // ---- Hardware.
  f.push_back({"accelerator", "hardware", "\"auto\", \"cpu\", \"cuda\" (\"gpu\"), or a registered name",
               [](const O& o) { return name_or_text(o.accelerator); },
               [](O& o, const std::string& t) { o.accelerator = t; return std::string(); }});
  f.push_back({"strategy", "hardware", "\"auto\", \"single_device\", \"ddp\", ... or a registered name",
               [](const O& o) { return name_or_text(o.strategy); },
               [](O& o, const std::string& t) { o.strategy = t; return std::string(); }});
  f.push_back({"devices", "hardware", "\"auto\", a count, -1 for all, or indices \"0,2\"",
               [](const O& o) { return o.devices.text(); },
               [](O& o, const std::string& t) { o.devices = DevicesSpec(t); return std::string(); }});
  f.push_back({"num_nodes", "hardware", "Number of machines",
               [](const O& o) { return get_int(o, &O::num_nodes); },
               [](O& o, const std::string& t) -> std::string {
                 const ParsedInt n = parse_int(t, INT_MIN, INT_MAX);
                 if (n.ok && !n.out_of_range) {
                   o.num_nodes = static_cast<int>(n.value);
                   return "";
                 }
                 return str(n.ok ? "out of range (at most 2147483647)." : "not an integer.",
                            " Pass the number of machines, e.g. --num_nodes 2.");
               }});
  f.push_back({"precision", "hardware",
               "32-true, 64-true, bf16-mixed, 16-mixed, bf16-true, 16-true (legacy: 32, 64, 16, bf16)",
               [](const O& o) { return o.precision.text(); },
               [](O& o, const std::string& t) { o.precision = t; return std::string(); }});
  f.push_back({"plugins", "hardware", "Comma-separated registered plugin names (e.g. slurm)",
               [](const O& o) {
                 std::vector<std::string> names;
                 for (const auto& p : o.plugins) names.push_back(plugin_text(p));
                 return join(names, ",");
               },
               [](O& o, const std::string& t) {
                 o.plugins.clear();
                 for (auto& name : split_list(t)) {
                   if (!name.empty()) o.plugins.emplace_back(std::move(name));
                 }
                 return std::string();
               }});
  f.push_back({"sync_batchnorm", "hardware", "Synchronise BatchNorm statistics across ranks (ddp)",
               [](const O& o) { return std::string(o.sync_batchnorm ? "true" : "false"); },
               set_bool(&O::sync_batchnorm)});
  f.push_back({"deterministic", "hardware", "true, false or warn; none: LibTorch's flag as it is",
               [](const O& o) {
                 return o.deterministic.given() ? o.deterministic.text() : std::string("none");
               },
               [](O& o, const std::string& t) {
                 if (is_none(t)) {
                   o.deterministic = {};
                 } else if (const auto on = parse_bool(t)) {
                   o.deterministic = *on;  // True, 1, ... as every other switch
                 } else {
                   o.deterministic = t;
                 }
                 return std::string();
               }});
  f.push_back({"benchmark", "hardware", "cuDNN autotuning (CUDA only)",
               [](const O& o) { return std::string(o.benchmark ? "true" : "false"); },
               set_bool(&O::benchmark)});
  f.push_back({"prefetch_to_device", "hardware",
               "Move the next batch to the device during the current step: auto (on a GPU), "
               "true or false",
               [](const O& o) {
                 return std::string(!o.prefetch_to_device ? "auto"
                                    : *o.prefetch_to_device ? "true"
                                                            : "false");
               },
               [](O& o, const std::string& t) -> std::string {
                 if (t == "auto" || is_none(t)) {
                   o.prefetch_to_device = std::nullopt;
                   return "";
                 }
                 const auto value = parse_bool(t);
                 if (!value) return "pass auto, true or false.";
                 o.prefetch_to_device = *value;
                 return "";
               }});
  f.push_back({"cuda_graph", "hardware",
               "Capture the training step into a CUDA graph and replay it (cuda, single_device, "
               "fulgur::optim)",
               [](const O& o) { return std::string(o.cuda_graph ? "true" : "false"); },
               set_bool(&O::cuda_graph)});
  f.push_back({"use_distributed_sampler", "hardware",
               "Split each epoch's samples across ranks (a DistributedSampler)",
               [](const O& o) { return std::string(o.use_distributed_sampler ? "true" : "false"); },
               set_bool(&O::use_distributed_sampler)});
  f.push_back({"reload_dataloaders_every_n_epochs", "hardware",
               "Make the DataModule's loaders again every N epochs (0: once per fit)",
               [](const O& o) { return get_int(o, &O::reload_dataloaders_every_n_epochs); },
               set_int(&O::reload_dataloaders_every_n_epochs, 0, "2")});
  // ---- Run length.
  f.push_back({"max_epochs", "run length",
               "Epochs to train; none: 1000, or unlimited when max_steps is set",
               [](const O& o) { return o.max_epochs ? std::to_string(*o.max_epochs) : "none"; },
               set_optional_int(&O::max_epochs, -1, "3")});
  f.push_back({"min_epochs", "run length", "Train at least this many epochs",
               [](const O& o) { return get_int(o, &O::min_epochs); },
               set_int(&O::min_epochs, 0, "1")});
  f.push_back({"max_steps", "run length", "Optimizer steps to train for (-1: no limit)",
               [](const O& o) { return get_int(o, &O::max_steps); },
               set_int(&O::max_steps, -1, "1000")});
  f.push_back({"min_steps", "run length", "Train at least this many steps",
               [](const O& o) { return get_int(o, &O::min_steps); },
               set_int(&O::min_steps, 0, "100")});
  f.push_back({"max_time", "run length",
               "Stop after this many seconds of training, with a checkpoint (none: no limit)",
               [](const O& o) { return o.max_time ? seconds_string(*o.max_time) : "none"; },
               [](O& o, const std::string& t) -> std::string {
                 if (is_none(t)) {
                   o.max_time = std::nullopt;
                   return "";
                 }
                 const auto value = parse_double(t);
                 if (!value) {
                   return str(not_a_double(t),
                              ". Pass a number of seconds > 0 (e.g. 3600), or none.");
                 }
                 if (*value <= 0 || *value > 1e12) {
                   return "not a number of seconds > 0 and at most 1e12. Pass e.g. 3600, or none.";
                 }
                 if (*value < 0.001) {
                   // It would round to 0 ms, which the Trainer refuses as "0".
                   return "under a millisecond (0.001), the finest max_time counts. Pass e.g. "
                          "3600, or none.";
                 }
                 o.max_time = std::chrono::milliseconds(std::llround(*value * 1000));
                 return "";
               }});
  f.push_back({"fast_dev_run", "run length",
               "Run N (true = 1) batches of each stage and stop; no checkpoints or logs",
               [](const O& o) { return get_int(o, &O::fast_dev_run); },
               [](O& o, const std::string& t) -> std::string {
                 if (t == "true" || t == "True") {
                   o.fast_dev_run = 1;
                   return "";
                 }
                 if (t == "false" || t == "False") {
                   o.fast_dev_run = 0;
                   return "";
                 }
                 const ParsedInt n = parse_int(t, 0, std::numeric_limits<int64_t>::max());
                 if (!n.ok || n.out_of_range) return "pass true, false or a number of batches >= 0.";
                 o.fast_dev_run = n.value;
                 return "";
               }});
  f.push_back({"limit_train_batches", "run length",
               "Training batches per epoch: a count (10) or a fraction (0.25)",
               [](const O& o) { return o.limit_train_batches.text(); },
               set_batch_limit(&O::limit_train_batches)});
  f.push_back({"limit_val_batches", "run length", "Validation batches: a count or a fraction",
               [](const O& o) { return o.limit_val_batches.text(); },
               set_batch_limit(&O::limit_val_batches)});
  f.push_back({"limit_test_batches", "run length", "Test batches: a count or a fraction",
               [](const O& o) { return o.limit_test_batches.text(); },
               set_batch_limit(&O::limit_test_batches)});
  f.push_back({"limit_predict_batches", "run length", "Prediction batches: a count or a fraction",
               [](const O& o) { return o.limit_predict_batches.text(); },
               set_batch_limit(&O::limit_predict_batches)});
  f.push_back({"overfit_batches", "run length",
               "Train and validate on the same first batches every epoch: a count or a "
               "fraction (0: off)",
               [](const O& o) { return o.overfit_batches.text(); },
               set_batch_limit(&O::overfit_batches)});
  f.push_back({"detect_anomaly", "debugging",
               "Autograd anomaly detection: a backward that returns NaN stops the fit, naming "
               "the operation (slow)",
               [](const O& o) { return std::string(o.detect_anomaly ? "true" : "false"); },
               set_bool(&O::detect_anomaly)});
  // ---- Validation.
  f.push_back({"val_check_interval", "validation",
               "Validate every N training batches (integer) or fraction of an epoch",
               [](const O& o) { return o.val_check_interval.text(); },
               set_batch_limit(&O::val_check_interval)});
  f.push_back({"check_val_every_n_epoch", "validation",
               "Validate at the end of every N-th epoch (none: by batch count across epochs)",
               [](const O& o) {
                 return o.check_val_every_n_epoch ? std::to_string(*o.check_val_every_n_epoch)
                                                  : "none";
               },
               set_optional_int(&O::check_val_every_n_epoch, 1, "1")});
  f.push_back({"num_sanity_val_steps", "validation",
               "Validation batches run before training (-1: all)",
               [](const O& o) { return get_int(o, &O::num_sanity_val_steps); },
               set_int(&O::num_sanity_val_steps, -1, "2")});
  // ---- Optimization.
  f.push_back({"accumulate_grad_batches", "optimization",
               "Batches whose gradients are summed per optimizer step",
               [](const O& o) { return get_int(o, &O::accumulate_grad_batches); },
               set_int(&O::accumulate_grad_batches, 1, "4")});
  f.push_back({"gradient_clip_val", "optimization",
               "Clip gradients at this value (none: no clipping)",
               [](const O& o) {
                 return o.gradient_clip_val ? number_text(*o.gradient_clip_val) : "none";
               },
               [](O& o, const std::string& t) -> std::string {
                 if (is_none(t)) {
                   o.gradient_clip_val = std::nullopt;
                   return "";
                 }
                 const auto value = parse_double(t);
                 if (!value)
                   return str(not_a_double(t), ". Pass a number >= 0 (e.g. 1.0), or none.");
                 if (*value < 0) return "not a number >= 0. Pass e.g. 1.0, or none.";
                 o.gradient_clip_val = *value;
                 return "";
               }});
  f.push_back({"gradient_clip_algorithm", "optimization", "\"norm\" or \"value\"",
               [](const O& o) { return o.gradient_clip_algorithm.text(); },
               [](O& o, const std::string& t) -> std::string {
                 for (const auto& [algorithm, name] : ChoiceNames<GradientClipAlgorithm>::kNames) {
                   if (t == name) {
                     o.gradient_clip_algorithm = algorithm;
                     return "";
                   }
                 }
                 return str("not an algorithm. Pass ", Choice<GradientClipAlgorithm>::spellings(),
                            ".");
               }});
  // ---- Reproducibility.
  f.push_back({"seed", "reproducibility", "Seed of every RNG (none: unseeded)",
               [](const O& o) { return o.seed ? std::to_string(*o.seed) : "none"; },
               [](O& o, const std::string& t) -> std::string {
                 if (is_none(t)) {
                   o.seed = std::nullopt;
                   return "";
                 }
                 const ParsedInt n = parse_int(t, 0, std::numeric_limits<int64_t>::max());
                 if (!n.ok) return "not an integer >= 0. Pass e.g. 42, or none.";
                 if (n.out_of_range) {
                   return str("out of range: a seed is from 0 to ",
                              std::numeric_limits<int64_t>::max(), ". Pass e.g. 42, or none.");
                 }
                 o.seed = static_cast<uint64_t>(n.value);
                 return "";
               }});
  // ---- Outputs.
  f.push_back({"default_root_dir", "outputs", "Root of logs and checkpoints (\"\": the working directory)",
               [](const O& o) { return o.default_root_dir; },
               [](O& o, const std::string& t) { o.default_root_dir = t; return std::string(); }});
  f.back().is_text = true;
  f.push_back({"enable_checkpointing", "outputs", "Save checkpoints (last.ckpt and the best)",
               [](const O& o) { return std::string(o.enable_checkpointing ? "true" : "false"); },
               set_bool(&O::enable_checkpointing)});
  f.push_back({"enable_progress_bar", "outputs", "Show progress",
               [](const O& o) { return std::string(o.enable_progress_bar ? "true" : "false"); },
               set_bool(&O::enable_progress_bar)});
  f.push_back({"logger", "outputs",
               "Loggers by name, comma-separated: csv, tensorboard (true: csv; false: none)",
               [](const O& o) { return o.logger.text(); },
               [](O& o, const std::string& t) -> std::string {
                 // A list with a problem is reported here, and not set (the
                 // Trainer's own check would report it again).
                 LoggerFlag flag(t);
                 if (!flag.problem().empty()) return flag.problem();
                 o.logger = std::move(flag);
                 return std::string();
               }});
  f.push_back({"profiler", "outputs",
               "simple: print where the fit loop's time went at the end of fit; pytorch: LibTorch's "
               "operator profiler over profiler_active batches after profiler_wait (a trace and a "
               "table of operators per rank); none: off",
               [](const O& o) { return o.profiler.text(); },
               [](O& o, const std::string& t) -> std::string {
                 const Choice<ProfilerKind> kind = is_none(t) ? Choice<ProfilerKind>("none") : t;
                 if (!kind.is_valid()) return str("pass ", Choice<ProfilerKind>::spellings(), ".");
                 o.profiler = kind;
                 return "";
               }});
  f.push_back({"profiler_wait", "outputs",
               "profiler=pytorch: training batches run before the recording starts",
               [](const O& o) { return get_int(o, &O::profiler_wait); },
               set_int(&O::profiler_wait, 0, "5")});
  f.push_back({"profiler_active", "outputs", "profiler=pytorch: training batches recorded",
               [](const O& o) { return get_int(o, &O::profiler_active); },
               set_int(&O::profiler_active, 1, "5")});
  f.push_back({"log_every_n_steps", "outputs",
               "Logged metrics reach the loggers every N optimizer steps (manual optimization: "
               "every N-th batch that steps)",
               [](const O& o) { return get_int(o, &O::log_every_n_steps); },
               set_int(&O::log_every_n_steps, 1, "50")});
  // ---- Recovery.
  f.push_back({"max_restarts", "recovery",
               "Start every rank again (resuming from the newest checkpoint) this many times when "
               "one dies, freezes or hangs",
               [](const O& o) { return get_int(o, &O::max_restarts); },
               set_int(&O::max_restarts, 0, "3")});
  f.push_back({"heartbeat_timeout", "recovery",
               "Seconds without a heartbeat before a rank is named as frozen (0: off)",
               [](const O& o) { return seconds_string(o.heartbeat_timeout); },
               set_seconds(&O::heartbeat_timeout)});
  f.push_back({"every_n_train_steps", "recovery",
               "Save a checkpoint (and last.ckpt) every N optimizer steps (0: every epoch)",
               [](const O& o) { return get_int(o, &O::every_n_train_steps); },
               set_int(&O::every_n_train_steps, 0, "500")});
  return f;
}

}  // namespace

const std::vector<TrainerFlag>& trainer_flags() {
  static const std::vector<TrainerFlag> flags = make_flags();
  return flags;
}

const TrainerFlag* find_trainer_flag(std::string_view name) {
  const std::string flag = flag_key(name);
  for (const auto& f : trainer_flags()) {
    if (f.name == flag) return &f;
  }
  return nullptr;
}

ParsedFlags parse_flags(const std::vector<std::pair<std::string, std::string>>& flags) {
  ParsedFlags parsed;
  std::set<std::string> seen;
  std::vector<std::string> known;
  for (const auto& f : trainer_flags()) known.push_back(f.name);
  for (const auto& [raw, value] : flags) {
    const std::string flag = flag_key(raw);
    if (!seen.insert(flag).second) {
      parsed.problems.push_back(str("--", flag, " is given twice: pass it once."));
      continue;
    }
    const TrainerFlag* f = find_trainer_flag(flag);
    if (f == nullptr) {
      parsed.problems.push_back(str("--", flag, ": unknown flag", did_you_mean(flag, known, "--", ""),
                                    "`--help` lists every flag."));
      continue;
    }
    // A value that does not parse leaves the option at its default.
    TrainerOptions attempt = parsed.options;
    if (std::string problem = f->set(attempt, value); !problem.empty()) {
      parsed.problems.push_back(str("--", flag, " ", value, ": ", problem));
    } else {
      parsed.options = std::move(attempt);
    }
  }
  return parsed;
}

TrainerOptions options_from_flags(const std::vector<std::pair<std::string, std::string>>& flags) {
  ParsedFlags parsed = parse_flags(flags);
  if (!parsed.problems.empty()) throw FlagError("invalid_flags", parsed.problems);
  return std::move(parsed.options);
}

}  // namespace fulgur
