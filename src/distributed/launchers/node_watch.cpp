#include "distributed/launchers/node_watch.h"

#include <algorithm>
#include <cstdlib>

#include "fulgur/core/errors.h"
#include "distributed/launchers/heartbeat.h"
#include "distributed/tcp_store.h"

namespace fulgur::detail {

namespace {

using Clock = std::chrono::steady_clock;

std::string key_of(int node) { return "fulgur/launcher/node/" + std::to_string(node); }

}  // namespace

int launcher_store_port(int main_port) {
  if (const char* v = std::getenv("FULGUR_LAUNCHER_PORT"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const long port = std::strtol(v, &end, 10);
    if (*end != '\0' || port < 1 || port > 65535) {
      throw ConfigError(str("FULGUR_LAUNCHER_PORT=\"", v,
                            "\" is not a TCP port: set it to a free port in 1..65535 that every "
                            "node reaches on node 0 (the launchers' store of a multi-node run), or "
                            "unset it to use MASTER_PORT + 1."));
    }
    return static_cast<int>(port);
  }
  if (main_port >= 65535) {
    throw ConfigError(str("MASTER_PORT=", main_port,
                          ": the launchers of a multi-node run keep their store on MASTER_PORT + 1, "
                          "which is not a port. Choose a lower MASTER_PORT, or set "
                          "FULGUR_LAUNCHER_PORT to a free port."));
  }
  return main_port + 1;
}

NodeWatch::NodeWatch(NodeWatchOptions options)
    : options_(std::move(options)), peers_(static_cast<size_t>(options_.num_nodes)) {
  const auto now = Clock::now();
  attempt_start_ = store_answered_ = last_round_ = now;
  if (options_.node_rank == 0) {
    try {
      server_ = std::make_unique<TcpStore>(options_.main_address, options_.port, /*server=*/true,
                                           std::chrono::seconds(5));
    } catch (const std::exception& e) {
      throw DistributedError(str("node 0's launcher cannot keep the launchers' store on ",
                                 options_.main_address, ":", options_.port,
                                 " (MASTER_PORT + 1, or FULGUR_LAUNCHER_PORT): ", e.what(),
                                 " Choose another MASTER_PORT or FULGUR_LAUNCHER_PORT."));
    }
  }
  thread_ = std::thread([this] { run(); });
}

NodeWatch::~NodeWatch() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::chrono::milliseconds NodeWatch::interval() const {
  return std::clamp<std::chrono::milliseconds>(options_.heartbeat_timeout / 5,
                                               std::chrono::milliseconds(50),
                                               std::chrono::milliseconds(1000));
}

void NodeWatch::begin_attempt(int attempt) {
  std::lock_guard<std::mutex> lock(mutex_);
  attempt_ = attempt;
  attempt_start_ = Clock::now();
  loss_.reset();
  for (auto& p : peers_) p.seen_this_attempt = p.done = false;
  store_answered_this_attempt_ = false;
}

void NodeWatch::publish(std::string state) {
  std::lock_guard<std::mutex> lock(mutex_);
  state_ = std::move(state);
}

std::optional<NodeLoss> NodeWatch::lost() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return loss_;
}

std::optional<NodeLoss> NodeWatch::wait_for_loss(std::chrono::milliseconds for_how_long) const {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait_for(lock, for_how_long, [&] { return loss_.has_value() || stop_; });
  return loss_;
}

void NodeWatch::finish() {
  publish("done");
  {
    std::lock_guard<std::mutex> quiet(beat_mutex_);
    beat_once();
  }
  if (options_.node_rank != 0) return;
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait_for(lock, options_.rejoin_timeout, [&] {
    if (loss_ || stop_) return true;
    for (int node = 1; node < options_.num_nodes; ++node) {
      if (!peers_[static_cast<size_t>(node)].done) return false;
    }
    return true;
  });
}

void NodeWatch::run() {
  for (;;) {
    {
      std::lock_guard<std::mutex> quiet(beat_mutex_);
      beat_once();
    }
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait_for(lock, interval(), [&] { return stop_; });
    if (stop_) return;
  }
}

void NodeWatch::beat_once() {
  std::string value;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    value = str(++counter_, " ", attempt_, " ", state_);
  }
  // Each request waits at most one interval: a partitioned store makes a
  // round fail, not hang.
  std::vector<std::optional<std::string>> beats(peers_.size());
  std::string error;
  try {
    if (!client_) {
      client_ = std::make_unique<TcpStore>(options_.main_address, options_.port, /*server=*/false,
                                           interval());
    }
    client_->set(key_of(options_.node_rank), string_to_bytes(value));
    for (int node = 0; node < options_.num_nodes; ++node) {
      if (node == options_.node_rank || !client_->check({key_of(node)})) continue;
      const auto bytes = client_->get(key_of(node));
      beats[static_cast<size_t>(node)] = bytes_to_string(bytes);
    }
  } catch (const std::exception& e) {
    client_.reset();
    error = e.what();
  }
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  // This process did not run for a while (the whole node was stopped, then
  // continued): the others' silence meanwhile says nothing about them.
  const auto gap = now - last_round_;
  last_round_ = now;
  if (gap > std::max<Clock::duration>(options_.heartbeat_timeout / 2, 4 * interval())) {
    for (auto& p : peers_) p.seen = std::max(p.seen, now);
    store_answered_ = now;
    attempt_start_ += gap;
  }
  if (error.empty()) {
    store_answered_ = now;
    store_answered_this_attempt_ = true;
  } else {
    client_error_ = error;
  }
  for (size_t node = 0; node < beats.size(); ++node) {
    if (!beats[node]) continue;
    long long counter = -1;
    int attempt = -1, used = 0;
    if (std::sscanf(beats[node]->c_str(), "%lld %d %n", &counter, &attempt, &used) < 2) continue;
    Peer& p = peers_[node];
    if (counter == p.counter) continue;
    p.counter = counter;
    p.attempt = attempt;
    p.state = beats[node]->substr(static_cast<size_t>(used));
    p.done = p.state == "done";
    p.seen = now;
    p.seen_this_attempt = true;
  }
  judge(now);
  changed_.notify_all();
}

