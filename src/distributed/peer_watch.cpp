#include "distributed/peer_watch.h"

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "fulgur/core/errors.h"

namespace fulgur::detail {

namespace {

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
std::string text_of(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

std::string where_of(const std::string& kind, int64_t seq) { return str(kind, " #", seq); }

void end_process(const std::string& message) {
  const std::string line = "fulgur: " + message + "\n";
  std::fflush(nullptr);
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

std::optional<std::string> DesyncJudge::verdict(Clock::time_point now) const {
  std::vector<std::string> where;
  auto waited = Clock::duration::max();
  for (const Seen& s : seen_) {
    if (!s.report || s.report->kind.empty() || now - s.same_since < after_ ||
        now - s.beat_at > alive_) {
      return std::nullopt;
    }
    where.push_back(where_of(s.report->kind, s.report->seq));
    waited = std::min(waited, now - s.same_since);
  }
  if (std::all_of(where.begin(), where.end(), [&](const auto& w) { return w == where.front(); })) {
    return std::nullopt;
  }
  return str("the ranks have waited ", seconds_text(waited),
             " s in different collectives, none of them moving (", by_rank(where, ": in "),
             "), which none can complete: a desync. ", kDesyncHint);
}

PeerWatch::PeerWatch(c10::intrusive_ptr<c10d::Store> store, PeerWatchOptions options, End end)
    : store_(std::move(store)),
      options_(options),
      end_(end ? std::move(end) : End(end_process)),
      judge_(options.world, options.desync_after, 3 * options.period) {
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

std::string PeerWatch::key(const std::string& name) const { return "fulgur/peers/" + name; }

void PeerWatch::enter(const CollectiveCall& call) {
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_ = {true, call, Clock::now()};
}

void PeerWatch::leave() {
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_.active = false;
}

void PeerWatch::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait_for(lock, options_.period, [&] { return stop_; });
    if (stop_) return;
    if (failed_here_) continue;
    const Waiting waiting = waiting_;
    lock.unlock();
    look(waiting, Clock::now());
    lock.lock();
  }
}

void PeerWatch::look(const Waiting& waiting, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(store_mutex_);
  if (ended_ || !store_) return;
  const bool long_wait = waiting.active && now - waiting.since >= options_.period;
  try {
    const std::string mine_key = key(str("wait/", options_.rank));
    if (!long_wait) {
      // Left its wait: rank 0 must not count it as still there.
      if (reported_waiting_) store_->set(mine_key, bytes_of(encode(WaitReport{++beat_, "", 0, 0})));
      reported_waiting_ = false;
      return;
    }
    const WaitReport mine{++beat_, waiting.call.kind, waiting.call.seq, waiting.call.bytes};
    store_->set(mine_key, bytes_of(encode(mine)));
    reported_waiting_ = true;

    read_failures();
    if (auto failure = first_failure()) {
      const auto from = std::max(waiting.since, *failure_seen_);
      if (now - from >= options_.stop_grace) {
        finish(
            str("rank ", options_.rank, " of ", options_.world, " ends: rank ", failure->rank,
                " failed (", failure->record.what, "), and this rank has waited for it in ",
                describe(waiting.call), " for ", seconds_text(now - from),
                " s since, a collective no rank can complete without it. (No launcher of "
                "fulgur's supervises these ranks, so their watch over the store ends them as the "
                "launcher would.)"));
        return;
      }
    }

    const std::string desync_key = key("desync");
    if (options_.rank == 0) {
      judge_.observe(0, mine, now);
      for (int r = 1; r < options_.world; ++r) {
        const std::string theirs = key(str("wait/", r));
        std::optional<WaitReport> report;
        if (store_->check({theirs})) report = decode_wait(text_of(store_->get(theirs)));
        judge_.observe(r, report, now);
      }
      if (auto verdict = judge_.verdict(now)) {
        store_->set(desync_key, bytes_of(*verdict));
        // The others read it from this rank's store: it stays up until
        // each has (or a few periods have passed).
        const std::string read_key = key("desync_read");
        for (int i = 0; i < 5 && store_->add(read_key, 0) < options_.world - 1; ++i) {
          std::this_thread::sleep_for(options_.period);
        }
        finish(str("rank 0 of ", options_.world, " ends: ", *verdict));
      }
    } else if (store_->check({desync_key})) {
      const std::string verdict = text_of(store_->get(desync_key));
      store_->add(key("desync_read"), 1);
      finish(str("rank ", options_.rank, " of ", options_.world, " ends: ", verdict));
    }
  } catch (const std::exception&) {
    // The store does not answer (rank 0 is gone, or its machine): the
    // collective's own error or timeout says what happened.
    store_.reset();
  }
}

void PeerWatch::read_failures() {
  // A failing rank writes its record, then counts it: a count that moved
  // says which keys to look for.
  const int64_t count = store_->add(key("failures"), 0);
  if (count == failures_read_) return;
  failures_read_ = count;
  for (int r = 0; r < options_.world; ++r) {
    if (r == options_.rank) continue;
    if (std::any_of(failures_.begin(), failures_.end(), [&](const auto& f) { return f.rank == r; }))
      continue;
    const std::string k = key(str("failure/", r));
    if (!store_->check({k})) continue;
    if (auto record = decode_failure(text_of(store_->get(k)))) failures_.push_back({r, *record});
  }
  if (!failures_.empty() && !failure_seen_) failure_seen_ = Clock::now();
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

void PeerWatch::publish_failure(bool peer_lost, const CollectiveCall* call,
                                const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_here_) return;
    failed_here_ = true;
  }
  FailureRecord record;
  record.peer_lost = peer_lost;
  if (call != nullptr) record.collective = describe(*call);
  record.at_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                     std::chrono::system_clock::now().time_since_epoch())
                     .count();
  record.what = what.substr(0, std::min<size_t>(what.find('\n'), 1000));
  std::lock_guard<std::mutex> lock(store_mutex_);
  if (ended_ || !store_) return;
  try {
    store_->set(key(str("failure/", options_.rank)), bytes_of(encode(record)));
    store_->add(key("failures"), 1);
  } catch (const std::exception&) {
    store_.reset();  // nobody is left to tell
  }
}

std::string PeerWatch::known_failure() {
  std::lock_guard<std::mutex> lock(store_mutex_);
  if (store_) {
    try {
      read_failures();
    } catch (const std::exception&) {
      store_.reset();
    }
  }
  const auto failure = first_failure();
  if (failure && !failure->record.peer_lost) {
    return str("rank ", failure->rank, " failed first: ", failure->record.what);
  }
  if (!store_ && options_.rank != 0) {
    return "The store, which rank 0 holds, no longer answers either: rank 0 failed or died, and "
           "its own output says why";
  }
  return "";
}

void PeerWatch::finish(const std::string& message) {
  ended_ = true;
  end_(message);
}

}  // namespace fulgur::detail
