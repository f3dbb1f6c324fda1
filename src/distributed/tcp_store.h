// fulgur's rendezvous store: a c10d::Store whose server (in global rank 0)
// listens on the main address only — LibTorch 1.13's TCPStore listens on
// every interface of the machine. Keys and values live in rank 0's memory;
// every rank (rank 0 included) is a client over TCP. get() and wait() block
// until the keys exist or the timeout passes, and every failure names the
// address, the port and what to check.
#pragma once

#include <sys/socket.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fulgur/utilities/torch_compat.h"

namespace fulgur::detail {

/// A resolved TCP address (the first getaddrinfo() gives).
struct SocketAddress {
  sockaddr_storage addr{};
  socklen_t len = 0;
  int family = AF_INET;
};
/// `host`:`port` resolved; DistributedError naming the host as MASTER_ADDR
/// when it does not resolve.
SocketAddress resolve_address(const std::string& host, int port);

/// A store value as text, and text as a store value.
std::string bytes_to_string(const std::vector<uint8_t>& v);
std::vector<uint8_t> string_to_bytes(const std::string& s);

/// The files (descriptors) this process has open now.
int64_t open_files_in_use();
/// Raises this process's soft limit of open files to `needed` where its
/// hard limit allows. Returns "" when the limit is (now) at least
/// `needed`; otherwise the soft limit is raised to the hard one and the
/// result says how far below `needed` that is and how to raise it.
std::string raise_open_file_limit(int64_t needed);
/// " This process has reached ..." naming the limit and how to raise it,
/// where `error` is an error of running out of open files; "" otherwise.
std::string open_files_hint(const std::string& error);

class StoreServer;

class TcpStore : public c10d::Store {
 public:
  /// `server`: this process runs the server (global rank 0); it binds to
  /// `host`:`port` and fails at once when that is not possible.
  TcpStore(const std::string& host, int port, bool server, std::chrono::milliseconds timeout);
  ~TcpStore() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  /// Another client of the same server, with its own connection. LibTorch
  /// 2.8's Store declares it (NCCL's watchdog uses a copy); before, it is
  /// fulgur's own.
  c10::intrusive_ptr<c10d::Store> clone() FULGUR_STORE_CLONE_OVERRIDE;
  /// From another thread: the request this client's connection waits in,
  /// and every later one, fails at once with `why` (the server, where
  /// this is rank 0, stays up).
  void interrupt(const std::string& why);

 private:
  std::string request(const std::string& message, std::chrono::milliseconds timeout,
                      const char* what);
  std::string where() const;

  std::string host_;
  int port_;
  std::unique_ptr<StoreServer> server_;
  int fd_ = -1;
  // Whether the server has answered on this connection: one closed before
  // any answer was refused (rank 0 out of open files) or found rank 0 ending.
  bool answered_ = false;
  std::mutex mutex_;  // one request at a time
  // Guards fd_'s closing against interrupt() from another thread (which
  // must not shut down a descriptor number already reused elsewhere).
  std::mutex fd_mutex_;
  std::string interrupted_;  // under fd_mutex_
};

}  // namespace fulgur::detail
