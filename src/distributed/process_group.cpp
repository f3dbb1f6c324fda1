#include "fulgur/distributed/process_group.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef USE_C10D_MPI
#include <torch/csrc/distributed/c10d/ProcessGroupMPI.hpp>
#endif
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "fulgur/core/errors.h"
#include "distributed/launchers/heartbeat.h"
#include "distributed/peer_watch.h"
#include "distributed/tcp_store.h"

namespace fulgur {

namespace {

// A socket that closes itself.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

using Resolved = detail::SocketAddress;

Resolved resolve(const std::string& host, int port, const ProcessGroupOptions& o) {
  try {
    return detail::resolve_address(host, port);
  } catch (const DistributedError& e) {
    throw DistributedError(str("rank ", o.rank, " of ", o.world_size, ": ", e.what(),
                               " Set MASTER_ADDR to the IP or host name of the machine that "
                               "runs rank 0."));
  }
}

std::string ip_text(const sockaddr_storage& addr) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (addr.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(addr).sin_addr, buf, sizeof buf);
  } else {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(addr).sin6_addr, buf, sizeof buf);
  }
  return buf;
}

// The local IP this machine uses to reach the main address: Gloo's pairs
// listen there, so other machines can connect back.
std::string local_ip_towards(const Resolved& main) {
  Fd sock(::socket(main.family, SOCK_DGRAM, 0));
  if (sock.fd >= 0 &&
      ::connect(sock.fd, reinterpret_cast<const sockaddr*>(&main.addr), main.len) == 0) {
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (::getsockname(sock.fd, reinterpret_cast<sockaddr*>(&local), &len) == 0)
      return ip_text(local);
  }
  return main.family == AF_INET6 ? "::1" : "127.0.0.1";
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean: return c10d::ReduceOp::SUM;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

}  // namespace

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<C10dGroup> group;
  // Its own connection to the store: the watch's requests are bounded.
  std::shared_ptr<detail::PeerWatch> watch;
};

const std::vector<std::string>& known_process_group_backends() {
  static const std::vector<std::string> names = {"gloo", "nccl", "mpi"};
  return names;
}

std::vector<std::string> available_process_group_backends() {
  std::vector<std::string> out = {"gloo"};
#ifdef USE_C10D_NCCL
  out.emplace_back("nccl");
#endif
#ifdef USE_C10D_MPI
  out.emplace_back("mpi");
#endif
  return out;
}

std::string process_group_backend_problem(const std::string& backend, c10::Device device) {
  const auto available = available_process_group_backends();
  if (std::find(available.begin(), available.end(), backend) == available.end()) {
    const auto& known = known_process_group_backends();
    const bool is_known = std::find(known.begin(), known.end(), backend) != known.end();
    return str(
        "backend \"", backend, "\" ",
        is_known ? "is not in this build: its LibTorch was built without it" : "is not a backend",
        ". Available: ", join(available),
        backend == "nccl" ? " (nccl needs a CUDA build of LibTorch with NCCL; gloo also "
                            "runs on CPU)"
                          : "",
        ".");
  }
  if (backend == "mpi" && device.is_cuda()) {
    return str("backend \"mpi\" on ", device.str(),
               " would need a CUDA-aware MPI; use \"nccl\" "
               "for CUDA devices.");
  }
  if (backend == "nccl" && !device.is_cuda()) {
    return str("backend \"nccl\" runs on CUDA devices, but this rank's device is ", device.str(),
               ". Use \"gloo\" on CPU.");
  }
  return {};
}

std::string default_process_group_backend(c10::Device device) {
  const auto available = available_process_group_backends();
  const bool nccl = std::find(available.begin(), available.end(), "nccl") != available.end();
  return device.is_cuda() && nccl ? "nccl" : "gloo";
}

namespace {

c10::intrusive_ptr<C10dGroup> make_gloo(const ProcessGroupOptions& o, const Resolved& main,
                                        const c10::intrusive_ptr<c10d::Store>& store) {
  auto options = c10d::ProcessGroupGloo::Options::create(o.timeout);
  options->devices.push_back(
      c10d::ProcessGroupGloo::createDeviceForHostname(local_ip_towards(main)));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, o.rank, o.world_size, options);
}

// How a rank that fails before it joins the rendezvous tells the others,
// where no launcher of fulgur's supervises the ranks: the first such
// failure, "<rank>\n<its error's first line>", then a count of the ranks
// that have told or read it (rank 0 holds its store until all have).
constexpr const char* kFailedBeforeJoiningKey = "fulgur/rendezvous/failed";
constexpr const char* kToldKey = "fulgur/rendezvous/told";
// Every rank counts itself in, the last one sets the second key.
constexpr const char* kArrivedKey = "fulgur/rendezvous/arrived";
constexpr const char* kAllArrivedKey = "fulgur/rendezvous/all_arrived";
constexpr auto kTellBound = std::chrono::seconds(5);

// The rendezvous this process has begun ("host:port#rank"): a failure of
// that rank after that is not one before it joined (a peer's failure it
// read there, a timeout that its peers saw too).
std::mutex rendezvous_begun_mutex;
std::set<std::string> rendezvous_begun;

