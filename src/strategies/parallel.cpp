#include "fulgur/strategies/parallel.h"

#include <torch/torch.h>

#include <atomic>
#include <mutex>
#include <map>
#include <sstream>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/distributed/launchers/fork.h"
#include "fulgur/distributed/launchers/subprocess_script.h"
#include "fulgur/distributed/process_group.h"
#include "fulgur/nn/sync_batch_norm.h"
#include "fulgur/plugins/environments/cluster_environment.h"
#include "distributed/launchers/heartbeat.h"
#include "strategies/early_failure.h"

namespace fulgur {

namespace {

// The process group a strategy made in a process that a launcher outside
// fulgur started (torchrun, SLURM, mpirun; not fulgur's own launchers,
// whose ranks run one stage): kept for the life of the process, as
// torch.distributed keeps its default group, and taken by any later
// Trainer of the same rendezvous (the Tuner's trials, then the fit; a fit,
// then a Trainer to test). A second rendezvous on the same port would race
// the first one's store: a rank done early joined it as its holder closed
// it, and the holder found its port taken while an earlier Trainer lived.
struct KeptGroup {
  std::string rendezvous;  // "address:port/prefix"
  std::shared_ptr<ProcessGroup> group;
};

std::mutex kept_mutex;
// The kept group, once there is one (a plain pointer: looking it up makes
// no static).
KeptGroup* kept_group = nullptr;

// The first time, after that group's making (which may bring statics of
// LibTorch to life): this one is destroyed before them, so the group ends
// at the process's normal exit while what it uses is still there.
void keep_group(KeptGroup group) {
  static KeptGroup kept;
  kept = std::move(group);
  kept_group = &kept;
}

std::string rendezvous_of(const ProcessGroupOptions& o) {
  return str(o.main_address, ":", o.main_port, "/", o.hosted_store_prefix);
}

}  // namespace

ParallelStrategy::ParallelStrategy(ParallelOptions options, std::string_view owner,
                                   const Choice<StartMethod>& start_method)
    : parallel_(std::move(options)) {
  const auto& backend = parallel_.process_group_backend;
  const auto& known = known_process_group_backends();
  if (!backend.empty() && std::find(known.begin(), known.end(), backend) == known.end()) {
    throw ConfigError(str(owner, ": process_group_backend=\"", backend, "\" is not one of ",
                          join(known), " (or empty: nccl on CUDA, else gloo)."));
  }
  if (!start_method.is_valid()) {
    throw ConfigError(str(owner, ": start_method=\"", start_method.text(),
                          "\" is not one of \"popen\" (re-execute the program per rank) or "
                          "\"fork\" (fork the ranks at fit())."));
  }
  if (parallel_.process_group_timeout.count() <= 0) {
    throw ConfigError(str(owner,
                          ": process_group_timeout=", parallel_.process_group_timeout.count(),
                          "ms: a collective must be given time, > 0 (default 30 min). Pass e.g. "
                          "std::chrono::minutes(10)."));
  }
  if (parallel_.stop_grace.count() < 0) {
    throw ConfigError(str(owner, ": stop_grace=", parallel_.stop_grace.count(),
                          "ms: the ranks' grace between SIGTERM and SIGKILL is >= 0 (default "
                          "5 s). Pass e.g. std::chrono::seconds(5)."));
  }
  start_method_ = start_method.value();
}

std::string describe_parallel_options(const ParallelOptions& o) {
  return str(", process_group_timeout=", o.process_group_timeout.count() / 1000, "s",
             ", process_group_backend=",
             o.process_group_backend.empty() ? "auto" : o.process_group_backend,
             ", stop_grace=", o.stop_grace.count() / 1000, "s");
}

ParallelStrategy::~ParallelStrategy() = default;

const LaunchedRank* ParallelStrategy::launched_rank() const {
  return launcher() != nullptr ? launcher()->launched_rank() : nullptr;
}

Ranks ParallelStrategy::ranks() const {
  const auto& env = cluster_environment();
  if (const auto* launched = launched_rank()) {
    return {.global = launched->global_rank,
            .local = launched->local_rank,
            .node = env.node_rank(),
            .world_size = launched->world_size};
  }
  int world = env.world_size();
  if (!env.creates_processes_externally() && world <= 1) {
    world = static_cast<int>(std::max<size_t>(parallel_devices().size(), 1)) * num_nodes();
  }
  return {.global = env.global_rank(),
          .local = env.local_rank(),
          .node = env.node_rank(),
          .world_size = world};
}

c10::Device ParallelStrategy::root_device() const {
  const auto& devices = parallel_devices();
  int local = local_rank();
  if (devices.empty()) return c10::Device(c10::kCPU);
  if (local < 0 || local >= static_cast<int>(devices.size())) {
    throw DistributedError(str("strategy \"", name(), "\": this process has local rank ", local,
                               " but the node has ", devices.size(),
                               " device(s). Set devices to "
                               "the number of processes per node (LOCAL_WORLD_SIZE)."));
  }
  return devices[static_cast<size_t>(local)];
}

int ParallelStrategy::main_port() const {
  if (launcher() != nullptr) {
    if (auto port = launcher()->main_port()) return *port;
  }
  return cluster_environment().main_port();
}

RankLayout ParallelStrategy::rank_layout() const {
  return RankLayout{
      .local_world_size = static_cast<int>(std::max<size_t>(parallel_devices().size(), 1)),
      .num_nodes = num_nodes(),
      .node_rank = node_rank(),
      .main_address = cluster_environment().main_address(),
      .main_port = main_port()};
}

void ParallelStrategy::do_setup_environment() {
  // In a rank the launcher forked: the cluster environment says what the
  // launcher assigned, to whoever reads it (the restart count, the ranks).
  if (const auto* launched = launched_rank()) {
    auto& env = cluster_environment();
    env.set_local_rank(launched->local_rank);
    env.set_global_rank(launched->global_rank);
    env.set_world_size(launched->world_size);
    env.set_restart_count(launched->restart_count);
  }
  // Under one of fulgur's launchers: heartbeats from a thread of their own,
  // so a frozen rank is named in seconds (a no-op otherwise).
  detail::start_pulse();
  ProcessGroupOptions options;
  options.main_address = cluster_environment().main_address();
  options.main_port = main_port();
  options.hosted_store_prefix = cluster_environment().hosted_store_prefix();
  options.world_size = world_size();
  options.rank = global_rank();
  options.timeout = parallel_.process_group_timeout;
  options.backend = process_group_backend();
  options.device = root_device();
  // Ranks no launcher of fulgur's supervises watch each other (a no-op
  // under one).
  options.watch_peers = true;
  options.stop_grace = parallel_.stop_grace;
  // Ranks that a launcher outside fulgur started keep their group for the
  // process's life (see KeptGroup).
  const bool keeps = options.main_port != 0 && launcher() == nullptr &&
                     launched_rank() == nullptr &&
                     cluster_environment().creates_processes_externally() &&
                     !cluster_environment().started_by_fulgur_launcher();
  bool kept_by_the_process = false;
  if (!has_group() && keeps) {
    std::lock_guard<std::mutex> lock(kept_mutex);
    if (kept_group != nullptr && kept_group->group) {
      const ProcessGroup& kept = *kept_group->group;
      if (kept_group->rendezvous == rendezvous_of(options) && kept.size() == world_size() &&
          kept.rank() == global_rank() && kept.options().backend == options.backend) {
        set_group(kept_group->group);
        kept_by_the_process = true;
      } else {
        // Another group (another backend): a rendezvous of its own, which
        // finds the port free once no Trainer holds the kept group.
        kept_group->group.reset();
      }
    }
  }
  // One group for the life of the process: fit, then test, reuse it (a
  // second rendezvous on the same port could meet the first one's keys).
  if (has_group()) {
    const ProcessGroup& group = process_group();
    if (group.size() != world_size() || group.rank() != global_rank()) {
      // An instance given to an earlier Trainer of other devices or nodes.
      throw ConfigError(str("strategy \"", name(), "\" keeps the process group it made for an ",
                            "earlier Trainer (rank ", group.rank(), " of ", group.size(),
                            "), but this Trainer's world is rank ", global_rank(), " of ",
                            world_size(),
                            ": a process keeps one group for its life (a second rendezvous could "
                            "meet the first one's). Give this Trainer the earlier one's devices "
                            "and num_nodes, or a strategy instance of its own in a new process."));
    }
    if (kept_by_the_process && group.options().timeout != options.timeout && is_global_zero()) {
      detail::print_note(str("strategy \"", name(),
                             "\": process_group_timeout=", options.timeout.count() / 1000.0,
                             " s, but this process keeps the group an earlier Trainer made, whose "
                             "collectives time out after ",
                             group.options().timeout.count() / 1000.0, " s."));
    }
    // Whatever failure this rank told its peers of is behind it.
    process_group().begin_stage();
    return;
  }
  if (options.main_port == 0 && options.backend != "mpi") {  // MPI connects without a store
    if (options.world_size > 1) {
      throw DistributedError(str("strategy \"", name(), "\": rank ", options.rank, " of ",
                                 options.world_size,
                                 " has no main port. Set MASTER_PORT (the same "
                                 "on every rank), or let fulgur's launcher start the ranks."));
    }
    options.main_port = find_free_port(options.main_address);
  }
  set_group(ProcessGroup::connect(options));
  if (keeps) {
    std::lock_guard<std::mutex> lock(kept_mutex);
    // An earlier kept group of another rendezvous goes once no Trainer holds it.
    keep_group(KeptGroup{rendezvous_of(options), shared_process_group()});
  }
}

namespace {
// The backend depends only on the devices' type, which every device of a
// node shares. (root_device() would also check this process's local rank,
// which is the cluster environment's to report, not a flag problem.)
c10::Device device_of_the_node(const std::vector<c10::Device>& devices) {
  return devices.empty() ? c10::Device(c10::kCPU) : devices.front();
}
}  // namespace

std::string ParallelStrategy::process_group_backend() const {
  const auto& backend = parallel_.process_group_backend;
  return backend.empty() ? default_process_group_backend(device_of_the_node(parallel_devices()))
                         : backend;
}

void ParallelStrategy::configure(std::vector<std::string>& notes) {
  configure_launcher();
  const c10::Device device = device_of_the_node(parallel_devices());
  const std::string backend = process_group_backend();
  if (auto problem = process_group_backend_problem(backend, device); !problem.empty()) {
    throw ConfigError(
        str("strategy \"", name(), "\" with process_group_backend=\"", backend, "\": ", problem));
  }
  if (parallel_.process_group_backend.empty()) {
    notes.push_back(str("process_group_backend=", backend,
                        " because process_group_backend=auto "
                        "and the devices are ",
                        c10::DeviceTypeName(device.type(), true),
                        device.is_cuda() ? (backend == "nccl" ? " (this LibTorch has NCCL)"
                                                              : " but this LibTorch has no NCCL")
                                         : ""));
  }
}

void ParallelStrategy::do_teardown() {
  if (stage_completed() || !has_group()) return;
  // A failed stage may leave the group's collectives unpaired (an
  // abandoned exchange, call counts that differ): a later Trainer makes a
  // group of its own instead of taking this one.
  std::lock_guard<std::mutex> lock(kept_mutex);
  if (kept_group != nullptr && kept_group->group == shared_process_group()) {
    kept_group->group.reset();
  }
}

namespace {

// One line per parameter and buffer: "parameter fc.weight\t[1, 4] Float".
std::string module_structure(Module& module) {
  std::string text;
  auto add = [&](const char* kind, const std::string& name, const at::Tensor& t) {
    text.append(kind).append(" ").append(name).append("\t");
    text.append(t.defined() ? fulgur::str(t.sizes(), " ", t.scalar_type())
                            : std::string("undefined"));
    text.append("\n");
  };
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    add("parameter", item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    add("buffer", item.key(), item.value());
  }
  return text;
}

// "kind name" -> "shape dtype", from module_structure's text.
std::map<std::string, std::string> structure_entries(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const size_t tab = line.find('\t');
    if (tab != std::string::npos) out[line.substr(0, tab)] = line.substr(tab + 1);
  }
  return out;
}

// What rank `r`'s structure has that rank 0's has not, or otherwise: at
// most `limit` differences.
std::vector<std::string> structure_differences(const std::string& zero, const std::string& mine,
                                               int rank, size_t limit) {
  const auto theirs = structure_entries(zero);
  const auto ours = structure_entries(mine);
  std::vector<std::string> out;
  for (const auto& [key, what] : ours) {
    auto it = theirs.find(key);
    if (it == theirs.end()) {
      out.push_back(str("rank ", rank, " has ", key, " (", what, "), which rank 0 has not"));
    } else if (it->second != what) {
      out.push_back(
          str("rank ", rank, "'s ", key, " is ", what, " where rank 0's is ", it->second));
    }
  }
  for (const auto& [key, what] : theirs) {
    if (ours.count(key) == 0) {
      out.push_back(str("rank ", rank, " has no ", key, " (rank 0's is ", what, ")"));
    }
  }
  if (out.size() > limit) {
    const size_t more = out.size() - limit;
    out.resize(limit);
    out.push_back(str("and ", more, " more on rank ", rank));
  }
  return out;
}

}  // namespace

