// File: src/utilities/helper_thread.h (internal)
//
// A second thread that runs one job at a time beside the calling thread,
// for work split in two (a checkpoint's large reads and writes, a
// snapshot's copies):
//
//   HelperThread helper;                 // kept: the thread is started once
//   helper.post([&] { second_half(); }); // never throws
//   first_half();
//   helper.wait();                       // rethrows what the job threw
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace fulgur::detail {

// One job at a time: post(job), the caller's own share of the work, then
// wait(). The helper polls briefly after a job (a checkpoint's next large
// read or write usually follows at once), then sleeps; it is started by
// the first post.
class HelperThread {
 public:
  HelperThread() = default;
  ~HelperThread() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      state_.store(kStop, std::memory_order_release);
    }
    posted_.notify_one();
    thread_.join();
  }
  HelperThread(const HelperThread&) = delete;
  HelperThread& operator=(const HelperThread&) = delete;

  /// Starts `job` on the helper (the previous one has been waited for);
  /// where no thread (or memory for the job) can be had, runs it here. The
  /// job's exception comes back from wait(). Never throws.
  template <typename Job>
  void post(const Job& job) {
    try {
      std::function<void()> task(job);
      if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
      {
        std::lock_guard<std::mutex> lock(mutex_);
        job_ = std::move(task);
        state_.store(kPosted, std::memory_order_release);
      }
      posted_.notify_one();
      return;
    } catch (const std::exception&) {
      // A process at its limit of threads or memory.
    }
    try {
      job();
    } catch (...) {
      error_ = std::current_exception();
    }
    state_.store(kDone, std::memory_order_release);
  }
  /// Until the posted job is over; rethrows what it threw.
  void wait() {
    // The helper's half usually ends within microseconds of the caller's:
    // polled for up to 200 us (waking from a sleep costs about as much),
    // then slept for (slow storage).
    const auto poll_until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    for (int spins = 0; state_.load(std::memory_order_acquire) != kDone; ++spins) {
      if (spins < 1000) continue;
      if (std::chrono::steady_clock::now() < poll_until) {
        std::this_thread::yield();
        continue;
      }
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, [this] { return state_.load(std::memory_order_acquire) == kDone; });
      break;
    }
    state_.store(kIdle, std::memory_order_relaxed);
    job_ = nullptr;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  enum : int { kIdle, kPosted, kDone, kStop };
  void run() {
    for (;;) {
      int state = kIdle;
      for (int spins = 0; spins < 20000; ++spins) {
        state = state_.load(std::memory_order_acquire);
        if (state == kPosted || state == kStop) break;
      }
      if (state != kPosted && state != kStop) {
        std::unique_lock<std::mutex> lock(mutex_);
        posted_.wait(lock, [&] {
          state = state_.load(std::memory_order_acquire);
          return state == kPosted || state == kStop;
        });
      }
      if (state == kStop) return;
      try {
        job_();
      } catch (...) {
        error_ = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        state_.store(kDone, std::memory_order_release);
      }
      done_.notify_one();
    }
  }

  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable posted_, done_;
  std::atomic<int> state_{kIdle};
  std::function<void()> job_;  // set before kPosted
  std::exception_ptr error_;   // set before kDone
};

}  // namespace fulgur::detail
