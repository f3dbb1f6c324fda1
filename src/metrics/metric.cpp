// The Metric base: declared states, their reductions across ranks (a
// concatenated state of uneven length per rank gathered exactly), the
// padded rows of an evaluation batch, and the states in checkpoints.
#include "fulgur/metrics/metric.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <string>

#include "fulgur/core/errors.h"
#include "fulgur/distributed/process_group.h"

namespace fulgur::metrics {

namespace {

thread_local int64_t g_padded_rows = 0;
thread_local bool g_capturing = false;

// `local` (rows of equal trailing shape, a different count per rank) from
// every rank of `group`, concatenated in rank order: the counts first, then
// the rows padded to the longest (all_gather needs one shape).
at::Tensor gather_rows(const at::Tensor& local, ProcessGroup& group) {
  const at::Tensor count = torch::tensor({local.size(0)}, torch::kLong).to(local.device());
  const at::Tensor counts = group.all_gather(count).reshape({-1}).to(at::kCPU);
  const auto* n = counts.data_ptr<int64_t>();
  const int64_t longest = *std::max_element(n, n + counts.size(0));
  // No rank has a row (an all_gather of empty tensors divides by zero in
  // Gloo): every rank's rows are this rank's none.
  if (longest == 0) return local;
  at::Tensor padded = local;
  if (local.size(0) < longest) {
    std::vector<int64_t> shape = local.sizes().vec();
    shape[0] = longest - local.size(0);
    padded = torch::cat({local, torch::zeros(shape, local.options())});
  }
  const at::Tensor all = group.all_gather(padded.contiguous());  // [world, longest, ...]
  std::vector<at::Tensor> rows;
  for (int64_t r = 0; r < counts.size(0); ++r) rows.push_back(all[r].narrow(0, 0, n[r]));
  return torch::cat(rows);
}

}  // namespace

Metric::Metric() = default;
Metric::~Metric() = default;

void Metric::set_padded_rows(int64_t rows) { g_padded_rows = std::max<int64_t>(rows, 0); }
int64_t Metric::padded_rows() { return g_padded_rows; }
void Metric::set_capturing(bool capturing) { g_capturing = capturing; }

void Metric::count_update() {
  if (g_capturing) {
    throw ConfigError(str(name(),
                          ".update() in a training_step captured as a CUDA graph "
                          "(cuda_graph=true): host code there runs once, at the capture, so the "
                          "metric would count one batch. Update it in on_train_batch_end, or "
                          "in validation_step."));
  }
  ++updates_;
}

at::Tensor Metric::without_padding(const at::Tensor& rows) {
  if (g_padded_rows == 0 || rows.dim() == 0) return rows;
  return rows.narrow(0, 0, std::max<int64_t>(rows.size(0) - g_padded_rows, 0));
}

void Metric::add_state(std::string name, at::Tensor initial, Reduction reduction) {
  if (name == "updates" || name == "options") {
    throw ConfigError(str(this->name(), ": a state cannot be named \"", name,
                          "\": state_dict() keeps the metric's ", name,
                          " under that name. Name it otherwise."));
  }
  for (const auto& s : states_) {
    if (s.name == name) {
      throw ConfigError(str(this->name(), ": state \"", name, "\" is declared twice."));
    }
  }
  if (reduction == Reduction::kCat && (initial.dim() == 0 || initial.size(0) != 0)) {
    throw ConfigError(str(this->name(), ": concatenated state \"", name,
                          "\" starts empty: pass an initial tensor of 0 rows (its dtype and "
                          "trailing shape), e.g. at::empty({0}, at::kFloat)."));
  }
  State s{std::move(name), initial.detach().clone(), reduction, {}, {}};
  if (reduction != Reduction::kCat) s.value = s.initial.clone();
  states_.push_back(std::move(s));
}

Metric::State& Metric::find(std::string_view name) {
  for (auto& s : states_) {
    if (s.name == name) return s;
  }
  throw InternalError(str(this->name(), " has no state \"", name, "\""));
}

at::Tensor& Metric::state(std::string_view name) {
  State& s = find(name);
  FULGUR_ASSERT(s.reduction != Reduction::kCat, "state() of a concatenated state; use append()");
  return s.value;
}

void Metric::follow(const at::Tensor& like) {
  for (auto& s : states_) {
    if (s.reduction != Reduction::kCat && s.value.device() != like.device()) {
      s.value = s.value.to(like.device());
    }
  }
}

void Metric::check_same_device(const std::string& name, const at::Tensor& preds,
                               const at::Tensor& target) {
  if (preds.device() == target.device()) return;
  throw ConfigError(str(name, ".update: preds is on ", preds.device().str(), " and target on ",
                        target.device().str(),
                        "; pass both on one device (e.g. target.to(preds.device()))."));
}

void Metric::append(std::string_view name, const at::Tensor& rows) {
  State& s = find(name);
  FULGUR_ASSERT(s.reduction == Reduction::kCat, "append() to a state that is not concatenated");
  s.parts.push_back(rows.detach().to(s.initial.scalar_type()));
}

void Metric::reset() {
  torch::NoGradGuard no_grad;
  for (auto& s : states_) {
    if (s.reduction == Reduction::kCat) {
      s.parts.clear();
    } else {
      // In place: the same storage across epochs; without any history a
      // state was given (e.g. loaded from a tensor that needs gradients).
      s.value = s.value.detach();
      s.value.copy_(s.initial);
    }
  }
  updates_ = 0;
}

std::vector<at::Tensor> Metric::local_states() const {
  std::vector<at::Tensor> out;
  out.reserve(states_.size());
  for (const auto& s : states_) {
    if (s.reduction != Reduction::kCat) {
      out.push_back(s.value);
    } else if (s.parts.empty()) {
      out.push_back(s.initial);
    } else {
      std::vector<at::Tensor> parts;
      for (const auto& p : s.parts) parts.push_back(p.to(s.parts.front().device()));
      out.push_back(torch::cat(parts));
    }
  }
  return out;
}

at::Tensor Metric::compute() const {
  torch::NoGradGuard no_grad;
  return compute_from(local_states());
}

std::vector<at::Tensor> Metric::combined_states(ProcessGroup* group) const {
  std::vector<at::Tensor> states = local_states();
  if (group == nullptr) return states;
  for (size_t i = 0; i < states.size(); ++i) {
    switch (states_[i].reduction) {
      case Reduction::kCat: states[i] = gather_rows(states[i], *group); break;
      case Reduction::kSum:
      case Reduction::kMax:
      case Reduction::kMin: {
        at::Tensor t = states[i].clone();
        group->all_reduce_(t, states_[i].reduction == Reduction::kSum   ? ReduceOp::kSum
                              : states_[i].reduction == Reduction::kMax ? ReduceOp::kMax
                                                                        : ReduceOp::kMin);
        states[i] = t;
        break;
      }
    }
  }
  return states;
}

at::Tensor Metric::compute(ProcessGroup* group) const {
  torch::NoGradGuard no_grad;
  return compute_from(combined_states(group));
}

std::map<std::string, at::Tensor> Metric::state_dict(ProcessGroup* group) const {
  torch::NoGradGuard no_grad;
  const std::vector<at::Tensor> states = combined_states(group);
  std::map<std::string, at::Tensor> out;
  // Copies: the caller's map stays as it was while the metric goes on.
  for (size_t i = 0; i < states.size(); ++i) {
    out[states_[i].name] = states[i].to(states[i].options().device(at::kCPU), false, true);
  }
  at::Tensor updates = torch::tensor({updates_}, torch::kLong);
  if (group != nullptr) group->all_reduce_(updates, ReduceOp::kSum);
  out["updates"] = updates;
  const std::string options = options_text();
  if (!options.empty()) {
    out["options"] =
        torch::tensor(std::vector<uint8_t>(options.begin(), options.end()), torch::kUInt8);
  }
  return out;
}

std::vector<at::Tensor> Metric::checked(const std::map<std::string, at::Tensor>& saved) const {
  if (auto it = saved.find("updates");
      it != saved.end() && (it->second.numel() != 1 || it->second.is_floating_point())) {
    throw c10::Error({__func__, __FILE__, __LINE__},
                     c10::str(name(), ": \"updates\" in the checkpoint has shape ",
                              it->second.sizes(), " and dtype ", it->second.scalar_type(),
                              ", not one integer: not a metric's state"));
  }
  if (auto it = saved.find("options"); it != saved.end()) {
    const at::Tensor bytes = it->second.to(at::kCPU, at::kByte).contiguous().reshape({-1});
    const std::string theirs(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()),
                             static_cast<size_t>(bytes.numel()));
    if (theirs != options_text()) {
      throw c10::Error({__func__, __FILE__, __LINE__},
                       str(name(), ": the checkpoint's states were counted with ", theirs,
                           ", this metric counts with ",
                           options_text().empty() ? std::string("no options") : options_text(),
                           " (its counts would mean something else; build it as it was)"));
    }
  }
  std::vector<at::Tensor> loaded(states_.size());
  for (size_t i = 0; i < states_.size(); ++i) {
    const State& s = states_[i];
    auto it = saved.find(s.name);
    if (it == saved.end()) {
      throw c10::Error({__func__, __FILE__, __LINE__},
                       str(name(), ": state \"", s.name, "\" is missing from the checkpoint"));
    }
    loaded[i] = it->second;
    const bool same_trailing =
        loaded[i].dim() == s.initial.dim() &&
        (s.reduction == Reduction::kCat
             ? loaded[i].sizes().slice(1) == s.initial.sizes().slice(1)
             : loaded[i].sizes() == s.initial.sizes());
    if (loaded[i].defined() && c10::isFloatingType(loaded[i].scalar_type()) &&
        !c10::isFloatingType(s.initial.scalar_type())) {
      throw c10::Error({__func__, __FILE__, __LINE__},
                       c10::str(name(), ": state \"", s.name, "\" is ", loaded[i].scalar_type(),
                                " in the checkpoint; the metric counts in ",
                                s.initial.scalar_type(), " (not a state it wrote)"));
    }
    if (!same_trailing) {
      throw c10::Error({__func__, __FILE__, __LINE__},
                       c10::str(name(), ": state \"", s.name, "\" has shape ", loaded[i].sizes(),
                                " in the checkpoint, not the metric's ", s.initial.sizes(),
                                " (another number of classes?)"));
    }
  }
  return loaded;
}

