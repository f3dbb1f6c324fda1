#include "data/prefetcher.h"

#include <ATen/core/grad_mode.h>

namespace fulgur::detail {

Prefetcher::Prefetcher(int64_t workers, int64_t depth) : workers_(workers), depth_(depth) {}

Prefetcher::~Prefetcher() { stop(); }

void Prefetcher::halt_loads(std::unique_lock<std::mutex>& lock) {
  end_ = next_issue_;  // nothing new is taken
  done_.wait(lock, [&] { return busy_ == 0; });
  ready_.clear();
  next_return_ = end_;
}

void Prefetcher::start(Load load, int64_t first, int64_t end) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    halt_loads(lock);
    load_ = std::move(load);
    next_issue_ = next_return_ = first;
    end_ = end;
  }
  if (threads_.empty()) {
    quit_ = false;
    for (int64_t i = 0; i < workers_; ++i) threads_.emplace_back([this] { work(); });
  }
  work_ready_.notify_all();
}

std::optional<Batch> Prefetcher::next() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (next_return_ >= end_ && ready_.empty()) return std::nullopt;
  const int64_t index = next_return_;
  done_.wait(lock, [&] { return ready_.count(index) > 0; });
  Result result = std::move(ready_.at(index));
  ready_.erase(index);
  ++next_return_;
  lock.unlock();
  work_ready_.notify_all();  // the window moved on
  if (result.error) std::rethrow_exception(result.error);
  return std::move(result.batch);
}

void Prefetcher::stop() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    halt_loads(lock);
    quit_ = true;
  }
  work_ready_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

void Prefetcher::work() {
  // Loading computes no gradients.
  at::NoGradGuard no_grad;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_ready_.wait(lock, [&] {
      return quit_ || (next_issue_ < end_ && next_issue_ < next_return_ + depth_);
    });
    if (quit_) return;
    const int64_t index = next_issue_++;
    ++busy_;
    Load load = load_;
    lock.unlock();
    Result result;
    try {
      result.batch = load(index);
    } catch (...) {
      result.error = std::current_exception();
    }
    lock.lock();
    ready_[index] = std::move(result);
    --busy_;
    done_.notify_all();
  }
}

}  // namespace fulgur::detail