void ParallelStrategy::check_same_module_on_every_rank(Module& module) {
  if (world_size() <= 1) return;
  const std::vector<std::string> every = values_where_they_differ(module_structure(module));
  if (every.empty()) return;
  // Every rank has every rank's structure: every rank throws the same error.
  std::vector<std::string> differences;
  for (int r = 1; r < world_size() && differences.size() < 12; ++r) {
    if (every[static_cast<size_t>(r)] == every[0]) continue;
    for (auto& d : structure_differences(every[0], every[static_cast<size_t>(r)], r, 3)) {
      differences.push_back(std::move(d));
    }
  }
  if (differences.empty()) {
    differences.push_back(
        "the same parameters and buffers, registered in another order on some "
        "rank (they pair up by position)");
  }
  throw ConfigError(str(
      "strategy \"", name(), "\": the module ", module.name(),
      " differs across ranks: ", join(differences, "; "),
      ". Every rank must build the same module (the same layers, sizes and dtypes, also in "
      "configure_model): its ranks start from rank 0's parameters and buffers and average "
      "their gradients pairwise, which unlike tensors cannot do. Build nothing from the rank."));
}

void ParallelStrategy::broadcast_parameters_from_rank_zero(Module& module) {
  check_same_module_on_every_rank(module);
  torch::NoGradGuard no_grad;
  auto& group = process_group();
  for (auto& p : module.parameters()) {
    at::Tensor data = p.detach();
    group.broadcast_(data, 0);
  }
}