namespace {
int64_t saved_updates(const std::map<std::string, at::Tensor>& saved) {
  auto it = saved.find("updates");
  return it == saved.end() ? 0 : it->second.item<int64_t>();
}
}  // namespace

void Metric::load_state_dict(const std::map<std::string, at::Tensor>& saved) {
  const std::vector<at::Tensor> loaded = checked(saved);
  for (size_t i = 0; i < states_.size(); ++i) {
    State& s = states_[i];
    if (s.reduction == Reduction::kCat) {
      s.parts.clear();
      if (loaded[i].size(0) > 0) {
        s.parts.push_back(
            loaded[i].to(loaded[i].options().dtype(s.initial.scalar_type()), false, true));
      }
    } else {
      // A copy, contiguous (updates view it flat): the metric's updates
      // change it in place, never the caller's.
      s.value =
          loaded[i].to(s.value.options().dtype(s.initial.scalar_type()), false, true).contiguous();
    }
  }
  updates_ = saved_updates(saved);
}

void Metric::merge_state_dict(const std::map<std::string, at::Tensor>& saved) {
  const std::vector<at::Tensor> loaded = checked(saved);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < states_.size(); ++i) {
    State& s = states_[i];
    const at::Tensor other = loaded[i].to(s.initial.scalar_type());
    switch (s.reduction) {
      case Reduction::kCat:
        // The saved rows came first (a copy, not the caller's tensor).
        if (other.size(0) > 0) s.parts.insert(s.parts.begin(), other.clone());
        break;
      case Reduction::kSum: s.value.add_(other.to(s.value.device())); break;
      case Reduction::kMax: at::maximum_out(s.value, s.value, other.to(s.value.device())); break;
      case Reduction::kMin: at::minimum_out(s.value, s.value, other.to(s.value.device())); break;
    }
  }
  updates_ += saved_updates(saved);
}

at::Tensor Metric::value_of(const std::map<std::string, at::Tensor>& saved) const {
  torch::NoGradGuard no_grad;
  return compute_from(checked(saved));
}

void Metric::save(StateDict& state) const {
  for (const auto& [key, tensor] : state_dict()) state.set_buffer(key, tensor);
}

void Metric::load(const StateDict& state) {
  std::map<std::string, at::Tensor> saved;
  for (const auto& key : state.keys()) {
    const c10::IValue* value = state.find(key);
    if (value != nullptr && value->isTensor()) saved[key] = value->toTensor();
  }
  load_state_dict(saved);
}

}  // namespace fulgur::metrics
