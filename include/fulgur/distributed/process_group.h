// File: fulgur/distributed/process_group.h
//
// A ProcessGroup is the set of ranks of one run and the collectives between
// them, on top of LibTorch's c10d: a store rendezvous at the main
// address:port, then ProcessGroupGloo (CPU tensors), ProcessGroupNCCL (CUDA
// tensors; in LibTorch builds with NCCL) or ProcessGroupMPI (in builds with
// MPI). Every collective is bounded by the group's timeout, and every
// failure (a peer that died, a timeout, a bad address) is a DistributedError
// naming the operation, this rank and what to check.
//
//   auto group = fulgur::ProcessGroup::connect({.main_address = "127.0.0.1",
//                                               .main_port = 29500,
//                                               .world_size = 2, .rank = r});
//   group->all_reduce_(grad, fulgur::ReduceOp::kSum);
//
// Parallel strategies create one in setup_environment(); a Module reaches it
// through Module::process_group() (see fulgur/strategies/parallel.h). The raw
// c10d group is there for what fulgur does not wrap.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fulgur/distributed/types.h"
#include "fulgur/utilities/torch_compat.h"

namespace c10d {
class Work;
}  // namespace c10d

namespace fulgur {

namespace detail {
class PeerWatch;
}  // namespace detail

/// The c10d object the collectives run on (see compat::C10dGroup).
using C10dGroup = compat::C10dGroup;

struct ProcessGroupOptions {
  /// Where rank 0 listens (MASTER_ADDR). Rank 0 must own this address.
  std::string main_address = "127.0.0.1";
  /// MASTER_PORT; must be set (launchers pick a free one when unset).
  int main_port = 0;
  int world_size = 1;
  int rank = 0;
  /// Non-empty: a store already listens at main_address:main_port (hosted
  /// by torchrun's agent); every rank joins it as a client and keeps its
  /// keys under this prefix. Empty: rank 0 hosts fulgur's own store.
  std::string hosted_store_prefix = {};
  /// Bounds the rendezvous and every collective.
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  /// "gloo" (CPU tensors), "nccl" (CUDA tensors), "mpi" (ranks from
  /// mpirun; no store). A backend this build's LibTorch lacks is a clear
  /// error (available_backends() lists the others).
  std::string backend = "gloo";
  /// This rank's device. nccl needs a CUDA device: CPU tensors passed to a
  /// collective (a decision, a path's bytes) go through it and back.
  c10::Device device = c10::Device(c10::kCPU);
  /// Where no launcher of fulgur's supervises the ranks (srun, mpirun over
  /// Gloo, torchrun, a program started on each machine), they watch each
  /// other through the store (parallel strategies turn it on): a rank that
  /// fails says so there, a peer whose collective lost it names it, a peer
  /// left waiting for it in a collective ends after `stop_grace` naming it,
  /// and ranks that wait in different collectives (a desync) all end after
  /// half the timeout (at most a minute), naming where each waits. Nothing
  /// reaches the store while no collective waits a second. A wait is seen
  /// where the host blocks in a collective (Gloo; NCCL's calls return at
  /// once). Off for ranks in one process (threads) and without a store (mpi).
  bool watch_peers = false;
  std::chrono::milliseconds stop_grace = std::chrono::seconds(5);
  /// While the rendezvous waits for the other ranks, a note after this long
  /// and again after twice as long each time (where no launcher of fulgur's
  /// supervises the ranks; zero: none): a rank that never comes keeps the
  /// others there until the timeout.
  std::chrono::milliseconds rendezvous_note_after = std::chrono::seconds(30);
};

/// Every backend name fulgur knows: "gloo", "nccl", "mpi".
const std::vector<std::string>& known_process_group_backends();
/// The backends this build's LibTorch has: "gloo", and "nccl" / "mpi"
/// where it was built with them.
std::vector<std::string> available_process_group_backends();
/// Why `backend` cannot run a rank on `device` with this build (naming
/// both and what to use instead); empty when it can.
std::string process_group_backend_problem(const std::string& backend, c10::Device device);
/// "nccl" for a CUDA device when available, else "gloo" (as PyTorch
/// Lightning's DDP picks).
std::string default_process_group_backend(c10::Device device);

/// A started asynchronous collective.
class PendingCollective {
 public:
  /// `what` names it in errors; `kind` ("all_reduce"), `seq` (the group's
  /// call number) and `bytes` are what a supervising launcher is told this
  /// rank waits in while wait() blocks.
  /// `watch`: the group's watch over its peers (ProcessGroupOptions::
  /// watch_peers), told of the wait and of its failure.
  PendingCollective(c10::intrusive_ptr<c10d::Work> work, std::string what,
                    const char* kind = "collective", int64_t seq = 0, int64_t bytes = 0,
                    std::shared_ptr<detail::PeerWatch> watch = nullptr);
  ~PendingCollective();
  PendingCollective(PendingCollective&&) noexcept;
  PendingCollective& operator=(PendingCollective&&) noexcept;
  /// Blocks until done; DistributedError on failure or timeout.
  void wait();

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;
  const char* kind_;
  int64_t seq_;
  int64_t bytes_;
  std::shared_ptr<detail::PeerWatch> watch_;
};

class ProcessGroup;

/// An all-gather or reduce-scatter under way (ProcessGroup's *_async), to
/// overlap with computation: wait() finishes it (DistributedError as the
/// blocking call's). A ring of more than two ranks moves its first step
/// when started and the rest in wait(). One dropped without wait() (an
/// error unwinding) keeps its tensors alive for the rest of the process, as
/// the transfer may still write into them.
class PendingExchange {
 public:
  PendingExchange();
  ~PendingExchange();
  PendingExchange(PendingExchange&&) noexcept;
  PendingExchange& operator=(PendingExchange&&) noexcept;
  void wait();
  bool pending() const { return state_ != nullptr; }

