// The program the multi-process tests launch: trains a small classifier on
// deterministic synthetic data with the flags given, then (global rank 0, or
// the calling process under a forking strategy) writes the final parameters
// and prints "RESULT key=value" lines. Faults are injected on request.
//
//   fulgur_ddp_worker --strategy ddp --devices 2 --batch 8 --steps 20 --out p.pt
#include <CLI/CLI.hpp>
#include <torch/torch.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <sstream>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <iomanip>
#include <cstdio>
#include <mutex>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <thread>

#include "fulgur/fulgur.h"
#include "fulgur/strategies/ddp.h"
#include "fulgur/utilities/torch_compat.h"

namespace {

struct Args {
  std::string strategy = "auto";
  std::string devices = "1";
  int num_nodes = 1;
  int64_t batch = 8;
  int64_t steps = 20;
  int64_t samples = 320;
  int64_t test_samples = 0;
  // Non-empty: after fit, predict --predict-samples samples (batches of 5)
  // with a PredictionFileWriter writing here.
  std::string predict_dir;
  int64_t predict_samples = 37;
  int64_t accumulate = 1;
  bool shuffle = false;
  bool skip_fit = false;
  bool manual = false;
  bool fsdp_units = false;
  bool cnn = false;       // two convolutions (the second a unit with --fsdp-units) before fc1
  bool prefetch = false;  // FSDPOptions::prefetch
  // --sequential: fc1, tanh, fc2 as a torch::nn::Sequential "body"
  // (FSDPOptions::auto_wrap_min_params = --auto-wrap N makes its units).
  bool sequential = false;
  // fc1 and tanh run as one checkpointed block (fulgur::nn::checkpoint).
  bool checkpoint_activations = false;
  // With --fsdp-units: fc1 is a unit around a fulgur::nn::Checkpoint of the
  // Linear (its parameters "fc1.module.weight", ...).
  bool unit_around_checkpoint = false;
  // With --checkpoint-activations: that block inside another one.
  bool nested_checkpoint = false;
  double ema = 0;         // > 0: an EMA callback of this decay (validating with the average)
  int64_t swa_start = 0;  // > 0: StochasticWeightAveraging from this epoch (counted from 1)
  int64_t auto_wrap = 0;
  bool histograms = false;
  bool skip_after_forward = false;
  std::string precision;
  bool frozen_bias = false;
  std::string state_dict_type;
  bool unused_layer = false;
  double gradient_clip_val = 0;  // > 0: clip by norm
  std::string optimizer = "sgd";
  std::string out;
  std::string root = ".";
  int die_rank = -1;
  int hang_rank = -1;
  int64_t fault_step = 5;
  double timeout_s = 60;
  int64_t seed = 7;
  bool sync_dist = true;
  double bucket_mb = 25;
  std::string process_group_backend;  // empty: the strategy's default
  std::string accelerator = "cpu";
  std::string plugins;
  std::string batchnorm = "none";  // none | plain (torch::nn) | sync (fulgur::nn)
  bool sync_batchnorm = false;
  bool checkpoint = false;
  // Ranks whose training_step returns no loss at the batches in skip_at.
  // On one process (the reference run) the batch is cut to the rows those
  // ranks would not have had under `reference_world` ranks.
  std::vector<int> skip_ranks;
  std::vector<int64_t> skip_at;
  int reference_world = 2;
  // A buffer every rank adds rank + 1 to in each training step.
  bool count_buffer = false;
  bool broadcast_buffers = true;
  // A rank that logs one more sync_dist metric than the others.
  int extra_metric_rank = -1;
  // fc2 built in configure_model() (as the README recommends for parts
  // that need the device), not in the constructor.
  bool head_in_configure_model = false;
  // This rank's configure_model() adds a buffer the others lack.
  int extra_buffer_rank = -1;
  // This rank exits with status 0 at fault_step.
  int exit_zero_rank = -1;
  // Logs a step value per rank with sync_dist (a tensor, mean; a number,
  // max) from this batch of each epoch on (-1: never).
  int rank_step_metric = -1;
  // At this global step rank 1 logs none of them.
  // Logs "end_step" = 10 * rank + global step with sync_dist in
  // on_train_batch_end (RESULT end_step_rank<r>: the callback metric after
  // fit).
  bool batch_end_step_metric = false;
  int64_t rank_step_skip_at = -1;
  // Logs "own" = 10 * rank + global step without sync_dist (each rank's
  // own value) at every step, and prints each rank's callback metric "own"
  // at on_train_start (RESULT start_own_rank<r>; -1 where there is none).
  bool own_metric = false;
  int metric_object_rank = -1;  // this rank alone logs a metric object in training_step
  // Logs "skew" without sync_dist: the global step on rank 0, 100 minus it
  // on the others; a ModelCheckpoint(monitor="skew", mode min, top 2,
  // every step) in <root>/skew ranks by it, and each rank prints its best
  // path (RESULT skew_best_rank<r>).
  bool monitor_skew = false;
  // What that ModelCheckpoint monitors instead ("skew": what it logs).
  std::string skew_monitor = "skew";
  // Prints the collectives each rank starts per step, from its training
  // steps 2 to 4 (RESULT collectives_per_step_rank<r>).
  bool count_collectives = false;
  // A rank that calls trainer().request_stop() at batch fault_step: in
  // training_step ("step"), on_train_batch_end ("batch-end"), or in the
  // validation that follows the step numbered fault_step ("validation").
  int stop_rank = -1;
  std::string stop_in = "step";
  // Validate every N training batches (0: no validation loader).
  int64_t val_every = 0;
  // A rank that throws from training_step at batch fault_step (it fails on
  // its own, outside any collective).
  int fail_rank = -1;
  // Appended to its error's text (e.g. words a collective's error uses).
  std::string fail_text;
  bool fail_all = false;             // every rank fails at --fault-step
  std::string fail_in = "step";      // or "validation": at global step --fault-step
  double on_exception_timeout = -1;  // >= 0: an OnExceptionCheckpoint with this peer_timeout (s)
  // A failed rank's on_exception takes this long (its connections open).
  double linger_after_failure = 0;
  double stop_grace_s = -1;  // < 0: the strategy's default
  // A rank that calls a barrier its peers do not, at batch fault_step.
  int extra_barrier_rank = -1;
  // > 0: Tuner::lr_find of this many steps on every rank before the fit
  // (whose Trainer then takes the trial's process group).
  int64_t lr_find_first = 0;
  // The test stage by a second Trainer, made while the fit's still lives.
  bool test_by_another_trainer = false;
  double tester_timeout_s = 0;  // > 0: the test's Trainer asks for this timeout
  // A CSVLogger (a row each step) and the PyTorch profiler (batches 1 and
  // 2); every rank prints its log_dir() (RESULT log_dir_rank<r>).
  bool csv_and_profiler = false;
  // A rank that sleeps slow_seconds in on_train_batch_end of the batch
  // before fault_step (it falls behind without hanging).
  int slow_rank = -1;
  double slow_seconds = 0;
  // A rank that never exits once fit and test are done.
  int hang_at_exit_rank = -1;
  // > 0: the data comes from a DataModule whose prepare_data() takes this
  // long to write the file every rank's setup() reads.
  double prepare_seconds = 0;
  // > 0: the training data comes from a DataModule whose loaders grow by 32
  // samples at every reload (reload_dataloaders_every_n_epochs).
  int64_t reload_every = 0;
  // >= 0: the data comes from a DataModule (UnevenData) under which this
  // rank's training loader, or with --uneven-val its validation loader, has
  // --uneven-samples more samples (fewer when negative) than its peers' from
  // the epoch --uneven-from on.
  int uneven_rank = -1;
  int64_t uneven_samples = 32;
  int64_t uneven_from = 0;
  bool uneven_val = false;
  // With --uneven-rank: UnevenData's loaders are iterables of unknown length
  // (each rank reads its own part), in order; but --known-length-rank's.
  bool iterable = false;
  int known_length_rank = -1;
  // > 0: limit_train_batches.
  int64_t limit_train_batches = 0;
  // Runs a multi-threaded matrix product before fit, so the intra-op
  // thread pool is up when a forking launcher forks.
  bool warm_parent = false;
  // Before the run's Trainer: "fit" (a one-process fit of another model in
  // this process) or "raw" (a backward of the program's own); "" none.
  std::string backward_before;
  bool distributed_sampler = true;
  // A rank that ignores SIGTERM from its first batch on (the launcher must
  // escalate to SIGKILL after the grace period).
  int ignore_sigterm_rank = -1;
  // A rank that sends SIGTERM to its launcher (its parent) at fault_step.
  int signal_launcher_rank = -1;
  int launcher_signal = SIGTERM;
  // The calling process ignores SIGCHLD, or runs a thread that reaps any
  // child (waitpid(-1)), before fit: the launcher must still see its ranks.
  bool ignore_sigchld = false;
  bool reap_elsewhere = false;
  // Recovery: the Trainer's flags, and faults that happen in one attempt
  // only (FULGUR_RESTART_COUNT / the cluster environment's restart count).
  int max_restarts = 0;
  double heartbeat_timeout_s = -1;  // < 0: the Trainer's default
  int64_t every_n_train_steps = 0;
  std::string ckpt_path;
  // Rank 1's ckpt_path instead (a node that sees other files).
  std::optional<std::string> ckpt_path_rank1;
  // Rank 1's checkpoint IO cannot read (a node whose disk fails).
  bool rank1_cannot_read = false;
  // Rank 1's checkpoint IO reads "<path><suffix>" for a path (a node whose
  // disk holds another file under the same name).
  std::string rank1_disk_suffix;
  // "R:S" or "R:S:A": rank R is SIGKILLed before global step S in attempt A
  // (default 0).
  std::vector<std::string> kills;
  // A rank that stops itself (SIGSTOP) at batch fault_step of attempt 0.
  int sigstop_rank = -1;
  // Every rank sleeps pause_seconds after global step pause_step of attempt
  // 0 (outside any collective), rank 0 first creating pause_file: a test
  // then does something to a node while the run is under way.
  int64_t pause_step = -1;
  double pause_seconds = 0;
  std::string pause_file;
  // A rank that waits forever on a condition variable (asleep, no CPU,
  // outside any collective) at batch fault_step of attempt 0.
  int deadlock_rank = -1;
  // Prints "TIME kill=<ns>" before a kill and "TIME restarted_step=<ns>"
  // (rank 0) after the first optimizer step of a restarted attempt.
  bool report_times = false;
  // A rank that calls one extra collective (a barrier) at batch fault_step:
  // the ranks then wait in different collectives.
  int desync_rank = -1;
  bool deterministic = false;
  // "R:S:SIG": rank R raises signal SIG before global step S of attempt 0
  // (a scheduler's preemption or requeue signal, delivered to one rank).
  std::vector<std::string> raises;
  // Each training step sleeps this long (a run long enough to be signalled).
  int step_sleep_ms = 0;
  // EarlyStopping (patience 1) on "es_metric", logged without sync_dist at
  // each epoch's end: worse every epoch on this rank, better on the others.
  int early_stop_rank = -1;
  // With early_stop_rank: es_metric is logged on that rank only.
  bool early_stop_metric_on_that_rank_only = false;
  // >= 0: a BackboneFinetuning freezes fc1 at the start and trains it from
  // this epoch on; the optimizer gets the trainable parameters only.
  int64_t finetune_at = -1;
  // >= 0: fc1 starts frozen, and before this global step rank 0 unfreezes
  // its weight and every other rank its bias (ranks that disagree); with
  // unfreeze_rank >= 0, that rank alone unfreezes the bias, at the start
  // of the epoch that begins with this step.
  int64_t unfreeze_mismatch_step = -1;
  int unfreeze_rank = -1;
  // Where global rank 0 writes the optimizer's state at the end of fit.
  std::string out_optimizer;
  // A learning-rate schedule: "epoch" (StepLR: halved every epoch),
  // "step" (LambdaLR: a 5-step warm-up, then a cosine decay stepped every
  // optimizer step), or "" (constant).
  std::string schedule;
};

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// 16 features, 4 classes; samples depend only on their index.
std::pair<at::Tensor, at::Tensor> make_data(int64_t n, int64_t offset) {
  auto idx = torch::arange(offset, offset + n, torch::kDouble).unsqueeze(1);
  auto feat = torch::arange(16, torch::kDouble).unsqueeze(0);
  auto x = torch::sin(idx * 0.37 + feat * 1.3) + torch::cos(idx * feat * 0.011);
  auto score = x.index({torch::indexing::Slice(), torch::indexing::Slice(0, 4)}) -
               x.index({torch::indexing::Slice(), torch::indexing::Slice(4, 8)});
  return {x.to(torch::kFloat), score.argmax(1)};
}

struct Classifier : fulgur::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, extra{nullptr};
  // --fsdp-units: the same layers (and names), each a unit of sharding.
  fulgur::nn::FSDPUnit<torch::nn::Linear> unit1{nullptr}, unit2{nullptr}, unit_extra{nullptr};
  fulgur::nn::FSDPUnit<fulgur::nn::Checkpoint> checkpointed_unit1{nullptr};
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  fulgur::nn::FSDPUnit<torch::nn::Conv2d> conv2_unit{nullptr};
  torch::nn::Sequential body{nullptr};
  std::shared_ptr<torch::nn::Module> body_first;  // body's first entry, as built
  torch::nn::BatchNorm1d plain_bn{nullptr};
  fulgur::nn::SyncBatchNorm sync_bn{nullptr};
  const Args& args;
  explicit Classifier(const Args& a) : args(a) {
    set_automatic_optimization(!a.manual);
    // --cnn: the 16 features as a 4x4 image through two 3x3 convolutions
    // and a 2x2 max pool (16 channels of 2x2 into fc1), as the example's CNN.
    if (a.cnn) {
      using torch::nn::Conv2dOptions;
      conv1 = register_module("conv1", torch::nn::Conv2d(Conv2dOptions(1, 8, 3).padding(1)));
      if (a.fsdp_units) {
        conv2_unit = register_module(
            "conv2", fulgur::nn::FSDPUnit(torch::nn::Conv2d(Conv2dOptions(8, 16, 3).padding(1))));
      } else {
        conv2 = register_module("conv2", torch::nn::Conv2d(Conv2dOptions(8, 16, 3).padding(1)));
      }
    }
    const int64_t features = a.cnn ? 64 : 16;
    if (a.sequential) {
      body = register_module(
          "body", torch::nn::Sequential(torch::nn::Linear(features, 32), torch::nn::Tanh(),
                                        torch::nn::Linear(32, 4)));
      body_first = body->ptr(0);
    } else if (a.fsdp_units && a.unit_around_checkpoint) {
      checkpointed_unit1 = register_module(
          "fc1", fulgur::nn::FSDPUnit(fulgur::nn::Checkpoint(torch::nn::Linear(features, 32))));
      unit2 = register_module("fc2", fulgur::nn::FSDPUnit(torch::nn::Linear(32, 4)));
    } else if (a.fsdp_units) {
      unit1 = register_module("fc1", fulgur::nn::FSDPUnit(torch::nn::Linear(features, 32)));
      unit2 = register_module("fc2", fulgur::nn::FSDPUnit(torch::nn::Linear(32, 4)));
    } else {
      fc1 = register_module("fc1", torch::nn::Linear(features, 32));
      if (!a.head_in_configure_model) fc2 = register_module("fc2", torch::nn::Linear(32, 4));
    }
    // Used only on even steps, and never by the test: exercises
    // find_unused_parameters.
    if (args.unused_layer && a.fsdp_units) {
      unit_extra = register_module("extra", fulgur::nn::FSDPUnit(torch::nn::Linear(32, 32)));
    } else if (args.unused_layer) {
      extra = register_module("extra", torch::nn::Linear(32, 32));
    }
    if (a.batchnorm == "plain") plain_bn = register_module("bn", torch::nn::BatchNorm1d(32));
    if (a.batchnorm == "sync") sync_bn = register_module("bn", fulgur::nn::SyncBatchNorm(32));
    if (a.count_buffer) seen = register_buffer("seen", torch::zeros({}, torch::kLong));
    // --frozen-bias: fc1's bias never trains (whole on every rank, in no shard).
    if (a.frozen_bias) named_parameters()["fc1.bias"].requires_grad_(false);
    if (a.unfreeze_mismatch_step >= 0) {
      for (auto& p : named_parameters()) {
        if (p.key().rfind("fc1.", 0) == 0) p.value().requires_grad_(false);
      }
    }
  }

