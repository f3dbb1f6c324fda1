#include "plugins/io/archive_snapshot.h"

#include <torch/csrc/jit/api/module.h>
#include <torch/serialize/output-archive.h>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "utilities/helper_thread.h"

namespace fulgur::detail {

namespace {

// The private OutputArchive::module_, named through an explicit template
// instantiation (where access is not checked, [temp.spec.general]/6).
struct ArchiveModule {
  using type = torch::jit::Module torch::serialize::OutputArchive::*;
};
ArchiveModule::type member_of(ArchiveModule);
template <typename Tag, typename Tag::type Member>
struct MemberOf {
  friend typename Tag::type member_of(Tag) { return Member; }
};
template struct MemberOf<ArchiveModule, &torch::serialize::OutputArchive::module_>;

}  // namespace

size_t ArchiveSnapshot::capacity_bytes() const {
  size_t bytes = 0;
  for (const auto& b : buffers_) bytes += b.nbytes();
  return bytes;
}

at::Tensor ArchiveSnapshot::copy(const at::Tensor& tensor, Seen& seen) {
  if (!tensor.defined()) return tensor;
  // A tensor the archive holds twice (tied weights) is copied once, so the
  // file shares its storage as a synchronous save's would.
  if (auto it = seen.find(tensor.unsafeGetTensorImpl()); it != seen.end()) return it->second;
  const at::Tensor source = tensor.detach();
  if (next_ == buffers_.size()) buffers_.emplace_back();
  at::Tensor& buffer = buffers_[next_++];
  const bool reusable = buffer.defined() && buffer.sizes() == source.sizes() &&
                        buffer.scalar_type() == source.scalar_type() &&
                        buffer.device() == source.device();
  if (reusable && source.is_cpu() && source.is_contiguous()) {
    // A plain memcpy (glibc's streams large copies past the cache, which
    // at::copy_ does not), at the end of take(), on two threads.
    pending_.push_back({source, static_cast<char*>(buffer.data_ptr()), source.nbytes()});
  } else if (reusable) {
    buffer.copy_(source);
  } else {
    buffer = source.clone(at::MemoryFormat::Contiguous);
  }
  copied_ += buffer.nbytes();
  // As the archive would have recorded the original (the flag is part of
  // what a parameter pickles); set on an alias, so the buffer stays a plain
  // tensor for the next copy_.
  at::Tensor copied = tensor.requires_grad() ? buffer.detach().requires_grad_(true) : buffer;
  seen.emplace(tensor.unsafeGetTensorImpl(), copied);
  return copied;
}

namespace {

// A copy of `value` in which every tensor is `copy(tensor)`; values holding
// no tensor come back as they are. Containers are rebuilt, never changed in
// place (a user may still hold the list written into the archive).
template <class Copy>
c10::IValue with_copies(const c10::IValue& value, Copy& copy) {
  if (value.isTensor()) return copy(value.toTensor());
  if (value.isTensorList()) {
    c10::List<at::Tensor> out;
    for (at::Tensor t : value.toTensorList())
      out.push_back(copy(t));  // by value: the list yields proxies
    return out;
  }
  if (value.isList()) {
    auto list = value.toList();
    c10::impl::GenericList out(list.elementType());
    out.reserve(list.size());
    for (c10::IValue element : list) out.push_back(with_copies(element, copy));
    return out;
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const c10::IValue& element : value.toTupleRef().elements()) {
      elements.push_back(with_copies(element, copy));
    }
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  if (value.isGenericDict()) {
    auto dict = value.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& entry : dict) out.insert(entry.key(), with_copies(entry.value(), copy));
    return out;
  }
  return value;
}

// Every slot of the archive's object and of its nested archives' objects
// (modules of their own, created for this archive: changed in place). An
// object of another class is a user's, and is left as it is.
template <class Copy>
void copy_slots(const c10::intrusive_ptr<c10::ivalue::Object>& object, Copy& copy) {
  const size_t slots = object->slots().size();
  for (size_t i = 0; i < slots; ++i) {
    const c10::IValue value = object->getSlot(i);
    if (value.isObject() && value.toObject()->type()->is_module()) {
      copy_slots(value.toObject(), copy);
    } else {
      object->setSlot(i, with_copies(value, copy));
    }
  }
}

}  // namespace

ArchiveSnapshot::ArchiveSnapshot() = default;
ArchiveSnapshot::~ArchiveSnapshot() = default;
ArchiveSnapshot::ArchiveSnapshot(ArchiveSnapshot&&) noexcept = default;
ArchiveSnapshot& ArchiveSnapshot::operator=(ArchiveSnapshot&&) noexcept = default;

size_t ArchiveSnapshot::take(torch::serialize::OutputArchive& archive) {
  next_ = 0;
  copied_ = 0;
  pending_.clear();
  Seen seen;
  torch::jit::Module& module = archive.*member_of(ArchiveModule());
  auto copy = [this, &seen](const at::Tensor& t) { return this->copy(t, seen); };
  try {
    copy_slots(module._ivalue(), copy);
    run_pending_copies();
  } catch (...) {
    pending_.clear();
    throw;
  }
  buffers_.resize(next_);  // tensors this archive no longer has
  return copied_;
}

void ArchiveSnapshot::run_pending_copies() {
  // Pieces of 4 MiB, taken in turn by this thread and the helper: one
  // thread's memcpy reaches about 10 GB/s here, two about 1.5x that.
  constexpr size_t kPiece = size_t{4} << 20;
  struct Piece {
    const char* from;
    char* to;
    size_t bytes;
  };
  std::vector<Piece> pieces;
  size_t total = 0;
  for (const auto& c : pending_) {
    const auto* from = static_cast<const char*>(c.source.data_ptr());
    for (size_t at = 0; at < c.bytes; at += kPiece) {
      pieces.push_back({from + at, c.to + at, std::min(kPiece, c.bytes - at)});
    }
    total += c.bytes;
  }
  std::atomic<size_t> next{0};
  auto copy_pieces = [&pieces, &next] {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < pieces.size();) {
      std::memcpy(pieces[i].to, pieces[i].from, pieces[i].bytes);
    }
  };
  if (total >= 2 * kPiece) {
    if (!helper_) helper_ = std::make_unique<HelperThread>();
    helper_->post(copy_pieces);
    copy_pieces();
    helper_->wait();
  } else {
    copy_pieces();
  }
  pending_.clear();
}

}  // namespace fulgur::detail
