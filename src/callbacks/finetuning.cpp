#include "fulgur/callbacks/finetuning.h"

#include <c10/util/Type.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <memory>
#include <type_traits>
#include <set>
#include <unordered_map>
#include <utility>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/data/data_module.h"
#include "fulgur/nn/sync_batch_norm.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"

namespace fulgur {

namespace {

// A BatchNorm layer's options and step count (LibTorch's and fulgur's
// layers keep them alike).
struct NormRef {
  torch::nn::BatchNormOptions* options = nullptr;
  at::Tensor* batches_tracked = nullptr;
};

template <class Layer>
bool as_norm(torch::nn::Module& m, NormRef& out) {
  auto* layer = dynamic_cast<Layer*>(&m);
  if (layer == nullptr) return false;
  out = NormRef{&layer->options, &layer->num_batches_tracked};
  return true;
}

// BatchNormOptions::momentum is a c10::optional (LibTorch 1.13's own type).
using Momentum = std::decay_t<decltype(std::declval<torch::nn::BatchNormOptions&>().momentum())>;
std::optional<double> momentum_of(const NormRef& norm) {
  const Momentum& m = norm.options->momentum();
  return m.has_value() ? std::optional<double>(*m) : std::nullopt;
}
void set_momentum(const NormRef& norm, std::optional<double> m) {
  norm.options->momentum(m.has_value() ? Momentum(*m) : Momentum());
}

std::optional<NormRef> batch_norm(torch::nn::Module& m) {
  NormRef ref;
  if (as_norm<torch::nn::BatchNorm1dImpl>(m, ref) || as_norm<torch::nn::BatchNorm2dImpl>(m, ref) ||
      as_norm<torch::nn::BatchNorm3dImpl>(m, ref) || as_norm<nn::SyncBatchNormImpl>(m, ref)) {
    return ref;
  }
  return std::nullopt;
}

// `root` and every module in it (without shared_from_this: the fit's
// Module may live on the stack).
std::vector<torch::nn::Module*> modules_in(torch::nn::Module& root) {
  std::vector<torch::nn::Module*> out{&root};
  for (const auto& m : root.modules(/*include_self=*/false)) out.push_back(m.get());
  return out;
}

// Every module of `root` by address, with its name there ("" for root).
std::unordered_map<const torch::nn::Module*, std::string> module_names(torch::nn::Module& root) {
  std::unordered_map<const torch::nn::Module*, std::string> names{{&root, ""}};
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    names.emplace(item.value().get(), item.key());
  }
  return names;
}

// The parameters `optimizer` holds, by their tensors.
std::set<const c10::TensorImpl*> held_by(const torch::optim::Optimizer& optimizer) {
  std::set<const c10::TensorImpl*> held;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) held.insert(p.unsafeGetTensorImpl());
  }
  return held;
}

// Every parameter of `module` by its tensor, with its name.
std::unordered_map<const c10::TensorImpl*, std::string> parameter_names(Module& module) {
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& item : module.named_parameters()) {
    names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  return names;
}

bool global_zero(Module& module) { return module.trainer().strategy().is_global_zero(); }

}  // namespace

// What load_state_dict read, applied at on_restore_optimizers.
struct BaseFinetuning::Saved {
  std::vector<std::string> trainable;
  std::map<std::string, FrozenNorm> frozen_norms;
  std::vector<std::vector<std::vector<std::string>>> added_groups;
};

std::string BaseFinetuning::state_key() const {
  // The class's own name, without its namespaces (Lightning's qualname).
  const std::string name = c10::demangle(typeid(*this).name());
  const size_t colons = name.rfind("::");
  if (name.find('<') != std::string::npos || colons == std::string::npos) return name;
  return name.substr(colons + 2);
}

Module& BaseFinetuning::fit_module(const char* method) const {
  if (module_ == nullptr) {
    throw ConfigError(str(state_key(), ": ", method,
                          "() works on the Module of a fit: call it from "
                          "freeze_before_training or finetune_function."));
  }
  return *module_;
}