  at::Tensor seen;
  int64_t collectives_at_2 = 0;  // --count-collectives
  // Test metrics from every rank's states (exact on any world size).
  fulgur::metrics::Accuracy test_macro_acc{{.num_classes = 4, .average = "macro"}};
  fulgur::metrics::F1Score test_macro_f1{{.num_classes = 4, .average = "macro"}};
  fulgur::metrics::AUROC test_auroc{{.num_classes = 4}};
  fulgur::metrics::SumMetric test_samples;
  fulgur::metrics::MeanMetric rank_metric;

  at::Tensor forward(const at::Tensor& x, bool use_extra) {
    at::Tensor in = x;
    if (conv1) {
      in = torch::relu(conv1(x.view({-1, 1, 4, 4})));
      in = torch::relu(conv2_unit ? conv2_unit(in) : conv2(in));
      in = torch::max_pool2d(in, 2).flatten(1);
    }
    if (body) return body->forward(in);
    at::Tensor h;
    if (args.checkpoint_activations) {
      const auto params = unit1 ? unit1->parameters() : fc1->parameters();
      auto block = [this](const std::vector<at::Tensor>& v) {
        return std::vector{torch::tanh(unit1 ? unit1(v[0]) : fc1(v[0]))};
      };
      if (args.nested_checkpoint) {
        // The same block inside another one around it.
        h = fulgur::nn::checkpoint(
            [block, params](const std::vector<at::Tensor>& v) {
              // By value: the second run comes in backward.
              return fulgur::nn::checkpoint(block, {v[0]}, params);
            },
            {in}, params)[0];
        return unit2 ? unit2(h) : fc2(h);
      }
      h = fulgur::nn::checkpoint(block, {in}, params)[0];
      return unit2 ? unit2(h) : fc2(h);
    }
    h = checkpointed_unit1 ? checkpointed_unit1(in) : unit1 ? unit1(in) : fc1(in);
    if (plain_bn) h = plain_bn(h);
    if (sync_bn) h = sync_bn(h);
    h = torch::tanh(h);
    if (use_extra) h = torch::tanh(unit_extra ? unit_extra(h) : extra(h));
    return unit2 ? unit2(h) : fc2(h);
  }

