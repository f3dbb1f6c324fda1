#include "fulgur/core/state_dict.h"

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>

#include <algorithm>
#include <initializer_list>
#include <set>
#include <sstream>
#include <string_view>
#include <utility>

#include "fulgur/core/errors.h"

namespace fulgur {

struct StateDict::Entry {
  Entry() = default;
  Entry(const Entry& other)
      : key(other.key),
        value(other.value),
        section(other.section ? std::make_unique<StateDict>(*other.section) : nullptr),
        buffer(other.buffer),
        plain(other.plain) {}
  Entry& operator=(const Entry& other) {
    if (this != &other) *this = Entry(other);
    return *this;
  }
  Entry(Entry&&) noexcept = default;
  Entry& operator=(Entry&&) noexcept = default;

  std::string key;
  c10::IValue value;                  // when section is null
  std::unique_ptr<StateDict> section;
  bool buffer = false;  // a tensor archived as a module buffer
  bool plain = false;   // a tensor archived as a plain value
};

namespace {

// Makes entry `e` hold `value` (no section), archived as a module parameter,
// a buffer or a plain value. (A template: the entry type is StateDict's own.)
template <class Entry>
void hold(Entry& e, c10::IValue value, bool buffer, bool plain) {
  e.value = std::move(value);
  e.section.reset();
  e.buffer = buffer;
  e.plain = plain;
}

void check_extent(const at::Tensor& t, const std::string& key);

// A sparse tensor (`kind`): each of its `parts` checked as a tensor of its
// own, then its indices against its sizes by LibTorch's own check
// (`validate`).
void check_sparse(const at::Tensor& t, const std::string& key, const char* kind,
                  std::initializer_list<std::pair<const char*, at::Tensor>> parts,
                  const std::function<void()>& validate) {
  for (const auto& [what, part] : parts) check_extent(part, key + " (its " + what + ")");
  try {
    validate();
  } catch (const c10::Error& e) {
    throw CheckpointError(::fulgur::str(
        "entry \"", key, "\": a ", kind, " whose indices do not fit its sizes ", t.sizes(), " (",
        e.what_without_backtrace(),
        "): the file was not written by fulgur's save of it. Pass a checkpoint written by "
        "fulgur."));
  }
}

// Refuses a tensor read from a file that reaches past its storage: the
// file's description (sizes, strides, offset) is what a crafted file or
// another writer makes up, and reading the tensor would read past the
// storage's bytes. A file's checksums do not rule it out.
void check_extent(const at::Tensor& t, const std::string& key) {
  if (!t.defined()) return;
  if (t.is_sparse()) {
    check_sparse(
        t, key, "sparse tensor", {{"indices", t._indices()}, {"values", t._values()}},
        [&] { at::_validate_sparse_coo_tensor_args(t._indices(), t._values(), t.sizes()); });
    return;
  }
  if (t.layout() == at::kSparseCsr) {
    check_sparse(t, key, "sparse CSR tensor",
                 {{"row offsets", t.crow_indices()},
                  {"column indices", t.col_indices()},
                  {"values", t.values()}},
                 [&] {
                   at::_validate_sparse_csr_tensor_args(t.crow_indices(), t.col_indices(),
                                                        t.values(), t.sizes());
                 });
    return;
  }
  if (t.layout() != at::kStrided || !t.has_storage() || t.numel() == 0) return;
  // Sub-byte quantized types pack several elements in a byte.
  const int64_t per_byte = t.scalar_type() == at::kQUInt4x2   ? 2
                           : t.scalar_type() == at::kQUInt2x4 ? 4
                                                              : 1;
  const int64_t item = static_cast<int64_t>(t.element_size());
  const int64_t holds = static_cast<int64_t>(t.storage().nbytes());
  // The last element's index in the storage, then the bytes up to its end.
  int64_t last = t.storage_offset();
  bool overflows = last < 0;
  for (int64_t d = 0; d < t.dim() && !overflows; ++d) {
    int64_t step = 0;
    overflows = t.stride(d) < 0 || __builtin_mul_overflow(t.size(d) - 1, t.stride(d), &step) ||
                __builtin_add_overflow(last, step, &last);
  }
  int64_t reaches = 0;
  overflows = overflows || __builtin_add_overflow(last, 1, &last) ||
              __builtin_mul_overflow(last, item, &reaches);
  if (!overflows && per_byte > 1) reaches = (last + per_byte - 1) / per_byte;
  if (!overflows && reaches <= holds) return;
  throw CheckpointError(::fulgur::str(
      "entry \"", key, "\": a tensor of sizes ", t.sizes(), ", strides ", t.strides(), ", offset ",
      t.storage_offset(), " and ", item, " bytes per element reaches ",
      (overflows ? std::string("beyond any size (its arithmetic overflows)")
                 : ::fulgur::str(reaches, " bytes")),
      " of its storage, which holds ", holds,
      ": the file was not written by LibTorch's save of this tensor (it was crafted, or written "
      "by another tool). Pass a checkpoint written by fulgur."));
}

void check_extents(const c10::IValue& value, const std::string& key) {
  if (value.isTensor()) {
    check_extent(value.toTensor(), key);
  } else if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorVector()) check_extent(t, key);
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) check_extents(item, key);
  } else if (value.isTuple()) {
    for (const c10::IValue& item : value.toTupleRef().elements()) check_extents(item, key);
  } else if (value.isGenericDict()) {
    for (const auto& item : value.toGenericDict()) {
      check_extents(item.key(), key);
      check_extents(item.value(), key);
    }
  }
}

}  // namespace