void BaseFinetuning::freeze_norms(torch::nn::Module& modules, bool freeze) {
  const auto names = module_names(fit_module(freeze ? "freeze" : "make_trainable"));
  torch::NoGradGuard no_grad;
  for (auto* m : modules_in(modules)) {
    auto norm = batch_norm(*m);
    if (!norm) continue;
    auto it = names.find(m);
    if (it == names.end()) {
      throw ConfigError(str(state_key(), ": a BatchNorm layer it was given is not part of module ",
                            module_->name(), ". Pass the fit's Module or one of its submodules."));
    }
    const std::string& name = it->second;
    auto frozen = frozen_norms_.find(name);
    if (freeze && frozen == frozen_norms_.end()) {
      const at::Tensor& count = *norm->batches_tracked;
      frozen_norms_[name] =
          FrozenNorm{momentum_of(*norm), count.defined() ? count.item<int64_t>() : 0};
      set_momentum(*norm, 0.0);  // keeps the running statistics
    } else if (!freeze && frozen != frozen_norms_.end()) {
      set_momentum(*norm, frozen->second.momentum);
      if (norm->batches_tracked->defined()) {
        norm->batches_tracked->fill_(frozen->second.batches_tracked);
      }
      frozen_norms_.erase(frozen);
    }
  }
}

void BaseFinetuning::freeze(torch::nn::Module& modules, bool train_bn) {
  fit_module("freeze");
  for (auto* m : modules_in(modules)) {
    const bool trains = train_bn && batch_norm(*m).has_value();
    for (auto& p : m->parameters(/*recurse=*/false)) p.requires_grad_(trains);
  }
  // Every BatchNorm layer in one pass: frozen with its statistics, or
  // (train_bn) updating them again.
  freeze_norms(modules, /*freeze=*/!train_bn);
}

void BaseFinetuning::make_trainable(torch::nn::Module& modules) {
  fit_module("make_trainable");
  for (auto& p : modules.parameters()) p.requires_grad_(true);
  freeze_norms(modules, /*freeze=*/false);
}

size_t BaseFinetuning::unfreeze_and_add_param_group(torch::nn::Module& modules,
                                                    torch::optim::Optimizer& optimizer,
                                                    std::optional<double> lr,
                                                    double initial_denom_lr, bool train_bn) {
  Module& root = fit_module("unfreeze_and_add_param_group");
  // The rate first: a bad one changes nothing.
  double group_lr = 0.0;
  if (lr) {
    group_lr = *lr;
  } else {
    if (optimizer.param_groups().empty()) {
      throw ConfigError(str(state_key(),
                            ": unfreeze_and_add_param_group without lr takes group 0's "
                            "learning rate, and the optimizer has no group. Pass lr."));
    }
    group_lr = optimizer.param_groups().front().options().get_lr() / initial_denom_lr;
  }
  if (!(std::isfinite(group_lr) && group_lr >= 0.0)) {
    throw ConfigError(str(state_key(), ": the new parameter group's learning rate is ", group_lr,
                          " (lr=", lr ? str(*lr) : std::string("none"), ", initial_denom_lr=",
                          initial_denom_lr, "). Pass a finite lr >= 0, or initial_denom_lr > 0."));
  }
  const std::set<const c10::TensorImpl*> held = held_by(optimizer);
  std::vector<at::Tensor> params;
  std::set<const c10::TensorImpl*> seen;
  size_t skipped = 0;
  for (auto* m : modules_in(modules)) {
    if (!train_bn && batch_norm(*m)) continue;  // stays frozen
    for (auto& p : m->parameters(/*recurse=*/false)) {
      const bool was_frozen = !p.requires_grad();
      p.requires_grad_(true);
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;  // shared
      if (held.count(p.unsafeGetTensorImpl()) != 0) {
        // One that trained all along (a BatchNorm layer under train_bn)
        // is where it belongs; a frozen one in the optimizer is noted.
        if (was_frozen) ++skipped;
        continue;
      }
      params.push_back(p);
    }
  }
  if (train_bn) freeze_norms(modules, /*freeze=*/false);
  if (skipped > 0 && global_zero(root)) {
    detail::print_note(
        str(state_key(), ": ", skipped,
            " of the frozen parameters it unfreezes are already in the "
            "optimizer's parameter groups and stay there, at their group's learning rate. To train "
            "them in a group of their own, give the optimizer only the trainable parameters in "
            "configure_optimizers (those with requires_grad())."));
  }
  if (params.empty()) return 0;
  const size_t count = params.size();
  // Without options the group takes the optimizer's defaults (as
  // PyTorch's add_param_group), then its own rate.
  optimizer.add_param_group(torch::optim::OptimizerParamGroup(std::move(params)));
  optimizer.param_groups().back().options().set_lr(group_lr);
  return count;
}