std::string rendezvous_key(const ProcessGroupOptions& o) {
  return str(o.main_address, ":", o.main_port, "#", o.rank);
}

// Watches a rendezvous where no launcher of fulgur's supervises the ranks
// (a launcher names a rank that ended):
//  - says now and then that it still waits (after rendezvous_note_after,
//    then twice as long each time), so that a rank that never comes (one
//    not started, one that crashed) does not leave the others silent until
//    the timeout;
//  - on its own connection to fulgur's store (not torchrun's: its agent
//    stops the ranks itself), reads whether a rank failed before it joined
//    (ProcessGroup::announce_failure_before_joining). Then it interrupts
//    the store the rendezvous waits on, which fails it at once, and
//    failure() says why.
// Nothing reaches the store until the rendezvous has waited a second.
class RendezvousWatch {
 public:
  explicit RendezvousWatch(const ProcessGroupOptions& o) : o_(o) {
    if (o.world_size < 2 || detail::has_supervisor()) return;
    reads_store_ = o.hosted_store_prefix.empty();
    if (!reads_store_ && o.rendezvous_note_after.count() <= 0) return;
    thread_ = std::thread([this] { run(); });
  }
  ~RendezvousWatch() { stop(); }
  RendezvousWatch(const RendezvousWatch&) = delete;
  RendezvousWatch& operator=(const RendezvousWatch&) = delete;

  // The store the rendezvous waits on: interrupted once a failure is read
  // (at once, where one was read already).
  void attach(const c10::intrusive_ptr<detail::TcpStore>& store) {
    std::lock_guard<std::mutex> lock(mutex_);
    store_ = store;
    if (!failure_.empty()) store_->interrupt(failure_);
  }

  // Whether it reads fulgur's store (then the ranks arrive there before
  // the backend connects them: see connect()).
  bool reads_store() const { return reads_store_; }

  // The rendezvous is over: no more reading, no interrupt of the group's
  // store, and the watch's connection closed (rank 0's store would hold
  // three per rank while the peers' watch opens its own).
  void finish() {
    stop();
    own_.reset();
    store_.reset();
  }

  // "rank 1 failed before it joined the rendezvous at ...", or "".
  std::string failure() {
    std::lock_guard<std::mutex> lock(mutex_);
    return failure_;
  }