void ParallelStrategy::set_process_group(std::shared_ptr<ProcessGroup> group) {
  if (!group) {
    throw ConfigError(str("strategy \"", name(),
                          "\".set_process_group(nullptr): pass a group, "
                          "or none at all to let the strategy create one."));
  }
  if (group->size() != world_size() || group->rank() != global_rank()) {
    throw ConfigError(str("strategy \"", name(), "\".set_process_group: the group has rank ",
                          group->rank(), " of ", group->size(), " but this process is rank ",
                          global_rank(), " of ", world_size(), " (from cluster environment \"",
                          cluster_environment().name(), "\"). Pass the group of all ranks."));
  }
  set_group(std::move(group));
}

void ParallelStrategy::configure_launcher() {
  const StartMethod start_method = start_method_;
  set_launcher(nullptr);  // an earlier Trainer's (a reused instance)
  if (cluster_environment().creates_processes_externally()) return;  // torchrun, srun, ...
  const int local_world = static_cast<int>(std::max<size_t>(parallel_devices().size(), 1));
  cluster_environment().set_global_rank(node_rank() * local_world + local_rank());
  // One process on this node: it is the rank itself, nothing to launch.
  if (local_world == 1) return;
  if (start_method == StartMethod::kFork && parallel_devices().front().is_cuda()) {
    // Counting the GPUs (which resolving devices does) initialises CUDA in
    // this process, and CUDA does not work in a process forked after that.
    throw ConfigError(str("strategy \"", name(),
                          "\" forks its ranks, which cannot use CUDA: this "
                          "process has already initialised it (counting the GPUs does). Use "
                          "strategy \"ddp\" (the program is re-executed once per rank), or "
                          "torchrun / srun / mpirun."));
  }
  Supervision supervision;
  supervision.stop_grace = parallel_.stop_grace;
  supervision.hang_timeout = parallel_.process_group_timeout;
  if (start_method == StartMethod::kFork) {
    set_launcher(std::make_unique<ForkLauncher>([this] { return rank_layout(); }, supervision));
  } else {
    set_launcher(
        std::make_unique<SubprocessScriptLauncher>([this] { return rank_layout(); }, supervision));
  }
}