std::vector<std::string> BaseFinetuning::trainable_names() const {
  if (module_ == nullptr) return trainable_at_end_;
  std::vector<std::string> names;
  for (const auto& item : module_->named_parameters()) {
    if (item.value().requires_grad()) names.push_back(item.key());
  }
  return names;
}

void BaseFinetuning::setup(Trainer& trainer, Module& module, Stage stage) {
  if (stage != Stage::kFit) return;
  Strategy& strategy = trainer.strategy();
  const std::string& why = strategy.traits().trainable_change_unsupported_reason;
  if (!why.empty()) {
    throw ConfigError(str(state_key(),
                          " makes parameters trainable during the fit, which strategy \"",
                          strategy.name(), "\" cannot follow: ", why,
                          ". Use strategy \"ddp\" (or one device), or train the whole model "
                          "from the start without this callback."));
  }
  module_ = &module;
  frozen_norms_.clear();
  added_groups_.clear();
  finetuned_epoch_ = -1;
  trainable_at_end_.clear();
  saved_.reset();
  freeze_before_training(module);
}

void BaseFinetuning::teardown(Trainer&, Module& module, Stage stage) {
  if (stage != Stage::kFit || module_ != &module) return;
  // A layer still frozen gets its own momentum and count back; its
  // parameters stay as the fit left them.
  if (!frozen_norms_.empty()) freeze_norms(module, /*freeze=*/false);
  trainable_at_end_ = trainable_names();
  module_ = nullptr;
}

void BaseFinetuning::on_train_epoch_start(Trainer& trainer, Module& module) {
  const int64_t epoch = trainer.current_epoch();
  // A resume within an epoch the saved run fine-tuned: done already (its
  // learning rates and groups came back with the checkpoint).
  if (epoch <= finetuned_epoch_) return;
  const auto& optimizers = module.optimizers();
  if (added_groups_.size() < optimizers.size()) added_groups_.resize(optimizers.size());
  std::unordered_map<const c10::TensorImpl*, std::string> names;  // made when needed
  for (size_t i = 0; i < optimizers.size(); ++i) {
    torch::optim::Optimizer& optimizer = *optimizers[i];
    const size_t before = optimizer.param_groups().size();
    finetune_function(module, epoch, optimizer);
    for (size_t g = before; g < optimizer.param_groups().size(); ++g) {
      if (names.empty()) names = parameter_names(module);
      auto& group = added_groups_[i].emplace_back();
      for (const auto& p : optimizer.param_groups()[g].params()) {
        auto it = names.find(p.unsafeGetTensorImpl());
        if (it == names.end()) {
          throw ConfigError(
              fulgur::str(state_key(), ": parameter group ", g, " of optimizer ", i,
                          ", added in epoch ", epoch, ", holds a tensor of shape ", p.sizes(),
                          " that is not a parameter of module ", module.name(),
                          ". Add the module's own parameters (a resumed run finds them "
                          "by name)."));
        }
        group.push_back(it->second);
      }
    }
  }
  finetuned_epoch_ = epoch;
}

StateDict BaseFinetuning::state_dict() const {
  StateDict state;
  state.set("finetuned_epoch", finetuned_epoch_);
  state.set("trainable", c10::List<std::string>(trainable_names()));
  // Lists side by side, one entry per frozen layer.
  std::vector<std::string> names;
  c10::List<double> momenta;
  c10::List<int64_t> cumulative;
  c10::List<int64_t> batches;
  for (const auto& [name, norm] : frozen_norms_) {
    names.push_back(name);
    momenta.push_back(norm.momentum.value_or(0.0));
    cumulative.push_back(norm.momentum ? 0 : 1);
    batches.push_back(norm.batches_tracked);
  }
  StateDict& norms = state.section("frozen_norms");
  norms.set("names", c10::List<std::string>(names));
  norms.set("momentum", momenta);
  norms.set("cumulative", cumulative);
  norms.set("batches_tracked", batches);
  StateDict& groups = state.section("added_groups");
  groups.set("optimizers", static_cast<int64_t>(added_groups_.size()));
  for (size_t i = 0; i < added_groups_.size(); ++i) {
    StateDict& one = groups.section(std::to_string(i));
    one.set("count", static_cast<int64_t>(added_groups_[i].size()));
    for (size_t g = 0; g < added_groups_[i].size(); ++g) {
      one.set(std::to_string(g), c10::List<std::string>(added_groups_[i][g]));
    }
  }
  state.set_section("extra", extra_state());
  return state;
}

