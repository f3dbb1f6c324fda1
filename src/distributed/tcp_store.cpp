#include "distributed/tcp_store.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <thread>

#include "fulgur/core/errors.h"

namespace fulgur::detail {

// The wire's op codes (outside the anonymous namespace: StoreServer, which
// has external linkage, holds one).
enum StoreOp : uint8_t { kSet = 1, kGet, kAdd, kCheck, kDelete, kNumKeys, kWait, kCompareSet };

namespace {

using Clock = std::chrono::steady_clock;

// ---- Framing: an op byte, then length-prefixed strings; replies are one
// length-prefixed string.
void put_string(std::string& out, const std::string& s) {
  uint32_t n = htonl(static_cast<uint32_t>(s.size()));
  out.append(reinterpret_cast<const char*>(&n), 4);
  out += s;
}

// Reads length-prefixed strings from `in` starting at `pos`.
bool take_string(const std::string& in, size_t& pos, std::string& out) {
  if (in.size() < pos + 4) return false;
  uint32_t n;
  std::memcpy(&n, in.data() + pos, 4);
  n = ntohl(n);
  if (in.size() < pos + 4 + n) return false;
  out.assign(in, pos + 4, n);
  pos += 4 + n;
  return true;
}

bool send_all(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

SocketAddress resolve_address(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    throw DistributedError(str("main address \"", host,
                               "\" (MASTER_ADDR) does not resolve: ", ::gai_strerror(rc), "."));
  }
  SocketAddress a;
  std::memcpy(&a.addr, found->ai_addr, found->ai_addrlen);
  a.len = found->ai_addrlen;
  a.family = found->ai_family;
  ::freeaddrinfo(found);
  return a;
}

std::string bytes_to_string(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}
std::vector<uint8_t> string_to_bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

int64_t open_files_in_use() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  int64_t n = 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n - 1;  // the directory's own descriptor
}

namespace {

constexpr const char* kRaiseOpenFileLimit =
    "Raise the limit where the ranks start: `ulimit -n` (the hard limit, `ulimit -Hn`, as root "
    "or in /etc/security/limits.conf), LimitNOFILE= of a systemd unit, or under SLURM the "
    "nodes' limit (slurmd's LimitNOFILE) that PropagateResourceLimits passes on.";

std::string limit_text(rlim_t limit) {
  return limit == RLIM_INFINITY ? std::string("unlimited") : std::to_string(limit);
}

}  // namespace

std::string raise_open_file_limit(int64_t needed) {
  rlimit limit{};
  if (needed <= 0 || ::getrlimit(RLIMIT_NOFILE, &limit) != 0) return "";
  const auto want = static_cast<rlim_t>(needed);
  if (limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur >= want) return "";
  const rlim_t hard = limit.rlim_max;
  const bool enough = hard == RLIM_INFINITY || hard >= want;
  limit.rlim_cur = enough ? want : hard;
  if (::setrlimit(RLIMIT_NOFILE, &limit) == 0 && enough) return "";
  ::getrlimit(RLIMIT_NOFILE, &limit);
  return str("this process may need about ", needed, " open files, but its limit is ",
             limit_text(limit.rlim_cur), " (hard limit ", limit_text(hard),
             "): past it a connection fails with \"Too many open files\". ", kRaiseOpenFileLimit);
}

std::string open_files_hint(const std::string& error) {
  if (error.find(std::strerror(EMFILE)) == std::string::npos) return "";  // ENFILE's starts so too
  rlimit limit{};
  ::getrlimit(RLIMIT_NOFILE, &limit);
  return str(" This process (limit ", limit_text(limit.rlim_cur),
             " open files) or the machine has run out of open files. ", kRaiseOpenFileLimit);
}

namespace {

// A connected socket to `a`, or -1 with `error` set. Bounded by `deadline`:
// a blocking connect() to an address that drops packets (a firewall, a full
// accept queue) waits for the kernel's SYN retries, about two minutes.
int connect_before(const SocketAddress& a, Clock::time_point deadline, int& error) {
  int fd = ::socket(a.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    error = errno;
    return -1;
  }
  auto give_up = [&](int why) {
    error = why;
    ::close(fd);
    return -1;
  };
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&a.addr), a.len) != 0) {
    if (errno != EINPROGRESS) return give_up(errno);
    pollfd p{fd, POLLOUT, 0};
    int n;
    do {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      n = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 0)));
    } while (n < 0 && errno == EINTR);
    if (n == 0) return give_up(ETIMEDOUT);
    if (n < 0) return give_up(errno);
    int so_error = 0;
    socklen_t len = sizeof so_error;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len);
    if (so_error != 0) return give_up(so_error);
  }
  // Requests wait with poll() and their own timeout; writes may block.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

}  // namespace