std::string NodeWatch::what_the_node_did(int node) const {
  const Peer& p = peers_[static_cast<size_t>(node)];
  if (p.counter < 0) return str(" Node ", node, "'s launcher never sent a heartbeat.");
  return str(" What node ", node, "'s ranks were doing when last heard from (restart ", p.attempt,
             "): ", p.state.empty() ? std::string("not started yet") : p.state, ".");
}

void NodeWatch::judge(Clock::time_point now) {
  if (loss_) return;
  const int me = options_.node_rank;
  const std::string limit =
      str("heartbeat_timeout is ", seconds_text(options_.heartbeat_timeout), " s");
  const std::string where = str(options_.main_address, ":", options_.port);
  // After a restart, every node must beat again within the rejoin timeout.
  const bool rejoin_over = attempt_ > 0 && now - attempt_start_ > options_.rejoin_timeout;
  auto did_not_come_back = [&](int node, const std::string& how) {
    NodeLoss l;
    l.final = true;
    l.cause = str("node ", node, " did not come back: ", how, " in the ",
                  seconds_text(now - attempt_start_), " s since restart ", attempt_,
                  " (the rejoin timeout is the process_group_timeout, ",
                  seconds_text(options_.rejoin_timeout), " s)");
    l.report = str(l.cause, ". Its machine is down or cut off from node ", me,
                   "; restarting again cannot help.", what_the_node_did(node));
    loss_ = std::move(l);
  };
  if (me != 0 && !peers_[0].done) {
    if (store_answered_this_attempt_ && now - store_answered_ > options_.heartbeat_timeout) {
      NodeLoss l;
      l.cause = str("node 0 is lost: the launchers' store it keeps at ", where,
                    " has not answered for ", seconds_text(now - store_answered_), " s (", limit,
                    ")");
      l.report = str(l.cause, ". Node 0's machine is down, its launcher was killed or stopped, "
                     "or the link between node 0 and node ", me, " is down (", client_error_, ").",
                     what_the_node_did(0));
      loss_ = std::move(l);
      return;
    }
    if (!store_answered_this_attempt_ && rejoin_over) {
      did_not_come_back(0, str("the launchers' store it keeps at ", where, " did not answer"));
      return;
    }
  }
  // On a node other than 0 every heartbeat comes through node 0's store:
  // while the store is silent, so are the peers, whatever they do. Their
  // silence counts up to the store's last answer, and the store's own check
  // above names a store that stopped answering. (Counted up to now, a peer
  // whose last beat came a round before the store's last answer was named
  // instead, depending on the beats' phase.)
  const auto heard_until = me != 0 && !peers_[0].done ? std::min(now, store_answered_) : now;
  for (int node = 0; node < options_.num_nodes; ++node) {
    if (node == me) continue;
    const Peer& p = peers_[static_cast<size_t>(node)];
    if (p.done) continue;
    if (p.seen_this_attempt && heard_until - p.seen > options_.heartbeat_timeout) {
      NodeLoss l;
      l.cause = str("node ", node, " is lost: no heartbeat from its launcher for ",
                    seconds_text(heard_until - p.seen), " s (", limit, ")");
      l.report = str(l.cause, ". Its machine is down, its processes were killed or stopped, or "
                     "the link between node ", node, " and node ", me, " is down.",
                     what_the_node_did(node));
      loss_ = std::move(l);
      return;
    }
    if (!p.seen_this_attempt && rejoin_over) {
      did_not_come_back(node, "no heartbeat from its launcher");
      return;
    }
  }
}

}  // namespace fulgur::detail