void BaseFinetuning::load_state_dict(const StateDict& state) {
  auto saved = std::make_shared<Saved>();
  const int64_t epoch = state.integer("finetuned_epoch");
  saved->trainable = state.strings("trainable");
  const StateDict& norms = state.section_at("frozen_norms");
  const auto names = norms.strings("names");
  const auto momenta = norms.reals("momentum");
  const auto cumulative = norms.integers("cumulative");
  const auto batches = norms.integers("batches_tracked");
  if (momenta.size() != names.size() || cumulative.size() != names.size() ||
      batches.size() != names.size()) {
    throw CheckpointError(str(state_key(), ": the checkpoint names ", names.size(),
                              " frozen BatchNorm layers but holds ", momenta.size(), ", ",
                              cumulative.size(), " and ", batches.size(),
                              " of their momenta, kinds and counts: the file is damaged."));
  }
  for (size_t k = 0; k < names.size(); ++k) {
    FrozenNorm norm;
    if (cumulative[k] == 0) norm.momentum = momenta[k];
    norm.batches_tracked = batches[k];
    saved->frozen_norms[names[k]] = norm;
  }
  const StateDict& groups = state.section_at("added_groups");
  const int64_t optimizers = groups.integer("optimizers");
  for (int64_t i = 0; i < optimizers; ++i) {
    const StateDict& one = groups.section_at(std::to_string(i));
    auto& added = saved->added_groups.emplace_back();
    const int64_t count = one.integer("count");
    for (int64_t g = 0; g < count; ++g) added.push_back(one.strings(std::to_string(g)));
  }
  if (const StateDict* extra = state.find_section("extra")) load_extra_state(*extra);
  finetuned_epoch_ = epoch;
  if (module_ == nullptr) {
    // Outside a fit (the state a forked launcher's rank 0 sends back to
    // the caller's callback): what the run ended with, for state_dict().
    trainable_at_end_ = std::move(saved->trainable);
    added_groups_ = std::move(saved->added_groups);
    return;
  }
  saved_ = std::move(saved);
}

void BaseFinetuning::on_restore_optimizers(Trainer&, Module& module) {
  if (!saved_) return;  // the checkpoint's run had no such callback
  const std::shared_ptr<Saved> saved = std::move(saved_);
  auto misfit = [&](const std::string& what) {
    return CheckpointError(str(state_key(), ": ", what,
                               ". Resume with the model and optimizers "
                               "the checkpoint was saved with."));
  };
  // Which parameters train, as in the saved run.
  auto named = module.named_parameters();
  const std::set<std::string> trainable(saved->trainable.begin(), saved->trainable.end());
  for (const auto& name : trainable) {
    if (named.find(name) == nullptr) {
      throw misfit(str("the checkpoint's run trained parameter \"", name, "\", which module ",
                       module.name(), " does not have"));
    }
  }
  for (auto& item : named) item.value().requires_grad_(trainable.count(item.key()) != 0);

  // The BatchNorm layers frozen there, with their own momentum and count
  // from then (the module's buffers came from the checkpoint).
  {
    torch::NoGradGuard no_grad;
    std::set<std::string> found;
    for (const auto& item : module.named_modules("", /*include_self=*/false)) {
      auto norm = batch_norm(*item.value());
      if (!norm) continue;
      const std::string& name = item.key();
      auto was = saved->frozen_norms.find(name);
      auto now = frozen_norms_.find(name);
      if (was != saved->frozen_norms.end()) {
        found.insert(name);
        set_momentum(*norm, 0.0);
        frozen_norms_[name] = was->second;
      } else if (now != frozen_norms_.end()) {
        set_momentum(*norm, now->second.momentum);
        frozen_norms_.erase(now);
      }
    }
    for (const auto& [name, norm] : saved->frozen_norms) {
      if (found.count(name) == 0) {
        throw misfit(str("the checkpoint's run froze BatchNorm layer \"", name, "\", which module ",
                         module.name(), " does not have"));
      }
    }
  }

  // The parameter groups added there, in their order, before the
  // optimizers' states (which hold their options) load.
  const auto& optimizers = module.optimizers();
  for (size_t i = optimizers.size(); i < saved->added_groups.size(); ++i) {
    if (!saved->added_groups[i].empty()) {
      throw misfit(str("the checkpoint's run added parameter groups to optimizer ", i,
                       ", and configure_optimizers returned ", optimizers.size(), " optimizer(s)"));
    }
  }
  added_groups_.assign(optimizers.size(), {});
  for (size_t i = 0; i < optimizers.size() && i < saved->added_groups.size(); ++i) {
    torch::optim::Optimizer& optimizer = *optimizers[i];
    std::set<const c10::TensorImpl*> held = held_by(optimizer);
    for (const auto& names : saved->added_groups[i]) {
      std::vector<at::Tensor> params;
      for (const auto& name : names) {
        const at::Tensor* p = named.find(name);
        if (p == nullptr) {
          throw misfit(str("optimizer ", i, " had parameter \"", name,
                           "\" in a group it added, "
                           "which module ",
                           module.name(), " does not have"));
        }
        if (!held.insert(p->unsafeGetTensorImpl()).second) {
          throw misfit(str("optimizer ", i, " had parameter \"", name,
                           "\" in a group it added, and configure_optimizers put it in the "
                           "optimizer already (the run it was saved by gave it the trainable "
                           "parameters only)"));
        }
        params.push_back(*p);
      }
      optimizer.add_param_group(torch::optim::OptimizerParamGroup(std::move(params)));
    }
    added_groups_[i] = saved->added_groups[i];
  }
}