  int attempt() { return trainer().strategy().cluster_environment().restart_count(); }

  int configure_model_calls = 0;  // in this process
  void configure_model() override {
    ++configure_model_calls;
    if (args.head_in_configure_model && !fc2) {
      fc2 = register_module("fc2", torch::nn::Linear(32, 4));
    }
    if (args.extra_buffer_rank == trainer().strategy().global_rank()) {
      register_buffer("extra_state", torch::zeros({3}));
    }
  }

  void on_train_epoch_start() override {
    if (args.unfreeze_rank >= 0 && args.unfreeze_rank == trainer().strategy().global_rank() &&
        args.unfreeze_mismatch_step == trainer().global_step()) {
      named_parameters()["fc1.bias"].requires_grad_(true);
    }
  }

  at::Tensor training_step(fulgur::Batch& batch, int64_t batch_idx) override {
    const int rank = trainer().strategy().global_rank();
    for (const auto& kill : args.kills) {
      int r = -1, a = 0;
      long long step = -1;
      if (std::sscanf(kill.c_str(), "%d:%lld:%d", &r, &step, &a) < 2) {
        throw std::runtime_error("--kill " + kill + ": expected RANK:STEP[:ATTEMPT]");
      }
      if (r == rank && step == trainer().global_step() && a == attempt()) {
        std::cout << "rank " << rank << " is killed before step " << step << std::endl;
        if (args.report_times) std::cout << "TIME kill=" << wall_ns() << std::endl;
        std::raise(SIGKILL);
      }
    }
    if (args.step_sleep_ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(args.step_sleep_ms));
    }
    if (args.unfreeze_mismatch_step == trainer().global_step() && args.unfreeze_rank < 0) {
      named_parameters()[rank == 0 ? "fc1.weight" : "fc1.bias"].requires_grad_(true);
    }
    for (const auto& spec : args.raises) {
      int r = -1, sig = 0;
      long long step = -1;
      if (std::sscanf(spec.c_str(), "%d:%lld:%d", &r, &step, &sig) != 3) {
        throw std::runtime_error("--raise " + spec + ": expected RANK:STEP:SIGNAL");
      }
      if (r == rank && step == trainer().global_step() && attempt() == 0) {
        std::cout << "rank " << rank << " receives signal " << sig << " before step " << step
                  << std::endl;
        std::raise(sig);
      }
    }
    if (rank == args.sigstop_rank && batch_idx == args.fault_step && attempt() == 0) {
      std::cout << "rank " << rank << " stops itself now" << std::endl;
      std::raise(SIGSTOP);
    }
    if (rank == args.exit_zero_rank && batch_idx == args.fault_step) {
      std::cout << "rank " << rank << " leaves with status 0 now" << std::endl;
      std::exit(0);
    }
    if (rank == args.desync_rank && batch_idx == args.fault_step) {
      std::cout << "rank " << rank << " calls a barrier its peers do not" << std::endl;
      trainer().strategy().barrier();
    }
    if (rank == args.deadlock_rank && batch_idx == args.fault_step && attempt() == 0) {
      std::cout << "rank " << rank << " deadlocks now" << std::endl;
      std::mutex m;
      std::condition_variable never;
      std::unique_lock<std::mutex> lock(m);
      never.wait(lock, [] { return false; });
    }
    if (rank == args.die_rank && batch_idx == args.fault_step) {
      std::cout << "rank " << rank << " dies now" << std::endl;
      std::raise(SIGKILL);
    }
    if (rank == args.hang_rank && batch_idx == args.fault_step) {
      std::cout << "rank " << rank << " hangs now" << std::endl;
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    if (rank == args.ignore_sigterm_rank && batch_idx == 0) std::signal(SIGTERM, SIG_IGN);
    if (rank == args.signal_launcher_rank && batch_idx == args.fault_step) {
      std::cout << "rank " << rank << " sends signal " << args.launcher_signal << " to its launcher"
                << std::endl;
      ::kill(::getppid(), args.launcher_signal);
    }
    if (args.count_collectives && (batch_idx == 2 || batch_idx == 4)) {
      const int64_t now = trainer().strategy().process_group().collectives_started();
      if (batch_idx == 2) {
        collectives_at_2 = now;
      } else {
        std::cout << "RESULT collectives_per_step_rank" << rank << "="
                  << (now - collectives_at_2) / 2 << std::endl;
      }
    }
    if (rank == args.extra_barrier_rank && batch_idx == args.fault_step) {
      std::cout << "rank " << rank << " calls a barrier its peers do not" << std::endl;
      trainer().strategy().barrier("extra");
    }
    if ((rank == args.fail_rank || args.fail_all) && batch_idx == args.fault_step &&
        args.fail_in == "step") {
      throw std::runtime_error("rank " + std::to_string(rank) + " fails on its own now" +
                               args.fail_text);
    }
    if (seen.defined()) seen.add_(rank + 1);
    if (rank == args.stop_rank && batch_idx == args.fault_step && args.stop_in == "step") {
      trainer().request_stop();
    }
    if (args.monitor_skew) {
      const auto step = static_cast<double>(trainer().global_step());
      log("skew", rank == 0 ? step : 100.0 - step);
    }
    if (args.own_metric) {
      log("own", 10.0 * rank + static_cast<double>(trainer().global_step()));
    }
    if (rank == args.metric_object_rank) {
      rank_metric.update(torch::tensor({1.0 * batch_idx}));
      log("rank_metric", rank_metric);
    }
    if (rank == args.extra_metric_rank)
      log("only_here", 1.0, {.on_epoch = true, .sync_dist = true});
    if (args.rank_step_metric >= 0 && batch_idx >= args.rank_step_metric &&
        !(rank == 1 && trainer().global_step() == args.rank_step_skip_at)) {
      log("rank_step", torch::tensor(10.0 * rank), {.sync_dist = true});
      log("rank_max", 1.0 * rank, {.sync_dist = true, .reduce = fulgur::ReduceOp::kMax});
    }
    auto [x, y] = batch.pair();
    if (std::count(args.skip_at.begin(), args.skip_at.end(), batch_idx) > 0) {
      const int world = trainer().strategy().world_size();
      auto skips = [&](int r) {
        return std::count(args.skip_ranks.begin(), args.skip_ranks.end(), r) > 0;
      };
      if (world > 1 && skips(rank)) {
        if (args.skip_after_forward) forward(x, false);  // and drop the output
        return {};
      }
      if (world == 1) {
        // The distributed sampler deals sample i to rank i % world: keep
        // the rows of the ranks that do not skip.
        std::vector<int64_t> keep;
        for (int64_t i = 0; i < x.size(0); ++i) {
          if (!skips(static_cast<int>(i % args.reference_world))) keep.push_back(i);
        }
        if (keep.empty()) return {};
        auto index = torch::tensor(keep, torch::kLong);
        x = x.index_select(0, index);
        y = y.index_select(0, index);
      }
    }
    auto loss = torch::cross_entropy_loss(forward(x, args.unused_layer && batch_idx % 2 == 0), y);
    log("train_loss", loss, {.on_epoch = true, .sync_dist = args.sync_dist});
    if (args.manual) {
      // The same step, written by hand: gradients must still be averaged.
      auto& optimizer = *optimizers().front();
      optimizer.zero_grad();
      manual_backward(loss);
      optimizer_step(optimizer);
    }
    return loss;
  }