// ---- Server: one thread, poll over the listening socket and the clients.
class StoreServer {
 public:
  StoreServer(const std::string& host, int port) : where_(str(host, ":", port)) {
    SocketAddress a = resolve_address(host, port);
    listen_fd_ = ::socket(a.family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(listen_fd_, reinterpret_cast<const sockaddr*>(&a.addr), a.len) != 0) {
      int err = errno;
      ::close(listen_fd_);
      if (err == EADDRNOTAVAIL) {
        throw DistributedError(str("rank 0: main address ", host,
                                   " (MASTER_ADDR) is not an "
                                   "address of this machine, but rank 0 runs here and must listen "
                                   "on it. Set MASTER_ADDR to this machine's address (127.0.0.1 "
                                   "for one machine)."));
      }
      if (err == EADDRINUSE) {
        throw DistributedError(str("rank 0: main port ", port, " (MASTER_PORT) on ", host,
                                   " is already in use by another process. Set MASTER_PORT to a "
                                   "free port, or unset it on a single machine to let fulgur pick "
                                   "one."));
      }
      throw DistributedError(
          str("rank 0: cannot listen on ", host, ":", port, ": ", std::strerror(err), "."));
    }
    // Every rank connects at once: a full queue drops connections, which
    // then wait out the kernel's SYN retries.
    if (::listen(listen_fd_, SOMAXCONN) != 0) {
      int err = errno;
      ::close(listen_fd_);
      throw DistributedError(
          str("rank 0: cannot listen on ", host, ":", port, ": ", std::strerror(err), "."));
    }
    if (::pipe2(wake_, O_CLOEXEC) != 0) {
      ::close(listen_fd_);
      throw DistributedError("rank 0: cannot create the store's wake-up pipe.");
    }
    spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    thread_ = std::thread([this] { loop(); });
  }

  ~StoreServer() {
    stop_ = true;
    char c = 0;
    (void)!::write(wake_[1], &c, 1);
    thread_.join();
    for (auto& [fd, _] : conns_) ::close(fd);
    ::close(listen_fd_);
    ::close(wake_[0]);
    ::close(wake_[1]);
    if (spare_fd_ >= 0) ::close(spare_fd_);
  }

 private:
  struct Waiter {
    int fd;
    StoreOp op;  // kGet or kWait
    std::vector<std::string> keys;
  };