StateDict::StateDict() = default;
StateDict::~StateDict() = default;
StateDict::StateDict(const StateDict& other) = default;
StateDict& StateDict::operator=(const StateDict& other) = default;
StateDict::StateDict(StateDict&& other) noexcept = default;
StateDict& StateDict::operator=(StateDict&& other) noexcept = default;

namespace {

// "training" is the flag every LibTorch archive carries itself.
void check_key(const std::string& key, const std::string& where) {
  if (key.empty() || key == "training") {
    throw ConfigError(str("StateDict: the key \"", key, "\"", where.empty() ? "" : " in \"",
                          where, where.empty() ? "" : "\"",
                          key.empty() ? " is empty" : " is reserved by LibTorch's archives",
                          ". Name the entry otherwise."));
  }
}

std::string kind_of(const c10::IValue& value) {
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    if (!t.defined()) return "an undefined tensor";
    return ::fulgur::str("a tensor (", c10::toString(t.scalar_type()), t.sizes(), ")");
  }
  if (value.isInt()) return str("an integer (", value.toInt(), ")");
  if (value.isDouble()) return str("a number (", value.toDouble(), ")");
  if (value.isBool()) return str("a bool (", value.toBool() ? "true" : "false", ")");
  if (value.isString()) return str("a string (\"", value.toStringRef(), "\")");
  if (value.isNone()) return "None";
  return str("a ", value.tagKind());
}

// Whether `value` may be saved: anything made of tensors, numbers, strings
// and containers; never an object (a module, a custom class).
bool storable(const c10::IValue& value) {
  if (value.isObject() || value.isModule() || value.isCapsule() || value.isFuture() ||
      value.isPyObject() || value.isRRef() || value.isEnum()) {
    return false;
  }
  if (value.isList()) {
    for (const c10::IValue& element : value.toListRef()) {
      if (!storable(element)) return false;
    }
  }
  if (value.isTuple()) {
    for (const c10::IValue& element : value.toTupleRef().elements()) {
      if (!storable(element)) return false;
    }
  }
  if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) {
      if (!storable(entry.value())) return false;
    }
  }
  return true;
}

// A copy of `value` in which every tensor is fn(tensor); containers are
// rebuilt, never changed in place (a caller may still hold the list it set).
c10::IValue with_tensors(const c10::IValue& value,
                         const std::function<at::Tensor(const at::Tensor&)>& fn) {
  if (value.isTensor()) return fn(value.toTensor());
  if (value.isTensorList()) {
    c10::List<at::Tensor> out;
    for (at::Tensor t : value.toTensorList()) out.push_back(fn(t));  // by value: proxies
    return out;
  }
  if (value.isList()) {
    auto list = value.toList();
    c10::impl::GenericList out(list.elementType());
    out.reserve(list.size());
    for (c10::IValue element : list) out.push_back(with_tensors(element, fn));
    return out;
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const c10::IValue& element : value.toTupleRef().elements()) {
      elements.push_back(with_tensors(element, fn));
    }
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  if (value.isGenericDict()) {
    auto dict = value.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& entry : dict) out.insert(entry.key(), with_tensors(entry.value(), fn));
    return out;
  }
  return value;
}

