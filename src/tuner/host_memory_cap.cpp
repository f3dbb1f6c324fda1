#include "tuner/host_memory_cap.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <unordered_map>

#include "fulgur/core/errors.h"
#include "fulgur/utilities/torch_compat.h"

// c10::Allocator::allocate lost its const, and copy_data became a pure
// virtual, in LibTorch 2.3.
#if FULGUR_TORCH_AT_LEAST(2, 3)
#define FULGUR_ALLOCATE_CONST
#else
#define FULGUR_ALLOCATE_CONST const
#endif

namespace fulgur::detail {

namespace {

// The refusal's message starts with this, so that it is recognised after
// LibTorch passed it on (an autograd or parallel_for worker rethrows the
// exception it caught; a wrapper may copy only its text).
constexpr const char* kRefusal = "fulgur host_memory_cap: ";

}  // namespace

struct HostMemoryCap::Ledger {
  int64_t cap = 0;
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> refused{0};
};

namespace {

// A block allocated under the cap, by its data pointer: what to give back
// to the ledger, and the inner allocator's deleter. LibTorch's own CPU
// allocator makes "simple" pointers (the data is the context, freed by its
// raw_deleter), and oneDNN and others allocate through raw_allocate, which
// requires them: so the capped pointers are simple too, and their blocks
// are found by address.
struct Block {
  int64_t bytes;
  std::shared_ptr<HostMemoryCap::Ledger> ledger;
  c10::DeleterFnPtr inner_deleter;
};
std::mutex blocks_mutex;
std::unordered_map<void*, Block>& blocks() {
  static auto* map = new std::unordered_map<void*, Block>();  // outlives every tensor
  return *map;
}

void release_block(void* data) {
  Block block;
  {
    std::lock_guard<std::mutex> lock(blocks_mutex);
    auto it = blocks().find(data);
    if (it == blocks().end()) return;  // not ours: cannot happen
    block = std::move(it->second);
    blocks().erase(it);
  }
  block.ledger->live.fetch_sub(block.bytes);
  block.inner_deleter(data);
}

// A block of an inner allocator whose pointers are not simple: it travels
// as the context.
struct Held {
  c10::DataPtr inner;
  int64_t bytes;
  std::shared_ptr<HostMemoryCap::Ledger> ledger;

  static void release(void* context) {
    auto* held = static_cast<Held*>(context);
    held->ledger->live.fetch_sub(held->bytes);
    delete held;
  }
};

class CappedAllocator final : public c10::Allocator {
 public:
  CappedAllocator(c10::Allocator* inner, std::shared_ptr<HostMemoryCap::Ledger> ledger)
      : inner_(inner), inner_deleter_(inner->raw_deleter()), ledger_(std::move(ledger)) {}

  c10::DataPtr allocate(size_t n) FULGUR_ALLOCATE_CONST override {
    const auto bytes = static_cast<int64_t>(n);
    const int64_t now = ledger_->live.fetch_add(bytes) + bytes;
    if (now > ledger_->cap) {
      ledger_->live.fetch_sub(bytes);
      ledger_->refused.fetch_add(1);
      C10_THROW_ERROR(OutOfMemoryError,
                      str(kRefusal, "a tensor of ", bytes,
                          " bytes would bring the trial's CPU tensors to ", now,
                          " bytes, over the cap of ", ledger_->cap, " bytes."));
    }
    int64_t peak = ledger_->peak.load();
    while (now > peak && !ledger_->peak.compare_exchange_weak(peak, now)) {
    }
    c10::DataPtr inner;
    try {
      inner = inner_->allocate(n);
    } catch (...) {
      ledger_->live.fetch_sub(bytes);
      throw;
    }
    void* data = inner.get();
    const c10::Device device = inner.device();
    if (data == nullptr) {  // nothing to hold (a zero-byte tensor)
      ledger_->live.fetch_sub(bytes);
      return inner;
    }
    if (inner_deleter_ != nullptr && inner.get_context() == data) {
      inner.release_context();
      std::lock_guard<std::mutex> lock(blocks_mutex);
      blocks()[data] = Block{bytes, ledger_, inner_deleter_};
      return c10::DataPtr(data, data, &release_block, device);
    }
    auto* held = new Held{std::move(inner), bytes, ledger_};
    return c10::DataPtr(data, held, &Held::release, device);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return inner_deleter_ != nullptr ? &release_block : nullptr;
  }

#if FULGUR_TORCH_AT_LEAST(2, 3)
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count > 0) std::memcpy(dest, src, count);
  }
#endif

 private:
  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_deleter_;
  std::shared_ptr<HostMemoryCap::Ledger> ledger_;
};

// The allocator's priority: the highest, so that the swap always takes
// (c10::SetCPUAllocator ignores a lower one than the current's).
constexpr uint8_t kPriority = 255;

}  // namespace

HostMemoryCap::HostMemoryCap(int64_t bytes)
    : ledger_(std::make_shared<Ledger>()), previous_(c10::GetCPUAllocator()) {
  ledger_->cap = bytes;
  allocator_ = std::make_unique<CappedAllocator>(previous_, ledger_);
  c10::SetCPUAllocator(allocator_.get(), kPriority);
}

HostMemoryCap::~HostMemoryCap() {
  c10::SetCPUAllocator(previous_, kPriority);
  // Storage allocated under the cap still holds the ledger (and the inner
  // allocator's own deleter); this allocator object is needed by none of it.
}

int64_t HostMemoryCap::live() const { return ledger_->live.load(); }
int64_t HostMemoryCap::peak() const { return ledger_->peak.load(); }
int64_t HostMemoryCap::refused() const { return ledger_->refused.load(); }

bool HostMemoryCap::is_refusal(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  const std::string text = error != nullptr ? error->msg() : e.what();
  return text.find(kRefusal) != std::string::npos;
}

}  // namespace fulgur::detail