double multiplicative(int64_t /*epoch*/) { return 2.0; }

BackboneFinetuning::BackboneFinetuning(BackboneFinetuningOptions options)
    : options_(std::move(options)) {
  std::vector<std::string> problems;
  if (options_.unfreeze_backbone_at_epoch < 0) {
    problems.push_back(str("unfreeze_backbone_at_epoch=", options_.unfreeze_backbone_at_epoch,
                           ": pass 0 or more"));
  }
  if (!options_.lambda_func) {
    problems.push_back("lambda_func is empty: pass a function of the epoch (multiplicative: x2)");
  }
  if (!(std::isfinite(options_.backbone_initial_ratio_lr) &&
        options_.backbone_initial_ratio_lr > 0.0)) {
    problems.push_back(str("backbone_initial_ratio_lr=", options_.backbone_initial_ratio_lr,
                           ": pass a finite value > 0 (default 0.1)"));
  }
  if (options_.backbone_initial_lr &&
      !(std::isfinite(*options_.backbone_initial_lr) && *options_.backbone_initial_lr >= 0.0)) {
    problems.push_back(str("backbone_initial_lr=", *options_.backbone_initial_lr,
                           ": pass a finite value >= 0, or none for the head's x ratio"));
  }
  if (options_.backbone.empty()) {
    problems.push_back("backbone is empty: pass the submodule's name (\"backbone\")");
  }
  if (!problems.empty()) throw ConfigError(str("BackboneFinetuning(", join(problems, "; "), ")."));
}

torch::nn::Module& BackboneFinetuning::backbone_of(Module& module) const {
  std::vector<std::string> children;
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    if (item.key() == options_.backbone) return *item.value();
  }
  for (const auto& item : module.named_children()) children.push_back(item.key());
  throw ConfigError(
      str("BackboneFinetuning: module ", module.name(), " has no submodule \"", options_.backbone,
          "\" (its children: ", children.empty() ? std::string("none") : join(children),
          "). Register the part to fine-tune under that name in the constructor "
          "(register_module(\"backbone\", ...); it is frozen at setup, before "
          "configure_model), or pass BackboneFinetuningOptions::backbone."));
}

void BackboneFinetuning::freeze_before_training(Module& module) {
  backbone_lr_.reset();
  backbone_group_ = 0;
  freeze(backbone_of(module), options_.train_bn);
}

