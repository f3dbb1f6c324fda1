// The logger connector. What a Module logs: step values and epoch aggregates
// (weighted means by batch size, sums, extremes), optionally reduced across
// ranks, published to callback_metrics, the progress bar and the loggers.
#include "trainer/connectors/logger_connector.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <sstream>
#include <map>
#include <limits>
#include <string>

#include "fulgur/core/errors.h"
#include "fulgur/loggers/csv_logger.h"
#include "fulgur/metrics/collection.h"
#include "fulgur/metrics/metric.h"
#include "fulgur/strategies/strategy.h"

namespace fulgur {
namespace detail {

void write_metrics(StateDict& state, const std::string& key, const Metrics& metrics) {
  std::vector<std::string> names;
  std::vector<double> values;
  for (const auto& [name, value] : metrics) {
    names.push_back(name);
    values.push_back(value);
  }
  state.set(key + ".names", c10::List<std::string>(names));
  state.set(key + ".values", torch::tensor(values, torch::kDouble));
}

Metrics read_metrics(const StateDict& state, const std::string& key) {
  const std::vector<std::string> names = state.strings(key + ".names");
  const at::Tensor values = state.tensor(key + ".values").to(torch::kDouble).contiguous();
  if (values.dim() != 1 || values.numel() != static_cast<int64_t>(names.size())) {
    throw CheckpointError(str("\"", key, ".values\" holds ", values.numel(), " values for ",
                              names.size(), " names in \"", key, ".names\""));
  }
  Metrics out;
  const double* data = values.data_ptr<double>();
  for (size_t i = 0; i < names.size(); ++i) out[names[i]] = data[i];
  return out;
}

std::string metrics_bytes(const Metrics& metrics) {
  std::string out;
  for (const auto& [name, value] : metrics) {
    const uint64_t size = name.size();
    out.append(reinterpret_cast<const char*>(&size), sizeof size);
    out += name;
    out.append(reinterpret_cast<const char*>(&value), sizeof value);
  }
  return out;
}

Metrics metrics_from_bytes(const std::string& bytes) {
  Metrics out;
  size_t at = 0;
  auto take = [&](void* to, size_t n) {
    FULGUR_ASSERT(at + n <= bytes.size(), "metrics_from_bytes: truncated bytes");
    std::memcpy(to, bytes.data() + at, n);
    at += n;
  };
  while (at < bytes.size()) {
    uint64_t size = 0;
    take(&size, sizeof size);
    FULGUR_ASSERT(size <= bytes.size() - at, "metrics_from_bytes: truncated name");
    std::string name = bytes.substr(at, size);
    at += size;
    double value = 0;
    take(&value, sizeof value);
    out[std::move(name)] = value;
  }
  return out;
}

namespace {
std::atomic<int64_t> g_tensor_reads{0};
}  // namespace

int64_t LogSink::tensor_reads() { return g_tensor_reads.load(std::memory_order_relaxed); }

double LogSink::read_tensor(const at::Tensor& tensor) {
  g_tensor_reads.fetch_add(1, std::memory_order_relaxed);
  return tensor.item<double>();
}

double LogSink::Value::read() const { return tensor.defined() ? read_tensor(tensor) : value; }

LogSink::Entry& LogSink::entry(std::string_view name, const LogOptions& options, bool& on_step,
                               bool& on_epoch, metrics::Metric* metric) {
  if (name.empty()) throw ConfigError("log(\"\", ...): a metric needs a non-empty name.");
  if (!closed_because_.empty()) throw ConfigError(str("log(\"", name, "\"): ", closed_because_));
  if (name == "step") {
    throw ConfigError(
        "log(\"step\"): \"step\" is each row's optimizer step in the loggers (metrics.csv's "
        "first column, TensorBoard's x-axis), which the Trainer sets. Log the value under "
        "another name, e.g. \"my_step\".");
  }
  if (const std::string why = CSVLogger::why_not_a_column(name); !why.empty()) {
    throw ConfigError(str("log(\"", name,
                          "\"): a metric name must fit a column of metrics.csv, and ", why,
                          ". Use another character, e.g. '_' or '/'."));
  }
  if (options.batch_size && *options.batch_size < 0) {
    throw ConfigError(str("log(\"", name, "\", batch_size=", *options.batch_size,
                          "): the batch size weighs the value in the epoch's mean and must be "
                          ">= 0. Pass the number of samples the value was computed over."));
  }
  on_step = options.on_step.value_or(in_step_);
  on_epoch = options.on_epoch.value_or(!in_step_);
  if (!on_step && !on_epoch) {
    throw ConfigError(str("log(\"", name,
                          "\", on_step=false, on_epoch=false): the value would "
                          "go nowhere. Set on_step or on_epoch."));
  }
  if (on_step && !on_epoch && !publishes_steps_) {
    throw ConfigError(str("log(\"", name,
                          "\", on_step=true, on_epoch=false) in an evaluation: its values are "
                          "published per epoch (the mean over its batches), so the value would go "
                          "nowhere. Drop on_step (or set on_epoch=true)."));
  }
  // Logged per step and per epoch, a metric is published as <name>_step
  // and <name>_epoch: no other metric may have those names.
  auto pending = [](const Entry& e) { return e.epoch_has_value || e.step_fresh; };
  for (const char* suffix : {"_step", "_epoch"}) {
    const std::string_view s(suffix);
    if (on_step && on_epoch) {
      scratch_.assign(name).append(s);  // no allocation in the steady state
      auto other = entries_.find(scratch_);
      if (other != entries_.end() && pending(other->second)) {
        throw ConfigError(str("log(\"", name,
                              "\", on_step=true, on_epoch=true): it is published "
                              "as \"",
                              name, "_step\" and \"", name, "_epoch\", and \"", name, s,
                              "\" is logged as a metric of its own this epoch. Rename one of "
                              "them."));
      }
    }
    if (name.size() > s.size() && name.substr(name.size() - s.size()) == s) {
      auto base = entries_.find(name.substr(0, name.size() - s.size()));
      if (base != entries_.end() && pending(base->second) && base->second.on_step &&
          base->second.on_epoch) {
        throw ConfigError(str("log(\"", name, "\"): \"", base->first,
                              "\" is logged per step and per epoch this epoch, and published as "
                              "\"",
                              base->first, "_step\" and \"", base->first,
                              "_epoch\". Rename one of them."));
      }
    }
  }
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    it = entries_.emplace(std::string(name), Entry{}).first;
  } else if (pending(it->second) && metric == nullptr && it->second.metric == nullptr &&
             (it->second.on_step != on_step || it->second.on_epoch != on_epoch)) {
    throw ConfigError(
        str("log(\"", name, "\", on_step=", on_step ? "true" : "false",
            ", on_epoch=", on_epoch ? "true" : "false",
            "): this metric was logged with on_step=", it->second.on_step ? "true" : "false",
            ", on_epoch=", it->second.on_epoch ? "true" : "false",
            " earlier in the epoch (its step and epoch values would land under "
            "different names). Log each name with the same on_step and on_epoch, "
            "or use two names."));
  } else if (it->second.metric != metric && (it->second.epoch_has_value || it->second.step_fresh)) {
    throw ConfigError(str("log(\"", name, "\"): this name was logged with ",
                          it->second.metric != nullptr ? "a metric object" : "values",
                          " earlier in the epoch, and now with ",
                          metric != nullptr ? "a metric object" : "values",
                          metric != nullptr && it->second.metric != nullptr ? " (another one)" : "",
                          ". Log one metric object, or values, per name."));
  } else if (metric == nullptr && it->second.options.reduce != options.reduce) {
    throw ConfigError(
        str("log(\"", name, "\", reduce=", to_string(options.reduce),
            "): this metric was logged with reduce=", to_string(it->second.options.reduce),
            " earlier in the epoch. Use one reduction per metric name."));
  }
  Entry& e = it->second;
  e.options = options;
  e.on_step = on_step;
  e.on_epoch = on_epoch;
  e.metric = metric;
  return e;
}

void LogSink::log(std::string_view name, double value, const LogOptions& options) {
  bool on_step = false;
  bool on_epoch = false;
  Entry& e = entry(name, options, on_step, on_epoch);
  if (on_step) {
    e.step_value = value;
    e.step_tensor = at::Tensor();
    e.step_fresh = true;
    e.step_published = e.step_in_row = false;
  }
  if (on_epoch) {
    double weight = static_cast<double>(options.batch_size.value_or(batch_size_));
    if (e.epoch_tensor.defined()) {
      // This metric was logged as a tensor earlier in the epoch.
      accumulate(e, at::scalar_tensor(value, e.epoch_tensor.options()), weight);
      return;
    }
    switch (options.reduce) {
      case ReduceOp::kMean:
        e.epoch_sum += value * weight;
        e.epoch_weight += weight;
        break;
      case ReduceOp::kSum: e.epoch_sum += value; break;
      case ReduceOp::kMax:
        e.epoch_sum = e.epoch_has_value ? std::max(e.epoch_sum, value) : value;
        break;
      case ReduceOp::kMin:
        e.epoch_sum = e.epoch_has_value ? std::min(e.epoch_sum, value) : value;
        break;
    }
    e.epoch_has_value = true;
  }
}

void LogSink::log(std::string_view name, const at::Tensor& value, const LogOptions& options) {
  bool on_step = false;
  bool on_epoch = false;
  Entry& e = entry(name, options, on_step, on_epoch);
  // The copies below must not join the value's graph.
  at::NoGradGuard no_grad;
  if (on_step) {
    // One buffer per metric, reused from step to step: a copy on the
    // value's device, no allocation and no read-back in steady state.
    if (!e.step_tensor.defined() || e.step_tensor.sizes() != value.sizes() ||
        e.step_tensor.device() != value.device() || e.step_tensor.dtype() != value.dtype()) {
      e.step_tensor = at::empty_like(value, at::MemoryFormat::Contiguous);
    }
    e.step_tensor.copy_(value, /*non_blocking=*/true);
    e.step_fresh = true;
    e.step_published = e.step_in_row = false;
  }
  if (on_epoch) {
    accumulate(e, value, static_cast<double>(options.batch_size.value_or(batch_size_)));
  }
}

void LogSink::log(std::string_view name, metrics::Metric& metric, const LogOptions& options) {
  if (options.on_step.value_or(false)) {
    throw ConfigError(str("log(\"", name, "\", ", metric.name(),
                          ", on_step=true): a metric is logged once per epoch, from the states "
                          "of every rank. Log a tensor for a step's value (e.g. the batch's "
                          "loss), or drop on_step."));
  }
  if (!metric.is_scalar()) {
    throw ConfigError(str("log(\"", name, "\", ", metric.name(),
                          "): its value is not one number. compute() it at the epoch's end "
                          "(compute(process_group().get()) under several ranks) and log what "
                          "you need of it."));
  }
  LogOptions per_epoch = options;
  per_epoch.on_step = false;
  per_epoch.on_epoch = true;
  bool on_step = false;
  bool on_epoch = false;
  Entry& e = entry(name, per_epoch, on_step, on_epoch, &metric);
  const bool first = !e.epoch_has_value;
  e.epoch_has_value = true;
  if (first && resumed_within_epoch_ && metric.update_count() > 0 &&
      restored_.count(std::string(name)) == 0) {
    unsaved_at_resume_.insert(std::string(name));
  }
  if (auto it = restored_.find(std::string(name)); it != restored_.end()) {
    try {
      if (!it->second.states.empty()) metric.merge_state_dict(it->second.states);
    } catch (const c10::Error& error) {
      throw CheckpointError(str("log(\"", name, "\", ", metric.name(),
                                "): the checkpoint resumed from holds this metric's states, "
                                "which do not fit it: ",
                                error.what_without_backtrace(),
                                ". Resume with the metric built as it was (same options)."));
    }
    restored_.erase(it);
  }
}


void LogSink::log_dict(metrics::MetricCollection& collection, const LogOptions& options) {
  for (auto& [key, metric] : collection.metrics()) {
    log(collection.prefix() + key, *metric, options);
  }
}

void LogSink::accumulate(Entry& e, const at::Tensor& value, double weight) {
  // float64 on the value's device, one element (shape [1] broadcasts with
  // a 0-d or [1] value; anything else is flattened).
  const at::Tensor v = value.dim() <= 1 ? value : value.reshape({1});
  if (!e.epoch_tensor.defined()) {
    e.epoch_tensor = at::full({1}, e.epoch_sum, value.options().dtype(at::kDouble));
  } else if (e.epoch_tensor.device() != value.device()) {
    e.epoch_tensor = e.epoch_tensor.to(value.device());
  }
  switch (e.options.reduce) {
    case ReduceOp::kMean:
      e.epoch_tensor.add_(v, weight);
      e.epoch_weight += weight;
      break;
    case ReduceOp::kSum: e.epoch_tensor.add_(v); break;
    case ReduceOp::kMax:
      if (e.epoch_has_value) {
        at::maximum_out(e.epoch_tensor, e.epoch_tensor, v);
      } else {
        e.epoch_tensor.copy_(v);
      }
      break;
    case ReduceOp::kMin:
      if (e.epoch_has_value) {
        at::minimum_out(e.epoch_tensor, e.epoch_tensor, v);
      } else {
        e.epoch_tensor.copy_(v);
      }
      break;
  }
  e.epoch_has_value = true;
}

const std::vector<LogSink::Value>& LogSink::collect_step(StepValues which) {
  // Reuses the vector and its strings: assign() keeps their capacity.
  size_t n = 0;
  for (auto& [name, e] : entries_) {
    bool& done = which == StepValues::kToPublish ? e.step_published : e.step_in_row;
    if (!e.step_fresh || done) continue;
    if (which == StepValues::kPublishedToRow && !e.step_published) continue;
    done = true;
    if (n == step_values_.size()) step_values_.emplace_back();
    Value& v = step_values_[n++];
    v.name.assign(name);
    if (e.on_epoch) v.name.append("_step");
    v.value = e.step_value;
    v.tensor = e.step_tensor;
    v.logger = e.options.logger;
    v.prog_bar = e.options.prog_bar;
  }
  step_values_.resize(n);
  return step_values_;
}

void LogSink::clear_step_flags() {
  for (auto& [_, e] : entries_) e.step_fresh = e.step_published = e.step_in_row = false;
}

namespace {

// The reductions below pair up by position: every rank must reduce the same
// metrics in the same order, or each would silently take another metric's
// values (or wait for a collective that never comes). One all-gather of a
// hash of the names per epoch makes a difference an error naming them.
void check_same_synced_metrics(const std::string& synced, Strategy& strategy) {
  std::vector<std::string> logged = strategy.values_where_they_differ(synced);
  if (logged.empty()) return;
  for (auto& names : logged) names = names.empty() ? "none" : names.substr(0, names.size() - 2);
  const std::string which = by_rank(logged, " logged ");
  throw ConfigError(
      str("metrics logged with sync_dist=true or as metric objects differ across ranks this "
          "epoch: ",
          which,
          ". Their reductions pair up by name across ranks, so every rank "
          "must log the same ones in an epoch (log them on every rank; "
          "a rank with nothing to add can log a mean with .batch_size = 0, and a metric object "
          "from an epoch-end hook, which every rank runs even without a batch), or log "
          "rank-local values without sync_dist."));
}

// What check_same_synced_metrics compares: each entry that reduces across
// ranks this epoch (a metric object; with `values`, also a sync_dist value),
// with how it reduces.
std::string synced_names(const std::map<std::string, LogSink::Entry, std::less<>>& entries,
                         bool values) {
  std::string names;
  for (const auto& [name, e] : entries) {
    if (!e.on_epoch || !e.epoch_has_value) continue;
    if (e.metric != nullptr) {
      names.append(name).append(" (").append(e.metric->name()).append("), ");
    } else if (values && e.options.sync_dist) {
      names.append(name).append(" (").append(to_string(e.options.reduce)).append("), ");
    }
  }
  return names;
}

}  // namespace

void LogSink::agree_step_names(const std::map<std::string, Entry*>& synced,
                               StepAgreement& agreement, Strategy& strategy) {
  // The union of every rank's names with their reductions: the names agreed
  // before, those this rank logged since outside them, and this step's.
  std::map<std::string, ReduceOp>& names = agreement.names;
  for (const auto& [name, e] : synced) names.emplace(name, e->options.reduce);
  names.insert(agreement.unagreed.begin(), agreement.unagreed.end());
  agreement.unagreed.clear();
  std::string lines;
  for (const auto& [name, op] : names) {
    lines.append(name).append("\t").append(to_string(op)) += '\n';
  }
  for (const auto& theirs : strategy.values_where_they_differ(lines)) {
    std::istringstream in(theirs);
    for (std::string line; std::getline(in, line);) {
      const size_t tab = line.find('\t');
      if (tab == std::string::npos) continue;
      ReduceOp op = ReduceOp::kMean;
      for (const ReduceOp o : {ReduceOp::kMean, ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
        if (line.compare(tab + 1, std::string::npos, to_string(o)) == 0) op = o;
      }
      const auto [it, added] = names.emplace(line.substr(0, tab), op);
      if (!added && it->second != op) {
        throw ConfigError(str("log(\"", it->first, "\", sync_dist=true) is reduced with ",
                              "another reduce on another rank: the ranks reduce a "
                              "name one way. Log it with one reduce on every rank."));
      }
    }
  }
}

void LogSink::forget_step_names() {
  for (StepAgreement& agreement : step_agreements_) {
    agreement.names.clear();
    agreement.unagreed.clear();
    if (agreement.unagreed_count.unread()) agreement.unagreed_count.read();
  }
}

void LogSink::sync_step_values(Strategy& strategy, StepPhase phase) {
  if (strategy.world_size() <= 1) return;
  StepAgreement& agreement = step_agreements_[phase];
  // This step's values to reduce, by name (every rank's map has one order).
  std::map<std::string, Entry*> synced;
  for (auto& [name, e] : entries_) {
    if (e.step_fresh && !e.step_published && e.options.sync_dist && e.metric == nullptr) {
      synced.emplace(name, &e);
    }
  }
  bool agree = false;
  if (agreement.sync == StepSync::kUndecided) {
    // Its names are the same on every rank (agreed), so is their emptiness.
    const bool any = !synced.empty() || !agreement.unagreed.empty() || !agreement.names.empty();
    agreement.sync =
        strategy.reduce_boolean_decision(any, /*all=*/false) ? StepSync::kOn : StepSync::kOff;
    agree = agreement.sync == StepSync::kOn;
  }
  if (agreement.sync == StepSync::kOff) {
    for (const auto& [name, e] : synced) {
      if (unsynced_noted_.insert(name).second && strategy.is_global_zero()) {
        print_note(str("log(\"", name,
                       "\", sync_dist=true): its step values are this rank's "
                       "until the next epoch: the ranks agree at each epoch's first step whether "
                       "they reduce step values (those logged up to training_step's end, and "
                       "those logged in on_train_batch_end, apart), and that step logged none "
                       "where this one is (its epoch value is reduced). Log it from the epoch's "
                       "first step on."));
      }
    }
    return;
  }
  // Some rank logged a name the ranks had not agreed on at the last step
  // (the count rode in that step's reduction, read now: the host waits for
  // the last step's all-reduce, not this one's): agree again, once.
  if (agreement.unagreed_count.unread() && agreement.unagreed_count.read().item<double>() > 0.5) {
    agree = true;
  }
  if (agree) agree_step_names(synced, agreement, strategy);
  // A name not agreed on yet keeps this rank's value at this step; the ranks
  // add it at the next one.
  double unagreed = 0.0;
  for (auto it = synced.begin(); it != synced.end();) {
    if (agreement.names.count(it->first) == 0) {
      unagreed = 1.0;
      agreement.unagreed.emplace(it->first, it->second->options.reduce);
      it = synced.erase(it);
    } else {
      ++it;
    }
  }
  const std::map<std::string, ReduceOp>& names = agreement.names;
  // One all_reduce per reduction, of the values in name order (the same on
  // every rank), on the device of the first logged tensor. A rank without a
  // value adds nothing: 0 (a mean counts the ranks that have one), or the
  // extreme that loses.
  c10::Device device(c10::kCPU);
  for (const auto& [name, e] : synced) {
    if (e->step_tensor.defined()) {
      device = e->step_tensor.device();
      break;
    }
  }
  const auto on_device = at::TensorOptions().dtype(at::kDouble).device(device);
  for (const ReduceOp op : {ReduceOp::kMean, ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
    std::vector<Entry*> group;  // null: a name another rank logged
    std::vector<at::Tensor> values, present;
    // The sums carry how many ranks logged a name not agreed on.
    if (op == ReduceOp::kMean) present.push_back(at::full({1}, unagreed, on_device));
    for (const auto& [name, reduce] : names) {
      if (reduce != op) continue;
      auto it = synced.find(name);
      Entry* e = it != synced.end() ? it->second : nullptr;
      group.push_back(e);
      const double none = op == ReduceOp::kMax   ? -std::numeric_limits<double>::infinity()
                          : op == ReduceOp::kMin ? std::numeric_limits<double>::infinity()
                                                 : 0.0;
      values.push_back(e == nullptr ? at::full({1}, none, on_device)
                       : e->step_tensor.defined()
                           ? e->step_tensor.reshape({1}).to(device, at::kDouble)
                           : at::full({1}, e->step_value, on_device));
      present.push_back(at::full({1}, e == nullptr ? 0.0 : 1.0, on_device));
    }
    if (group.empty() && op != ReduceOp::kMean) continue;
    const auto n = static_cast<int64_t>(group.size());
    at::Tensor reduced;
    if (op == ReduceOp::kMean) {
      // Stays on its device, unread (a GPU's step is not synchronised here);
      // the count of ranks with names not agreed on goes to the host behind
      // it, read at the next step.
      values.insert(values.end(), present.begin(), present.end());
      const at::Tensor sums = strategy.all_reduce(at::cat(values), ReduceOp::kSum);
      agreement.unagreed_count.start(sums.narrow(0, n, 1));
      reduced = sums.narrow(0, 0, n) / sums.narrow(0, n + 1, n);
    } else {
      reduced = strategy.all_reduce(at::cat(values), op);
    }
    for (int64_t i = 0; i < n; ++i) {
      if (Entry* e = group[static_cast<size_t>(i)]) e->step_tensor = reduced.narrow(0, i, 1);
    }
  }
}

LogSink::MetricStates LogSink::metric_states(Strategy& strategy) const {
  // Every rank compares the names first (one all-gather of a hash), also
  // a rank that logged none: the states' collectives below pair up only
  // where the ranks logged the same metric objects.
  const auto group = strategy.world_size() > 1 ? strategy.shared_process_group() : nullptr;
  if (group) check_same_synced_metrics(synced_names(entries_, /*values=*/false), strategy);
  MetricStates out;
  for (const auto& [name, e] : entries_) {
    if (e.metric == nullptr || !e.epoch_has_value) continue;
    SavedMetric& saved = out[name];
    saved.states = e.metric->state_dict(group.get());
    if (saved.states.at("updates").item<int64_t>() > 0) {
      saved.value = e.metric->value_of(saved.states).to(at::kDouble).item<double>();
    }
    saved.logger = e.options.logger;
    saved.prog_bar = e.options.prog_bar;
  }
  // What a resume brought back that this epoch has not logged again goes
  // on to the next checkpoint as it came (its states on global rank 0).
  for (const auto& [name, saved] : restored_) out.emplace(name, saved);
  return out;
}

std::vector<LogSink::Value> LogSink::collect_epoch(Strategy& strategy) const {
  const auto group = strategy.world_size() > 1 ? strategy.shared_process_group() : nullptr;
  if (group) check_same_synced_metrics(synced_names(entries_, /*values=*/true), strategy);
  std::vector<Value> out;
  for (const auto& [name, e] : entries_) {
    if (!e.on_epoch || !e.epoch_has_value) continue;
    if (e.metric != nullptr) {
      // Every rank's states combined, the value computed once, read once.
      const at::Tensor v = e.metric->compute(group.get());
      e.metric->reset();
      out.push_back({name, read_tensor(v), at::Tensor(), e.options.logger, e.options.prog_bar});
      continue;
    }
    // Read once an epoch (logged tensors accumulated on their device).
    double value = e.epoch_tensor.defined() ? read_tensor(e.epoch_tensor) : e.epoch_sum;
    double weight = e.epoch_weight;
    if (e.options.sync_dist && strategy.world_size() > 1) {
      // Mean: reduce the weighted sum and the weight, so ranks with more
      // samples count more, exactly as on one process.
      if (e.options.reduce == ReduceOp::kMean) {
        auto t = strategy.all_reduce(torch::tensor({value, weight}, torch::kDouble), ReduceOp::kSum);
        value = t[0].item<double>();
        weight = t[1].item<double>();
      } else {
        value = strategy.all_reduce(torch::tensor({value}, torch::kDouble), e.options.reduce)
                    .item<double>();
      }
    }
    const bool weightless = e.options.reduce == ReduceOp::kMean && !(weight > 0);
    if (e.options.reduce == ReduceOp::kMean) value = weightless ? std::nan("") : value / weight;
    out.push_back({e.on_step ? name + "_epoch" : name, value, at::Tensor(), e.options.logger,
                   e.options.prog_bar, weightless});
  }
  // A metric object a resume brought back that this epoch did not log
  // again (its checkpoint was written after the epoch's last batch, e.g. at
  // the end-of-epoch validation): the value of its saved states, which
  // the uninterrupted run published here. Every rank has it.
  for (const auto& [name, saved] : restored_) {
    if (!saved.value) continue;
    if (auto it = entries_.find(name); it != entries_.end() && it->second.epoch_has_value) {
      continue;
    }
    if (stepped_since_restore_ && strategy.is_global_zero()) {
      print_note(str("log(\"", name,
                     "\", <metric>): the checkpoint resumed from held this metric's states, "
                     "but training_step did not log it again after the resume, so its epoch "
                     "value counts the batches up to the checkpoint only. Log it at every "
                     "training step (or from on_train_epoch_end) to count the whole epoch."));
    }
    out.push_back({name, *saved.value, at::Tensor(), saved.logger, saved.prog_bar});
  }
  for (const std::string& name : unsaved_at_resume_) {
    if (!strategy.is_global_zero()) break;
    print_note(str("log(\"", name,
                   "\", <metric>): this epoch was resumed from a checkpoint written within it, "
                   "before this metric was first logged: a checkpoint keeps a metric's states "
                   "from its first log() in the epoch on, so its epoch value counts the batches "
                   "after the checkpoint only (the updates before it were not saved). Log it "
                   "where it is updated (log(\"",
                   name,
                   "\", metric) in training_step: its value is still the epoch's, computed once "
                   "at its end) so that every checkpoint keeps it."));
  }
  return out;
}

void LoggerConnector::reset_metrics() {
  train_sink_.forget_step_names();
  // A resume's states that an earlier fit (one that failed before its
  // resumed epoch ended) did not take.
  train_sink_.drop_restored_metrics();
  ended_ = false;
  divergence_noted_ = false;
  weightless_noted_.clear();
  callback_metrics_.clear();
  progress_bar_metrics_.clear();
  pending_callback_.clear();
  pending_progress_bar_.clear();
}

namespace {

// Reads the pending tensors into `metrics` (the first access after the
// steps that logged them).
void read_pending(std::map<std::string, at::Tensor>& pending, Metrics& metrics) {
  for (auto& [name, tensor] : pending) metrics[name] = LogSink::read_tensor(tensor);
  pending.clear();
}

}  // namespace

const Metrics& LoggerConnector::callback_metrics() const {
  if (!pending_callback_.empty()) read_pending(pending_callback_, callback_metrics_);
  return callback_metrics_;
}

const Metrics& LoggerConnector::progress_bar_metrics() const {
  if (!pending_progress_bar_.empty()) read_pending(pending_progress_bar_, progress_bar_metrics_);
  return progress_bar_metrics_;
}

void LoggerConnector::publish(const std::vector<LogSink::Value>& values, const char* suffix,
                              bool to_loggers, bool global_zero, int64_t epoch, int64_t step,
                              bool in_fit) {
  const std::string_view sfx(suffix);
  // Updates in place: a key published before allocates nothing.
  // (Metrics has no heterogeneous lookup: the key goes through one reused string.)
  // A tensor goes to the pending map (read on first access), a double to
  // the metrics; either replaces what the other holds for the key.
  auto set = [](Metrics& m, std::map<std::string, at::Tensor>& pending, std::string_view key,
                const LogSink::Value& v) {
    thread_local std::string scratch;
    scratch.assign(key);
    if (v.tensor.defined()) {
      auto it = pending.find(scratch);
      if (it != pending.end()) {
        it->second = v.tensor;
      } else {
        pending.emplace(std::string(key), v.tensor);
      }
      return;
    }
    if (!pending.empty()) pending.erase(scratch);
    auto it = m.find(scratch);
    if (it != m.end()) {
      it->second = v.value;
    } else {
      m.emplace(std::string(key), v.value);
    }
  };
  for (const auto& v : values) {
    set(callback_metrics_, pending_callback_, v.name, v);
    std::string_view name(v.name);
    if (name.size() > sfx.size() && name.substr(name.size() - sfx.size()) == sfx) {
      set(callback_metrics_, pending_callback_, name.substr(0, name.size() - sfx.size()), v);
    }
    if (v.prog_bar) set(progress_bar_metrics_, pending_progress_bar_, v.name, v);
  }
  if (to_loggers) write_row(values, global_zero, epoch, step, in_fit);
}

void LoggerConnector::write_row(const std::vector<LogSink::Value>& values, bool global_zero,
                                int64_t epoch, int64_t step, bool in_fit) {
  // The loggers' row is built only on the steps that reach them: the one
  // place a logged tensor is read in the steady-state step.
  if (loggers_.empty() || !global_zero) return;
  Metrics row;
  for (const auto& v : values) {
    if (!v.logger) continue;
    const double value = v.read();
    row[v.name] = value;
    if (in_fit && !v.weightless) note_divergence(v.name, value, epoch, step);
  }
  if (row.empty()) return;
  // The epoch, unless the module logged an "epoch" of its own (Lightning's
  // setdefault: the logged value is kept).
  row.emplace("epoch", static_cast<double>(epoch));
  choose_versions();
  for (auto& logger : loggers_) logger->log_metrics(row, step);
}

void LoggerConnector::publish_step_values(Strategy& strategy) {
  train_sink_.sync_step_values(strategy, LogSink::kTrainingStep);
  publish(train_sink_.collect_step(LogSink::StepValues::kToPublish), "_step",
          /*to_loggers=*/false, strategy.is_global_zero(), 0, 0, /*in_fit=*/true);
}

void LoggerConnector::publish_step(Strategy& strategy, bool to_loggers, int64_t epoch,
                                   int64_t step) {
  // What on_train_batch_end logged.
  train_sink_.sync_step_values(strategy, LogSink::kBatchEnd);
  publish(train_sink_.collect_step(LogSink::StepValues::kToPublish), "_step",
          /*to_loggers=*/false, strategy.is_global_zero(), epoch, step, /*in_fit=*/true);
  // The step's row: everything it logged (but what a row before a save
  // within on_train_batch_end held).
  if (to_loggers) write_step_row(strategy, epoch, step, /*published_only=*/false);
  train_sink_.clear_step_flags();
}

void LoggerConnector::write_step_row(Strategy& strategy, int64_t epoch, int64_t step,
                                     bool published_only) {
  write_row(train_sink_.collect_step(published_only ? LogSink::StepValues::kPublishedToRow
                                                    : LogSink::StepValues::kToRow),
            strategy.is_global_zero(), epoch, step, /*in_fit=*/true);
}

Metrics LoggerConnector::publish_epoch(LogSink& sink, Strategy& strategy, bool sanity_checking,
                                       int64_t epoch, int64_t step, bool in_fit) {
  auto values = sink.collect_epoch(strategy);
  sink.close(
      "this epoch's values are already published (a callback's on_train_epoch_end or "
      "on_validation_epoch_end runs after the Module's and the publish, as do on_train_end and "
      "on_fit_end), so the value would go nowhere. Log it from the Module's epoch-end hook, or "
      "from a batch hook (its epoch value is then the mean over the batches).");
  Metrics out;
  for (const auto& v : values) {
    out[v.name] = v.value;
    if (sanity_checking || !strategy.is_global_zero()) continue;
    if (v.weightless) {
      note_weightless(v.name, epoch);
    } else if (in_fit) {
      note_divergence(v.name, v.value, epoch, step);
    }
  }
  if (!sanity_checking) {
    publish(values, "_epoch", /*to_loggers=*/true, strategy.is_global_zero(), epoch, step, in_fit);
  }
  return out;
}

void LoggerConnector::note_divergence(const std::string& name, double value, int64_t epoch,
                                      int64_t step) {
  if (divergence_noted_ || std::isfinite(value) || name.find("loss") == std::string::npos) return;
  divergence_noted_ = true;
  detail::print_note(str("\"", name, "\" is ", value, " at step ", step, " (epoch ", epoch,
                         "): the training diverged, and the run goes on with it. Lower the "
                         "learning rate, clip gradients (gradient_clip_val), or stop such a run "
                         "early: EarlyStopping on a loss stops when it is not finite "
                         "(check_finite)."));
}

void LoggerConnector::note_weightless(const std::string& name, int64_t epoch) {
  if (weightless_noted_.count(name) != 0) return;
  weightless_noted_.insert(name);
  detail::print_note(
      str("\"", name, "\" is nan for epoch ", epoch,
          ": it is logged as a mean weighed by batch "
          "size, and its batch sizes this epoch add up to 0 (batch_size=0 on every call, "
          "on every rank it is synced over, or batches without samples). Pass the number of "
          "samples each value covers as "
          "batch_size, or log it with reduce=sum, max or min."));
}

void LoggerConnector::choose_versions() {
  if (versions_chosen_) return;
  for (auto& logger : loggers_) (void)logger->log_dir();
  versions_chosen_ = true;
}

void LoggerConnector::agree_log_dirs(Strategy& strategy) {
  // Also where this rank has no logger: the ranks' lists may differ.
  if (strategy.world_size() <= 1) return;
  std::string dirs;
  if (strategy.is_global_zero()) {
    choose_versions();
    for (const auto& logger : loggers_) dirs.append(logger->log_dir()).push_back('\0');
  }
  dirs = strategy.broadcast_bytes(dirs);
  if (strategy.is_global_zero()) return;
  size_t begin = 0;
  for (auto& logger : loggers_) {
    const size_t end = dirs.find('\0', begin);
    if (end == std::string::npos) break;  // rank 0 has fewer loggers
    logger->follow_log_dir(dirs.substr(begin, end - begin));
    begin = end + 1;
  }
  versions_chosen_ = true;
}

void LoggerConnector::log_hyperparams(const HParams& hparams) {
  choose_versions();
  for (auto& logger : loggers_) logger->log_hyperparams(hparams);
}

void LoggerConnector::log_parameters(const Module& module, int64_t step) {
  choose_versions();
  for (auto& logger : loggers_) logger->log_parameters(module, step);
}

bool LoggerConnector::logs_parameters() const {
  for (const auto& logger : loggers_) {
    if (logger->logs_parameters()) return true;
  }
  return false;
}

void LoggerConnector::save() {
  for (auto& logger : loggers_) logger->save();
}

void LoggerConnector::save_quietly() noexcept {
  for (auto& logger : loggers_) {
    try {
      logger->save();
    } catch (const std::exception& e) {
      detail::print_note(e.what());
    }
  }
}

void LoggerConnector::finalize(RunStatus status) {
  ended_ = true;
  for (auto& logger : loggers_) {
    logger->log_run_status(status);
    logger->finalize();
  }
}

void LoggerConnector::finalize_quietly(RunStatus status) noexcept {
  if (ended_) return;  // finalize() itself failed: the run's end is recorded
  ended_ = true;
  for (auto& logger : loggers_) {
    try {
      logger->log_run_status(status);
      logger->finalize();
    } catch (const std::exception& e) {
      detail::print_note(e.what());
    }
  }
}

}  // namespace detail
}  // namespace fulgur