void visit_tensors(const c10::IValue& value, const std::function<void(const at::Tensor&)>& fn) {
  if (value.isTensor()) {
    fn(value.toTensor());
  } else if (value.isTensorList()) {
    for (at::Tensor t : value.toTensorList()) fn(t);
  } else if (value.isList()) {
    for (const c10::IValue& element : value.toListRef()) visit_tensors(element, fn);
  } else if (value.isTuple()) {
    for (const c10::IValue& element : value.toTupleRef().elements()) visit_tensors(element, fn);
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) visit_tensors(entry.value(), fn);
  }
}

}  // namespace

std::string StateDict::key_path(const std::string& key) const {
  return path_.empty() ? key : path_ + "/" + key;
}

void StateDict::set_path(std::string path) {
  path_ = std::move(path);
  for (auto& e : entries_) {
    if (e.section) e.section->set_path(key_path(e.key));
  }
}

StateDict::Entry& StateDict::slot(const std::string& key) {
  check_key(key, path_);
  if (auto it = index_.find(key); it != index_.end()) return entries_[it->second];
  index_.emplace(key, entries_.size());
  entries_.emplace_back();
  entries_.back().key = key;
  return entries_.back();
}

void StateDict::set(const std::string& key, c10::IValue value) {
  if (!storable(value)) {
    throw ConfigError(str("StateDict: \"", key_path(key), "\" is ", kind_of(value),
                          ", which a checkpoint cannot hold. Save tensors, numbers, bools, "
                          "strings and lists of them; nest a StateDict with section()."));
  }
  hold(slot(key), std::move(value), /*buffer=*/false, /*plain=*/false);
}

void StateDict::set_buffer(const std::string& key, at::Tensor tensor) {
  hold(slot(key), std::move(tensor), /*buffer=*/true, /*plain=*/false);
}

void StateDict::set_plain(const std::string& key, at::Tensor tensor) {
  hold(slot(key), std::move(tensor), /*buffer=*/false, /*plain=*/true);
}

StateDict& StateDict::section(const std::string& key) {
  Entry& e = slot(key);
  if (!e.section) {
    hold(e, c10::IValue(), false, false);
    e.section = std::make_unique<StateDict>();
    e.section->set_path(key_path(key));
  }
  return *e.section;
}

void StateDict::set_section(const std::string& key, StateDict state) {
  Entry& e = slot(key);
  hold(e, c10::IValue(), false, false);
  e.section = std::make_unique<StateDict>(std::move(state));
  e.section->set_path(key_path(key));
}

bool StateDict::erase(const std::string& key) {
  auto it = index_.find(key);
  if (it == index_.end()) return false;
  entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(it->second));
  index_.clear();
  for (size_t i = 0; i < entries_.size(); ++i) index_.emplace(entries_[i].key, i);
  return true;
}

bool StateDict::contains(const std::string& key) const { return index_.count(key) != 0; }

const c10::IValue* StateDict::find(const std::string& key) const {
  auto it = index_.find(key);
  if (it == index_.end() || entries_[it->second].section) return nullptr;
  return &entries_[it->second].value;
}

const StateDict* StateDict::find_section(const std::string& key) const {
  auto it = index_.find(key);
  if (it == index_.end()) return nullptr;
  return entries_[it->second].section.get();
}

StateDict* StateDict::find_section(const std::string& key) {
  auto it = index_.find(key);
  if (it == index_.end()) return nullptr;
  return entries_[it->second].section.get();
}

void StateDict::wrong_kind(const std::string& key, const Entry* found, const char* kind) const {
  if (found == nullptr) {
    const auto present = keys();
    throw CheckpointError(str("checkpoint entry \"", key_path(key), "\" (", kind,
                              ") is missing; ", path_.empty() ? "the checkpoint" : "\"" + path_ + "\"",
                              " holds ", present.empty() ? std::string("nothing") : join(present),
                              ". It was saved by another version of this component or by a "
                              "different one: resume with the components it was saved with."));
  }
  throw CheckpointError(str("checkpoint entry \"", key_path(key), "\" is ",
                            found->section ? std::string("a section") : kind_of(found->value),
                            " where ", kind,
                            " was expected. It was saved by another version of this component "
                            "or by a different one: resume with the components it was saved "
                            "with."));
}