void BackboneFinetuning::on_fit_start(Trainer&, Module& module) {
  const size_t count = module.optimizers().size();
  if (count != 1) {
    throw ConfigError(str("BackboneFinetuning: configure_optimizers returned ", count,
                          " optimizers; it adds the backbone to one (with several, each would "
                          "step it). Return one optimizer, or write a BaseFinetuning that "
                          "picks one in finetune_function."));
  }
  // Found now rather than at the unfreezing epoch, hours in.
  const std::set<const c10::TensorImpl*> held = held_by(*module.optimizers().front());
  // The frozen parameters the optimizer holds, and those the unfreezing
  // epoch will add (frozen, not held): none of either (a backbone of no
  // parameters, or of BatchNorm layers alone, which train_bn keeps
  // training) would fail there.
  size_t frozen_held = 0, to_add = 0, in_all = 0;
  for (const auto& p : backbone_of(module).parameters()) {
    ++in_all;
    if (p.requires_grad()) continue;
    ++(held.count(p.unsafeGetTensorImpl()) != 0 ? frozen_held : to_add);
  }
  if (!backbone_lr_ && to_add == 0 && frozen_held == 0) {
    throw ConfigError(str(
        "BackboneFinetuning: the backbone \"", options_.backbone, "\" has ",
        in_all == 0
            ? std::string("no parameters")
            : str(in_all, " parameter(s), none of them frozen (train_bn=",
                  options_.train_bn ? "true keeps its BatchNorm layers training" : "false", ")"),
        ", so unfreeze_backbone_at_epoch=", options_.unfreeze_backbone_at_epoch,
        " would have nothing to add to the optimizer. Name a backbone with weights to fine-tune, "
        "or train without this callback."));
  }
  if (frozen_held > 0) {
    throw ConfigError(str("BackboneFinetuning: the optimizer holds ", frozen_held,
                          " of the frozen backbone's parameters (configure_optimizers gave it "
                          "every parameter), so the backbone could not train at a rate of its "
                          "own. Give the optimizer the parameters with requires_grad() only: "
                          "the backbone is frozen before configure_optimizers runs."));
  }
}

void BackboneFinetuning::finetune_function(Module& module, int64_t epoch,
                                           torch::optim::Optimizer& optimizer) {
  if (epoch < options_.unfreeze_backbone_at_epoch) return;
  auto& groups = optimizer.param_groups();
  const double head_lr = groups.front().options().get_lr();
  if (!backbone_lr_) {
    const double lr =
        options_.backbone_initial_lr.value_or(head_lr * options_.backbone_initial_ratio_lr);
    torch::nn::Module& backbone = backbone_of(module);
    const size_t added = unfreeze_and_add_param_group(backbone, optimizer, lr,
                                                      options_.initial_denom_lr, options_.train_bn);
    if (added == 0) {
      throw ConfigError(
          str("BackboneFinetuning: epoch ", epoch, ": the backbone \"", options_.backbone,
              "\" has no parameter to add to the optimizer (", backbone.parameters().size(),
              " in all, every one already in its groups). configure_optimizers gave the optimizer "
              "the frozen backbone too, so it cannot train at a rate of its own: give the "
              "optimizer the parameters with requires_grad() only."));
    }
    backbone_group_ = optimizer.param_groups().size() - 1;
    backbone_lr_ = lr;
  } else {
    if (backbone_group_ >= groups.size()) {
      throw ConfigError(str("BackboneFinetuning: epoch ", epoch,
                            ": the backbone's parameter group ", backbone_group_,
                            " is gone (the optimizer has ", groups.size(),
                            "). Leave the groups it adds in place (another callback or "
                            "finetune_function removed it)."));
    }
    const double factor = options_.lambda_func(epoch + 1);
    if (!(std::isfinite(factor) && factor >= 0.0)) {
      throw ConfigError(str("BackboneFinetuning: lambda_func(", epoch + 1, ") returned ", factor,
                            ", which would make the backbone's learning rate ",
                            factor * *backbone_lr_,
                            ". Return a finite factor >= 0 for every epoch."));
    }
    double next = factor * *backbone_lr_;
    if (options_.should_align && next > head_lr) next = head_lr;
    groups[backbone_group_].options().set_lr(next);
    backbone_lr_ = next;
  }
  if (options_.verbose && global_zero(module)) {
    detail::print_note(str("BackboneFinetuning: epoch ", epoch, ": head lr ", head_lr,
                           ", backbone lr ", *backbone_lr_));
  }
}

StateDict BackboneFinetuning::extra_state() const {
  StateDict state;
  if (backbone_lr_) state.set("backbone_lr", *backbone_lr_);
  state.set("backbone_group", static_cast<int64_t>(backbone_group_));
  return state;
}

void BackboneFinetuning::load_extra_state(const StateDict& state) {
  backbone_lr_.reset();
  if (state.contains("backbone_lr")) backbone_lr_ = state.real("backbone_lr");
  backbone_group_ = static_cast<size_t>(state.integer("backbone_group"));
}

}  // namespace fulgur
