// An optimizer's state as a StateDict (LibTorch's Optimizer::save layout):
// the parameter groups through the optimizer's own save (small: numbers and
// keys), the per-parameter states of torch::optim's optimizers by their
// accessors, so the tensors go into the dict uncopied.
#include "fulgur/optim/state_dict.h"

#include <torch/optim.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <functional>
#include <memory>
#include <sstream>
#include <utility>

#include "fulgur/core/errors.h"
#include "fulgur/optim/optimizers.h"
#include "fulgur/utilities/torch_compat.h"

namespace fulgur {
namespace {

// The entry naming the optimizer a state is of (not one LibTorch writes:
// its load ignores it).
constexpr const char* kOptimizerKindKey = "optimizer";

using ParamStates = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;

// The archive `save` writes, read back as a StateDict (through bytes: an
// OutputArchive cannot be read).
template <class Save>
StateDict saved_through_archive(Save&& save) {
  torch::serialize::OutputArchive archive;
  save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return from_bytes(out.str());
}

// An InputArchive holding `state` (through bytes, as above).
void load_through_archive(const StateDict& state, torch::serialize::InputArchive& archive) {
  std::istringstream in(to_bytes(state));
  archive.load_from(in);
}

// Each parameter's state put on that parameter's device, through the
// state's own serialization (which every optimizer state has): LibTorch's
// load keeps a state's tensors where the archive had them, a checkpoint's
// in host memory, and an optimizer such as LBFGS would step a GPU's
// gradients with them.
void move_states_to_their_parameters(torch::optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      auto it = optimizer.state().find(compat::optimizer_state_key(p));
      if (it == optimizer.state().end() || !it->second || p.device().is_cpu()) continue;
      torch::serialize::OutputArchive out;
      it->second->serialize(out);
      std::ostringstream bytes;
      out.save_to(bytes);
      std::istringstream in(bytes.str());
      torch::serialize::InputArchive moved;
      moved.load_from(in, p.device());
      it->second->serialize(moved);
    }
  }
}

// As LibTorch writes them: a plain value, none for an undefined tensor.
void set_tensor(StateDict& out, const char* key, const at::Tensor& t) {
  if (t.defined()) out.set_plain(key, t);
}

// An undefined tensor when absent (as LibTorch reads it); CheckpointError
// naming the entry when it is something else.
at::Tensor optional_tensor(const StateDict& in, const char* key) {
  if (!in.contains(key)) return at::Tensor();
  return in.tensor(key);
}

// The same, on `param`'s device, floating-point state in its dtype (as
// PyTorch's Optimizer.load_state_dict casts it); a no-op where it already is.
at::Tensor optional_tensor(const StateDict& in, const char* key, const at::Tensor& param) {
  at::Tensor t = optional_tensor(in, key);
  if (!t.defined()) return t;
  return t.to(param.device(), t.is_floating_point() ? param.scalar_type() : t.scalar_type());
}

// The entries LibTorch's ParamState::serialize writes, for the states fulgur
// knows; false for another.
bool write_param_state(const torch::optim::OptimizerParamState& state, StateDict& out) {
  auto moments = [&](const auto& s) {  // Adam's and AdamW's
    out.set("step", s.step());
    set_tensor(out, "exp_avg", s.exp_avg());
    set_tensor(out, "exp_avg_sq", s.exp_avg_sq());
    set_tensor(out, "max_exp_avg_sq", s.max_exp_avg_sq());
  };
  if (const auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    moments(*adam);
  } else if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    moments(*adamw);
  } else if (const auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(&state)) {
    set_tensor(out, "momentum_buffer", sgd->momentum_buffer());
  } else if (const auto* rms = dynamic_cast<const torch::optim::RMSpropParamState*>(&state)) {
    out.set("step", rms->step());
    set_tensor(out, "square_avg", rms->square_avg());
    set_tensor(out, "momentum_buffer", rms->momentum_buffer());
    set_tensor(out, "grad_avg", rms->grad_avg());
  } else if (const auto* ada = dynamic_cast<const torch::optim::AdagradParamState*>(&state)) {
    out.set("step", ada->step());
    set_tensor(out, "sum", ada->sum());
  } else {
    return false;
  }
  return true;
}

