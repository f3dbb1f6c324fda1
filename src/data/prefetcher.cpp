#include "data/prefetcher.h"

#include <ATen/core/grad_mode.h>
#include <pthread.h>

#include <new>
#include <set>

namespace fulgur::detail {

namespace {

// The live prefetchers, for the fork handlers (one registration).
std::mutex& live_mutex() {
  static std::mutex* m = new std::mutex;  // never destroyed: a fork may come at exit
  return *m;
}
std::set<Prefetcher*>& live() {
  static auto* set = new std::set<Prefetcher*>;
  return *set;
}

}  // namespace

Prefetcher::Prefetcher(int64_t workers, int64_t depth) : workers_(workers), depth_(depth) {
  static const int registered =
      pthread_atfork(&Prefetcher::before_fork, &Prefetcher::after_fork_in_parent,
                     &Prefetcher::after_fork_in_child);
  (void)registered;
  std::lock_guard<std::mutex> lock(live_mutex());
  live().insert(this);
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard<std::mutex> lock(live_mutex());
    live().erase(this);
  }
  stop();
}

void Prefetcher::before_fork() {
  live_mutex().lock();
  for (Prefetcher* p : live()) p->mutex_.lock();
}

void Prefetcher::after_fork_in_parent() {
  for (Prefetcher* p : live()) p->mutex_.unlock();
  live_mutex().unlock();
}

void Prefetcher::after_fork_in_child() {
  for (Prefetcher* p : live()) {
    p->forget_parents_threads();
    p->mutex_.unlock();
  }
  live_mutex().unlock();
}

void Prefetcher::forget_parents_threads() {
  if (threads_.empty()) return;
  // Their std::thread objects name threads this process does not have:
  // destroying one (joinable) would terminate it, joining it would wait
  // forever. Kept, never destroyed.
  new std::vector<std::thread>(std::move(threads_));
  threads_.clear();
  // Condition variables the parent's threads waited on (glibc counts its
  // waiters): new ones, the old ones never destroyed either.
  new (&work_ready_) std::condition_variable();
  new (&done_) std::condition_variable();
  // The loads that were running are lost with their threads: every batch
  // not yet handed out is loaded again, in order, by new threads.
  busy_ = 0;
  ready_.clear();
  next_issue_ = next_return_;
  quit_ = false;
}

void Prefetcher::start_threads() {
  quit_ = false;
  for (int64_t i = 0; i < workers_; ++i) threads_.emplace_back([this] { work(); });
}

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
  if (threads_.empty()) start_threads();
  work_ready_.notify_all();
}

std::optional<Batch> Prefetcher::next() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (next_return_ >= end_ && ready_.empty()) return std::nullopt;
  // In a forked child (after_fork_in_child), before its first start().
  if (threads_.empty()) start_threads();
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
