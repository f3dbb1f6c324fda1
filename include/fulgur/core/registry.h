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
      throw ConfigError(str("register ", kind_, " \"\": a ", kind_,
                            " needs a non-empty name."));
    }
    if (contains(name)) {
      throw ConfigError(str("register ", kind_, " \"", name, "\": a ", kind_,
                            " with this name is already registered (",
                            entries_.at(name).description,
                            "). Pick another name, or call replace() to "
                            "override it on purpose."));
    }
    entries_.emplace(name, Entry{name, std::move(description), std::move(factory),
                                 std::move(defaults)});
  }

  /// Adds or overrides `name`.
  void replace(const std::string& name, std::string description, Factory factory,
               std::string defaults = {}) {
    entries_.insert_or_assign(name, Entry{name, std::move(description), std::move(factory),
                                          std::move(defaults)});
  }

  bool contains(const std::string& name) const { return entries_.count(name) > 0; }

  /// Builds the entry `name`; never returns null. Throws ConfigError naming
  /// the closest registered name when `name` is unknown.
  std::unique_ptr<Base> create(const std::string& name, Args... args) const {
    auto result = entry(name).factory(std::forward<Args>(args)...);
    FULGUR_ASSERT(result != nullptr, "the factory of ", kind_, " \"", name,
                  "\" returned null");
    return result;
  }

  /// The entry `name`; throws ConfigError when unknown.
  const Entry& entry(const std::string& name) const {
    auto it = entries_.find(name);
    if (it == entries_.end()) throw ConfigError(unknown_name_message(name));
    return it->second;
  }

  /// "unknown strategy "dpp"; did you mean "ddp"? Registered: ddp, ...".
  std::string unknown_name_message(const std::string& name) const {
    auto known = names();
    auto guess = closest_match(name, known);
    return str("unknown ", kind_, " \"", name, "\"",
               guess.empty() ? std::string() : str("; did you mean \"", guess, "\"?"),
               guess.empty() ? ". " : " ", "Registered: ", join(known), ".");
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