// A parameter's state for `optimizer` from its entries, its tensors on the
// device of `param` (a checkpoint's tensors are loaded into host memory);
// null for an optimizer whose state fulgur does not know.
std::unique_ptr<torch::optim::OptimizerParamState> read_param_state(
    const torch::optim::Optimizer& optimizer, const StateDict& in, const at::Tensor& param) {
  auto state_tensor = [&](const char* key) { return optional_tensor(in, key, param); };
  auto moments = [&](auto s) {
    s->step(in.integer("step"));
    s->exp_avg(state_tensor("exp_avg"));
    s->exp_avg_sq(state_tensor("exp_avg_sq"));
    s->max_exp_avg_sq(state_tensor("max_exp_avg_sq"));
    return s;
  };
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) {
    return moments(std::make_unique<torch::optim::AdamParamState>());
  }
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) {
    return moments(std::make_unique<torch::optim::AdamWParamState>());
  }
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(state_tensor("momentum_buffer"));
    return s;
  }
  if (dynamic_cast<const torch::optim::RMSprop*>(&optimizer)) {
    auto s = std::make_unique<torch::optim::RMSpropParamState>();
    s->step(in.integer("step"));
    s->square_avg(state_tensor("square_avg"));
    s->momentum_buffer(state_tensor("momentum_buffer"));
    s->grad_avg(state_tensor("grad_avg"));
    return s;
  }
  if (dynamic_cast<const torch::optim::Adagrad*>(&optimizer)) {
    auto s = std::make_unique<torch::optim::AdagradParamState>();
    s->step(in.integer("step"));
    s->sum(state_tensor("sum"));
    return s;
  }
  return nullptr;
}

// The torch::optim optimizer `optimizer` is (fulgur's multi-tensor ones are
// theirs: same options, same state), or null for one fulgur does not know.
const char* kind_of(const torch::optim::Optimizer& optimizer) {
  namespace o = torch::optim;
  if (dynamic_cast<const o::Adam*>(&optimizer)) return "Adam";
  if (dynamic_cast<const o::AdamW*>(&optimizer)) return "AdamW";
  if (dynamic_cast<const o::SGD*>(&optimizer)) return "SGD";
  if (dynamic_cast<const o::RMSprop*>(&optimizer)) return "RMSprop";
  if (dynamic_cast<const o::Adagrad*>(&optimizer)) return "Adagrad";
  return nullptr;
}

bool knows_state_of(const torch::optim::Optimizer& optimizer) {
  return kind_of(optimizer) != nullptr;
}

// Adam's and AdamW's states and options have the same names: the kind a
// save wrote tells them apart (a state saved before fulgur wrote it has
// none, and is taken as it is).
void check_kind(const torch::optim::Optimizer& optimizer, const StateDict& state) {
  const c10::IValue* saved = state.find(kOptimizerKindKey);
  const char* kind = kind_of(optimizer);
  if (saved == nullptr || kind == nullptr) return;
  const std::string saved_kind = state.string(kOptimizerKindKey);
  if (saved_kind != kind) {
    throw CheckpointError(str("the optimizer state is ", saved_kind, "'s and the optimizer is ",
                              kind,
                              ": it is the state of another kind of optimizer (with the "
                              "same entries, stepped another way)"));
  }
}

// The keys of the parameters in the dict's param_groups, group by group.
std::vector<std::vector<std::string>> saved_keys(const StateDict& groups) {
  std::vector<std::vector<std::string>> keys;
  const int64_t count = groups.tensor("param_groups/size").item<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    const StateDict& group = groups.section_at(str("param_groups/", i));
    const int64_t size = group.tensor("params/size").item<int64_t>();
    auto& out = keys.emplace_back();
    for (int64_t j = 0; j < size; ++j) out.push_back(group.string(str("params/", j)));
  }
  return keys;
}

// LibTorch's Optimizer::load reads each parameter group's options and drops
// them (torch/optim/serialize.h); they are restored here from the same
// archive, for the optimizers of torch::optim (one of one's own that saves
// another layout restores its options in its own load()).
void restore_group_options(torch::optim::Optimizer& optimizer,
                           torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive groups;
  if (!archive.try_read("param_groups", groups)) return;
  auto& param_groups = optimizer.param_groups();
  for (size_t i = 0; i < param_groups.size(); ++i) {
    torch::serialize::InputArchive group;
    torch::serialize::InputArchive options;
    if (!groups.try_read(str("param_groups/", i), group) || !group.try_read("options", options)) {
      throw CheckpointError(str("the optimizer state holds no options for parameter group ", i,
                                " of ", param_groups.size(), " (the save had fewer groups)"));
    }
    param_groups[i].options().serialize(options);
  }
}

