#include "fulgur/plugins/io/async_checkpoint_io.h"

#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <iostream>
#include <mutex>
#include <thread>
#include <utility>

#include "fulgur/core/errors.h"
#include "fulgur/plugins/io/torch_checkpoint_io.h"
#include "plugins/io/state_snapshot.h"

namespace fulgur {

// The writer thread and what it shares with the saving thread. Saves and
// removals run in the order they were handed over; the snapshot's buffers
// are busy from a save's hand-over until its write ends.
struct AsyncCheckpointIO::Writer {
  struct Operation {
    bool save;  // else a removal
    std::string path;
  };

  explicit Writer(CheckpointIO& io) : io(io) {}
  ~Writer() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    changed.notify_all();
    if (thread.joinable()) thread.join();
  }

  // Hands `operation` over, starting the thread on first use.
  void push(Operation operation) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      // The thread first: if it cannot start (std::system_error), nothing
      // is queued that would never be written.
      if (!thread.joinable()) thread = std::thread([this] { run(); });
      if (operation.save) buffer_busy = true;
      queue.push_back(std::move(operation));
    }
    changed.notify_all();
  }

  // Blocks until nothing is queued or being written.
  void drain(std::unique_lock<std::mutex>& lock) {
    changed.wait(lock, [&] { return queue.empty() && !running; });
  }

  // Throws a failure not raised yet (once).
  void raise(std::unique_lock<std::mutex>& lock) {
    if (!error) return;
    std::exception_ptr failure = std::exchange(error, nullptr);
    lock.unlock();
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      throw CheckpointError(str("a checkpoint written in the background failed: ", e.what(),
                                " The checkpoints written before it are intact."));
    } catch (...) {
      throw CheckpointError(
          "a checkpoint written in the background failed with an exception that is not a "
          "std::exception. The checkpoints written before it are intact.");
    }
  }

  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      changed.wait(lock, [&] { return stopping || !queue.empty(); });
      if (queue.empty()) return;  // stopping, and everything written
      Operation operation = std::move(queue.front());
      queue.pop_front();
      // After a failed save, an older checkpoint may be the newest one
      // left: no removal runs until the failure has been raised.
      const bool skip = !operation.save && error;
      running = true;
      lock.unlock();
      std::exception_ptr failure;
      if (!skip) {
        try {
          if (operation.save) {
            io.save_checkpoint(*state, operation.path);
          } else {
            io.remove_checkpoint(operation.path);
          }
        } catch (...) {
          failure = std::current_exception();
        }
      }
      // The state's containers go on this thread; the buffers stay.
      if (operation.save) state.reset();
      lock.lock();
      running = false;
      if (operation.save) buffer_busy = false;
      if (failure && !error) error = failure;
      changed.notify_all();
    }
  }

  CheckpointIO& io;
  const pid_t owner = ::getpid();
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<Operation> queue;
  bool buffer_busy = false;  // a snapshot is queued or being written
  bool running = false;      // the thread is carrying out an operation
  bool stopping = false;
  std::exception_ptr error;  // the first failure not raised yet
  detail::StateSnapshot snapshot;
  std::unique_ptr<StateDict> state;  // the save in flight
  std::thread thread;
};

AsyncCheckpointIO::AsyncCheckpointIO(std::shared_ptr<CheckpointIO> io)
    : io_(io ? std::move(io) : std::make_shared<TorchCheckpointIO>()) {}

AsyncCheckpointIO::~AsyncCheckpointIO() {
  if (!writer_) return;
  if (writer_->owner != ::getpid()) {
    // A forked copy: its thread lives in the parent only.
    (void)writer_.release();
    return;
  }
  std::unique_lock<std::mutex> lock(writer_->mutex);
  writer_->drain(lock);
  if (writer_->error) {
    try {
      std::rethrow_exception(writer_->error);
    } catch (const std::exception& e) {
      detail::print_note(
          str("a checkpoint written in the background failed, and nothing "
              "reported it before its writer closed: ",
              e.what()));
    } catch (...) {
      detail::print_note(
          "a checkpoint written in the background failed (an exception that is not a "
          "std::exception), and nothing reported it before its writer closed.");
    }
  }
  lock.unlock();
  writer_.reset();
}

AsyncCheckpointIO::Writer& AsyncCheckpointIO::writer() {
  if (writer_ && writer_->owner != ::getpid()) {
    // Forked after the parent's writer started: its thread, and perhaps its
    // lock, stayed in the parent. Leave the copy alone; start afresh.
    (void)writer_.release();
  }
  if (!writer_) writer_ = std::make_unique<Writer>(*io_);
  return *writer_;
}

void AsyncCheckpointIO::save_checkpoint(StateDict& checkpoint, const std::string& path) {
  Writer& w = writer();
  {
    std::unique_lock<std::mutex> lock(w.mutex);
    w.changed.wait(lock, [&] { return !w.buffer_busy; });
    w.raise(lock);
  }
  // The buffers are free: the snapshot, on this thread; then the state,
  // holding only copies, is the writer's (it becomes a file there).
  w.snapshot.take(checkpoint);
  w.state = std::make_unique<StateDict>(std::move(checkpoint));
  checkpoint = StateDict();
  w.push({/*save=*/true, path});
}

void AsyncCheckpointIO::drain_writer() {
  Writer& w = writer();
  std::unique_lock<std::mutex> lock(w.mutex);
  w.drain(lock);
}

StateDict AsyncCheckpointIO::load_checkpoint(const std::string& path) {
  drain_writer();
  return io_->load_checkpoint(path);
}

void AsyncCheckpointIO::remove_checkpoint(const std::string& path) {
  writer().push({/*save=*/false, path});
}

std::string AsyncCheckpointIO::verify(const std::string& path) {
  drain_writer();
  return io_->verify(path);
}

FileFingerprint AsyncCheckpointIO::fingerprint(const std::string& path) {
  drain_writer();
  return io_->fingerprint(path);
}

void AsyncCheckpointIO::remove_stale_files(const std::string& dir) {
  // Only dead writers' files go: this process's writer is alive.
  io_->remove_stale_files(dir);
}

void AsyncCheckpointIO::raise_pending_error() {
  if (!writer_) return;
  Writer& w = writer();
  std::unique_lock<std::mutex> lock(w.mutex);
  w.raise(lock);
}

void AsyncCheckpointIO::wait_until_durable() {
  if (!writer_) return;
  Writer& w = writer();
  std::unique_lock<std::mutex> lock(w.mutex);
  w.drain(lock);
  w.raise(lock);
}

size_t AsyncCheckpointIO::snapshot_bytes() const {
  if (!writer_) return 0;
  std::lock_guard<std::mutex> lock(writer_->mutex);
  return writer_->snapshot.capacity_bytes();
}

}  // namespace fulgur