  bool reported_restart = false;

  void on_train_batch_end(const at::Tensor&, const fulgur::Batch&, int64_t batch_idx) override {
    if (args.batch_end_step_metric) {
      log("end_step",
          torch::tensor(10.0 * trainer().strategy().global_rank() +
                        static_cast<double>(trainer().global_step())),
          {.sync_dist = true});
    }
    if (args.report_times && !reported_restart && attempt() > 0 &&
        trainer().strategy().is_global_zero()) {
      reported_restart = true;
      std::cout << "TIME restarted_step=" << wall_ns() << std::endl;
    }
    if (trainer().global_step() == args.pause_step && attempt() == 0) {
      if (trainer().strategy().is_global_zero() && !args.pause_file.empty()) {
        std::ofstream(args.pause_file) << "paused\n";
      }
      std::this_thread::sleep_for(std::chrono::duration<double>(args.pause_seconds));
    }
    if (trainer().strategy().global_rank() == args.slow_rank && batch_idx + 1 == args.fault_step) {
      std::this_thread::sleep_for(std::chrono::duration<double>(args.slow_seconds));
    }
    if (trainer().strategy().global_rank() == args.stop_rank && batch_idx == args.fault_step &&
        args.stop_in == "batch-end") {
      trainer().request_stop();
    }
  }

  void on_train_epoch_end() override {
    if (args.early_stop_rank < 0) return;
    const double epoch = static_cast<double>(trainer().current_epoch());
    const bool that_rank = trainer().strategy().global_rank() == args.early_stop_rank;
    if (args.early_stop_metric_on_that_rank_only && !that_rank) return;
    log("es_metric", that_rank ? epoch : -epoch);
  }

  void validation_step(fulgur::Batch& batch, int64_t) override {
    auto& [x, y] = batch.pair();
    const auto out = forward(x, false);
    auto acc = (out.argmax(1) == y).to(torch::kDouble).mean();
    log("val_acc", acc, {.sync_dist = args.sync_dist});
    const int rank = trainer().strategy().global_rank();
    if ((rank == args.fail_rank || args.fail_all) && args.fail_in == "validation" &&
        !trainer().sanity_checking() && trainer().global_step() == args.fault_step) {
      throw std::runtime_error("rank " + std::to_string(rank) + " fails on its own in validation");
    }
    if (args.ema > 0) {
      // The weights validated, finely: an EMA's average or not.
      log("val_loss", torch::cross_entropy_loss(out, y), {.sync_dist = args.sync_dist});
    }
  }

  // StochasticWeightAveraging's BatchNorm pass runs it in training mode.
  fulgur::Batch predict_step(fulgur::Batch& batch, int64_t) override {
    return forward(batch.pair().first, false);
  }

  void on_validation_epoch_end() override {
    if (trainer().strategy().global_rank() == args.stop_rank && !trainer().sanity_checking() &&
        trainer().global_step() == args.fault_step && args.stop_in == "validation") {
      trainer().request_stop();
    }
  }

  void test_step(fulgur::Batch& batch, int64_t) override {
    auto& [x, y] = batch.pair();
    const at::Tensor logits = forward(x, false);
    auto acc = (logits.argmax(1) == y).to(torch::kDouble).mean();
    log("test_acc", acc, {.sync_dist = args.sync_dist});
    test_macro_acc.update(logits, y);
    test_macro_f1.update(logits, y);
    test_auroc.update(logits.softmax(1), y);
    test_samples.update(torch::ones({x.size(0)}));
    log("test_macro_acc", test_macro_acc);
    log("test_macro_f1", test_macro_f1);
    log("test_auroc", test_auroc);
    log("test_samples", test_samples);
    log("test_count", static_cast<double>(x.size(0)),
        {.sync_dist = args.sync_dist, .reduce = fulgur::ReduceOp::kSum});
  }

  // What a sharded strategy holds at the end of training (before it
  // gathers the parameters back), per rank.
  void on_train_end() override {
    auto* fsdp = dynamic_cast<fulgur::FSDPStrategy*>(&trainer().strategy());
    if (fsdp == nullptr) return;
    const auto memory = fsdp->memory();
    const int rank = trainer().strategy().global_rank();
    std::cout << "RESULT rank" << rank << "_held_parameter_bytes=" << memory.parameters << "\n"
              << "RESULT rank" << rank << "_peak_parameter_bytes=" << fsdp->peak_parameter_bytes()
              << "\n"
              << "RESULT rank" << rank << "_unit_gathers=" << fsdp->unit_gathers() << "\n"
              << "RESULT rank" << rank << "_shard_bytes=" << memory.shards << std::endl;
  }