const StateDict::Entry& StateDict::required(const std::string& key, const char* kind) const {
  auto it = index_.find(key);
  if (it == index_.end()) wrong_kind(key, nullptr, kind);
  return entries_[it->second];
}

const c10::IValue& StateDict::at(const std::string& key) const {
  const Entry& e = required(key, "a value");
  if (e.section) wrong_kind(key, &e, "a value");
  return e.value;
}

at::Tensor StateDict::tensor(const std::string& key) const {
  const Entry& e = required(key, "a tensor");
  if (e.section || !e.value.isTensor()) wrong_kind(key, &e, "a tensor");
  return e.value.toTensor();
}

int64_t StateDict::integer(const std::string& key) const {
  const Entry& e = required(key, "an integer");
  if (e.section || !e.value.isInt()) wrong_kind(key, &e, "an integer");
  return e.value.toInt();
}

double StateDict::real(const std::string& key) const {
  const Entry& e = required(key, "a number");
  if (!e.section && e.value.isDouble()) return e.value.toDouble();
  if (!e.section && e.value.isInt()) return static_cast<double>(e.value.toInt());
  wrong_kind(key, &e, "a number");
}

bool StateDict::boolean(const std::string& key) const {
  const Entry& e = required(key, "a bool");
  if (e.section || !e.value.isBool()) wrong_kind(key, &e, "a bool");
  return e.value.toBool();
}

std::string StateDict::string(const std::string& key) const {
  const Entry& e = required(key, "a string");
  if (e.section || !e.value.isString()) wrong_kind(key, &e, "a string");
  return e.value.toStringRef();
}

std::vector<int64_t> StateDict::integers(const std::string& key) const {
  const Entry& e = required(key, "a list of integers");
  if (e.section || !e.value.isIntList()) wrong_kind(key, &e, "a list of integers");
  return e.value.toIntVector();
}

std::vector<double> StateDict::reals(const std::string& key) const {
  const Entry& e = required(key, "a list of numbers");
  if (e.section || !e.value.isDoubleList()) wrong_kind(key, &e, "a list of numbers");
  return e.value.toDoubleVector();
}

std::vector<std::string> StateDict::strings(const std::string& key) const {
  const Entry& e = required(key, "a list of strings");
  bool ok = !e.section && e.value.isList();
  if (ok) {
    for (const auto& v : e.value.toListRef()) ok = ok && v.isString();
  }
  if (!ok) wrong_kind(key, &e, "a list of strings");
  std::vector<std::string> out;
  for (const auto& v : e.value.toListRef()) out.push_back(v.toStringRef());
  return out;
}

const StateDict& StateDict::section_at(const std::string& key) const {
  const Entry& e = required(key, "a section");
  if (!e.section) wrong_kind(key, &e, "a section");
  return *e.section;
}

bool StateDict::is_buffer(const std::string& key) const {
  auto it = index_.find(key);
  return it != index_.end() && entries_[it->second].buffer;
}

bool StateDict::is_plain(const std::string& key) const {
  auto it = index_.find(key);
  return it != index_.end() && entries_[it->second].plain;
}

size_t StateDict::size() const { return entries_.size(); }

bool StateDict::empty() const { return entries_.empty(); }

std::vector<std::string> StateDict::keys() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& e : entries_) out.push_back(e.key);
  return out;
}

void StateDict::transform_tensors(const std::function<at::Tensor(const at::Tensor&)>& fn) {
  for (auto& e : entries_) {
    if (e.section) {
      e.section->transform_tensors(fn);
    } else {
      e.value = with_tensors(e.value, fn);
    }
  }
}

void StateDict::for_each_tensor(const std::function<void(const at::Tensor&)>& fn) const {
  for (const auto& e : entries_) {
    if (e.section) {
      e.section->for_each_tensor(fn);
    } else {
      visit_tensors(e.value, fn);
    }
  }
}

// ---- LibTorch archives.