bool ParallelStrategy::agree_to_stop_from_votes(bool requested, bool boundary, int64_t exchanges,
                                                const std::function<bool()>& votes_say_stop) {
  if (world_size() <= 1) return requested;
  if (!stop_agreed_ && !boundary) {
    if (exchanges != vote_exchanges_seen_) {
      // Every rank voted in this batch's collectives; a request made after
      // them is in the next batch's votes.
      vote_exchanges_seen_ = exchanges;
      stop_agreed_ = votes_say_stop();
      return stop_agreed_;
    }
    if (!gradient_sync()) return false;  // a no_sync micro-batch: the step's collectives vote
  }
  vote_exchanges_seen_ = exchanges;
  if (!stop_agreed_) stop_agreed_ = reduce_boolean_decision(requested, /*all=*/false);
  return stop_agreed_;
}

void ParallelStrategy::restart_stop_votes(int64_t exchanges) {
  vote_exchanges_seen_ = exchanges;
  stop_agreed_ = false;
}

void ParallelStrategy::connect_sync_batchnorm(Module& module) {
  ProcessGroup& group = process_group();
  std::vector<std::string> plain;
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    auto* m = item.value().get();
    if (auto* sync = dynamic_cast<nn::SyncBatchNormImpl*>(m)) {
      sync->set_all_reduce([&group](at::Tensor& t) { group.all_reduce_(t, ReduceOp::kSum); });
    } else if (dynamic_cast<torch::nn::BatchNorm1dImpl*>(m) != nullptr ||
               dynamic_cast<torch::nn::BatchNorm2dImpl*>(m) != nullptr ||
               dynamic_cast<torch::nn::BatchNorm3dImpl*>(m) != nullptr) {
      plain.push_back(item.key());
    }
  }
  if (!plain.empty()) {
    throw ConfigError(str("sync_batchnorm=true, but ", module.name(),
                          " has torch::nn::BatchNorm "
                          "layers (",
                          join(plain),
                          "), whose statistics LibTorch cannot "
                          "synchronise and fulgur cannot replace from outside the module. "
                          "Declare them as fulgur::nn::SyncBatchNorm (same options, same "
                          "checkpoint names), or drop sync_batchnorm."));
  }
}