  // On rank 0 (which holds the store), after failure(): until every rank
  // has told or read the failure (bounded), so that none of them finds the
  // store gone instead.
  void let_the_others_read() {
    stop();
    const auto deadline = std::chrono::steady_clock::now() + kTellBound;
    while (std::chrono::steady_clock::now() < deadline) {
      try {
        if (own_told()->add(kToldKey, 0) >= o_.world_size) return;
      } catch (const std::exception&) {
        own_.reset();  // a slow answer: a new connection
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

 private:
  void stop() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }

  void run() {
    using Clock = std::chrono::steady_clock;
    constexpr auto kPeriod = std::chrono::seconds(1);
    const auto start = Clock::now();
    auto note_after = o_.rendezvous_note_after;
    auto next_note = note_after.count() > 0 && note_after < o_.timeout ? start + note_after
                                                                       : Clock::time_point::max();
    auto next_read = reads_store_ ? start + kPeriod : Clock::time_point::max();
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (changed_.wait_until(lock, std::min(next_note, next_read), [&] { return done_; })) return;
      const auto now = Clock::now();
      if (now >= next_note) {
        detail::print_note(str(
            "rank ", o_.rank, " of ", o_.world_size, ": the rendezvous at ", o_.main_address, ":",
            o_.main_port, " has waited ", detail::seconds_text(note_after),
            " s for the other ranks (it gives up after ", detail::seconds_text(o_.timeout),
            " s: process_group_timeout). A rank that failed before it joined, or one not "
            "started, keeps every other rank here until then: check each rank's output, and that "
            "every rank has the same MASTER_ADDR and MASTER_PORT."));
        note_after *= 2;
        next_note = note_after < o_.timeout ? start + note_after : Clock::time_point::max();
      }
      if (now >= next_read) {
        lock.unlock();
        std::string failure = read_failure();
        lock.lock();
        next_read = Clock::now() + kPeriod;
        if (!failure.empty()) {
          failure_ = std::move(failure);
          if (store_) store_->interrupt(failure_);
          lock.unlock();
          // Counted as told only now: rank 0 may close its store once
          // every rank is, and this rank's rendezvous must fail naming the
          // cause, not the closed store.
          const auto deadline = Clock::now() + kTellBound;
          while (Clock::now() < deadline) {
            try {
              own_told()->add(kToldKey, 1);
              return;
            } catch (const std::exception&) {
              own_.reset();  // a slow answer (a loaded rank 0): again
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
          }
          return;
        }
      }
    }
  }

  // The watch's connection, for counting who has heard of a failure: with
  // requests of a second (reading polls with shorter ones).
  detail::TcpStore* own_told() {
    if (!own_) {
      own_ = std::make_unique<detail::TcpStore>(o_.main_address, o_.main_port, /*server=*/false,
                                                std::chrono::seconds(1));
    }
    own_->setTimeout(std::chrono::seconds(1));
    return own_.get();
  }

  // The failure a rank told of, as this rank's error says it; "" while
  // none has (or the store cannot be reached yet).
  std::string read_failure() {
    // Short requests: the main thread waits for this one at the end of a
    // rendezvous.
    constexpr auto kRequest = std::chrono::milliseconds(300);
    try {
      if (!own_) {
        own_ = std::make_unique<detail::TcpStore>(o_.main_address, o_.main_port,
                                                  /*server=*/false, kRequest);
      }
      if (!own_->check({kFailedBeforeJoiningKey})) return "";
      const std::string text = detail::bytes_to_string(own_->get(kFailedBeforeJoiningKey));
      const auto newline = text.find('\n');
      return str("rank ", text.substr(0, newline), " failed before it joined the rendezvous at ",
                 o_.main_address, ":", o_.main_port, ": ",
                 newline == std::string::npos ? std::string() : text.substr(newline + 1),
                 " The rendezvous cannot complete without it: this rank stops waiting.");
    } catch (const std::exception&) {
      own_.reset();  // rank 0's store is not up yet, or went away: again later
      return "";
    }
  }

  const ProcessGroupOptions o_;
  bool reads_store_ = false;
  std::unique_ptr<detail::TcpStore> own_;  // the thread's, then (joined) the caller's
  std::mutex mutex_;
  std::condition_variable changed_;
  bool done_ = false;
  std::string failure_;
  c10::intrusive_ptr<detail::TcpStore> store_;
  std::thread thread_;
};

// The watch of ranks no launcher of fulgur's supervises (peer_watch.h),
// over a connection of its own whose requests end within seconds: the
// group's has the group's timeout. Null where that connection fails (the
// collectives work without it).
std::shared_ptr<detail::PeerWatch> watch_peers(const ProcessGroupOptions& o) {
  detail::PeerWatch::Connect connect = [o]() -> c10::intrusive_ptr<c10d::Store> {
    constexpr std::chrono::milliseconds kStoreTimeout = std::chrono::seconds(3);
    if (o.hosted_store_prefix.empty()) {
      return c10::make_intrusive<detail::TcpStore>(o.main_address, o.main_port,
                                                   /*server=*/false, kStoreTimeout);
    }
    return c10::make_intrusive<c10d::PrefixStore>(
        o.hosted_store_prefix,
        compat::connect_tcp_store(o.main_address, o.main_port, kStoreTimeout));
  };
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = connect();
  } catch (const std::exception& e) {
    detail::print_note(str("rank ", o.rank, " of ", o.world_size,
                           ": the ranks will not watch each other (a peer's failure or a desync "
                           "is then named only by the process group's timeout): a second "
                           "connection to the store at ",
                           o.main_address, ":", o.main_port, " failed: ", e.what()));
    return nullptr;
  }
  detail::PeerWatchOptions watch;
  watch.rank = o.rank;
  watch.world = o.world_size;
  watch.stop_grace = o.stop_grace;
  watch.desync_after = std::min<std::chrono::milliseconds>(o.timeout / 2, std::chrono::minutes(1));
  watch.store_holder = o.hosted_store_prefix.empty() ? "rank 0" : "torchrun's agent";
  watch.holds_store = o.rank == 0 && o.hosted_store_prefix.empty();
  static std::atomic<int64_t> groups{0};
  watch.group = groups.fetch_add(1);
  return std::make_shared<detail::PeerWatch>(std::move(store), std::move(connect), watch);
}

// The error of a collective that failed because a peer left or stopped
// answering.
std::string peer_lost_message(const std::string& message, const detail::CollectiveCall& call,
                              detail::PeerWatch* watch) {
  // The launcher learns from the record that this rank is a victim; so do
  // the peers, where they watch each other.
  detail::report_failure(/*peer_lost=*/true, &call, message);
  if (watch == nullptr) return str(message, "\n", detail::kPeerFailedHint);
  watch->publish_failure(/*peer_lost=*/true, &call, message);
  const std::string cause = watch->known_failure();
  return str(message, "\n", cause.empty() ? detail::kUnsupervisedPeerFailedHint : cause + ".");
}

}  // namespace

PendingCollective::PendingCollective(c10::intrusive_ptr<c10d::Work> work, std::string what,
                                     const char* kind, int64_t seq, int64_t bytes,
                                     std::shared_ptr<detail::PeerWatch> watch)
    : work_(std::move(work)),
      what_(std::move(what)),
      kind_(kind),
      seq_(seq),
      bytes_(bytes),
      watch_(std::move(watch)) {}
PendingCollective::~PendingCollective() = default;
PendingCollective::PendingCollective(PendingCollective&&) noexcept = default;
PendingCollective& PendingCollective::operator=(PendingCollective&&) noexcept = default;

void PendingCollective::wait() {
  if (!work_) return;
  auto work = std::move(work_);
  // Reaching a collective is progress: a rank that never gets here while
  // its peers wait falls behind, and the launcher can name it.
  detail::send_heartbeat("collective");
  const detail::CollectiveCall call{kind_, seq_, bytes_};
  detail::InCollective waiting(call);
  if (watch_) watch_->enter(call);
  try {
    work->wait();
  } catch (const std::exception& e) {
    if (watch_) watch_->leave();
    throw DistributedError(
        peer_lost_message(str(what_, " failed: ", e.what()), call, watch_.get()));
  }
  if (watch_) watch_->leave();
}

