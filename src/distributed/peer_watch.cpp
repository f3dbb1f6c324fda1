#include "distributed/peer_watch.h"

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "fulgur/core/errors.h"
#include "distributed/tcp_store.h"

namespace fulgur::detail {

namespace {

// Only a write: stdio's locks may be held by a thread that blocks on a full
// pipe, and the process ends here.
void end_process(const std::string& message) {
  const std::string line = "fulgur: " + message + "\n";
  write_all(STDERR_FILENO, line.data(), line.size());
  std::_Exit(1);
}

}  // namespace

std::string encode(const WaitReport& report) {
  if (report.kind.empty()) return str(report.beat, " -");
  return str(report.beat, " ", report.kind, " ", report.seq, " ", report.bytes);
}

std::optional<WaitReport> decode_wait(const std::string& text) {
  std::istringstream in(text);
  WaitReport report;
  std::string kind;
  if (!(in >> report.beat >> kind)) return std::nullopt;
  if (kind == "-") return in >> kind ? std::nullopt : std::optional<WaitReport>(report);
  report.kind = kind;
  if (!(in >> report.seq >> report.bytes) || in >> kind) return std::nullopt;
  return report;
}

DesyncJudge::DesyncJudge(int world, std::chrono::milliseconds after,
                         std::chrono::milliseconds alive)
    : seen_(static_cast<size_t>(std::max(world, 1))), after_(after), alive_(alive) {}

void DesyncJudge::observe(int rank, const std::optional<WaitReport>& report,
                          Clock::time_point now) {
  if (rank < 0 || rank >= static_cast<int>(seen_.size())) return;
  Seen& s = seen_[static_cast<size_t>(rank)];
  if (!report) {
    s.report.reset();
    return;
  }
  if (!s.report || s.report->kind != report->kind || s.report->seq != report->seq) {
    s.same_since = now;
  }
  if (!s.report || s.report->beat != report->beat) s.beat_at = now;
  s.report = report;
}

void DesyncJudge::forget() {
  for (auto& s : seen_) s = Seen{};
}

std::optional<std::string> DesyncJudge::verdict(Clock::time_point now) const {
  std::vector<std::string> where;
  auto waited = Clock::duration::max();
  for (const Seen& s : seen_) {
    if (!s.report || s.report->kind.empty() || now - s.same_since < after_ ||
        now - s.beat_at > alive_ || s.report->seq != seen_.front().report->seq) {
      return std::nullopt;
    }
    where.push_back(describe({s.report->kind.c_str(), s.report->seq, s.report->bytes}));
    waited = std::min(waited, now - s.same_since);
  }
  if (std::all_of(where.begin(), where.end(), [&](const auto& w) { return w == where.front(); })) {
    return std::nullopt;
  }
  return str("the ranks have waited ", seconds_text(waited),
             " s in different collectives of one call number, none of them moving (",
             by_rank(where, ": in "), "), which none can complete: a desync. ", kDesyncHint);
}

PeerWatch::PeerWatch(c10::intrusive_ptr<c10d::Store> store, Connect connect,
                     PeerWatchOptions options, End end)
    : options_(std::move(options)),
      connect_(std::move(connect)),
      end_(end ? std::move(end) : End(end_process)),
      prefix_(str("fulgur/peers/", options_.group, "/")),
      store_(std::move(store)),
      judge_(options_.world, std::max(options_.desync_after, 5 * options_.period),
             3 * options_.period) {
  thread_ = std::thread([this] { loop(); });
}

PeerWatch::~PeerWatch() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

std::string PeerWatch::key(const std::string& name) const { return prefix_ + name; }

void PeerWatch::enter(const CollectiveCall& call) {
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_ = {true, ++waits_, call, Clock::now()};
}

void PeerWatch::leave() {
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_.active = false;
}

bool PeerWatch::still_waiting(const Waiting& waiting) {
  std::lock_guard<std::mutex> lock(mutex_);
  return waiting_.active && waiting_.id == waiting.id && !failed_here_;
}

void PeerWatch::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait_for(lock, options_.period, [&] { return stop_; });
    if (stop_) return;
    if (failed_here_) continue;
    const Waiting waiting = waiting_;
    lock.unlock();
    {
      std::unique_lock<std::mutex> store(store_mutex_);
      look(waiting, Clock::now(), store);
    }
    lock.lock();
  }
}