// `state` with every parameter's key replaced by its position ("1", "2",
// ...), in param_groups and in the state alike: LibTorch 2.x's load parses
// the keys as decimal addresses (a 1.13 key "0x55d0..." parses as 0, and
// every state would land on one), 1.13's compares them as text; positions
// read the same in both.
StateDict with_position_keys(const StateDict& state) {
  StateDict out = state;
  StateDict* groups = out.find_section("param_groups");
  StateDict* states = out.find_section("state");
  if (groups == nullptr || states == nullptr) return out;
  const StateDict original_states = *states;
  StateDict renamed;
  int64_t position = 0;
  const int64_t count = groups->tensor("param_groups/size").item<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    StateDict& group = groups->section(str("param_groups/", i));
    const int64_t size = group.tensor("params/size").item<int64_t>();
    for (int64_t j = 0; j < size; ++j) {
      const std::string key = group.string(str("params/", j));
      const std::string by_position = std::to_string(++position);
      group.set(str("params/", j), by_position);
      if (const StateDict* one = original_states.find_section(key)) {
        renamed.set_section(by_position, *one);
      }
    }
  }
  *states = std::move(renamed);
  return out;
}

// The optimizer's own load (its states then put on their parameters'
// devices), then its groups' options.
void load_whole(torch::optim::Optimizer& optimizer, const StateDict& state) {
  torch::serialize::InputArchive archive;
  load_through_archive(with_position_keys(state), archive);
  optimizer.load(archive);
  move_states_to_their_parameters(optimizer);
  restore_group_options(optimizer, archive);
}

// The option names of the optimizer's groups, as its options serialize
// them (lr, momentum, ... for SGD; lr, betas, ... for Adam).
std::vector<std::string> option_names(torch::optim::Optimizer& optimizer) {
  if (optimizer.param_groups().empty()) return {};
  return saved_through_archive(
             [&](auto& archive) { optimizer.param_groups()[0].options().serialize(archive); })
      .keys();
}

// Refuses the options of another optimizer (LibTorch would fail an
// internal assert on the first option missing).
void check_group_options(torch::optim::Optimizer& optimizer, const StateDict& groups) {
  const auto expected = option_names(optimizer);
  const int64_t count = groups.tensor("param_groups/size").item<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    const StateDict* options = groups.section_at(str("param_groups/", i)).find_section("options");
    if (options == nullptr) continue;  // restore_group_options names it
    std::vector<std::string> missing;
    for (const auto& name : expected) {
      if (!options->contains(name)) missing.push_back(name);
    }
    if (!missing.empty()) {
      throw CheckpointError(str("parameter group ", i, " of the optimizer state has the options ",
                                join(options->keys()), ", without ", join(missing),
                                ", which this optimizer has (", join(expected),
                                "): it is the state of another kind of optimizer"));
    }
  }
}

}  // namespace

StateDict optimizer_state_dict(torch::optim::Optimizer& optimizer) {
  // A step the device may have skipped: its verdict first (the states below
  // are read directly).
  if (auto* skipping = dynamic_cast<fulgur::optim::DeviceSkippedSteps*>(&optimizer)) {
    skipping->settle();
  }
  bool known = true;
  for (const auto& [key, state] : optimizer.state()) {
    (void)key;
    StateDict scratch;  // holds references only
    if (!write_param_state(*state, scratch)) known = false;
  }
  if (!known) {
    // An optimizer of its own kind: its own save, read back.
    return saved_through_archive([&](auto& archive) { optimizer.save(archive); });
  }
  // The parameter groups through the optimizer's own save, with its states
  // set aside (their tensors are not serialized), then the states.
  ParamStates states = std::move(optimizer.state());
  optimizer.state().clear();
  StateDict out;
  try {
    out = saved_through_archive([&](auto& archive) { optimizer.save(archive); });
  } catch (...) {
    optimizer.state() = std::move(states);
    throw;
  }
  optimizer.state() = std::move(states);
  const auto* groups = out.find_section("param_groups");
  auto* state_section = out.find_section("state");
  if (groups == nullptr || state_section == nullptr || !state_section->empty()) {
    // Not LibTorch's layout: the optimizer saves itself.
    return saved_through_archive([&](auto& archive) { optimizer.save(archive); });
  }
  if (const char* kind = kind_of(optimizer)) out.set(kOptimizerKindKey, std::string(kind));
  const auto keys = saved_keys(*groups);
  const auto& param_groups = optimizer.param_groups();
  for (size_t i = 0; i < keys.size() && i < param_groups.size(); ++i) {
    const auto& params = param_groups[i].params();
    for (size_t j = 0; j < keys[i].size() && j < params.size(); ++j) {
      auto it = optimizer.state().find(compat::optimizer_state_key(params[j]));
      if (it == optimizer.state().end() || state_section->contains(keys[i][j])) continue;
      write_param_state(*it->second, state_section->section(keys[i][j]));
    }
  }
  return out;
}

