// File: fulgur/data/batch.h
//
// A Batch is what a DataLoader yields and what the Module's steps receive:
// one tensor, an (input, target) pair, a list of tensors, or a string-keyed
// map of tensors. The strategy moves every tensor in it to the right device.
//
//   torch::Tensor training_step(fulgur::Batch& batch, int64_t) override {
//     auto& [x, y] = batch.pair();
//     return torch::nn::functional::cross_entropy(net->forward(x), y);
//   }
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace fulgur {

class Batch {
 public:
  using Pair = std::pair<at::Tensor, at::Tensor>;
  using List = std::vector<at::Tensor>;
  using Map = std::map<std::string, at::Tensor>;

  Batch() = default;
  Batch(at::Tensor t) : value_(std::move(t)) {}  // NOLINT: implicit on purpose
  Batch(at::Tensor input, at::Tensor target) : value_(Pair(std::move(input), std::move(target))) {}
  Batch(Pair p) : value_(std::move(p)) {}  // NOLINT
  Batch(List l) : value_(std::move(l)) {}  // NOLINT
  Batch(Map m) : value_(std::move(m)) {}   // NOLINT

  bool is_tensor() const { return std::holds_alternative<at::Tensor>(value_); }
  bool is_pair() const { return std::holds_alternative<Pair>(value_); }
  bool is_list() const { return std::holds_alternative<List>(value_); }
  bool is_map() const { return std::holds_alternative<Map>(value_); }

  /// The single tensor; throws ConfigError if the batch is another kind.
  at::Tensor& tensor();
  const at::Tensor& tensor() const;
  /// The (input, target) pair; throws ConfigError if the batch is another kind.
  Pair& pair();
  const Pair& pair() const;
  List& list();
  const List& list() const;
  Map& map();
  const Map& map() const;

  /// Element `i` of a pair (0 or 1) or a list.
  const at::Tensor& operator[](size_t i) const;
  /// Entry `key` of a map; throws ConfigError naming the keys present.
  const at::Tensor& operator[](const std::string& key) const;

  /// Number of tensors held.
  size_t num_tensors() const;
  /// Size of dimension 0 of the first tensor (0 for an empty batch).
  int64_t batch_size() const;
  /// "tensor", "pair", "list" or "map".
  const char* kind() const;

  /// Calls `fn` on every tensor, in order.
  void for_each(const std::function<void(const at::Tensor&)>& fn) const;
  /// A batch of the same shape with every defined tensor replaced by
  /// `fn(tensor)` (an undefined member, e.g. a batch without targets, stays
  /// undefined: for_each still visits it).
  Batch map_tensors(const std::function<at::Tensor(const at::Tensor&)>& fn) const;
  /// Every tensor moved to `device` (a no-op for tensors already there).
  Batch to(c10::Device device, bool non_blocking = false) const;

 private:
  std::variant<at::Tensor, Pair, List, Map> value_;
};

}  // namespace fulgur