  // The optimizer's per-parameter state, in parameter order: SGD's momentum
  // buffers, or Adam's step, exp_avg and exp_avg_sq.
  void on_fit_end() override {
    if (args.out_optimizer.empty() || !trainer().strategy().is_global_zero()) return;
    auto& optimizer = *optimizers().front();
    std::vector<at::Tensor> state;
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        auto it = optimizer.state().find(fulgur::compat::optimizer_state_key(p));
        if (it == optimizer.state().end()) continue;
        if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
          state.push_back(sgd->momentum_buffer().clone());
        } else if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
          state.push_back(torch::tensor(adam->step()));
          state.push_back(adam->exp_avg().clone());
          state.push_back(adam->exp_avg_sq().clone());
        }
      }
    }
    // Then every group's learning rate, where a schedule leaves it.
    for (const auto& group : optimizer.param_groups()) {
      state.push_back(torch::tensor(group.options().get_lr(), torch::kDouble));
    }
    torch::save(state, args.out_optimizer);
  }

  fulgur::OptimizerConfig configure_optimizers() override {
    std::shared_ptr<torch::optim::Optimizer> optimizer;
    std::vector<at::Tensor> params;
    for (auto& p : parameters()) {
      if (args.finetune_at < 0 || p.requires_grad()) params.push_back(p);
    }
    if (args.optimizer == "adam") {
      optimizer = std::make_shared<torch::optim::Adam>(params, 0.01);
    } else if (args.optimizer == "split-sgd") {
      // Two optimizers, each stepping half of the parameters, as one SGD
      // over all of them would.
      const auto half = static_cast<std::ptrdiff_t>(params.size() / 2);
      const auto options = torch::optim::SGDOptions(0.1).momentum(0.9);
      return {{std::make_shared<torch::optim::SGD>(
                   std::vector<at::Tensor>(params.begin(), params.begin() + half), options),
               std::make_shared<torch::optim::SGD>(
                   std::vector<at::Tensor>(params.begin() + half, params.end()), options)}};
    } else {
      optimizer =
          std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    }
    if (args.schedule == "epoch") {
      return {{optimizer},
              {{.scheduler = std::make_shared<torch::optim::StepLR>(*optimizer, 1, 0.5),
                .interval = fulgur::Interval::kEpoch}}};
    }
    if (args.schedule == "step") {
      const double steps = static_cast<double>(std::max<int64_t>(args.steps, 6));
      auto warmup_cosine = [steps](int64_t step) {
        if (step < 5) return (static_cast<double>(step) + 1) / 5.0;
        return 0.5 * (1 + std::cos(M_PI * static_cast<double>(step - 5) / (steps - 5)));
      };
      return {{optimizer},
              {{.scheduler = std::make_shared<fulgur::LambdaLR>(*optimizer, warmup_cosine),
                .interval = fulgur::Interval::kStep}}};
    }
    if (!args.schedule.empty()) {
      throw std::runtime_error("--schedule " + args.schedule + ": expected epoch or step");
    }
    return {optimizer};
  }
};

// --linger-after-failure: a failed rank whose failure path takes this long
// (its process group, and so its connections, still open).
struct LingerOnException : fulgur::Callback {
  explicit LingerOnException(double seconds) : seconds(seconds) {}
  double seconds;
  std::string state_key() const override { return "LingerOnException"; }
  void on_exception(fulgur::Trainer&, fulgur::Module&, const std::exception&) override {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }
};

// The most elements of a weight average (EMA's, SWA's) this rank held
// during training, printed at its end: under fsdp each rank averages its
// shards.
struct StartMetricsProbe : fulgur::Callback {
  std::string state_key() const override { return "StartMetricsProbe"; }
  void on_train_start(fulgur::Trainer& trainer, fulgur::Module&) override {
    const auto& metrics = trainer.callback_metrics();
    const auto own = metrics.find("own");
    std::cout << "RESULT start_own_rank" << trainer.strategy().global_rank() << "="
              << (own != metrics.end() ? own->second : -1.0) << std::endl;
  }
};

struct AverageSizeProbe : fulgur::Callback {
  int64_t most = 0;
  std::string state_key() const override { return "AverageSizeProbe"; }
  void on_train_batch_end(fulgur::Trainer& trainer, fulgur::Module&, const at::Tensor&,
                          const fulgur::Batch&, int64_t) override {
    for (const auto& cb : trainer.callbacks()) {
      const std::vector<at::Tensor>* average = nullptr;
      if (const auto* ema = dynamic_cast<const fulgur::EMA*>(cb.get())) average = &ema->average();
      if (const auto* swa = dynamic_cast<const fulgur::StochasticWeightAveraging*>(cb.get())) {
        average = &swa->average();
      }
      if (average == nullptr) continue;
      int64_t elements = 0;
      for (const auto& t : *average) elements += t.numel();
      most = std::max(most, elements);
    }
  }
  void on_train_end(fulgur::Trainer& trainer, fulgur::Module&) override {
    std::cout << "RESULT rank" << trainer.strategy().global_rank() << "_average_elements=" << most
              << std::endl;
  }
};

// Writes the training data to a file in prepare_data() (slowly: it is a
// download), reads it back in setup(): every rank's setup() must come after
// the node's prepare_data() has finished.
struct SlowlyPreparedData : fulgur::DataModule {
  const Args& args;
  std::string file;
  std::shared_ptr<fulgur::TensorDataset> train;
  explicit SlowlyPreparedData(const Args& a) : args(a), file(a.root + "/prepared.pt") {}

  void prepare_data() override {
    std::this_thread::sleep_for(std::chrono::duration<double>(args.prepare_seconds));
    auto [x, y] = make_data(args.samples, 0);
    torch::save(std::vector<at::Tensor>{x, y}, file + ".tmp");
    std::filesystem::rename(file + ".tmp", file);
  }
  void setup(fulgur::Stage) override {
    if (!std::filesystem::exists(file)) {
      throw std::runtime_error("setup() ran before prepare_data() wrote " + file);
    }
    std::vector<at::Tensor> xy;
    torch::load(xy, file);
    train = std::make_shared<fulgur::TensorDataset>(xy.at(0), xy.at(1));
  }
  std::shared_ptr<fulgur::DataLoader> train_dataloader() override {
    return fulgur::make_data_loader(train, {.batch_size = args.batch, .shuffle = args.shuffle});
  }
};

// Made again every reload_every epochs (reload_dataloaders_every_n_epochs):
// 32 more samples, from further along the data, for each epoch it is made
// for. Every rank makes the same loaders; the Trainer splits them.
struct GrowingData : fulgur::DataModule {
  const Args& args;
  explicit GrowingData(const Args& a) : args(a) {}
  std::shared_ptr<fulgur::DataLoader> train_dataloader() override {
    auto [x, y] = make_data(args.samples + 32 * current_epoch(), 1000 * current_epoch());
    return fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(x, y),
                                    {.batch_size = args.batch, .shuffle = args.shuffle});
  }
};

