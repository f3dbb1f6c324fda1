// Validation, test and predict loops: eval mode, no gradients, the stage's
// step and hooks, and epoch metrics published at the end.
#include "trainer/loops/evaluation_loop.h"

#include <torch/torch.h>

#include <functional>
#include <optional>

#include "fulgur/callbacks/callback.h"
#include "fulgur/core/errors.h"
#include "fulgur/metrics/metric.h"
#include "trainer/loops/device_feed.h"
#include "trainer/loops/module_modes.h"
#include "trainer/trainer_impl.h"

namespace fulgur::detail {

namespace {
// Batches a pass over `loader` runs: the loader's count cut at `limit`; -1
// when neither is known.
int64_t pass_length(const DataLoader& loader, std::optional<int64_t> limit) {
  const auto n = loader.num_batches();
  if (n && limit) return std::min(*n, *limit);
  if (n) return *n;
  return limit.value_or(-1);
}

// While a padded shard's last batch is evaluated: the metrics updated leave
// its repeated rows out (fulgur/metrics/metric.h).
class PaddedRows {
 public:
  explicit PaddedRows(int64_t rows) { metrics::Metric::set_padded_rows(rows); }
  ~PaddedRows() { metrics::Metric::set_padded_rows(0); }
  PaddedRows(const PaddedRows&) = delete;
  PaddedRows& operator=(const PaddedRows&) = delete;
};

// Runs `fn(batch, batch on the device, index)` for the first `limit` batches
// (all when unset) of one pass over `loader`; with prefetch, each batch is
// put on the device while the step before it runs. With `agree` (every rank
// must run as many batches, and the loader's length is unknown on some
// rank), each batch's look-ahead goes through it
// (Trainer::Impl::end_at_the_shortest_rank).
template <class Fn>
void for_each_batch(Strategy& strategy, std::optional<bool> prefetch, Module& module,
                    DataLoader& loader, std::optional<int64_t> limit,
                    const std::function<void(std::optional<Batch>&)>& agree, Fn fn) {
  DeviceFeed feed;
  feed.reset(strategy, prefetch, module);
  // Non-persistent workers end with the pass, whichever way it ends.
  struct Release {
    DataLoader& loader;
    ~Release() { loader.release_workers(); }
  } release{loader};
  loader.start_epoch(0);
  auto fetch = [&] {
    std::optional<Batch> b = loader.next();
    if (agree) agree(b);
    return b;
  };
  std::optional<Batch> batch;
  if (!limit || *limit > 0) batch = fetch();
  if (batch) feed.put(*batch);
  const bool ahead = feed.enabled() || agree;
  for (int64_t idx = 0; batch; ++idx) {
    const bool more = !limit || idx + 1 < *limit;
    std::optional<Batch> next;
    if (ahead && more) {
      next = fetch();
      if (next) feed.put(*next);
    }
    Batch on_device = feed.take(*batch);
    fn(*batch, on_device, idx);
    if (!more) break;
    batch = ahead ? std::move(next) : loader.next();
  }
}

// When every rank must run as many batches (a collective forward): the
// lengths compared, and where some rank's is unknown, the look-ahead
// agreement for_each_batch applies; empty otherwise.
std::function<void(std::optional<Batch>&)> agreement(Trainer::Impl& trainer,
                                                     const DataLoader& loader, int64_t batches,
                                                     const char* which, const char* limit_flag,
                                                     bool& noted) {
  if (!trainer.drive().forward_is_collective() ||
      !trainer.require_equal_pass_lengths(batches, !loader.num_batches(), which, limit_flag)) {
    return {};
  }
  return [&trainer, which, &noted](std::optional<Batch>& ahead) {
    trainer.end_at_the_shortest_rank(ahead, which, noted);
  };
}
}  // namespace

Metrics EvaluationLoop::run(DataLoader& loader, Stage s, std::optional<int64_t> limit) {
  Module& m = *trainer_.module;
  const bool is_test = s == Stage::kTest;
  num_batches_ = pass_length(loader, limit);
  const char* const what = is_test ? "test" : "validation";
  // (The sanity check's 2 batches differ only where a rank has fewer:
  // limit_val_batches caps both passes.)
  const auto agree =
      agreement(trainer_, loader, num_batches_, what,
                is_test ? "limit_test_batches" : trainer_.limits.val_flag, noted_shorter_peer_);
  torch::NoGradGuard no_grad;
  // Each submodule's mode comes back as it was, as Lightning's (a
  // submodule kept in eval mode within training stays so; a standalone
  // validate leaves the module as it found it).
  const ModuleModes modes(m);
  m.eval();
  trainer_.logging.eval_sink().reset();
  Trainer::Impl::set_log_sink(m, &trainer_.logging.eval_sink());
  trainer_.logging.eval_sink().set_context(/*training_step=*/false, 1);
  // The test hooks in a test, the validation hooks otherwise: the Module's,
  // every callback's.
  using ModuleHook = void (Module::*)();
  using Hook = void (Callback::*)(Trainer&, Module&);
  auto module_hook = [&](ModuleHook test, ModuleHook validation) {
    (m.*(is_test ? test : validation))();
  };
  auto callbacks = [&](Hook test, Hook validation) {
    for (auto& cb : trainer_.callbacks) ((*cb).*(is_test ? test : validation))(trainer_.self, m);
  };
  using ModuleBatchHook = void (Module::*)(const Batch&, int64_t);
  using BatchHook = void (Callback::*)(Trainer&, Module&, const Batch&, int64_t);
  auto batch_hooks = [&](ModuleBatchHook test, ModuleBatchHook validation, BatchHook cb_test,
                         BatchHook cb_validation, const Batch& batch, int64_t idx) {
    (m.*(is_test ? test : validation))(batch, idx);
    for (auto& cb : trainer_.callbacks) {
      ((*cb).*(is_test ? cb_test : cb_validation))(trainer_.self, m, batch, idx);
    }
  };
  module_hook(&Module::on_test_start, &Module::on_validation_start);
  callbacks(&Callback::on_test_start, &Callback::on_validation_start);
  module_hook(&Module::on_test_epoch_start, &Module::on_validation_epoch_start);
  callbacks(&Callback::on_test_epoch_start, &Callback::on_validation_epoch_start);
  for_each_batch(
      *trainer_.strategy, trainer_.options.prefetch_to_device, m, loader, limit, agree,
      [&](const Batch& batch, Batch& on_device, int64_t idx) {
        // The batch's hooks log with its size too (as the training batch's
        // and Lightning's do; they weighed 1 in the epoch's mean).
        trainer_.logging.eval_sink().set_context(/*training_step=*/false, on_device.batch_size());
        batch_hooks(&Module::on_test_batch_start, &Module::on_validation_batch_start,
                    &Callback::on_test_batch_start, &Callback::on_validation_batch_start, batch,
                    idx);
        const PaddedRows padded(loader.padded_rows(idx));
        {
          auto scope = trainer_.drive().step_scope();
          if (is_test) {
            m.test_step(on_device, idx);
          } else {
            m.validation_step(on_device, idx);
          }
        }
        batch_hooks(&Module::on_test_batch_end, &Module::on_validation_batch_end,
                    &Callback::on_test_batch_end, &Callback::on_validation_batch_end, batch, idx);
        trainer_.logging.eval_sink().set_context(/*training_step=*/false, 1);
      });
  module_hook(&Module::on_test_epoch_end, &Module::on_validation_epoch_end);
  const auto& fit = trainer_.fit_loop;
  Metrics out =
      trainer_.logging.publish_epoch(trainer_.logging.eval_sink(), *trainer_.strategy,
                                     fit.sanity_checking(), fit.current_epoch(), fit.global_step(),
                                     /*in_fit=*/trainer_.stage == Stage::kFit);
  // A fit's monitored step-interval schedulers read these values (as
  // Lightning's plateau schedulers, after the validation).
  if (!is_test && trainer_.stage == Stage::kFit && !fit.sanity_checking()) {
    trainer_.fit_loop.step_monitored_schedulers();
  }
  callbacks(&Callback::on_test_epoch_end, &Callback::on_validation_epoch_end);
  Trainer::Impl::set_log_sink(m, nullptr);
  if (!is_test && trainer_.stage == Stage::kFit && !fit.sanity_checking()) {
    // A checkpoint written here resumes after this validation.
    trainer_.fit_loop.validation_end(m);
  } else {
    module_hook(&Module::on_test_end, &Module::on_validation_end);
    callbacks(&Callback::on_test_end, &Callback::on_validation_end);
  }
  return out;
}

std::vector<Batch> PredictionLoop::run(DataLoader& loader, std::optional<int64_t> limit) {
  Module& m = *trainer_.module;
  torch::NoGradGuard no_grad;
  const ModuleModes modes(m);
  m.eval();
  num_batches_ = pass_length(loader, limit);
  const auto agree = agreement(trainer_, loader, num_batches_, "predict", "limit_predict_batches",
                               noted_shorter_peer_);
  loader_ = &loader;
  struct Forget {
    DataLoader*& loader;
    ~Forget() { loader = nullptr; }
  } forget{loader_};
  trainer_.call_hooks([](Module& mod) { mod.on_predict_start(); },
                      [&](Callback& cb) { cb.on_predict_start(trainer_.self, m); });
  trainer_.call_hooks([](Module& mod) { mod.on_predict_epoch_start(); },
                      [&](Callback& cb) { cb.on_predict_epoch_start(trainer_.self, m); });
  std::vector<Batch> out;
  if (auto n = loader.num_batches())
    out.reserve(static_cast<size_t>(limit ? std::min(*n, *limit) : *n));
  for_each_batch(
      *trainer_.strategy, trainer_.options.prefetch_to_device, m, loader, limit, agree,
      [&](const Batch& batch, Batch& on_device, int64_t idx) {
        trainer_.call_hooks(
            [&](Module& mod) { mod.on_predict_batch_start(batch, idx); },
            [&](Callback& cb) { cb.on_predict_batch_start(trainer_.self, m, batch, idx); });
        {
          auto scope = trainer_.drive().step_scope();
          out.push_back(m.predict_step(on_device, idx));
        }
        trainer_.call_hooks([&](Module& mod) { mod.on_predict_batch_end(out.back(), batch, idx); },
                            [&](Callback& cb) {
                              cb.on_predict_batch_end(trainer_.self, m, out.back(), batch, idx);
                            });
      });
  trainer_.call_hooks([](Module& mod) { mod.on_predict_epoch_end(); },
                      [&](Callback& cb) { cb.on_predict_epoch_end(trainer_.self, m); });
  trainer_.call_hooks([](Module& mod) { mod.on_predict_end(); },
                      [&](Callback& cb) { cb.on_predict_end(trainer_.self, m); });
  return out;
}

}  // namespace fulgur::detail