bool PeerWatch::usable_store(Clock::time_point now) {
  if (store_) return true;
  if (!connect_ || now < reconnect_at_) return false;
  try {
    store_ = connect_();
  } catch (const std::exception&) {
    reconnect_at_ = now + 2 * options_.period;
  }
  return static_cast<bool>(store_);
}

void PeerWatch::lost_store() {
  // fulgur's store closes a connection whose request failed: a new one
  // next time (the holder may only have been slow).
  store_.reset();
  reconnect_at_ = Clock::now() + options_.period;
}

void PeerWatch::look(const Waiting& waiting, Clock::time_point now,
                     std::unique_lock<std::mutex>& store) {
  if (ended_) return;
  const bool long_wait = waiting.active && now - waiting.since >= options_.period;
  if (!long_wait && !reported_waiting_) return;  // nothing to tell: no traffic
  if (!usable_store(now)) return;
  try {
    const std::string mine_key = key(str("wait/", options_.rank));
    if (!long_wait) {
      // Left its wait: rank 0 must not count it as still there.
      store_->set(mine_key, string_to_bytes(encode(WaitReport{++beat_, "", 0, 0})));
      reported_waiting_ = false;
      return;
    }
    const WaitReport mine{++beat_, waiting.call.kind, waiting.call.seq, waiting.call.bytes};
    store_->set(mine_key, string_to_bytes(encode(mine)));
    reported_waiting_ = true;

    read_failures();
    if (auto failure = first_failure()) {
      const auto from = std::max(waiting.since, *failure_seen_);
      if (now - from >= options_.stop_grace && still_waiting(waiting)) {
        finish(str("rank ", options_.rank, " of ", options_.world,
                   " ends: ", failure_text(*failure), ", and this rank has waited for it in ",
                   describe(waiting.call), " for ", seconds_text(now - from),
                   " s since, a collective no rank can complete without it. (No launcher of "
                   "fulgur's supervises these ranks, so their watch over the store ends them as "
                   "the launcher would.)"));
        return;
      }
    }

    const std::string desync_key = key("desync");
    const std::string read_key = key("desync_read");
    if (options_.rank == 0) {
      judge_.observe(0, mine, now);
      for (int r = 1; r < options_.world; ++r) {
        const std::string theirs = key(str("wait/", r));
        std::optional<WaitReport> report;
        if (store_->check({theirs})) report = decode_wait(bytes_to_string(store_->get(theirs)));
        judge_.observe(r, report, now);
      }
      const auto verdict = judge_.verdict(now);
      if (!verdict || !still_waiting(waiting)) return;
      store_->set(desync_key, string_to_bytes(*verdict));
      // The others read it from this rank's store: it stays up until each
      // has, or a few periods have passed (the store answers meanwhile).
      for (int i = 0; i < 5 && store_ && store_->add(read_key, 0) < options_.world - 1; ++i) {
        store.unlock();
        std::this_thread::sleep_for(options_.period);
        store.lock();
      }
      finish(str("rank 0 of ", options_.world, " ends: ", *verdict));
    } else if (store_->check({desync_key})) {
      const std::string verdict = bytes_to_string(store_->get(desync_key));
      if (!still_waiting(waiting)) return;
      store_->add(read_key, 1);
      finish(str("rank ", options_.rank, " of ", options_.world, " ends: ", verdict));
    }
  } catch (const std::exception&) {
    // The store does not answer (its holder is gone, or slow): the
    // collective's own error or timeout says what happened.
    lost_store();
  }
}

void PeerWatch::read_failures() {
  // Every failure written and every stage started counts one change: only
  // a count that moved is read again.
  const int64_t changes = store_->add(key("changes"), 0);
  if (changes == changes_read_) return;
  std::vector<Failure> failures;
  for (int r = 0; r < options_.world; ++r) {
    if (r == options_.rank) continue;
    const std::string k = key(str("failure/", r));
    if (!store_->check({k})) continue;
    // "<stage> <record>": a rank that has started a later stage since has
    // recovered from it.
    const std::string text = bytes_to_string(store_->get(k));
    const auto space = text.find(' ');
    if (space == std::string::npos) continue;
    const int64_t stage = std::atoll(text.substr(0, space).c_str());
    const std::string stage_key = key(str("stage/", r));
    if (store_->check({stage_key}) &&
        std::atoll(bytes_to_string(store_->get(stage_key)).c_str()) > stage) {
      continue;
    }
    if (auto record = decode_failure(text.substr(space + 1))) failures.push_back({r, *record});
  }
  changes_read_ = changes;
  failures_ = std::move(failures);
  if (failures_.empty()) {
    failure_seen_.reset();
  } else if (!failure_seen_) {
    failure_seen_ = Clock::now();
  }
}

