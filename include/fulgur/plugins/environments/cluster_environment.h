// File: fulgur/plugins/environments/cluster_environment.h
//
// A ClusterEnvironment says who this process is: world size, global, local
// and node rank, and where the main process listens. It reads its own
// environment variables (through an EnvView), says whether processes are
// created externally (torchrun, srun, mpirun) or by fulgur's launcher, and
// checks devices x num_nodes against what the cluster reports.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fulgur/core/env.h"
#include "fulgur/core/registry.h"

namespace fulgur {

class ClusterEnvironment {
 public:
  virtual ~ClusterEnvironment() = default;
  virtual std::string_view name() const = 0;
  /// True when something else (torchrun, srun, mpirun) created this process
  /// and its peers; fulgur then launches nothing.
  virtual bool creates_processes_externally() const = 0;
  virtual std::string main_address() const = 0;
  virtual int main_port() const = 0;
  /// Non-empty when a rendezvous store already listens at main_address():
  /// main_port(), hosted by whoever created the processes (torchrun's agent
  /// with TORCHELASTIC_USE_AGENT_STORE=True): every rank, rank 0 included,
  /// then connects to it as a client, and keeps its keys under this prefix.
  /// Empty (the default): rank 0 hosts the store itself.
  virtual std::string hosted_store_prefix() const { return {}; }
  /// The ranks as read from the environment (the defaults describe one
  /// process); launchers set world size and global rank once known.
  virtual int world_size() const { return world_size_; }
  virtual void set_world_size(int size) { world_size_ = size; }
  virtual int global_rank() const { return global_rank_; }
  virtual void set_global_rank(int rank) { global_rank_ = rank; }
  virtual int local_rank() const { return local_rank_; }
  virtual void set_local_rank(int rank) { local_rank_ = rank; }
  virtual int node_rank() const { return node_rank_; }
  /// How many times this job's processes were started before this one: a
  /// scheduler's or launcher's restart (TORCHELASTIC_RESTART_COUNT,
  /// SLURM_RESTART_COUNT, FULGUR_RESTART_COUNT from fulgur's own launcher).
  /// When > 0, fit resumes from the newest checkpoint that verifies.
  virtual int restart_count() const { return restart_count_; }
  void set_restart_count(int count) { restart_count_ = count; }
  /// Whether fulgur's own launcher started this process: it supervises
  /// the ranks and restarts them (max_restarts), and says what they
  /// resume from.
  virtual bool started_by_fulgur_launcher() const { return false; }
  /// Signals by which the scheduler announces the end of this job
  /// (preemption, the time limit, a requeue request). While fit runs they
  /// only set a flag; the ranks agree at the next step boundary, save one
  /// checkpoint (`last.ckpt` of the checkpoint directory), global rank 0
  /// calls requeue(), and every process ends by that signal (status
  /// 128 + signal). Empty (the default): the signals keep their action.
  virtual std::vector<int> preemption_signals() const { return {}; }
  /// On global rank 0, once that checkpoint is durable: asks the scheduler
  /// to start the job again when `signal` asks for it. Returns what was done,
  /// for the message ("" when nothing).
  virtual std::string requeue(int /*signal*/) { return {}; }
  /// Throws ConfigError when `num_devices` x `num_nodes` disagrees with what
  /// the cluster reports, naming both numbers and both sources.
  virtual void validate_settings(int /*num_devices*/, int /*num_nodes*/) const {}
  /// Called in each process once its rank is known.
  virtual void teardown() {}

  /// The ranks read from the environment against the flags, one problem
  /// each, naming the variable it came from: the global rank in
  /// [0, world size), the local rank in [0, num_devices), the node rank in
  /// [0, num_nodes). Empty when all are in range. The connector reports
  /// them for processes created externally (a rank out of range would
  /// otherwise surface as a process group that never forms).
  std::vector<std::string> rank_problems(int num_devices, int num_nodes) const;
  /// The variable the world size and the global rank were read from (""
  /// when none was: a default, or a value derived from others).
  const std::string& world_size_variable() const { return rank_sources_.world_size; }
  const std::string& global_rank_variable() const { return rank_sources_.global_rank; }

 protected:
  // Filled by each environment's constructor from its variables.
  int world_size_ = 1;
  int global_rank_ = 0;
  int local_rank_ = 0;
  int node_rank_ = 0;
  int restart_count_ = 0;
  /// The variable each value was read from, for rank_problems(); empty for
  /// a value derived from others (then described as such) or a default.
  struct RankSources {
    std::string world_size, global_rank, local_rank, node_rank;
  };
  RankSources rank_sources_;
};

/// The cluster environments by name, and how each is recognised. An entry
/// may declare a detector with a priority; detect() asks the detectors from
/// the highest priority down and falls back to "lightning" (fulgur creates
/// the processes), so an environment a user registers is detected like a
/// built-in:
///
///   auto& r = fulgur::cluster_environment_registry();
///   r.add("my_scheduler", "...", [](const EnvView& env) { return ...; });
///   r.set_detector("my_scheduler", 600, [](const EnvView& env) {
///     return env.has("MY_SCHED_RANK") ? Detection::match("MY_SCHED_RANK is set")
///                                     : Detection::no();
///   });
class ClusterEnvironmentRegistry : public Registry<ClusterEnvironment, const EnvView&> {
 public:
  /// A detector's verdict. `reason` completes "cluster_environment=NAME
  /// because ..." when it matches; a detector that declines may still say
  /// why (a note: "SLURM_NTASKS is set but ... interactive").
  struct Detection {
    bool matched = false;
    std::string reason;
    static Detection match(std::string why) { return {true, std::move(why)}; }
    static Detection no(std::string why = {}) { return {false, std::move(why)}; }
  };
  using Detector = std::function<Detection(const EnvView&)>;

  using Registry::Registry;

  /// Makes the registered environment `name` detectable (replacing its
  /// detector if it has one). Higher priorities are asked first. The
  /// built-ins: torchelastic 500 (torchrun runs inside other schedulers'
  /// jobs), slurm 400, mpi 300 (srun --mpi=pmi2 sets PMI_* too), lsf 200,
  /// kubeflow 100 (its variables are the most generic). Throws ConfigError
  /// when `name` is not registered, or another detector has this priority.
  void set_detector(const std::string& name, int priority, Detector detector);

  /// The environment `env` describes, created from its entry; "lightning"
  /// when no detector matches. Appends to `notes` (when not null) which one
  /// was chosen and why, and what declining detectors said.
  std::unique_ptr<ClusterEnvironment> detect(const EnvView& env,
                                             std::vector<std::string>* notes) const;

  /// Detectable names, highest priority first.
  std::vector<std::string> detection_order() const;

 private:
  struct DetectorEntry {
    std::string name;
    int priority;
    Detector detect;
  };
  std::vector<DetectorEntry> detectors_;  // highest priority first
};

/// lightning, torchelastic, slurm, mpi, lsf, kubeflow, and what users add.
ClusterEnvironmentRegistry& cluster_environment_registry();

/// cluster_environment_registry().detect(env, notes).
std::unique_ptr<ClusterEnvironment> detect_cluster_environment(const EnvView& env,
                                                               std::vector<std::string>* notes);

}  // namespace fulgur
