#include "fulgur/data/batch.h"

#include "fulgur/core/errors.h"

namespace fulgur {

namespace {
template <class T>
T& expect(std::variant<at::Tensor, Batch::Pair, Batch::List, Batch::Map>& value, const char* wanted,
          const char* have) {
  if (auto* p = std::get_if<T>(&value)) return *p;
  throw ConfigError(str("Batch::", wanted, "(): this batch is a ", have, ", not a ", wanted,
                        ". Use batch.", have, "() or check what the DataLoader yields."));
}
}  // namespace

const char* Batch::kind() const {
  switch (value_.index()) {
    case 0: return "tensor";
    case 1: return "pair";
    case 2: return "list";
    default: return "map";
  }
}

at::Tensor& Batch::tensor() { return expect<at::Tensor>(value_, "tensor", kind()); }
const at::Tensor& Batch::tensor() const { return const_cast<Batch*>(this)->tensor(); }
Batch::Pair& Batch::pair() { return expect<Pair>(value_, "pair", kind()); }
const Batch::Pair& Batch::pair() const { return const_cast<Batch*>(this)->pair(); }
Batch::List& Batch::list() { return expect<List>(value_, "list", kind()); }
const Batch::List& Batch::list() const { return const_cast<Batch*>(this)->list(); }
Batch::Map& Batch::map() { return expect<Map>(value_, "map", kind()); }
const Batch::Map& Batch::map() const { return const_cast<Batch*>(this)->map(); }

const at::Tensor& Batch::operator[](size_t i) const {
  if (const auto* p = std::get_if<Pair>(&value_)) {
    if (i < 2) return i == 0 ? p->first : p->second;
  } else if (const auto* l = std::get_if<List>(&value_)) {
    if (i < l->size()) return (*l)[i];
  } else {
    throw ConfigError(str("batch[", i, "]: this batch is a ", kind(),
                          "; integer indexing works on pairs and lists."));
  }
  throw ConfigError(
      str("batch[", i, "]: index out of range; the batch holds ", num_tensors(), " tensors."));
}

const at::Tensor& Batch::operator[](const std::string& key) const {
  const auto* m = std::get_if<Map>(&value_);
  if (m == nullptr) {
    throw ConfigError(str("batch[\"", key, "\"]: this batch is a ", kind(),
                          "; string keys work on map batches."));
  }
  auto it = m->find(key);
  if (it == m->end()) {
    std::vector<std::string> keys;
    for (const auto& [k, _] : *m) keys.push_back(k);
    throw ConfigError(str("batch[\"", key, "\"]: no such key. The batch has: ", join(keys), "."));
  }
  return it->second;
}

size_t Batch::num_tensors() const {
  switch (value_.index()) {
    case 0: return std::get<0>(value_).defined() ? 1 : 0;
    case 1: return 2;
    case 2: return std::get<2>(value_).size();
    default: return std::get<3>(value_).size();
  }
}

void Batch::for_each(const std::function<void(const at::Tensor&)>& fn) const {
  std::visit(
      [&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, at::Tensor>) {
          if (v.defined()) fn(v);
        } else if constexpr (std::is_same_v<T, Pair>) {
          fn(v.first);
          fn(v.second);
        } else if constexpr (std::is_same_v<T, List>) {
          for (const auto& t : v) fn(t);
        } else {
          for (const auto& [_, t] : v) fn(t);
        }
      },
      value_);
}

int64_t Batch::batch_size() const {
  int64_t size = -1;
  for_each([&](const at::Tensor& t) {
    if (size < 0 && t.defined()) size = t.dim() > 0 ? t.size(0) : 1;
  });
  return size < 0 ? 0 : size;
}

Batch Batch::map_tensors(const std::function<at::Tensor(const at::Tensor&)>& fn) const {
  // An undefined member (a batch without targets) stays undefined.
  auto apply = [&fn](const at::Tensor& t) { return t.defined() ? fn(t) : t; };
  return std::visit(
      [&](const auto& v) -> Batch {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, at::Tensor>) {
          return Batch(apply(v));
        } else if constexpr (std::is_same_v<T, Pair>) {
          return Batch(Pair(apply(v.first), apply(v.second)));
        } else if constexpr (std::is_same_v<T, List>) {
          List out;
          out.reserve(v.size());
          for (const auto& t : v) out.push_back(apply(t));
          return Batch(std::move(out));
        } else {
          Map out;
          for (const auto& [k, t] : v) out.emplace(k, apply(t));
          return Batch(std::move(out));
        }
      },
      value_);
}

Batch Batch::to(c10::Device device, bool non_blocking) const {
  return map_tensors(
      [&](const at::Tensor& t) { return t.device() == device ? t : t.to(device, non_blocking); });
}

}  // namespace fulgur