namespace detail {

namespace {
thread_local int quiet = 0;
}  // namespace

NoFailureAnnouncement::NoFailureAnnouncement() { ++quiet; }
NoFailureAnnouncement::~NoFailureAnnouncement() { --quiet; }

void announce_failure_before_joining(const ClusterEnvironment& env, const std::string& what) {
  static std::atomic<bool> told{false};
  try {
    // mpirun stops every rank when one fails.
    if (quiet > 0 || !env.creates_processes_externally() || env.world_size() < 2 ||
        env.name() == "mpi") {
      return;
    }
    ProcessGroupOptions o;
    o.main_address = env.main_address();
    o.main_port = env.main_port();
    o.hosted_store_prefix = env.hosted_store_prefix();
    o.world_size = env.world_size();
    o.rank = env.global_rank();
    if (told.exchange(true)) return;
    ProcessGroup::announce_failure_before_joining(o, what);
  } catch (const std::exception&) {
    // An environment that cannot say where the others wait: nobody to tell.
  }
}

void announce_failure_before_joining(const std::string& what) {
  if (quiet > 0) return;
  try {
    if (auto env = detect_cluster_environment(EnvView(), nullptr)) {
      announce_failure_before_joining(*env, what);
    }
  } catch (const std::exception&) {
    // Variables that name no environment (this failure may be about them).
  }
}

}  // namespace detail

}  // namespace fulgur
