// File: fulgur/core/state_dict.h
//
// StateDict: the state of a component, as a checkpoint holds it. Named
// entries in the order they were set; each is a value (a tensor, a number, a
// string, a list of them: an IValue) or a nested StateDict. The Trainer
// builds one for the whole run from its parts (module, optimizers,
// schedulers, loops, callbacks, loggers, RNGs) and hands it to the
// CheckpointIO, the one place where it becomes a file; a load gives one back.
//
//   fulgur::StateDict state_dict() const override {   // in a Callback
//     fulgur::StateDict state;
//     state.set("count", count_);
//     state.set("history", history_);                  // a tensor
//     return state;
//   }
//   void load_state_dict(const fulgur::StateDict& state) override {
//     count_ = state.integer("count");                 // CheckpointError when
//     history_ = state.tensor("history");              // absent or another kind
//   }
//
// A required read that finds nothing, or something else, throws
// CheckpointError naming the entry's path ("callbacks/Timer/elapsed"), what
// is there, and what the dict holds. Optional entries: find() and
// find_section() return nullptr.
//
// write_archive/read_archive convert to and from LibTorch's archive (the
// layout of checkpoints since format version 1: a section is a nested
// archive, a tensor an archive tensor, anything else an archive value).
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace fulgur {

class StateDict {
 public:
  StateDict();
  ~StateDict();
  StateDict(const StateDict& other);
  StateDict& operator=(const StateDict& other);
  StateDict(StateDict&& other) noexcept;
  StateDict& operator=(StateDict&& other) noexcept;

  // ---- Writing. A key set again is replaced in place (its position kept).

  /// A value: a tensor (a module parameter when archived), a number, a
  /// bool, a string, a list or tuple of them. An object or a module is
  /// refused (ConfigError).
  void set(const std::string& key, c10::IValue value);
  /// A tensor recorded as a module buffer, not a parameter (what
  /// nn::Module::save marks; the archive keeps the difference).
  void set_buffer(const std::string& key, at::Tensor tensor);
  /// A tensor recorded as a plain value of the archive, neither parameter
  /// nor buffer (as LibTorch's optimizers write their state tensors). A
  /// tensor given to set() is archived as a module parameter.
  void set_plain(const std::string& key, at::Tensor tensor);
  /// The nested dict under `key`, created empty when there is none (a value
  /// under `key` is replaced).
  StateDict& section(const std::string& key);
  void set_section(const std::string& key, StateDict state);
  /// Removes `key`; false when there was none.
  bool erase(const std::string& key);

  // ---- Reading.

  bool contains(const std::string& key) const;
  /// The value under `key`; nullptr when there is none or it is a section.
  const c10::IValue* find(const std::string& key) const;
  /// The section under `key`; nullptr when there is none or it is a value.
  const StateDict* find_section(const std::string& key) const;
  StateDict* find_section(const std::string& key);
  /// Required entries: CheckpointError when absent or of another kind.
  const c10::IValue& at(const std::string& key) const;
  at::Tensor tensor(const std::string& key) const;
  int64_t integer(const std::string& key) const;
  /// A double (an integer is converted).
  double real(const std::string& key) const;
  bool boolean(const std::string& key) const;
  std::string string(const std::string& key) const;
  std::vector<int64_t> integers(const std::string& key) const;
  std::vector<double> reals(const std::string& key) const;
  /// Set as a c10::List<std::string>.
  std::vector<std::string> strings(const std::string& key) const;
  const StateDict& section_at(const std::string& key) const;
  /// Whether the tensor under `key` was set with set_buffer / set_plain.
  /// (A state read from an archive cannot tell: its tensors read as set().)
  bool is_buffer(const std::string& key) const;
  bool is_plain(const std::string& key) const;

  /// The keys, in the order they were first set.
  std::vector<std::string> keys() const;
  size_t size() const;
  bool empty() const;

  /// Where this dict sits in the state it was read from ("callbacks/EMA"),
  /// for error messages; empty at the top. Sections get theirs from the
  /// key they are under.
  const std::string& path() const { return path_; }
  void set_path(std::string path);

  /// Calls `fn` on every tensor (in sections, lists, tuples and dicts too)
  /// in order, replacing each with what `fn` returns.
  void transform_tensors(const std::function<at::Tensor(const at::Tensor&)>& fn);
  /// Calls `fn` on every tensor, in the same order.
  void for_each_tensor(const std::function<void(const at::Tensor&)>& fn) const;

 private:
  struct Entry;
  friend StateDict read_archive(torch::serialize::InputArchive& archive, const std::string& path);
  Entry& slot(const std::string& key);
  const Entry& required(const std::string& key, const char* kind) const;
  [[noreturn]] void wrong_kind(const std::string& key, const Entry* found, const char* kind) const;
  std::string key_path(const std::string& key) const;

  std::vector<Entry> entries_;
  std::unordered_map<std::string, size_t> index_;
  std::string path_;
};

/// Writes `state` into `archive` (sections as nested archives).
void write_archive(const StateDict& state, torch::serialize::OutputArchive& archive);
/// The state `archive` holds (nested archives as sections); `path` names it
/// in error messages.
StateDict read_archive(torch::serialize::InputArchive& archive, const std::string& path = "");
/// `state` as the bytes of a LibTorch archive, and back (what one process
/// sends another).
std::string to_bytes(const StateDict& state);
StateDict from_bytes(const std::string& bytes);

}  // namespace fulgur