  void loop() {
    while (!stop_) {
      std::vector<pollfd> fds = {{wake_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}};
      for (const auto& [fd, _] : conns_) fds.push_back({fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), -1) < 0) continue;
      if (fds[1].revents & POLLIN) accept_one();
      for (size_t i = 2; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        int fd = fds[i].fd;
        char buf[65536];
        ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n <= 0) {
          drop(fd);
          continue;
        }
        std::string& in = conns_[fd];
        in.append(buf, static_cast<size_t>(n));
        try {
          while (handle_one(fd, in)) {
          }
        } catch (const std::exception&) {
          // A malformed request (not one of our clients, or a corrupted
          // stream): that connection goes, the store and rank 0 stay.
          drop(fd);
        }
      }
    }
  }

  void accept_one() {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      conns_[fd];
      if (spare_fd_ < 0) spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      return;
    }
    const int error = errno;
    if (error == EMFILE || error == ENFILE) {
      refuse(error);
    } else if (error == ENOBUFS || error == ENOMEM) {
      // The connection stays queued; poll() would return at once.
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  // No descriptor is left for a waiting connection. Left queued, it would
  // wake poll() at once, forever, and its rank would wait out its timeout:
  // the spare descriptor makes room to accept and close it, so that rank
  // fails at once, and rank 0 says why.
  void refuse(int error) {
    if (!said_out_of_files_) {
      said_out_of_files_ = true;
      print_note(str("rank 0: the store at ", where_,
                     " cannot take another rank's connection: ", std::strerror(error), " (",
                     conns_.size(), " connections open). That rank fails.",
                     open_files_hint(std::strerror(error))));
    }
    if (spare_fd_ >= 0) {
      ::close(spare_fd_);
      spare_fd_ = -1;
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) ::close(fd);
      spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    if (spare_fd_ < 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  void drop(int fd) {
    ::close(fd);
    // Where refuse() lost the spare to another thread's open.
    if (spare_fd_ < 0) spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    conns_.erase(fd);
    std::erase_if(waiters_, [fd](const Waiter& w) { return w.fd == fd; });
  }

  void reply(int fd, const std::string& payload) {
    std::string out;
    put_string(out, payload);
    send_all(fd, out);
  }

  bool has_all(const std::vector<std::string>& keys) const {
    for (const auto& k : keys) {
      if (data_.count(k) == 0) return false;
    }
    return true;
  }

  void wake_waiters() {
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (has_all(it->keys)) {
        reply(it->fd, it->op == kGet ? data_[it->keys.front()] : std::string("1"));
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Handles one complete request at the front of `in`; false when `in`
  // does not hold a complete one yet.
  bool handle_one(int fd, std::string& in) {
    if (in.empty()) return false;
    const auto op = static_cast<StoreOp>(in[0]);
    size_t pos = 1;
    std::vector<std::string> args;
    const int count = op == kNumKeys                ? 0
                      : op == kSet || op == kAdd    ? 2
                      : op == kCompareSet           ? 3
                      : op == kCheck || op == kWait ? -1
                                                    : 1;
    if (count < 0) {
      std::string n;
      if (!take_string(in, pos, n)) return false;
      const int keys = std::stoi(n);
      for (int i = 0; i < keys; ++i) {
        std::string k;
        if (!take_string(in, pos, k)) return false;
        args.push_back(std::move(k));
      }
    } else {
      for (int i = 0; i < count; ++i) {
        std::string s;
        if (!take_string(in, pos, s)) return false;
        args.push_back(std::move(s));
      }
    }
    in.erase(0, pos);
    switch (op) {
      case kSet:
        data_[args[0]] = args[1];
        reply(fd, "");
        wake_waiters();
        break;
      case kGet:
      case kWait:
        if (has_all(args)) {
          reply(fd, op == kGet ? data_[args[0]] : std::string("1"));
        } else {
          waiters_.push_back({fd, op, args});
        }
        break;
      case kAdd: {
        int64_t value = std::stoll(args[1]);
        auto it = data_.find(args[0]);
        if (it != data_.end()) value += std::stoll(it->second);
        data_[args[0]] = std::to_string(value);
        reply(fd, std::to_string(value));
        wake_waiters();
        break;
      }
      case kCheck: reply(fd, has_all(args) ? "1" : "0"); break;
      case kDelete: reply(fd, data_.erase(args[0]) > 0 ? "1" : "0"); break;
      case kNumKeys: reply(fd, std::to_string(data_.size())); break;
      case kCompareSet: {
        auto it = data_.find(args[0]);
        if (it == data_.end()) {
          if (args[1].empty()) data_[args[0]] = args[2];
          reply(fd, it == data_.end() && args[1].empty() ? args[2] : args[1]);
        } else {
          if (it->second == args[1]) it->second = args[2];
          reply(fd, it->second);
        }
        wake_waiters();
        break;
      }
      default:
        drop(fd);  // not a client of ours
        return false;
    }
    return true;
  }

  std::string where_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  // Held for refuse(); reopened once a descriptor is free again.
  int spare_fd_ = -1;
  bool said_out_of_files_ = false;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::map<int, std::string> conns_;
  std::map<std::string, std::string> data_;
  std::vector<Waiter> waiters_;
};

// ---- Client.

c10::intrusive_ptr<c10d::Store> TcpStore::clone() {
  return c10::make_intrusive<TcpStore>(host_, port_, /*server=*/false, timeout_);
}

TcpStore::TcpStore(const std::string& host, int port, bool server,
                   std::chrono::milliseconds timeout)
    : c10d::Store(timeout), host_(host), port_(port) {
  if (server) server_ = std::make_unique<StoreServer>(host, port);
  SocketAddress a = resolve_address(host, port);
  // Rank 0 may start later than the others: retry until the timeout.
  const auto deadline = Clock::now() + timeout;
  int last_error = 0;
  for (;;) {
    fd_ = connect_before(a, deadline, last_error);
    if (fd_ >= 0) break;
    if (last_error == EMFILE || last_error == ENFILE) {
      throw DistributedError(str("cannot open a connection to the store at ", where(), ": ",
                                 std::strerror(last_error), ".",
                                 open_files_hint(std::strerror(last_error))));
    }
    if (Clock::now() >= deadline) {
      throw DistributedError(str("cannot reach the main process's store at ", where(), " within ",
                                 timeout.count() / 1000.0, " s: ", std::strerror(last_error),
                                 ". Check that rank 0 is running, that MASTER_ADDR and MASTER_PORT "
                                 "are the same on every rank, and that the port is reachable."));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

void TcpStore::interrupt(const std::string& why) {
  std::lock_guard<std::mutex> lock(fd_mutex_);
  interrupted_ = why;
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

std::string TcpStore::where() const { return str(host_, ":", port_, " (MASTER_ADDR:MASTER_PORT)"); }

std::string TcpStore::request(const std::string& message, std::chrono::milliseconds timeout,
                              const char* what) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fd_ < 0) {
    std::lock_guard<std::mutex> fd_lock(fd_mutex_);
    throw DistributedError(interrupted_.empty() ? str("the store at ", where(),
                                                      " is unusable after an earlier failure.")
                                                : interrupted_);
  }
  auto fail = [&](const std::string& why) {
    std::string interrupted;
    {
      std::lock_guard<std::mutex> fd_lock(fd_mutex_);
      ::close(fd_);
      fd_ = -1;
      interrupted = interrupted_;
    }
    throw DistributedError(
        str("store ", what, " at ", where(), " failed: ", interrupted.empty() ? why : interrupted));
  };
  if (!send_all(fd_, message)) fail(std::strerror(errno));
  std::string in;
  const auto deadline = timeout.count() > 0 ? Clock::now() + timeout : Clock::time_point::max();
  for (;;) {
    size_t pos = 0;
    std::string payload;
    if (take_string(in, pos, payload)) {
      answered_ = true;
      return payload;
    }
    int wait_ms = -1;
    if (deadline != Clock::time_point::max()) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) {
        fail(str("no answer within ", timeout.count() / 1000.0,
                 " s (a rank that should have "
                 "written the key did not arrive: check that every rank started)"));
      }
      wait_ms = static_cast<int>(left.count());
    }
    pollfd p{fd_, POLLIN, 0};
    int r = ::poll(&p, 1, wait_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) continue;
    char buf[65536];
    ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      fail(answered_ ? "the main process (rank 0) closed the connection: it probably ended"
                     : "the main process (rank 0) closed this new connection without an answer: it "
                       "ended, or it had no open file left for the connection (rank 0's output "
                       "says which)");
    }
    in.append(buf, static_cast<size_t>(n));
  }
}

namespace {
std::string message(StoreOp op, const std::vector<std::string>& args, bool counted = false) {
  std::string out(1, static_cast<char>(op));
  if (counted) put_string(out, std::to_string(args.size()));
  for (const auto& a : args) put_string(out, a);
  return out;
}
}  // namespace

void TcpStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  request(message(kSet, {key, bytes_to_string(value)}), timeout_, "set");
}

std::vector<uint8_t> TcpStore::compareSet(const std::string& key,
                                          const std::vector<uint8_t>& expected,
                                          const std::vector<uint8_t>& desired) {
  return string_to_bytes(
      request(message(kCompareSet, {key, bytes_to_string(expected), bytes_to_string(desired)}),
              timeout_, "compare_set"));
}

std::vector<uint8_t> TcpStore::get(const std::string& key) {
  return string_to_bytes(request(message(kGet, {key}), timeout_, "get"));
}

int64_t TcpStore::add(const std::string& key, int64_t value) {
  return std::stoll(request(message(kAdd, {key, std::to_string(value)}), timeout_, "add"));
}

bool TcpStore::deleteKey(const std::string& key) {
  return request(message(kDelete, {key}), timeout_, "delete") == "1";
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  return request(message(kCheck, keys, /*counted=*/true), timeout_, "check") == "1";
}

int64_t TcpStore::getNumKeys() {
  return std::stoll(request(message(kNumKeys, {}), timeout_, "num_keys"));
}

void TcpStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void TcpStore::wait(const std::vector<std::string>& keys,
                    const std::chrono::milliseconds& timeout) {
  request(message(kWait, keys, /*counted=*/true), timeout, "wait");
}

}  // namespace fulgur::detail