 private:
  friend class ProcessGroup;
  struct State;
  explicit PendingExchange(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

class ProcessGroup {
 public:
  /// Rendezvous with every rank and build the group. DistributedError when
  /// the peers do not all arrive within the timeout, or the address cannot
  /// be used, naming the address, port, rank and world size.
  static std::shared_ptr<ProcessGroup> connect(const ProcessGroupOptions& options);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return options_.rank; }
  int size() const { return options_.world_size; }
  const ProcessGroupOptions& options() const { return options_; }
  /// The collectives started on this group so far (each one's sequence
  /// number is the count after it): what a step costs, counted.
  int64_t collectives_started() const { return calls_; }

  void barrier();
  /// `tensor` takes rank `src`'s values (in place).
  void broadcast_(at::Tensor& tensor, int src = 0);
  /// `value` takes rank `src`'s bytes; any length.
  std::string broadcast_bytes(const std::string& value, int src = 0);
  /// In place. Mean is a sum divided by the world size.
  void all_reduce_(at::Tensor& tensor, ReduceOp op);
  /// Starts a sum all-reduce of `tensor` in place; wait on the result.
  PendingCollective all_reduce_sum_async_(at::Tensor& tensor);
  /// Every rank's `tensor` (same shape everywhere), stacked on dimension 0.
  at::Tensor all_gather(const at::Tensor& tensor);
  /// Every rank's 1-D `shard` (the same length everywhere) written in rank
  /// order into `out`, 1-D of size() times that length (no copy after).
  void all_gather_into(at::Tensor& out, const at::Tensor& shard);
  /// This rank's chunk of the sum over every rank of `input`: 1-D, its
  /// length a multiple of size(), chunk r for rank r (a reduce-scatter, as
  /// sharded data parallel reduces gradients).
  at::Tensor reduce_scatter_sum(const at::Tensor& input);
  /// The same in `input`'s own memory, which the exchange uses as its
  /// scratch (it holds partial sums after): returns the view of chunk
  /// rank() of `input`, which holds the sum.
  at::Tensor reduce_scatter_sum_(at::Tensor& input);
  /// all_gather_into and reduce_scatter_sum_, started: `out` (and, for the
  /// reduce-scatter, chunk rank() of `input`) hold the result after wait().
  /// Neither tensor may be touched until then.
  PendingExchange all_gather_into_async(at::Tensor out, at::Tensor shard);
  PendingExchange reduce_scatter_sum_async_(at::Tensor input);
  //
  // Under Gloo the all-gather and the reduce-scatter run as rings of
  // sends and receives straight between the callers' tensors (size()-1
  // steps of one chunk each: the bytes of a ring collective, and no copy;
  // Debian 12's Gloo has no reduce-scatter, and its all-gather copies
  // through buffers it allocates, 5x slower on 200 MB); other backends use
  // their all-gather, and an all-to-all with a local sum.

  /// Whether every rank calls this with the same `key` within `timeout`
  /// (through the rendezvous store, not a collective: a rank stuck in a
  /// collective elsewhere only makes it false, never blocks it). False
  /// without a store (mpi). Each key is used once per group.
  bool ranks_arrive(const std::string& key, std::chrono::milliseconds timeout);

  /// Tells the peers that this rank failed (`what`: its error), where they
  /// watch each other (ProcessGroupOptions::watch_peers); a no-op otherwise,
  /// and after this rank's first failure. The Trainer calls it for an error
  /// that ends a stage.
  void announce_failure(const std::string& what);
  /// Where this rank fails before it has joined the rendezvous `o` describes
  /// (a flag, a file or a device wrong on its machine only) and no launcher
  /// of fulgur's supervises the ranks: tells the others through fulgur's
  /// store at o.main_address:o.main_port (rank 0 hosts it for the
  /// purpose), so that their rendezvous fails at once naming this rank and
  /// `what` instead of waiting out the timeout. Takes at most a few
  /// seconds: rank 0 until every rank has heard, another rank while rank
  /// 0's store is not up. A no-op for one rank, torchrun's store (its
  /// agent stops the ranks), mpi, and a rank that has begun this
  /// rendezvous in connect() (it has joined, or it failed there, as the
  /// others did). The Trainer and fulgur::CLI call it for their errors.
  /// True when it told: rank 0 once every other rank has heard, another
  /// rank once rank 0's store has it.
  static bool announce_failure_before_joining(const ProcessGroupOptions& o,
                                              const std::string& what);
  /// Another stage (fit, validate, test, predict) starts on this rank, which
  /// has recovered from any failure it announced: its peers stop counting
  /// it. Parallel strategies call it for each stage after the first.
  void begin_stage();

  /// The underlying c10d group (include the c10d headers to use it).
  const c10::intrusive_ptr<C10dGroup>& c10d_group() const;

 private:
  struct Impl;
  ProcessGroup(ProcessGroupOptions options, std::unique_ptr<Impl> impl);
  /// Runs a blocking collective, turning a c10d failure into a
  /// DistributedError that says which operation failed on which rank.
  void run(const char* what, int64_t bytes,
           const std::function<c10::intrusive_ptr<c10d::Work>()>& start);
  /// `tensor` itself, or (nccl, CPU tensor) a copy on the group's device.
  at::Tensor staged(const at::Tensor& tensor) const;
  /// Whether all-gathers and reduce-scatters of `tensor` run as rings of
  /// sends and receives (Gloo, more than one rank, host memory).
  bool uses_rings(const at::Tensor& tensor) const;
  friend class PendingExchange;
  /// size()-1 ring steps, one call number: step(k) gives what this rank
  /// sends to the next rank and the tensor the previous rank's arrives in;
  /// received(k) runs once it has. The first step starts now.
  PendingExchange start_ring(const char* what, int64_t bytes,
                             std::function<std::pair<at::Tensor, at::Tensor>(int)> step,
                             std::function<void(int)> received = {});
  void post_ring_step(PendingExchange::State& ring);
  void finish_ring(PendingExchange::State& ring);
  void check_reduce_scatter_input(const at::Tensor& input) const;
  void check_all_gather_into(const at::Tensor& out, const at::Tensor& shard) const;
  static constexpr int kRingTag = 0x7269;

  ProcessGroupOptions options_;
  std::unique_ptr<Impl> impl_;
  /// Collectives started so far: the next one's sequence number.
  int64_t calls_ = 0;
};

/// A TCP port that was free on `address` a moment ago, outside the range
/// the kernel gives outgoing connections (net.ipv4.ip_local_port_range), so
/// that no connection opened meanwhile takes it (bind to port 0 where that
/// range leaves no room).
int find_free_port(const std::string& address = "127.0.0.1");

}  // namespace fulgur