std::optional<PeerWatch::Failure> PeerWatch::first_failure() const {
  // The first rank that failed on its own; else the first that lost a peer.
  const Failure* first = nullptr;
  for (const auto& f : failures_) {
    if (first == nullptr || (first->record.peer_lost && !f.record.peer_lost) ||
        (first->record.peer_lost == f.record.peer_lost && f.record.at_ms < first->record.at_ms)) {
      first = &f;
    }
  }
  return first == nullptr ? std::nullopt : std::optional<Failure>(*first);
}

std::string PeerWatch::failure_text(const Failure& failure) const {
  if (!failure.record.peer_lost)
    return str("rank ", failure.rank, " failed (", failure.record.what, ")");
  return str("rank ", failure.rank, " lost a peer (", failure.record.what,
             ") and no rank said that it failed on its own (one died: a signal, the OOM killer?)");
}

void PeerWatch::publish_failure(bool peer_lost, const CollectiveCall* call,
                                const std::string& what) {
  int64_t stage = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_here_) return;
    failed_here_ = true;
    stage = stage_;
  }
  const FailureRecord record = failure_record(peer_lost, call, what);
  {
    std::lock_guard<std::mutex> lock(store_mutex_);
    if (ended_ || !usable_store(Clock::now())) return;
    try {
      store_->set(key(str("failure/", options_.rank)),
                  string_to_bytes(str(stage, " ", encode(record))));
      store_->add(key("changes"), 1);
    } catch (const std::exception&) {
      lost_store();
      return;
    }
  }
  keep_store_for_peers();
}

void PeerWatch::keep_store_for_peers() {
  // This process holds the store, and is about to fail: the peers that
  // learn of the failure later (a third rank, whose collective loses this
  // one) read who failed from it. Until each has said it failed too, or
  // for the stop grace (at most 5 s). Two ranks: the other is the cause.
  if (!options_.holds_store || options_.world <= 2) return;
  const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(options_.stop_grace,
                                                                           std::chrono::seconds(5));
  while (Clock::now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(store_mutex_);
      if (!store_) return;
      int told = 0;
      try {
        for (int r = 1; r < options_.world; ++r) told += store_->check({key(str("failure/", r))});
      } catch (const std::exception&) {
        lost_store();
        return;
      }
      if (told == options_.world - 1) return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void PeerWatch::new_stage() {
  int64_t stage = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failed_here_ = false;
    stage = ++stage_;
  }
  std::lock_guard<std::mutex> lock(store_mutex_);
  judge_.forget();
  if (ended_ || !usable_store(Clock::now())) return;
  try {
    store_->set(key(str("stage/", options_.rank)), string_to_bytes(std::to_string(stage)));
    store_->add(key("changes"), 1);
  } catch (const std::exception&) {
    lost_store();
  }
}

std::string PeerWatch::known_failure() {
  std::lock_guard<std::mutex> lock(store_mutex_);
  if (usable_store(Clock::now())) {
    try {
      read_failures();
    } catch (const std::exception&) {
      lost_store();
    }
  }
  const auto failure = first_failure();
  if (failure && !failure->record.peer_lost) {
    return str("rank ", failure->rank, " failed first: ", failure->record.what);
  }
  if (!store_) {
    if (options_.store_holder == "rank 0") {
      return "Rank 0, which holds the ranks' store, does not answer either: it failed or died, "
             "and its own output says why";
    }
    return str("The ranks' store, which ", options_.store_holder, " holds, does not answer either");
  }
  return "";
}

void PeerWatch::finish(const std::string& message) {
  ended_ = true;
  end_(message);
}

}  // namespace fulgur::detail
