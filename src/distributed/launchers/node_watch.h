// The launchers of a multi-node run watch each other, as torch elastic's
// agents do through their rendezvous store: node 0's launcher hosts a small
// store (fulgur's TcpStore) at MASTER_ADDR, on MASTER_PORT + 1 or
// FULGUR_LAUNCHER_PORT; every node's launcher, node 0's included, writes a
// beat there a few times per heartbeat_timeout (a counter, its restart
// attempt and what its ranks are doing) and reads the others'.
//
// A node whose beats stop for heartbeat_timeout is lost (its machine died, its
// processes were killed or stopped, or its link is down); node 0's store not
// answering for that long is node 0 lost. Every surviving node then names it
// (which node, its ranks, what each was doing when last heard from), instead
// of its ranks waiting in a collective until the process_group_timeout. After
// a restart, a node that does not beat again within the rejoin timeout (the
// launcher's hang timeout, the process_group_timeout) did not come back: a
// final failure, no restart can help.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace fulgur::detail {

class TcpStore;

struct NodeWatchOptions {
  int node_rank = 0;
  int num_nodes = 1;
  /// Node 0's address (MASTER_ADDR) and the launchers' store port.
  std::string main_address;
  int port = 0;
  std::chrono::milliseconds heartbeat_timeout{10000};
  /// After a restart, how long a node may take to beat again.
  std::chrono::milliseconds rejoin_timeout{60000};
};

/// A node the launchers lost.
struct NodeLoss {
  /// One line ("node 1 is lost: ..."), for a restart's message.
  std::string cause;
  /// The whole report, with what its ranks were doing.
  std::string report;
  /// It did not come back after a restart: restarting again cannot help.
  bool final = false;
};

/// The launchers' store port: FULGUR_LAUNCHER_PORT, else MASTER_PORT + 1.
/// ConfigError for a value that is not a port.
int launcher_store_port(int main_port);

class NodeWatch {
 public:
  /// Node 0 starts the store (DistributedError when it cannot listen); every
  /// node starts beating from a thread of its own.
  explicit NodeWatch(NodeWatchOptions options);
  ~NodeWatch();
  NodeWatch(const NodeWatch&) = delete;
  NodeWatch& operator=(const NodeWatch&) = delete;

  /// The ranks start again (attempt 0: the first start): every other node
  /// must beat in this attempt, within the rejoin timeout after a restart.
  void begin_attempt(int attempt);
  /// What this node's ranks are doing, one line: sent with the next beat.
  void publish(std::string state);
  /// A lost node, once one is.
  std::optional<NodeLoss> lost() const;
  /// Waits up to `for_how_long` for a node to be lost.
  std::optional<NodeLoss> wait_for_loss(std::chrono::milliseconds for_how_long) const;
  /// This node's ranks all succeeded: the others hear it at once (a node
  /// that finished is not lost when it goes quiet), and node 0 keeps the
  /// store until every node finished or was lost (at most the rejoin timeout).
  void finish();
  /// While held, the watch thread sends nothing (held around fork()).
  std::unique_lock<std::mutex> quiet() { return std::unique_lock<std::mutex>(beat_mutex_); }

 private:
  struct Peer {
    int64_t counter = -1;
    int attempt = -1;
    std::string state;
    bool seen_this_attempt = false;
    /// Its ranks all succeeded.
    bool done = false;
    std::chrono::steady_clock::time_point seen;
  };
  void run();
  void beat_once();
  void judge(std::chrono::steady_clock::time_point now);
  std::string what_the_node_did(int node) const;
  std::chrono::milliseconds interval() const;

  NodeWatchOptions options_;
  std::unique_ptr<TcpStore> server_;  // node 0
  std::unique_ptr<TcpStore> client_;
  std::string client_error_;
  std::vector<Peer> peers_;
  int64_t counter_ = 0;
  int attempt_ = 0;
  std::string state_;
  std::chrono::steady_clock::time_point attempt_start_;
  /// When the store last answered (other nodes than 0), and whether it did
  /// in this attempt.
  std::chrono::steady_clock::time_point store_answered_;
  bool store_answered_this_attempt_ = false;
  std::chrono::steady_clock::time_point last_round_;
  std::optional<NodeLoss> loss_;

  mutable std::mutex mutex_;  // everything above
  mutable std::condition_variable changed_;
  std::mutex beat_mutex_;  // a round of requests
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace fulgur::detail
