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

// A block allocated under a cap, by its data pointer: what to give back to
// the ledger, and the inner allocator's deleter. LibTorch's own CPU
// allocator makes "simple" pointers (the data is the context, freed by its
// raw_deleter), and oneDNN and others allocate through raw_allocate, which
// requires them, and free through whichever CPU allocator is current then:
// so the capped pointers are simple too, their blocks are found by address,
// and a pointer that is not one of them goes to the inner allocator's
// deleter.
struct Block {
  int64_t bytes = 0;
  std::shared_ptr<HostMemoryCap::Ledger> ledger;
  c10::DeleterFnPtr inner_deleter = nullptr;
};

struct Shared {
  std::mutex mutex;
  std::unordered_map<void*, Block> blocks;
  std::shared_ptr<HostMemoryCap::Ledger> active;  // the cap in force; null: none
  c10::Allocator* inner = nullptr;                // the allocator wrapped
  c10::DeleterFnPtr inner_deleter = nullptr;      // its raw deleter
};
Shared& shared() {
  static auto* state = new Shared();  // outlives every tensor
  return *state;
}

void release_block(void* data) {
  Shared& s = shared();
  Block block;
  c10::DeleterFnPtr deleter = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.blocks.find(data);
    if (it != s.blocks.end()) {
      block = std::move(it->second);
      s.blocks.erase(it);
      deleter = block.inner_deleter;
    } else {
      deleter = s.inner_deleter;  // allocated outside any cap
    }
  }
  if (block.ledger) block.ledger->live.fetch_sub(block.bytes);
  if (deleter != nullptr) deleter(data);
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
  c10::DataPtr allocate(size_t n) FULGUR_ALLOCATE_CONST override {
    Shared& s = shared();
    std::shared_ptr<HostMemoryCap::Ledger> ledger;
    c10::Allocator* inner = nullptr;
    c10::DeleterFnPtr inner_deleter = nullptr;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      ledger = s.active;
      inner = s.inner;
      inner_deleter = s.inner_deleter;
    }
    if (!ledger) return inner->allocate(n);  // no cap now: LibTorch's own
    const auto bytes = static_cast<int64_t>(n);
    const int64_t now = ledger->live.fetch_add(bytes) + bytes;
    if (now > ledger->cap) {
      ledger->live.fetch_sub(bytes);
      ledger->refused.fetch_add(1);
      C10_THROW_ERROR(OutOfMemoryError, str(kRefusal, "a tensor of ", bytes,
                                            " bytes would bring the trial's CPU tensors to ", now,
                                            " bytes, over the cap of ", ledger->cap, " bytes."));
    }
    int64_t peak = ledger->peak.load();
    while (now > peak && !ledger->peak.compare_exchange_weak(peak, now)) {
    }
    c10::DataPtr block;
    try {
      block = inner->allocate(n);
    } catch (...) {
      ledger->live.fetch_sub(bytes);
      throw;
    }
    void* data = block.get();
    const c10::Device device = block.device();
    if (data == nullptr) {  // nothing to hold (a zero-byte tensor)
      ledger->live.fetch_sub(bytes);
      return block;
    }
    if (inner_deleter != nullptr && block.get_context() == data) {
      block.release_context();
      std::lock_guard<std::mutex> lock(s.mutex);
      s.blocks[data] = Block{bytes, ledger, inner_deleter};
      return c10::DataPtr(data, data, &release_block, device);
    }
    auto* held = new Held{std::move(block), bytes, ledger};
    return c10::DataPtr(data, held, &Held::release, device);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    Shared& s = shared();
    std::lock_guard<std::mutex> lock(s.mutex);
    return s.inner_deleter != nullptr ? &release_block : nullptr;
  }

#if FULGUR_TORCH_AT_LEAST(2, 3)
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count > 0) std::memcpy(dest, src, count);
  }
#endif
};

CappedAllocator& capped_allocator() {
  static auto* allocator = new CappedAllocator();  // a storage may ask it again, any time
  return *allocator;
}

}  // namespace

HostMemoryCap::HostMemoryCap(int64_t bytes) : ledger_(std::make_shared<Ledger>()) {
  ledger_->cap = bytes;
  CappedAllocator& capped = capped_allocator();
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current == &capped) {
    throw InternalError("HostMemoryCap: one is already in force (one at a time).");
  }
  Shared& s = shared();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.inner = current;
    s.inner_deleter = current->raw_deleter();
    s.active = ledger_;
  }
  previous_ = current;
  // Priority 0, LibTorch's own allocator's: a higher one would stay for good.
  c10::SetCPUAllocator(&capped, 0);
  if (c10::GetCPUAllocator() != &capped) {
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.active.reset();
    }
    throw ConfigError(
        "host_memory_cap: LibTorch's CPU allocator was replaced by one set with a higher "
        "priority (c10::SetCPUAllocator), which the cap cannot wrap. Find the batch size without "
        "that allocator, or on a GPU.");
  }
}

HostMemoryCap::~HostMemoryCap() {
  {
    std::lock_guard<std::mutex> lock(shared().mutex);
    shared().active.reset();
  }
  c10::SetCPUAllocator(previous_, 0);
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
