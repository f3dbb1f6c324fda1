// File: fulgur/core/registry.h
//
// One registry template for every named family (strategies, accelerators,
// precision plugins, cluster environments, checkpoint IO). An entry is a
// name, a one-line description and a factory; the factory captures the
// variant's options, so `ddp_spawn` and `ddp` are two entries building the
// same class with different options.
//
//   fulgur::strategy_registry().add(
//       "my_ddp", "DDP with my bucket size",
//       [] { return std::make_unique<MyStrategy>(); });
//   fulgur::Trainer trainer({.strategy = "my_ddp"});
//
// No static-initialisation macros: built-ins are registered in one place per
// family and users call add() from their own code before building a Trainer.
// Names match regardless of case ("DDP", "Ddp_Spawn"), as Lightning's do; two
// names that differ only in case cannot both be registered.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fulgur/core/errors.h"

namespace fulgur {

template <class Base, class... Args>
class Registry {
 public:
  using Factory = std::function<std::unique_ptr<Base>(Args...)>;

  struct Entry {
    std::string name;
    std::string description;
    Factory factory;
    /// The arguments the factory passes ("start_method=fork, ..."), for
    /// listings; empty when it takes none.
    std::string defaults;
  };

  /// `kind` names the family in messages ("strategy", "accelerator").
  explicit Registry(std::string kind) : kind_(std::move(kind)) {}

  /// Adds `name`. Throws ConfigError if it is already registered; use
  /// replace() to override an entry on purpose.
  void add(const std::string& name, std::string description, Factory factory,
           std::string defaults = {}) {
    if (name.empty()) {
      throw ConfigError(str("register ", kind_, " \"\": a ", kind_, " needs a non-empty name."));
    }
    if (const Entry* existing = find(name)) {
      throw ConfigError(str("register ", kind_, " \"", name, "\": a ", kind_, " with this name",
                            existing->name == name ? "" : " (in another case)",
                            " is already registered (", existing->description,
                            "). Pick another name, or call replace() to "
                            "override it on purpose."));
    }
    entries_.emplace(name,
                     Entry{name, std::move(description), std::move(factory), std::move(defaults)});
  }

  /// Adds or overrides `name`.
  void replace(const std::string& name, std::string description, Factory factory,
               std::string defaults = {}) {
    if (const Entry* existing = find(name)) {
      const std::string old_name = existing->name;  // a copy: erase() frees the entry
      entries_.erase(old_name);
    }
    entries_.insert_or_assign(
        name, Entry{name, std::move(description), std::move(factory), std::move(defaults)});
  }

  bool contains(const std::string& name) const { return find(name) != nullptr; }

  /// Builds the entry `name`; never returns null. Throws ConfigError naming
  /// the closest registered name when `name` is unknown.
  std::unique_ptr<Base> create(const std::string& name, Args... args) const {
    auto result = entry(name).factory(std::forward<Args>(args)...);
    FULGUR_ASSERT(result != nullptr, "the factory of ", kind_, " \"", name, "\" returned null");
    return result;
  }

  /// The entry `name`; throws ConfigError when unknown.
  const Entry& entry(const std::string& name) const {
    const Entry* found = find(name);
    if (found == nullptr) throw ConfigError(unknown_name_message(name));
    return *found;
  }
  /// The entry `name` (in any case); null when unknown.
  const Entry* find(const std::string& name) const {
    if (auto it = entries_.find(name); it != entries_.end()) return &it->second;
    const std::string lower = to_lower(name);
    for (const auto& [key, e] : entries_) {
      if (to_lower(key) == lower) return &e;
    }
    return nullptr;
  }

  /// "unknown strategy "dpp"; did you mean "ddp"? Registered: ddp, ...".
  std::string unknown_name_message(const std::string& name) const {
    auto known = names();
    return str("unknown ", kind_, " \"", shortened(name), "\"", did_you_mean(name, known),
               "Registered: ", join(known), ".");
  }

  /// Registered names, sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, _] : entries_) out.push_back(name);
    return out;
  }

  /// Registered entries, sorted by name.
  std::vector<const Entry*> entries() const {
    std::vector<const Entry*> out;
    for (const auto& [_, e] : entries_) out.push_back(&e);
    return out;
  }

  const std::string& kind() const { return kind_; }

 private:
  std::string kind_;
  std::map<std::string, Entry> entries_;
};

}  // namespace fulgur