ProcessGroup::ProcessGroup(ProcessGroupOptions options, std::unique_ptr<Impl> impl)
    : options_(std::move(options)), impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() {
  if (impl_ && impl_->group) compat::shutdown_group(*impl_->group, options_.backend);
}

std::shared_ptr<ProcessGroup> ProcessGroup::connect(const ProcessGroupOptions& o) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    throw DistributedError(str("ProcessGroup: rank ", o.rank, " does not fit world size ",
                               o.world_size, ". Check RANK and WORLD_SIZE."));
  }
  if (o.main_port < 1 || o.main_port > 65535) {
    throw DistributedError(str("ProcessGroup: main port ", o.main_port,
                               " (MASTER_PORT) is not a "
                               "TCP port; set MASTER_PORT to a port in 1..65535."));
  }
  if (auto problem = process_group_backend_problem(o.backend, o.device); !problem.empty()) {
    throw DistributedError("ProcessGroup: " + problem);
  }
  if (o.timeout.count() <= 0) {
    throw DistributedError(str("ProcessGroup: timeout ", o.timeout.count(), " ms must be > 0."));
  }
  // A write to a peer that died must be an error this rank reports (EPIPE,
  // a failed collective), not a SIGPIPE that kills it first and gets it
  // named as the cause of the failure: gloo writes to its peers without
  // MSG_NOSIGNAL. Python ignores SIGPIPE at start-up, which is why PyTorch's
  // ranks never die of it; a C++ program does not. (Here, not only in the
  // strategies: a program that connects a group itself gets it too.)
  if (o.world_size > 1) std::signal(SIGPIPE, SIG_IGN);
  auto impl = std::make_unique<Impl>();
#ifdef USE_C10D_MPI
  if (o.backend == "mpi") {
    // mpirun made the ranks and MPI connects them: no store.
    try {
      impl->group = c10d::ProcessGroupMPI::createProcessGroupMPI();
    } catch (const std::exception& e) {
      throw DistributedError(str("rank ", o.rank, " of ", o.world_size,
                                 ": building the MPI "
                                 "process group failed: ",
                                 e.what()));
    }
    if (impl->group->getRank() != o.rank || impl->group->getSize() != o.world_size) {
      throw DistributedError(str("ProcessGroup: MPI says this is rank ", impl->group->getRank(),
                                 " of ", impl->group->getSize(),
                                 ", but the cluster environment "
                                 "says rank ",
                                 o.rank, " of ", o.world_size,
                                 ". Start the "
                                 "program with mpirun -np <devices x num_nodes>."));
    }
    return std::shared_ptr<ProcessGroup>(new ProcessGroup(o, std::move(impl)));
  }
#endif
  Resolved main = resolve(o.main_address, o.main_port, o);
  if (o.world_size > 1) {
    // Gloo connects to every peer; the store's server in rank 0 holds two
    // connections per rank (the group's and the peers' watch's; the
    // rendezvous's watch's closes before that one opens). Linux's usual
    // limit of 1024 open files would end a few hundred ranks.
    const bool hosts_store = o.rank == 0 && o.hosted_store_prefix.empty();
    const int64_t needed =
        detail::open_files_in_use() + 256 + int64_t{o.world_size} * (hosts_store ? 3 : 1);
    if (auto problem = detail::raise_open_file_limit(needed); !problem.empty()) {
      detail::print_note(str("rank ", o.rank, " of ", o.world_size, ": ", problem));
    }
  }
  {
    std::lock_guard<std::mutex> lock(rendezvous_begun_mutex);
    rendezvous_begun.insert(rendezvous_key(o));
  }
  RendezvousWatch watch(o);

  if (!o.hosted_store_prefix.empty()) {
    // torchrun's agent hosts a c10d TCPStore there: join it as a client.
    try {
      impl->store = c10::make_intrusive<c10d::PrefixStore>(
          o.hosted_store_prefix, compat::connect_tcp_store(o.main_address, o.main_port, o.timeout));
    } catch (const std::exception& e) {
      throw DistributedError(str("rank ", o.rank, " of ", o.world_size,
                                 ": rendezvous failed: "
                                 "could not join the store that torchrun's agent hosts at ",
                                 o.main_address, ":", o.main_port,
                                 " (TORCHELASTIC_USE_AGENT_"
                                 "STORE=True): ",
                                 e.what(),
                                 " Check that torchrun is still "
                                 "running and that MASTER_ADDR/MASTER_PORT are torchrun's."));
    }
  } else {
    try {
      // Rank 0 listens on the main address only (LibTorch 1.13's TCPStore
      // would listen on every interface); it says at once when the address
      // is not its own or the port is taken.
      auto store = c10::make_intrusive<detail::TcpStore>(o.main_address, o.main_port, o.rank == 0,
                                                         o.timeout);
      watch.attach(store);
      impl->store = std::move(store);
    } catch (const DistributedError& e) {
      throw DistributedError(
          str("rank ", o.rank, " of ", o.world_size, ": rendezvous failed: ", e.what()));
    }
  }
  // A rank that failed before it joined, read by the watch, is the cause
  // of whatever failed here.
  auto failed_for_a_peer = [&] {
    std::string failure = watch.failure();
    if (failure.empty()) return;
    if (o.rank == 0) watch.let_the_others_read();
    throw DistributedError(str("rank ", o.rank, " of ", o.world_size, ": ", failure));
  };
  if (watch.reads_store()) {
    // Every rank arrives in the store before the backend connects them, so
    // that a rank waiting for one that never comes waits where the watch
    // can interrupt it: not in Gloo's connections to its peers (a rank
    // whose peer is held up by the missing rank waits there), nor in
    // NCCL's (made at its first collective).
    try {
      if (impl->store->add(kArrivedKey, 1) == o.world_size) {
        impl->store->set(kAllArrivedKey, detail::string_to_bytes("1"));
      }
      impl->store->wait({kAllArrivedKey});
    } catch (const std::exception& e) {
      failed_for_a_peer();
      throw DistributedError(
          str("rank ", o.rank, " of ", o.world_size, ": rendezvous failed: ", e.what()));
    }
  }
  try {
    if (o.backend == "nccl") {
      impl->group = compat::make_nccl_group(impl->store, o.rank, o.world_size, o.timeout);
    }
    if (o.backend == "gloo") impl->group = make_gloo(o, main, impl->store);
  } catch (const std::exception& e) {
    failed_for_a_peer();
    throw DistributedError(str("rank ", o.rank, " of ", o.world_size, ": building the ", o.backend,
                               " process group through ", o.main_address, ":", o.main_port,
                               " failed: ", e.what(), detail::open_files_hint(e.what())));
  }
  watch.finish();
  if (o.watch_peers && o.world_size > 1 && !detail::has_supervisor()) {
    impl->watch = watch_peers(o);
  }
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(o, std::move(impl)));
}