namespace {

// An archive names each entry as an attribute in the TorchScript code it
// writes, which a keyword ("class", "in"), a name of its own ("__buffers__")
// or a quote, backslash or line break breaks: the file saved and verified,
// and never loaded. Such a key is written as kEscaped + the hex of its bytes
// (a name the reader turns back); so is a key that starts with kEscaped.
constexpr std::string_view kEscaped = "fulgur_k_";

bool archive_safe(const std::string& key) {
  static const std::set<std::string, std::less<>> keywords = {
      "False", "None",     "True",  "and",    "as",   "assert", "async",  "await",    "break",
      "class", "continue", "def",   "del",    "elif", "else",   "except", "finally",  "for",
      "from",  "global",   "if",    "import", "in",   "is",     "lambda", "nonlocal", "not",
      "or",    "pass",     "raise", "return", "try",  "while",  "with",   "yield"};
  if (keywords.count(key) != 0 || key.rfind("__", 0) == 0 || key.rfind(kEscaped, 0) == 0) {
    return false;
  }
  return std::none_of(key.begin(), key.end(), [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return c == '"' || c == '\\' || c == '\'' || u < 0x20 || u == 0x7f;
  });
}

std::string archive_key(const std::string& key) {
  if (archive_safe(key)) return key;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(kEscaped);
  for (const char c : key) {
    const auto u = static_cast<unsigned char>(c);
    out += kHex[u >> 4];
    out += kHex[u & 15];
  }
  return out;
}

// The key archive_key() wrote `name` for (as it is when it is none of those).
std::string key_of(const std::string& name) {
  if (name.rfind(kEscaped, 0) != 0) return name;
  const std::string_view hex = std::string_view(name).substr(kEscaped.size());
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::string key;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    const int high = digit(hex[i]);
    const int low = digit(hex[i + 1]);
    if (high < 0 || low < 0) return name;
    key += static_cast<char>(high * 16 + low);
  }
  return hex.size() % 2 == 0 ? key : name;
}

}  // namespace

void write_archive(const StateDict& state, torch::serialize::OutputArchive& archive) {
  for (const auto& key : state.keys()) {
    const std::string name = archive_key(key);
    if (const StateDict* section = state.find_section(key)) {
      torch::serialize::OutputArchive nested(archive.compilation_unit());
      write_archive(*section, nested);
      archive.write(name, nested);
      continue;
    }
    const c10::IValue& value = *state.find(key);
    if (value.isTensor() && !value.toTensor().defined()) {
      // LibTorch's archive fails on one, unnamed ("strides() called on an
      // undefined Tensor"), at every save.
      throw ConfigError(str("StateDict: entry \"",
                            state.path().empty() ? key : state.path() + "/" + key,
                            "\" is an undefined tensor, which a checkpoint cannot hold. Set a "
                            "defined one (e.g. torch::empty({0}) for none yet), or leave the entry "
                            "out until it has a value."));
    }
    if (value.isTensor() && !state.is_plain(key)) {
      archive.write(name, value.toTensor(), state.is_buffer(key));
    } else {
      archive.write(name, value);
    }
  }
}

StateDict read_archive(torch::serialize::InputArchive& archive, const std::string& path) {
  StateDict state;
  state.set_path(path);
  for (const auto& key : archive.keys()) {
    if (key == "training") continue;  // the archive's own flag
    c10::IValue value;
    if (!archive.try_read(key, value)) continue;
    const std::string own = key_of(key);
    if (value.isObject() && value.toObject()->type()->is_module()) {
      torch::serialize::InputArchive nested;
      archive.try_read(key, nested);
      state.set_section(own, read_archive(nested, path.empty() ? own : path + "/" + own));
    } else {
      // As it is: what a file holds is loaded, whatever set() would refuse
      // to save (the component reading it names what it expected); but no
      // tensor that reaches past its storage.
      check_extents(value, path.empty() ? own : path + "/" + own);
      state.slot(own).value = std::move(value);
    }
  }
  return state;
}

std::string to_bytes(const StateDict& state) {
  torch::serialize::OutputArchive archive;
  write_archive(state, archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

StateDict from_bytes(const std::string& bytes) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  return read_archive(archive);
}

}  // namespace fulgur
