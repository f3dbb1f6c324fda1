// Internal: worker threads that load the batches of an epoch ahead of the
// training thread and hand them out in order, so that what a loader yields
// does not depend on how many workers load it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "fulgur/data/batch.h"

namespace fulgur::detail {

class Prefetcher {
 public:
  /// Loads batch `index` of the current epoch; runs on a worker thread.
  using Load = std::function<Batch(int64_t index)>;

  /// `workers` threads; at most `depth` batches loaded ahead of the one the
  /// training thread takes next.
  Prefetcher(int64_t workers, int64_t depth);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  /// Loads batches [first, end) with `load`, after the previous epoch's
  /// loads in flight have finished (their batches are dropped).
  void start(Load load, int64_t first, int64_t end);
  /// The next batch in order; nullopt after the last. A load's exception is
  /// rethrown here, in the training thread.
  std::optional<Batch> next();
  /// Waits for the loads in flight, drops what was loaded, and ends the
  /// threads (started again by the next start()).
  void stop();

  // fork() (the ddp_fork launcher, a user's): a child has none of the
  // parent's worker threads. Every live prefetcher's lock is held across
  // the fork, so its state is whole in the child, where the loads not yet
  // handed out are made again by new threads (next()).
  static void before_fork();
  static void after_fork_in_parent();
  static void after_fork_in_child();

 private:
  void work();
  void halt_loads(std::unique_lock<std::mutex>& lock);
  void start_threads();
  // In a forked child, under mutex_: forgets the parent's threads and loads.
  void forget_parents_threads();

  const int64_t workers_;
  const int64_t depth_;
  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable work_ready_;  // workers wait for an index to load
  std::condition_variable done_;        // the training thread waits for a batch
  Load load_;
  int64_t next_issue_ = 0;   // the next index a worker takes
  int64_t next_return_ = 0;  // the next index next() hands out
  int64_t end_ = 0;
  int64_t busy_ = 0;  // loads running
  bool quit_ = false;
  struct Result {
    std::optional<Batch> batch;
    std::exception_ptr error;
  };
  std::map<int64_t, Result> ready_;
};

}  // namespace fulgur::detail