const c10::intrusive_ptr<C10dGroup>& ProcessGroup::c10d_group() const { return impl_->group; }

at::Tensor ProcessGroup::staged(const at::Tensor& tensor) const {
  if (options_.backend == "nccl" && !tensor.is_cuda()) return tensor.to(options_.device);
  return tensor;
}

void ProcessGroup::run(const char* what, int64_t bytes,
                       const std::function<c10::intrusive_ptr<c10d::Work>()>& start) {
  const int64_t seq = ++calls_;
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = start();
  } catch (const std::exception& e) {
    throw DistributedError(
        str(what, " on rank ", rank(), " of ", size(), " failed to start: ", e.what()));
  }
  PendingCollective(std::move(work), str(what, " #", seq, " on rank ", rank(), " of ", size()),
                    what, seq, bytes, impl_->watch)
      .wait();
}

void ProcessGroup::announce_failure(const std::string& what) {
  if (impl_->watch) impl_->watch->publish_failure(/*peer_lost=*/false, nullptr, what);
}

bool ProcessGroup::announce_failure_before_joining(const ProcessGroupOptions& o,
                                                   const std::string& what) {
  if (o.world_size < 2 || o.rank < 0 || o.rank >= o.world_size || o.main_port < 1 ||
      o.main_port > 65535 || !o.hosted_store_prefix.empty() || o.backend == "mpi" ||
      detail::has_supervisor()) {
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(rendezvous_begun_mutex);
    if (rendezvous_begun.count(rendezvous_key(o)) > 0) return false;
  }
  std::string first_line = what.substr(0, what.find('\n'));
  if (first_line.size() > 500) first_line = first_line.substr(0, 497) + "...";
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + kTellBound;
  try {
    // Rank 0 hosts the store the others wait for; another rank waits a
    // little for rank 0's (it may start later).
    detail::TcpStore store(o.main_address, o.main_port, /*server=*/o.rank == 0, kTellBound);
    store.setTimeout(std::chrono::seconds(1));  // a live store answers at once
    store.compareSet(kFailedBeforeJoiningKey, {},
                     detail::string_to_bytes(str(o.rank, "\n", first_line)));
    store.add(kToldKey, 1);
    if (o.rank != 0) return true;
    bool noted = false;
    for (;;) {
      if (store.add(kToldKey, 0) >= o.world_size) return true;
      if (Clock::now() >= deadline) return false;
      if (!noted && Clock::now() >= deadline - kTellBound + std::chrono::milliseconds(500)) {
        noted = true;
        detail::print_note(str("rank 0 of ", o.world_size, " keeps the rendezvous's store at ",
                               o.main_address, ":", o.main_port, " up for up to ",
                               detail::seconds_text(kTellBound),
                               " s, so that the other ranks learn of its failure."));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception&) {
    // No store to tell (rank 0 not up, its port taken): the others' notes
    // say that the rendezvous waits.
    return false;
  }
}

void ProcessGroup::begin_stage() {
  if (impl_->watch) impl_->watch->new_stage();
}

void ProcessGroup::barrier() {
  c10d::BarrierOptions opts;
  // NCCL would otherwise guess the device from the rank.
  if (options_.device.is_cuda()) opts.device_ids = {options_.device.index()};
  run("barrier", 0, [&] { return impl_->group->barrier(opts); });
}

void ProcessGroup::broadcast_(at::Tensor& tensor, int src) {
  if (src < 0 || src >= size()) {
    throw DistributedError(
        str("broadcast from rank ", src, ": the world has ranks 0..", size() - 1, "."));
  }
  std::vector<at::Tensor> tensors = {staged(tensor)};
  c10d::BroadcastOptions opts;
  opts.rootRank = src;
  run("broadcast", static_cast<int64_t>(tensor.nbytes()),
      [&] { return impl_->group->broadcast(tensors, opts); });
  if (!tensors[0].is_same(tensor)) tensor.copy_(tensors[0]);
}

std::string ProcessGroup::broadcast_bytes(const std::string& value, int src) {
  at::Tensor length = torch::tensor({static_cast<int64_t>(value.size())}, torch::kLong);
  broadcast_(length, src);
  at::Tensor bytes = torch::empty({length.item<int64_t>()}, torch::kUInt8);
  if (rank() == src && !value.empty()) std::memcpy(bytes.data_ptr(), value.data(), value.size());
  if (bytes.numel() > 0) broadcast_(bytes, src);
  return std::string(static_cast<const char*>(bytes.data_ptr()),
                     static_cast<size_t>(bytes.numel()));
}

void ProcessGroup::all_reduce_(at::Tensor& tensor, ReduceOp op) {
  std::vector<at::Tensor> tensors = {staged(tensor)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  run("all_reduce", static_cast<int64_t>(tensor.nbytes()),
      [&] { return impl_->group->allreduce(tensors, opts); });
  if (!tensors[0].is_same(tensor)) tensor.copy_(tensors[0]);
  if (op == ReduceOp::kMean) {
    if (tensor.is_floating_point()) {
      tensor.div_(size());
    } else {
      tensor.div_(size(), "floor");
    }
  }
}

PendingCollective ProcessGroup::all_reduce_sum_async_(at::Tensor& tensor) {
  std::vector<at::Tensor> tensors = {tensor};
  const int64_t seq = ++calls_;
  std::string what = str("all_reduce #", seq, " of a ", tensor.numel(),
                         "-element gradient bucket on rank ", rank(), " of ", size());
  try {
    return PendingCollective(impl_->group->allreduce(tensors), std::move(what), "all_reduce", seq,
                             static_cast<int64_t>(tensor.nbytes()), impl_->watch);
  } catch (const std::exception& e) {
    throw DistributedError(str(what, " failed to start: ", e.what()));
  }
}

at::Tensor ProcessGroup::all_gather(const at::Tensor& tensor) {
  at::Tensor input = staged(tensor.contiguous());
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size(); ++r) outputs[0].push_back(torch::empty_like(input));
  std::vector<at::Tensor> inputs = {input};
  run("all_gather", static_cast<int64_t>(input.nbytes()) * size(),
      [&] { return impl_->group->allgather(outputs, inputs); });
  return torch::stack(outputs[0]).to(tensor.device());
}

void ProcessGroup::check_all_gather_into(const at::Tensor& out, const at::Tensor& shard) const {
  const int64_t n = shard.numel();
  if (shard.dim() != 1 || out.dim() != 1 || out.numel() != n * size() || !out.is_contiguous() ||
      out.scalar_type() != shard.scalar_type()) {
    throw DistributedError(fulgur::str(
        "all_gather_into on rank ", rank(), " of ", size(), ": the shard ", shard.sizes(), " ",
        shard.scalar_type(), " and the output ", out.sizes(), " ", out.scalar_type(),
        " do not fit: pass a 1-D shard and a contiguous 1-D output of ", size(),
        " times its length, of its dtype."));
  }
}

void ProcessGroup::all_gather_into(at::Tensor& out, const at::Tensor& shard) {
  check_all_gather_into(out, shard);
  const int64_t n = shard.numel();
  if (uses_rings(out)) {
    all_gather_into_async(out, shard).wait();
    return;
  }
  at::Tensor target = staged(out);
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size(); ++r) outputs[0].push_back(target.narrow(0, r * n, n));
  std::vector<at::Tensor> inputs = {staged(shard.contiguous())};
  run("all_gather", static_cast<int64_t>(shard.nbytes()) * size(),
      [&] { return impl_->group->allgather(outputs, inputs); });
  if (!target.is_same(out)) out.copy_(target);
}

PendingExchange ProcessGroup::all_gather_into_async(at::Tensor out, at::Tensor shard) {
  check_all_gather_into(out, shard);
  const int64_t n = shard.numel();
  if (!uses_rings(out)) {
    all_gather_into(out, shard);
    return {};
  }
  // Chunk k moves one rank along the ring per step, straight from the
  // `out` of the rank that has it into the `out` of the next.
  at::Tensor mine = out.narrow(0, rank() * n, n);
  if (mine.data_ptr() != shard.data_ptr()) mine.copy_(shard);
  const int world = size(), me = rank();
  return start_ring("all_gather", static_cast<int64_t>(shard.nbytes()) * size(),
                    [out, n, world, me](int k) {
                      const int64_t send = (me - k + world) % world;
                      const int64_t receive = (me - k - 1 + world) % world;
                      return std::pair{out.narrow(0, send * n, n), out.narrow(0, receive * n, n)};
                    });
}

bool ProcessGroup::uses_rings(const at::Tensor& tensor) const {
  // Gloo's sends and receives read and write host memory only.
  return options_.backend == "gloo" && size() > 1 && tensor.device().is_cpu();
}

struct PendingExchange::State {
  ProcessGroup* group = nullptr;
  const char* what = "";
  int64_t seq = 0, bytes = 0;
  int tag = 0;
  std::function<std::pair<at::Tensor, at::Tensor>(int)> step;
  std::function<void(int)> received;
  int next_step = 0;  // the step posted last is next_step - 1
  c10::intrusive_ptr<c10d::Work> out_work, in_work;
  at::Tensor sending, receiving;  // the posted step's, alive until it is done
};

PendingExchange::PendingExchange() = default;
PendingExchange::PendingExchange(std::unique_ptr<State> state) : state_(std::move(state)) {}
PendingExchange::PendingExchange(PendingExchange&&) noexcept = default;
PendingExchange& PendingExchange::operator=(PendingExchange&& other) noexcept {
  if (this != &other) {
    PendingExchange dropped(std::move(*this));
    state_ = std::move(other.state_);
  }
  return *this;
}

PendingExchange::~PendingExchange() {
  if (!state_) return;
  // Unwinding past an exchange still under way: the transport may write
  // into its tensors until the process ends, so they are never freed.
  static std::mutex mutex;
  static auto* kept = new std::vector<std::unique_ptr<State>>();
  std::lock_guard<std::mutex> lock(mutex);
  kept->push_back(std::move(state_));
}

void PendingExchange::wait() {
  if (!state_) return;
  std::unique_ptr<State> state = std::move(state_);
  try {
    state->group->finish_ring(*state);
  } catch (...) {
    state_ = std::move(state);  // kept by the destructor
    throw;
  }
}

PendingExchange ProcessGroup::start_ring(const char* what, int64_t bytes,
                                         std::function<std::pair<at::Tensor, at::Tensor>(int)> step,
                                         std::function<void(int)> received) {
  auto ring = std::make_unique<PendingExchange::State>();
  ring->group = this;
  ring->what = what;
  ring->seq = ++calls_;
  ring->bytes = bytes;
  // Rings under way at once each have a tag of their own (the same on
  // every rank: the call numbers are).
  ring->tag = kRingTag + static_cast<int>(ring->seq % 4096);
  ring->step = std::move(step);
  ring->received = std::move(received);
  post_ring_step(*ring);
  return PendingExchange(std::move(ring));
}

void ProcessGroup::post_ring_step(PendingExchange::State& ring) {
  const int next = (rank() + 1) % size(), previous = (rank() - 1 + size()) % size();
  std::tie(ring.sending, ring.receiving) = ring.step(ring.next_step);
  std::vector<at::Tensor> sent = {ring.sending}, into = {ring.receiving};
  try {
    ring.out_work = impl_->group->send(sent, next, ring.tag);
    ring.in_work = impl_->group->recv(into, previous, ring.tag);
  } catch (const std::exception& e) {
    // A peer that is gone by now shows here (its connection closed) or in
    // the wait: the same names either way.
    std::string message = str(ring.what, " #", ring.seq, " (ring step ", ring.next_step + 1,
                              " of ", size() - 1, ") on rank ", rank(), " of ", size(),
                              ", sending to rank ", next, " and receiving from rank ", previous,
                              ", failed to start: ", e.what());
    const detail::CollectiveCall call{ring.what, ring.seq, ring.bytes};
    throw DistributedError(peer_lost_message(message, call, impl_->watch.get()));
  }
  ++ring.next_step;
}

void ProcessGroup::finish_ring(PendingExchange::State& ring) {
  const int next = (rank() + 1) % size(), previous = (rank() - 1 + size()) % size();
  for (;;) {
    const int k = ring.next_step - 1;
    const std::string name = str(ring.what, " #", ring.seq, " (ring step ", k + 1, " of ",
                                 size() - 1, ") on rank ", rank(), " of ", size());
    PendingCollective(std::move(ring.in_work),
                      name + ", receiving from rank " + std::to_string(previous), ring.what,
                      ring.seq, ring.bytes, impl_->watch)
        .wait();
    PendingCollective(std::move(ring.out_work), name + ", sending to rank " + std::to_string(next),
                      ring.what, ring.seq, ring.bytes, impl_->watch)
        .wait();
    if (ring.received) ring.received(k);
    if (ring.next_step + 1 >= size()) return;
    post_ring_step(ring);
  }
}

at::Tensor ProcessGroup::reduce_scatter_sum_(at::Tensor& input) {
  reduce_scatter_sum_async_(input).wait();
  const int64_t chunk = input.numel() / size();
  return input.narrow(0, rank() * chunk, chunk);
}

PendingExchange ProcessGroup::reduce_scatter_sum_async_(at::Tensor input) {
  check_reduce_scatter_input(input);
  const int64_t chunk = input.numel() / size();
  if (size() == 1) return {};
  if (!uses_rings(input) || !input.is_contiguous()) {
    input.narrow(0, rank() * chunk, chunk).copy_(reduce_scatter_sum(input));
    return {};
  }
  // Step k sends the partial sum of chunk rank-k-1 on to the next rank and
  // adds the previous rank's partial sum of chunk rank-k-2 into this
  // rank's; after size()-1 steps chunk rank() holds every rank's sum.
  at::Tensor incoming = torch::empty({chunk}, input.options().requires_grad(false));
  const int world = size(), me = rank();
  auto index = [world, me](int offset) { return (me - offset + 2 * world) % world; };
  return start_ring(
      "reduce_scatter", static_cast<int64_t>(input.nbytes()),
      [input, incoming, chunk, index](int k) {
        return std::pair{input.narrow(0, index(k + 1) * chunk, chunk), incoming};
      },
      [input, incoming, chunk, index](int k) {
        input.narrow(0, index(k + 2) * chunk, chunk).add_(incoming);
      });
}

void ProcessGroup::check_reduce_scatter_input(const at::Tensor& input) const {
  if (input.dim() != 1 || input.numel() % size() != 0) {
    throw DistributedError(fulgur::str("reduce_scatter on rank ", rank(), " of ", size(),
                                       ": the input ", input.sizes(),
                                       " is not 1-D with a length divisible by ", size(),
                                       ". Pad it to a multiple of the world size."));
  }
}

at::Tensor ProcessGroup::reduce_scatter_sum(const at::Tensor& input) {
  check_reduce_scatter_input(input);
  const int64_t world = size();
  const int64_t chunk = input.numel() / world;
  if (world == 1) return input.clone();
  if (uses_rings(input)) {
    at::Tensor scratch = input.contiguous().clone();
    return reduce_scatter_sum_(scratch).clone();
  }
  at::Tensor send = staged(input.contiguous());
  at::Tensor received = torch::empty_like(send);
  // Chunk r of `send` goes to rank r; chunk r of `received` came from rank r.
  std::vector<int64_t> splits(static_cast<size_t>(world), chunk);
  run("reduce_scatter", static_cast<int64_t>(input.nbytes()),
      [&] { return impl_->group->alltoall_base(received, send, splits, splits); });
  return received.view({world, chunk}).sum(0).to(input.device());
}

bool ProcessGroup::ranks_arrive(const std::string& key, std::chrono::milliseconds timeout) {
  if (!impl_->store) return false;
  const std::string prefix = str("fulgur/arrive/", key, "/");
  std::vector<std::string> keys;
  for (int r = 0; r < size(); ++r) keys.push_back(prefix + std::to_string(r));
  // A rank that gave up says so: its arrival key stays, and a rank coming
  // later must not count it as there.
  const std::string gave_up = prefix + "gave_up";
  try {
    impl_->store->set(keys[static_cast<size_t>(rank())], std::vector<uint8_t>{1});
    // Polled: a store's blocking wait that times out leaves its
    // connection unusable.
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (impl_->store->check(keys)) return !impl_->store->check({gave_up});
      if (std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception&) {
    // The store's host is gone.
  }
  try {
    impl_->store->set(gave_up, std::vector<uint8_t>{1});
  } catch (const std::exception&) {
    // The store's host is gone: nobody is left to tell.
  }
  return false;
}

namespace {

// The ports the kernel gives outgoing connections and binds to port 0
// (net.ipv4.ip_local_port_range); Linux's default when unreadable.
std::pair<int, int> ephemeral_ports() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int first = 0, last = 0;
  if (in >> first >> last && first > 0 && first <= last && last <= 65535) return {first, last};
  return {32768, 60999};
}

bool can_bind(const Resolved& r) {
  Fd sock(::socket(r.family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  return sock.fd >= 0 && ::bind(sock.fd, reinterpret_cast<const sockaddr*>(&r.addr), r.len) == 0;
}

}  // namespace

int find_free_port(const std::string& address) {
  ProcessGroupOptions o;
  o.main_address = address;
  Resolved r = resolve(address, 0, o);
  // Outside the ephemeral range: a port bound to 0 comes from there, and
  // every connection any process opens meanwhile may take it before the
  // caller binds it (two tests' stores met so).
  const auto [first, last] = ephemeral_ports();
  int low = 10000, high = first - 1;
  if (high - low < 1000) std::tie(low, high) = std::pair{last + 1, 65535};
  if (high - low >= 1000) {
    std::mt19937 pick(std::random_device{}());
    std::uniform_int_distribution<int> port(low, high);
    for (int attempt = 0; attempt < 200; ++attempt) {
      const int p = port(pick);
      Resolved candidate = r;
      if (candidate.family == AF_INET) {
        reinterpret_cast<sockaddr_in&>(candidate.addr).sin_port = htons(static_cast<uint16_t>(p));
      } else {
        reinterpret_cast<sockaddr_in6&>(candidate.addr).sin6_port = htons(static_cast<uint16_t>(p));
      }
      if (can_bind(candidate)) return p;
    }
  }
  Fd sock(::socket(r.family, SOCK_STREAM, 0));
  if (sock.fd < 0 || ::bind(sock.fd, reinterpret_cast<const sockaddr*>(&r.addr), r.len) != 0) {
    throw DistributedError(str("cannot find a free TCP port on ", address, ": ",
                               std::strerror(errno), ". Set MASTER_PORT."));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(sock.fd, reinterpret_cast<sockaddr*>(&bound), &len);
  return bound.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in&>(bound).sin_port)
                                    : ntohs(reinterpret_cast<sockaddr_in6&>(bound).sin6_port);
}

}  // namespace fulgur