// Every rank makes loaders of --samples samples (validation: 64), but
// --uneven-rank's training loader (with --uneven-val, its validation loader)
// has --uneven-samples more from the epoch --uneven-from on: what a
// rank-dependent dataset under use_distributed_sampler=false gives.
struct UnevenData : fulgur::DataModule {
  const Args& args;
  fulgur::Trainer& trainer;
  UnevenData(const Args& a, fulgur::Trainer& t) : args(a), trainer(t) {}
  int64_t extra() const {
    return trainer.strategy().global_rank() == args.uneven_rank &&
                   current_epoch() >= args.uneven_from
               ? args.uneven_samples
               : 0;
  }
  std::shared_ptr<fulgur::DataLoader> train_dataloader() override {
    return loader(args.samples + (args.uneven_val ? 0 : extra()), 0, args.batch);
  }
  std::shared_ptr<fulgur::DataLoader> val_dataloader() override {
    return loader(64 + (args.uneven_val ? extra() : 0), 50000, 16);
  }
  std::shared_ptr<fulgur::DataLoader> loader(int64_t samples, int64_t offset, int64_t batch) const {
    auto [x, y] = make_data(samples, offset);
    if (!args.iterable || trainer.strategy().global_rank() == args.known_length_rank) {
      return fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(x, y),
                                      {.batch_size = batch});
    }
    return fulgur::make_iterable_loader([x, y, batch](int64_t) -> fulgur::BatchGenerator {
      return [x, y, batch, at = int64_t{0}]() mutable -> std::optional<fulgur::Batch> {
        if (at >= x.size(0)) return std::nullopt;
        const int64_t end = std::min(at + batch, x.size(0));
        fulgur::Batch b(x.slice(0, at, end), y.slice(0, at, end));
        at = end;
        return b;
      };
    });
  }
};

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"fulgur multi-process test worker"};
  app.add_option("--strategy", a.strategy);
  app.add_option("--devices", a.devices);
  app.add_option("--num-nodes", a.num_nodes);
  app.add_option("--batch", a.batch);
  app.add_option("--steps", a.steps);
  app.add_option("--samples", a.samples);
  app.add_option("--test-samples", a.test_samples);
  app.add_option("--predict-dir", a.predict_dir);
  app.add_option("--predict-samples", a.predict_samples);
  app.add_option("--accumulate", a.accumulate);
  app.add_flag("--shuffle", a.shuffle);
  app.add_flag("--skip-fit", a.skip_fit);
  app.add_flag("--manual-optimization", a.manual);
  app.add_flag("--unused-layer", a.unused_layer);
  app.add_flag("--fsdp-units", a.fsdp_units);
  app.add_flag("--cnn", a.cnn);
  app.add_flag("--prefetch", a.prefetch);
  app.add_flag("--sequential", a.sequential);
  app.add_option("--auto-wrap", a.auto_wrap);
  app.add_flag("--histograms", a.histograms);
  app.add_flag("--skip-after-forward", a.skip_after_forward);
  app.add_option("--precision", a.precision);
  app.add_flag("--frozen-bias", a.frozen_bias);
  app.add_option("--state-dict-type", a.state_dict_type);
  app.add_option("--optimizer", a.optimizer);
  app.add_option("--gradient-clip-val", a.gradient_clip_val);
  app.add_option("--out", a.out);
  app.add_option("--root", a.root);
  app.add_option("--die-rank", a.die_rank);
  app.add_option("--hang-rank", a.hang_rank);
  app.add_option("--fault-step", a.fault_step);
  app.add_option("--timeout", a.timeout_s);
  app.add_option("--seed", a.seed);
  app.add_option("--sync-dist", a.sync_dist);
  app.add_option("--bucket-mb", a.bucket_mb);
  app.add_option("--process-group-backend", a.process_group_backend);
  app.add_option("--accelerator", a.accelerator);
  app.add_option("--plugins", a.plugins);
  app.add_option("--batchnorm", a.batchnorm);
  app.add_flag("--sync-batchnorm", a.sync_batchnorm);
  app.add_flag("--checkpoint", a.checkpoint);
  app.add_option("--skip-ranks", a.skip_ranks)->delimiter(',');
  app.add_option("--skip-at", a.skip_at)->delimiter(',');
  app.add_option("--reference-world", a.reference_world);
  app.add_flag("--count-buffer", a.count_buffer);
  app.add_option("--broadcast-buffers", a.broadcast_buffers);
  app.add_option("--extra-metric-rank", a.extra_metric_rank);
  app.add_flag("--head-in-configure-model", a.head_in_configure_model);
  app.add_option("--extra-buffer-rank", a.extra_buffer_rank);
  app.add_option("--exit-zero-rank", a.exit_zero_rank);
  app.add_option("--rank-step-metric", a.rank_step_metric);
  app.add_flag("--batch-end-step-metric", a.batch_end_step_metric);
  app.add_option("--rank-step-skip-at", a.rank_step_skip_at);
  app.add_flag("--own-metric", a.own_metric);
  app.add_option("--metric-object-rank", a.metric_object_rank);
  app.add_flag("--monitor-skew", a.monitor_skew);
  app.add_option("--skew-monitor", a.skew_monitor);
  app.add_flag("--count-collectives", a.count_collectives);
  app.add_option("--stop-rank", a.stop_rank);
  app.add_option("--stop-in", a.stop_in)->check(CLI::IsMember({"step", "batch-end", "validation"}));
  app.add_option("--val-every", a.val_every);
  app.add_option("--fail-rank", a.fail_rank);
  app.add_option("--fail-text", a.fail_text);
  app.add_flag("--fail-all", a.fail_all);
  app.add_option("--fail-in", a.fail_in)->check(CLI::IsMember({"step", "validation"}));
  app.add_option("--on-exception-checkpoint", a.on_exception_timeout);
  app.add_option("--linger-after-failure", a.linger_after_failure);
  app.add_option("--stop-grace", a.stop_grace_s);
  app.add_option("--extra-barrier-rank", a.extra_barrier_rank);
  app.add_option("--lr-find-first", a.lr_find_first);
  app.add_flag("--test-by-another-trainer", a.test_by_another_trainer);
  app.add_option("--tester-timeout", a.tester_timeout_s);
  app.add_flag("--csv-and-profiler", a.csv_and_profiler);
  app.add_option("--slow-rank", a.slow_rank);
  app.add_flag("--checkpoint-activations", a.checkpoint_activations);
  app.add_flag("--unit-around-checkpoint", a.unit_around_checkpoint);
  app.add_flag("--nested-checkpoint", a.nested_checkpoint);
  app.add_option("--ema", a.ema);
  app.add_option("--swa-start", a.swa_start);
  app.add_option("--pause-step", a.pause_step);
  app.add_option("--pause-seconds", a.pause_seconds);
  app.add_option("--pause-file", a.pause_file);
  app.add_option("--slow-seconds", a.slow_seconds);
  app.add_option("--hang-at-exit-rank", a.hang_at_exit_rank);
  app.add_option("--prepare-seconds", a.prepare_seconds);
  app.add_option("--reload-every", a.reload_every);
  app.add_option("--uneven-rank", a.uneven_rank);
  app.add_option("--uneven-samples", a.uneven_samples);
  app.add_option("--uneven-from", a.uneven_from);
  app.add_flag("--uneven-val", a.uneven_val);
  app.add_flag("--iterable", a.iterable);
  app.add_option("--known-length-rank", a.known_length_rank);
  app.add_option("--limit-train-batches", a.limit_train_batches);
  app.add_option("--finetune-at", a.finetune_at);
  app.add_option("--unfreeze-mismatch-step", a.unfreeze_mismatch_step);
  app.add_option("--unfreeze-rank", a.unfreeze_rank);
  app.add_flag("--warm-parent", a.warm_parent);
  app.add_option("--backward-before", a.backward_before)->check(CLI::IsMember({"", "fit", "raw"}));
  app.add_option("--distributed-sampler", a.distributed_sampler);
  app.add_option("--ignore-sigterm-rank", a.ignore_sigterm_rank);
  app.add_option("--signal-launcher-rank", a.signal_launcher_rank);
  app.add_option("--launcher-signal", a.launcher_signal);
  app.add_flag("--ignore-sigchld", a.ignore_sigchld);
  app.add_flag("--reap-elsewhere", a.reap_elsewhere);
  app.add_option("--max-restarts", a.max_restarts);
  app.add_option("--heartbeat-timeout", a.heartbeat_timeout_s);
  app.add_option("--every-n-train-steps", a.every_n_train_steps);
  app.add_option("--ckpt-path", a.ckpt_path);
  app.add_option("--ckpt-path-rank1", a.ckpt_path_rank1);
  app.add_flag("--rank1-cannot-read", a.rank1_cannot_read);
  app.add_option("--rank1-disk-suffix", a.rank1_disk_suffix);
  app.add_option("--kill", a.kills);
  app.add_option("--sigstop-rank", a.sigstop_rank);
  app.add_option("--deadlock-rank", a.deadlock_rank);
  app.add_flag("--report-times", a.report_times);
  app.add_option("--desync-rank", a.desync_rank);
  app.add_flag("--deterministic", a.deterministic);
  app.add_option("--out-optimizer", a.out_optimizer);
  app.add_option("--raise", a.raises);
  app.add_option("--step-sleep-ms", a.step_sleep_ms);
  app.add_option("--early-stop-rank", a.early_stop_rank);
  app.add_flag("--early-stop-metric-on-that-rank-only", a.early_stop_metric_on_that_rank_only);
  app.add_option("--schedule", a.schedule);
  CLI11_PARSE(app, argc, argv);

  try {
    torch::manual_seed(static_cast<uint64_t>(a.seed));
    Classifier model(a);
    auto [x, y] = make_data(a.samples, 0);
    auto train = fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(x, y),
                                          {.batch_size = a.batch, .shuffle = a.shuffle});
    fulgur::TrainerOptions options;
    if (a.strategy.rfind("ddp", 0) == 0) {
      // The registered variant, with this run's timeout and bucket size.
      auto probe = fulgur::strategy_registry().create(a.strategy);
      auto* ddp = dynamic_cast<fulgur::DDPStrategy*>(probe.get());
      fulgur::DDPOptions ddp_options = ddp->options();
      ddp_options.parallel.process_group_timeout =
          std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
      if (a.stop_grace_s >= 0) {
        ddp_options.parallel.stop_grace =
            std::chrono::milliseconds(static_cast<int64_t>(a.stop_grace_s * 1000));
      }
      ddp_options.bucket_cap_mb = a.bucket_mb;
      ddp_options.broadcast_buffers = a.broadcast_buffers;
      if (!a.process_group_backend.empty()) {
        ddp_options.parallel.process_group_backend = a.process_group_backend;
      }
      options.strategy = std::make_shared<fulgur::DDPStrategy>(ddp_options, a.strategy);
    } else if (a.strategy.rfind("fsdp", 0) == 0) {
      // The registered variant, with this run's timeout.
      auto probe = fulgur::strategy_registry().create(a.strategy);
      fulgur::FSDPOptions fsdp_options = dynamic_cast<fulgur::FSDPStrategy&>(*probe).options();
      fsdp_options.parallel.process_group_timeout =
          std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
      if (!a.state_dict_type.empty()) fsdp_options.state_dict_type = a.state_dict_type;
      fsdp_options.prefetch = a.prefetch;
      fsdp_options.auto_wrap_min_params = a.auto_wrap;
      options.strategy = std::make_shared<fulgur::FSDPStrategy>(fsdp_options, a.strategy);
    } else {
      options.strategy = a.strategy;
    }
    options.accelerator = a.accelerator;
    options.devices = fulgur::DevicesSpec(a.devices);
    options.num_nodes = a.num_nodes;
    options.sync_batchnorm = a.sync_batchnorm;
    options.use_distributed_sampler = a.distributed_sampler;
    if (!a.plugins.empty()) options.plugins = {a.plugins};
    if (a.rank1_cannot_read || !a.rank1_disk_suffix.empty()) {
      // Rank 1's disk. RANK: what the launcher sets in the ranks it starts.
      struct Rank1Disk : fulgur::TorchCheckpointIO {
        bool cannot_read = false;
        std::string suffix;
        static bool rank1() {
          const char* rank = std::getenv("RANK");
          return rank != nullptr && std::string(rank) == "1";
        }
        fulgur::StateDict load_checkpoint(const std::string& path) override {
          if (!rank1()) return TorchCheckpointIO::load_checkpoint(path);
          if (cannot_read) {
            throw fulgur::CheckpointError("cannot read \"" + path + "\": Input/output error");
          }
          return TorchCheckpointIO::load_checkpoint(path + suffix);
        }
        fulgur::FileFingerprint fingerprint(const std::string& path) override {
          return TorchCheckpointIO::fingerprint(rank1() ? path + suffix : path);
        }
      };
      auto disk = std::make_shared<Rank1Disk>();
      disk->cannot_read = a.rank1_cannot_read;
      disk->suffix = a.rank1_disk_suffix;
      options.plugins.push_back(disk);
    }
    options.max_steps = a.steps;
    options.reload_dataloaders_every_n_epochs = a.reload_every;
    if (a.limit_train_batches > 0) {
      options.limit_train_batches =
          fulgur::BatchLimit(static_cast<long long>(a.limit_train_batches));
    }
    if (!a.precision.empty()) options.precision = a.precision;
    options.accumulate_grad_batches = a.accumulate;
    if (a.gradient_clip_val > 0) options.gradient_clip_val = a.gradient_clip_val;
    options.enable_progress_bar = false;
    auto checkpoint = std::make_shared<fulgur::ModelCheckpoint>(
        fulgur::ModelCheckpointOptions{.monitor = "train_loss", .save_top_k = 1});
    options.enable_checkpointing = a.checkpoint || a.every_n_train_steps > 0;
    if (a.checkpoint) options.callbacks = {checkpoint};
    if (a.on_exception_timeout >= 0) {
      options.callbacks.push_back(
          std::make_shared<fulgur::OnExceptionCheckpoint>(fulgur::OnExceptionCheckpointOptions{
              .peer_timeout =
                  std::chrono::milliseconds(static_cast<int64_t>(a.on_exception_timeout * 1000))}));
    }
    if (a.linger_after_failure > 0) {
      options.callbacks.push_back(std::make_shared<LingerOnException>(a.linger_after_failure));
    }
    if (a.early_stop_rank >= 0) {
      options.callbacks.push_back(std::make_shared<fulgur::EarlyStopping>(
          fulgur::EarlyStoppingOptions{.monitor = "es_metric", .patience = 1}));
    }
    if (a.ema > 0) {
      options.callbacks.push_back(std::make_shared<fulgur::EMA>(fulgur::EMAOptions{.decay = a.ema}));
    }
    if (a.swa_start > 0) {
      options.callbacks.push_back(std::make_shared<fulgur::StochasticWeightAveraging>(
          fulgur::SWAOptions{.swa_lr = 0.02,
                             .swa_epoch_start = static_cast<double>(a.swa_start),
                             .annealing_epochs = 1}));
    }
    if (a.own_metric) options.callbacks.push_back(std::make_shared<StartMetricsProbe>());
    auto skew = std::make_shared<fulgur::ModelCheckpoint>(
        fulgur::ModelCheckpointOptions{.dirpath = a.root + "/skew",
                                       .filename = "{step}-{skew:.0f}",
                                       .monitor = a.skew_monitor,
                                       .save_top_k = 2,
                                       .save_last = false,
                                       .every_n_train_steps = 1});
    if (a.monitor_skew) {
      options.enable_checkpointing = true;
      options.callbacks.push_back(skew);
    }
    if (a.ema > 0 || a.swa_start > 0) {
      options.callbacks.push_back(std::make_shared<AverageSizeProbe>());
    }
    if (!a.predict_dir.empty()) {
      options.callbacks.push_back(std::make_shared<fulgur::PredictionFileWriter>(a.predict_dir));
    }
    if (a.finetune_at >= 0) {
      options.callbacks.push_back(
          std::make_shared<fulgur::BackboneFinetuning>(fulgur::BackboneFinetuningOptions{
              .unfreeze_backbone_at_epoch = a.finetune_at, .backbone = "fc1"}));
    }
    options.every_n_train_steps = a.every_n_train_steps;
    options.max_restarts = a.max_restarts;
    if (a.deterministic) options.deterministic = true;
    if (a.heartbeat_timeout_s >= 0) {
      options.heartbeat_timeout =
          std::chrono::milliseconds(static_cast<int64_t>(a.heartbeat_timeout_s * 1000));
    }
    options.logger = a.histograms;
    if (a.csv_and_profiler) {
      options.logger = "csv";
      options.log_every_n_steps = 1;
      options.profiler = fulgur::ProfilerKind::kPyTorch;
      options.profiler_wait = 1;
      options.profiler_active = 2;
    }
    if (a.histograms) {
      // Every rank has it (a sharded strategy gathers for it on each);
      // rank 0 writes.
      options.loggers.push_back(std::make_shared<fulgur::TensorBoardLogger>(
          fulgur::TensorBoardLoggerOptions{.save_dir = a.root, .log_histograms = true}));
    }
    options.default_root_dir = a.root;
    options.seed = static_cast<uint64_t>(a.seed);
    if (a.val_every > 0) options.val_check_interval = a.val_every;
    if (a.backward_before == "fit") {
      Classifier first(a);
      fulgur::Trainer({.accelerator = "cpu",
                       .devices = 1,
                       .max_steps = 1,
                       .default_root_dir = a.root + "/before",
                       .enable_checkpointing = false,
                       .enable_progress_bar = false,
                       .logger = false})
          .fit(first, train);
      std::cout << "fitted once in the launching process" << std::endl;
    } else if (a.backward_before == "raw") {
      auto w = torch::ones({2}, torch::requires_grad());
      (w * w).sum().backward();
    }
    fulgur::Trainer trainer(options);
    fulgur::FitResult result;
    if (a.warm_parent) {
      // No random numbers: the run's weights must not depend on this.
      torch::set_num_threads(2);
      auto m = torch::ones({384, 384}) / 384.0;
      std::cout << "warm-up product " << torch::mm(m, m).sum().item<double>() << " on "
                << torch::get_num_threads() << " intra-op threads" << std::endl;
    }
    if (a.ignore_sigchld) std::signal(SIGCHLD, SIG_IGN);
    if (a.reap_elsewhere) {
      std::thread([] {
        for (;;) {
          int status = 0;
          if (::waitpid(-1, &status, 0) < 0) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
        }
      }).detach();
    }
    // The options with a strategy instance of their own, as a program that
    // names its strategy for each Trainer has (an instance given to two
    // Trainers keeps its group anyway).
    auto with_own_strategy = [&](fulgur::TrainerOptions o) {
      if (auto* s = std::get_if<std::shared_ptr<fulgur::Strategy>>(&o.strategy)) {
        if (auto* ddp = dynamic_cast<fulgur::DDPStrategy*>(s->get())) {
          o.strategy = std::make_shared<fulgur::DDPStrategy>(ddp->options(), a.strategy);
        }
      }
      return o;
    };
    if (a.lr_find_first > 0) {
      fulgur::Tuner tuner(with_own_strategy(options));
      const fulgur::LRFinderResult found = tuner.lr_find(
          model, train, {.num_training = a.lr_find_first, .early_stop_threshold = 0.0});
      std::cout << "RESULT lr_find_steps=" << found.lrs.size() << std::endl;
      std::ostringstream losses;
      for (const double loss : found.losses) losses << (losses.tellp() > 0 ? ";" : "") << loss;
      std::cout << "RESULT lr_find_losses=" << losses.str() << std::endl;
    }
    SlowlyPreparedData prepared(a);
    if (!a.skip_fit) {
      if (a.prepare_seconds > 0) {
        result = trainer.fit(model, prepared);
      } else if (a.uneven_rank >= 0) {
        UnevenData uneven(a, trainer);
        result = trainer.fit(model, uneven);
      } else if (a.reload_every > 0) {
        GrowingData growing(a);
        result = trainer.fit(model, growing);
      } else if (a.val_every > 0) {
        auto [vx, vy] = make_data(64, 50000);
        result =
            trainer.fit(model, train,
                        fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(vx, vy),
                                                 {.batch_size = 16}));
      } else {
        // RANK: what the launcher sets in the ranks it starts.
        const char* rank = std::getenv("RANK");
        const bool rank1 = rank != nullptr && std::string(rank) == "1";
        result = trainer.fit(
            model, train, nullptr,
            {.ckpt_path = rank1 && a.ckpt_path_rank1 ? *a.ckpt_path_rank1 : a.ckpt_path});
      }
    }
    fulgur::Metrics test;
    if (a.test_samples > 0) {
      auto [tx, ty] = make_data(a.test_samples, 100000);
      auto test_loader = fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(tx, ty),
                                                  {.batch_size = 64});
      if (a.test_by_another_trainer) {
        fulgur::TrainerOptions tester_options = with_own_strategy(options);
        if (a.tester_timeout_s > 0) {
          auto& s = std::get<std::shared_ptr<fulgur::Strategy>>(tester_options.strategy);
          fulgur::DDPOptions ddp = dynamic_cast<fulgur::DDPStrategy&>(*s).options();
          ddp.parallel.process_group_timeout =
              std::chrono::milliseconds(static_cast<int64_t>(a.tester_timeout_s * 1000));
          tester_options.strategy = std::make_shared<fulgur::DDPStrategy>(ddp, a.strategy);
        }
        fulgur::Trainer tester(tester_options);
        test = tester.test(model, test_loader);
      } else {
        test = trainer.test(model, test_loader);
      }
    }
    if (!a.predict_dir.empty()) {
      auto [px, py] = make_data(a.predict_samples, 200000);
      const auto mine = trainer.predict(
          model, fulgur::make_data_loader(std::make_shared<fulgur::TensorDataset>(px, py),
                                          {.batch_size = 5}));
      int64_t rows = 0;
      for (const auto& p : mine) rows += p.batch_size();
      std::cout << "RESULT predicted_rank" << trainer.strategy().global_rank() << "=" << rows
                << std::endl;
    }
    auto& strategy = trainer.strategy();
    if (model.body) {
      // After fit the Sequential runs its own entries again.
      std::cout << "RESULT body_entries_restored="
                << (model.body->ptr(0).get() == model.body_first.get()) << std::endl;
    }
    if (a.monitor_skew) {
      std::cout << "RESULT skew_best_rank" << strategy.global_rank() << "="
                << skew->best_model_path() << std::endl;
    }
    if (a.rank_step_metric >= 0) {
      for (const char* name : {"rank_step", "rank_max"}) {
        std::cout << "RESULT " << name << "_rank" << strategy.global_rank() << "="
                  << trainer.callback_metrics().at(name) << std::endl;
      }
    }
    if (a.batch_end_step_metric) {
      std::cout << "RESULT end_step_rank" << strategy.global_rank() << "="
                << trainer.callback_metrics().at("end_step") << std::endl;
    }
    if (a.csv_and_profiler) {
      std::cout << "RESULT log_dir_rank" << strategy.global_rank() << "=" << trainer.log_dir()
                << std::endl;
    }
    if (model.seen.defined()) {
      std::cout << "RESULT seen_rank" << strategy.global_rank() << "=" << model.seen.item<int64_t>()
                << std::endl;
    }
    if (strategy.is_global_zero()) {
      if (!a.out.empty()) {
        std::vector<at::Tensor> params;
        for (auto& p : model.parameters()) params.push_back(p.detach().cpu().clone());
        for (auto& b : model.buffers()) {
          params.push_back(b.detach().cpu().to(torch::kFloat).clone());
        }
        torch::save(params, a.out);
      }
      std::cout << "RESULT configure_model_calls=" << model.configure_model_calls << "\n";
      int64_t parameter_elements = 0;
      for (const auto& p : model.parameters()) parameter_elements += p.numel();
      std::cout << "RESULT parameter_elements=" << parameter_elements << "\n";
      std::cout << "RESULT world_size=" << strategy.world_size() << "\n"
                << "RESULT global_step=" << result.global_step << "\n"
                << "RESULT train_loss=" << result.metrics["train_loss"] << "\n"
                << (result.metrics.count("val_acc") != 0
                        ? "RESULT val_acc=" + std::to_string(result.metrics.at("val_acc")) + "\n"
                        : std::string())
                << "RESULT cluster_environment=" << strategy.cluster_environment().name() << "\n"
                << "RESULT sigpipe="
                << (std::signal(SIGPIPE, SIG_IGN) == SIG_IGN ? "ignored" : "default") << "\n";
      if (auto* parallel = dynamic_cast<fulgur::ParallelStrategy*>(&strategy)) {
        std::cout << "RESULT process_group_backend=" << parallel->process_group_backend() << "\n";
      }
      if (a.checkpoint) {
        // The caller's callback object, which a forking launcher updates too.
        std::cout << "RESULT result_best=" << result.best_model_path << "\n"
                  << "RESULT callback_best=" << checkpoint->best_model_path() << "\n"
                  << "RESULT callback_last=" << checkpoint->last_model_path() << "\n"
                  << "RESULT callback_dirpath=" << checkpoint->dirpath() << "\n";
      }
      for (const auto& [k, v] : test) std::cout << "RESULT " << k << "=" << v << "\n";
      if (result.metrics.count("val_loss") > 0) {
        std::cout << "RESULT val_loss=" << std::setprecision(17) << result.metrics["val_loss"]
                  << std::setprecision(6) << "\n";
      }
      // The metrics' values to the last bit (fulgur::metrics).
      for (const auto& [k, v] : test) {
        if (k == "test_macro_acc" || k == "test_macro_f1" || k == "test_auroc" ||
            k == "test_samples") {
          std::cout << "RESULT exact_" << k << "=" << std::setprecision(17) << v
                    << std::setprecision(6) << "\n";
        }
      }
      std::cout.flush();
    }
    if (strategy.global_rank() == a.hang_at_exit_rank) {
      std::cout << "rank " << a.hang_at_exit_rank << " hangs on its way out" << std::endl;
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ERROR " << e.what() << std::endl;
    return 1;
  }
}
