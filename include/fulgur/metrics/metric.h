// File: fulgur/metrics/metric.h
//
// A Metric accumulates state over the batches of an epoch (counts, a
// confusion matrix, every score seen) and computes its value from that state
// once. Across ranks the states are combined before the value is computed,
// each by its declared reduction (sum, concatenation, max, min), so the
// value of a run of several ranks is exactly the one of a single process
// over the same samples: an F1 score, a macro average or an AUROC is not a
// mean of per-rank values.
//
//   fulgur::metrics::Accuracy acc({.num_classes = 10});
//   acc.update(logits, labels);             // in each validation_step
//   log("val_acc", acc);                    // the epoch's value, synchronised
//
// Logged with Module::log, a metric's value is computed once at the end of
// the epoch from the states of every rank, and the metric is reset. Used
// alone, compute() is this process's value and compute(group) every rank's
// (a collective: every rank of `group` calls it).
//
// Samples are counted once. Evaluation gives each sample to one rank (no
// padding) unless the strategy's forward is collective (fsdp FULL_SHARD):
// then the ranks' last batches are padded with repeats of the first
// samples, and the Trainer tells every metric updated during that batch
// how many trailing rows are repeats, which update() leaves out.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "fulgur/core/state_dict.h"

namespace fulgur {

class ProcessGroup;

namespace metrics {

/// How a state combines across ranks.
enum class Reduction {
  kSum,  // elementwise sum (counts, sums)
  kCat,  // concatenated along dimension 0, in rank order (every score seen)
  kMax,  // elementwise maximum
  kMin,  // elementwise minimum
};

class Metric {
 public:
  Metric();
  virtual ~Metric();
  Metric(const Metric&) = delete;
  Metric& operator=(const Metric&) = delete;

  /// "Accuracy", "F1Score", ...
  virtual std::string name() const = 0;
  /// Whether compute() gives one number (what log() takes).
  virtual bool is_scalar() const { return true; }
  /// The options its states depend on, as text ("" for none), e.g.
  /// "task=binary threshold=0.5": state_dict() keeps it under "options",
  /// and a state saved with other options is refused on load (its counts
  /// would mean something else).
  virtual std::string options_text() const { return ""; }

  /// The value over everything updated since the last reset(), in this
  /// process.
  at::Tensor compute() const;
  /// The value over every rank's updates: each state is combined across
  /// `group` (one or two collectives per state, in declaration order) and
  /// the value computed from the result. Every rank of `group` calls it at
  /// the same point, with the same metrics in the same order. A null group:
  /// compute().
  at::Tensor compute(ProcessGroup* group) const;
  /// Back to the initial states.
  void reset();
  /// Updates since the last reset() (on this rank).
  int64_t update_count() const { return updates_; }

  /// The states by name (a concatenated state as one tensor), the update
  /// count ("updates") and options_text() ("options", its bytes; when not
  /// empty), copies on the CPU: this rank's, or with `group`
  /// every rank's combined as compute(group) combines them (a collective).
  std::map<std::string, at::Tensor> state_dict(ProcessGroup* group = nullptr) const;
  /// Replaces the states with saved ones. c10::Error naming a missing
  /// state, one of another shape (another number of classes), or states
  /// saved with other options.
  void load_state_dict(const std::map<std::string, at::Tensor>& saved);
  /// Combines saved states with the current ones, as ranks' states are
  /// combined (sums added, saved rows first): a resumed run's metric goes
  /// on from where the checkpoint left it, whatever it counted since.
  void merge_state_dict(const std::map<std::string, at::Tensor>& saved);
  /// The value of saved states (what state_dict() returned, e.g. every
  /// rank's combined) without loading them: no collective, the metric's own
  /// states unchanged. c10::Error as load_state_dict().
  at::Tensor value_of(const std::map<std::string, at::Tensor>& saved) const;
  /// Writes this rank's state_dict() into `state`, each tensor as a buffer
  /// under its state's name (and "updates"), e.g. into a section of a
  /// checkpoint: metric.save(checkpoint.section("val_acc")).
  void save(StateDict& state) const;
  /// load_state_dict() from the tensors of `state` (what save() wrote;
  /// entries that are not tensors are ignored). c10::Error as there.
  void load(const StateDict& state);

  /// Set by the Trainer around an evaluation batch whose last `rows` rows
  /// repeat earlier samples (a padded shard; see above): updates during it
  /// leave those rows out. 0: every row counts.
  static void set_padded_rows(int64_t rows);
  static int64_t padded_rows();
  /// Set by the Trainer while it captures a training step into a CUDA graph
  /// (cuda_graph=true): an update() then is a ConfigError, since host code
  /// in the captured step runs once, at the capture.
  static void set_capturing(bool capturing);
  /// ConfigError naming `name`'s update when preds and target are on two
  /// devices (an update's check; LibTorch's error came from inside it).
  static void check_same_device(const std::string& name, const at::Tensor& preds,
                                const at::Tensor& target);

 protected:
  /// Declares a state. Its value after reset() is `initial`; a kCat state
  /// starts empty, `initial` then giving the dtype and the trailing shape
  /// of what append() adds (e.g. at::empty({0}, at::kFloat)).
  void add_state(std::string name, at::Tensor initial, Reduction reduction);
  /// A kSum/kMax/kMin state, to update in place.
  at::Tensor& state(std::string_view name);
  /// Moves the kSum/kMax/kMin states to `like`'s device when they are
  /// elsewhere (an update() calls it first with its input).
  void follow(const at::Tensor& like);
  /// Adds rows to a kCat state (kept as parts; joined when computed).
  void append(std::string_view name, const at::Tensor& rows);
  /// The value from `states` (this rank's, or combined across ranks), in
  /// declaration order; a kCat state is one tensor of every row.
  virtual at::Tensor compute_from(const std::vector<at::Tensor>& states) const = 0;
  /// A subclass's update() calls it once per update, before it changes a
  /// state (ConfigError while a CUDA graph captures; see set_capturing).
  void count_update();
  /// `rows` less the trailing padded rows of the current batch (see
  /// set_padded_rows), for an update whose dimension 0 is the batch.
  static at::Tensor without_padding(const at::Tensor& rows);

 private:
  struct State {
    std::string name;
    at::Tensor initial;
    Reduction reduction;
    at::Tensor value;               // kSum/kMax/kMin
    std::vector<at::Tensor> parts;  // kCat
  };
  State& find(std::string_view name);
  /// This rank's states in declaration order (kCat parts joined).
  std::vector<at::Tensor> local_states() const;
  /// local_states(), combined across `group` when given.
  std::vector<at::Tensor> combined_states(ProcessGroup* group) const;
  /// `saved`'s states in declaration order, checked against the metric's.
  std::vector<at::Tensor> checked(const std::map<std::string, at::Tensor>& saved) const;

  std::vector<State> states_;
  int64_t updates_ = 0;
};

/// A metric of predictions against targets (what MetricCollection holds).
class PredictionMetric : public Metric {
 public:
  virtual void update(const at::Tensor& preds, const at::Tensor& target) = 0;
  /// ConfigError for the inputs update() would refuse, changing nothing: a
  /// MetricCollection checks each of its metrics before it updates any.
  virtual void check(const at::Tensor& /*preds*/, const at::Tensor& /*target*/) const {}
};

}  // namespace metrics
}  // namespace fulgur