void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const StateDict& state) {
  const StateDict* saved_states = state.find_section("state");
  const StateDict* groups = state.find_section("param_groups");
  if (saved_states == nullptr || groups == nullptr || !knows_state_of(optimizer)) {
    load_whole(optimizer, state);
    return;
  }
  const auto keys = saved_keys(*groups);
  auto& param_groups = optimizer.param_groups();
  check_group_options(optimizer, *groups);
  check_kind(optimizer, state);
  if (keys.size() != param_groups.size()) {
    throw CheckpointError(str("the optimizer state has ", keys.size(),
                              " parameter group(s); the optimizer has ", param_groups.size()));
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].size() != param_groups[i].params().size()) {
      throw CheckpointError(str("parameter group ", i, " has ", keys[i].size(),
                                " parameter(s) in the optimizer state and ",
                                param_groups[i].params().size(), " in the optimizer"));
    }
  }
  // Every state read before any is set: a state that does not fit changes
  // nothing.
  std::vector<
      std::pair<compat::OptimizerStateKey, std::unique_ptr<torch::optim::OptimizerParamState>>>
      loaded;
  for (size_t i = 0; i < keys.size(); ++i) {
    for (size_t j = 0; j < keys[i].size(); ++j) {
      const StateDict* saved = saved_states->find_section(keys[i][j]);
      if (saved == nullptr) continue;
      const at::Tensor& param = param_groups[i].params()[j];
      loaded.emplace_back(compat::optimizer_state_key(param),
                          read_param_state(optimizer, *saved, param));
    }
  }
  // The groups' options, through the optimizer's own load with no state.
  StateDict without_states = state;
  without_states.section("state") = StateDict();
  load_whole(optimizer, without_states);
  // The saved states replace the optimizer's, as PyTorch's load_state_dict
  // does: a parameter without one in `state` has none after (it kept its
  // momentum of an earlier step).
  optimizer.state().clear();
  for (auto& [key, param_state] : loaded) optimizer.state()[key] = std::move(param_state);
}

void check_optimizer_state_shapes(const torch::optim::Optimizer& optimizer,
                                  const std::function<std::string(const at::Tensor&)>& name_of) {
  const auto& param_groups = optimizer.param_groups();
  for (size_t i = 0; i < param_groups.size(); ++i) {
    const auto& params = param_groups[i].params();
    for (size_t j = 0; j < params.size(); ++j) {
      auto it = optimizer.state().find(compat::optimizer_state_key(params[j]));
      if (it == optimizer.state().end() || !it->second) continue;
      StateDict entries;  // references to the state's tensors
      if (!write_param_state(*it->second, entries)) continue;
      for (const auto& key : entries.keys()) {
        const c10::IValue& entry = entries.at(key);
        if (!entry.isTensor() || entry.toTensor().sizes() == params[j].sizes()) continue;
        const std::string name = name_of ? name_of(params[j]) : std::string();
        throw CheckpointError(str(
            "the state of parameter ", j, name.empty() ? "" : str(" (", name, ")"),
            " of parameter group ", i, " has \"", key, "\" of shape ",
            c10::str(entry.toTensor().sizes()), " where the parameter has ",
            c10::str(params[j].sizes()),
            ": it is another parameter's (configure_optimizers listing the parameters in another "
            "order, or another model)"));
      }
    }
  }
}

}  // namespace fulgur
