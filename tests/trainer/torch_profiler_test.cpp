// Trainer option profiler = "pytorch": LibTorch's operator profiler records
// exactly the window of training batches asked for, each rank writes a
// Chrome trace that parses and a table of operators, the fit loop's phases
// are spans inside each batch's, a fit too short to reach the window says
// so, a recording a failed fit left running is let go (the next fit records
// again), and a directory that cannot be written costs the profile, not the
// fit. The operator table's self times are checked against hand-made
// events.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "fulgur/fulgur.h"
#include "support/test_support.h"
#include "trainer/torch_profiler.h"

namespace torch_profiler_test {

using fulgur::detail::OperatorRecord;
using fulgur::detail::OperatorRow;
using fulgur::test::LinearRegression;
using fulgur::test::regression_dataset;
using fulgur::test::TempDir;
using fulgur::test::test_options;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

/// The complete ("X") events of a trace file, parsed as the JSON they are
/// (yaml-cpp reads JSON).
struct TraceEvent {
  std::string name;
  double ts = 0;
  double dur = 0;
  std::string tid;  // a thread's number (Kineto writes a GPU stream's as text)
};
std::vector<TraceEvent> trace_events(const std::string& path) {
  const YAML::Node root = YAML::LoadFile(path);
  std::vector<TraceEvent> events;
  for (const auto& e : root["traceEvents"]) {
    if (!e["ph"] || e["ph"].as<std::string>() != "X" || !e["dur"]) continue;
    events.push_back({e["name"].as<std::string>(), e["ts"].as<double>(), e["dur"].as<double>(),
                      e["tid"].as<std::string>()});
  }
  return events;
}

fulgur::TrainerOptions pytorch_options(const TempDir& dir, int64_t wait, int64_t active) {
  auto options = test_options(dir);
  options.profiler = "pytorch";
  options.profiler_wait = wait;
  options.profiler_active = active;
  return options;
}

/// What a fit of 4 batches under profiler=pytorch printed (stdout) and
/// noted (stderr), and the global step it ended at.
struct CapturedFit {
  std::string printed;
  std::string noted;
  int64_t global_step = 0;
};
CapturedFit fit_capturing_output(const TempDir& dir, int64_t wait, int64_t active) {
  LinearRegression model;
  fulgur::Trainer trainer(pytorch_options(dir, wait, active));
  testing::internal::CaptureStderr();
  testing::internal::CaptureStdout();
  trainer.fit(model, fulgur::make_data_loader(regression_dataset(16), {.batch_size = 4}));
  CapturedFit fit;
  fit.printed = testing::internal::GetCapturedStdout();
  fit.noted = testing::internal::GetCapturedStderr();
  fit.global_step = trainer.global_step();
  return fit;
}

TEST(TorchProfiler, RecordsTheWindowOfBatchesAndWritesATraceAndATable) {
  TempDir dir;
  LinearRegression model;
  fulgur::Trainer trainer(pytorch_options(dir, 2, 3));
  testing::internal::CaptureStdout();
  trainer.fit(model, fulgur::make_data_loader(regression_dataset(48), {.batch_size = 4}));
  const std::string printed = testing::internal::GetCapturedStdout();
  EXPECT_THAT(printed, testing::HasSubstr("profiler (pytorch): rank 0, training batches 2..4"));
  EXPECT_THAT(printed, testing::HasSubstr("aten::"));

  const std::string trace = dir.path() + "/profiler/fit-rank0.pt.trace.json";
  const std::string table = dir.path() + "/profiler/fit-rank0.operators.txt";
  ASSERT_TRUE(std::filesystem::exists(trace)) << printed;
  ASSERT_TRUE(std::filesystem::exists(table)) << printed;
  EXPECT_THAT(printed, testing::HasSubstr("trace: " + trace));
  EXPECT_THAT(read_file(table), testing::HasSubstr("the operators that took the most time"));

  const auto events = trace_events(trace);
  // One span per recorded batch, named by the global step it starts at
  // (one optimizer step per batch here), and the phases inside each.
  std::vector<TraceEvent> steps;
  std::map<std::string, int> count;
  for (const auto& e : events) {
    ++count[e.name];
    if (e.name.rfind("ProfilerStep#", 0) == 0) steps.push_back(e);
  }
  ASSERT_EQ(steps.size(), 3u) << read_file(trace).substr(0, 2000);
  std::sort(steps.begin(), steps.end(), [](const auto& a, const auto& b) { return a.ts < b.ts; });
  EXPECT_EQ(steps[0].name, "ProfilerStep#2");
  EXPECT_EQ(steps[1].name, "ProfilerStep#3");
  EXPECT_EQ(steps[2].name, "ProfilerStep#4");
  EXPECT_EQ(count["fulgur::training_step"], 3);
  EXPECT_EQ(count["fulgur::backward"], 3);
  EXPECT_EQ(count["fulgur::optimizer_step"], 3);
  EXPECT_GE(count["aten::addmm"] + count["aten::mm"] + count["aten::matmul"], 3)
      << "the Linear layer's forward in each recorded batch";
  for (const auto& e : events) {
    if (e.name != "fulgur::training_step") continue;
    const bool inside = std::any_of(steps.begin(), steps.end(), [&](const TraceEvent& s) {
      return s.tid == e.tid && s.ts <= e.ts && e.ts + e.dur <= s.ts + s.dur + 1e-3;
    });
    EXPECT_TRUE(inside) << "training_step at " << e.ts << " is inside a ProfilerStep span";
  }
}

// A later fit writing to the same directory (a second fit of the Trainer;
// runs without a logger share default_root_dir/profiler) takes the next
// free name instead of replacing the first profile.
TEST(TorchProfiler, ALaterFitKeepsTheEarlierProfile) {
  TempDir dir;
  const std::string first = dir.path() + "/profiler/fit-rank0.pt.trace.json";
  for (int run = 0; run < 2; ++run) {
    LinearRegression model;
    fulgur::Trainer trainer(pytorch_options(dir, 1, 1));
    testing::internal::CaptureStdout();
    trainer.fit(model, fulgur::make_data_loader(regression_dataset(16), {.batch_size = 4}));
    const std::string printed = testing::internal::GetCapturedStdout();
    if (run == 0) {
      ASSERT_TRUE(std::filesystem::exists(first)) << printed;
      std::ofstream(first, std::ios::app) << "\n";  // marked: it must stay as it is
      // Another rank's file of a second fit (a run of two ranks): a name
      // any rank's file has is taken, so that every rank of a fit takes
      // one name (rank 1 wrote fit-rank1 where rank 0 wrote fit2-rank0).
      std::ofstream(dir.path() + "/profiler/fit2-rank1.operators.txt") << "rank 1\n";
    } else {
      EXPECT_THAT(printed, testing::HasSubstr("trace: " + dir.path() +
                                              "/profiler/fit3-rank0.pt.trace.json"));
    }
  }
  EXPECT_EQ(read_file(first).back(), '\n');
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/profiler/fit3-rank0.operators.txt"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/profiler/fit3-rank0.pt.trace.json.partial"));
}

TEST(TorchProfiler, AFitShorterThanTheWaitRecordsNothingAndSaysSo) {
  TempDir dir;
  LinearRegression model;
  fulgur::Trainer trainer(pytorch_options(dir, 20, 5));
  testing::internal::CaptureStdout();
  trainer.fit(model, fulgur::make_data_loader(regression_dataset(16), {.batch_size = 4}));
  const std::string printed = testing::internal::GetCapturedStdout();
  EXPECT_THAT(printed, testing::HasSubstr("recorded nothing: the fit ran 4 training batches"));
  EXPECT_THAT(printed, testing::HasSubstr("profiler_wait=20"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/profiler"));
}

TEST(TorchProfiler, AFitEndingInsideTheWindowWritesWhatItRecorded) {
  TempDir dir;
  LinearRegression model;
  fulgur::Trainer trainer(pytorch_options(dir, 1, 50));
  testing::internal::CaptureStdout();
  trainer.fit(model, fulgur::make_data_loader(regression_dataset(16), {.batch_size = 4}));
  const std::string printed = testing::internal::GetCapturedStdout();
  EXPECT_THAT(printed, testing::HasSubstr("training batches 1..3 of the fit"));
  int steps = 0;
  for (const auto& e : trace_events(dir.path() + "/profiler/fit-rank0.pt.trace.json")) {
    steps += e.name.rfind("ProfilerStep#", 0) == 0 ? 1 : 0;
  }
  EXPECT_EQ(steps, 3);
}

/// Throws from training_step at one batch.
class FailsAt : public LinearRegression {
 public:
  explicit FailsAt(int64_t batch) : batch_(batch) {}
  at::Tensor training_step(fulgur::Batch& batch, int64_t batch_idx) override {
    if (batch_idx == batch_) throw std::runtime_error("training_step fails on purpose");
    return LinearRegression::training_step(batch, batch_idx);
  }

 private:
  int64_t batch_;
};

TEST(TorchProfiler, AFitThatFailsInsideTheWindowLetsGoAndTheNextFitRecords) {
  TempDir dir;
  {
    FailsAt model(2);
    fulgur::Trainer trainer(pytorch_options(dir, 1, 5));
    EXPECT_THROW(
        trainer.fit(model, fulgur::make_data_loader(regression_dataset(32), {.batch_size = 4})),
        std::runtime_error);
  }
  EXPECT_FALSE(torch::profiler::impl::profilerEnabled())
      << "the failed fit left LibTorch's profiler recording";
  TempDir again;
  LinearRegression model;
  fulgur::Trainer trainer(pytorch_options(again, 1, 2));
  testing::internal::CaptureStdout();
  trainer.fit(model, fulgur::make_data_loader(regression_dataset(32), {.batch_size = 4}));
  EXPECT_THAT(testing::internal::GetCapturedStdout(), testing::HasSubstr("training batches 1..2"));
  EXPECT_TRUE(std::filesystem::exists(again.path() + "/profiler/fit-rank0.pt.trace.json"));
}

TEST(TorchProfiler, ADirectoryThatCannotBeWrittenCostsTheProfileNotTheFit) {
  TempDir dir;
  // A file where the profiler's directory should be.
  std::ofstream(dir.path() + "/profiler") << "not a directory";
  const CapturedFit fit = fit_capturing_output(dir, 0, 2);
  EXPECT_THAT(fit.noted,
              testing::HasSubstr("profiler=pytorch: could not create " + dir.path() + "/profiler"));
  EXPECT_THAT(fit.noted, testing::HasSubstr("(\"" + dir.path() + "/profiler\" is a file)"));
  EXPECT_THAT(fit.noted, testing::HasSubstr("the fit goes on"));
  EXPECT_THAT(fit.printed, testing::HasSubstr("training batches 0..1"))
      << "the table is still printed";
  EXPECT_EQ(fit.global_step, 4) << "the fit ran to its end";
}

TEST(TorchProfiler, AProfilerAlreadyRecordingTheThreadIsNotedAndTheFitGoesOn) {
  // The program (or a library in it) records this thread already: fulgur
  // starts no second profiler (1.13 refuses one, 2.6 would start it over the
  // first), which costs the profile, not the fit, and the program's own
  // recording is left running.
  namespace kineto = torch::autograd::profiler;
  namespace impl = torch::profiler::impl;
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  const std::set<impl::ActivityType> cpu{impl::ActivityType::CPU};
  kineto::prepareProfiler(config, cpu);
  kineto::enableProfiler(config, cpu);
  TempDir dir;
  const CapturedFit fit = fit_capturing_output(dir, 0, 2);
  const bool still_ours = impl::profilerEnabled();
  if (still_ours) kineto::disableProfiler();
  EXPECT_THAT(fit.noted,
              testing::HasSubstr("profiler=pytorch: LibTorch's profiler did not start ("));
  EXPECT_THAT(fit.noted, testing::HasSubstr("the fit goes on without a profile"));
  EXPECT_THAT(fit.printed, testing::HasSubstr(
                               "profiler (pytorch): recorded nothing: LibTorch's profiler did "
                               "not start ("));
  EXPECT_THAT(fit.printed, testing::Not(testing::HasSubstr("training batches")));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/profiler/fit-rank0.pt.trace.json"));
  EXPECT_EQ(fit.global_step, 4) << "the fit ran to its end";
  EXPECT_TRUE(still_ours) << "the fit stopped the program's own recording";
}

TEST(TorchProfiler, TheWindowIsCheckedAndReadFromFlags) {
  TempDir dir;
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer{pytorch_options(dir, -1, 5)},
                     {"profiler_wait=-1", ">= 0"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::Trainer{pytorch_options(dir, 5, 0)},
                     {"profiler_active=0", ">= 1"});
  const auto options = fulgur::options_from_flags(
      {{"profiler", "pytorch"}, {"profiler_wait", "7"}, {"profiler_active", "2"}});
  EXPECT_EQ(options.profiler, fulgur::ProfilerKind::kPyTorch);
  EXPECT_EQ(options.profiler_wait, 7);
  EXPECT_EQ(options.profiler_active, 2);
  EXPECT_THROWS_WITH(fulgur::FlagError, fulgur::options_from_flags({{"profiler_active", "0"}}),
                     {"profiler_active", "0"});
}

OperatorRecord host(const std::string& name, uint64_t thread, double start, double duration,
                    bool annotation = false) {
  return {name, thread, /*on_device=*/false, annotation, start, duration};
}

TEST(TorchProfiler, AnOperatorsSelfTimeIsItsSpanLessTheOperatorsItCalled) {
  // Thread 1: a step span around linear [0, 10) calling addmm [1, 4) and
  // t [5, 9), which calls transpose [6, 7). Thread 2: another addmm [0, 2).
  // A device kernel of 0.5 us.
  const std::vector<OperatorRecord> records = {
      host("ProfilerStep#0", 1, 0, 12, /*annotation=*/true),
      host("aten::linear", 1, 0, 10),
      host("aten::addmm", 1, 1, 3),
      host("aten::t", 1, 5, 4),
      host("aten::transpose", 1, 6, 1),
      host("aten::addmm", 2, 0, 2),
      {"gemm_kernel", 0, /*on_device=*/true, false, 1.5, 0.5},
  };
  const auto rows = fulgur::detail::operator_rows(records);
  std::map<std::string, OperatorRow> by_name;
  for (const auto& r : rows) by_name[r.name] = r;
  EXPECT_EQ(by_name.count("ProfilerStep#0"), 0u) << "annotations are not operators";
  EXPECT_EQ(by_name.at("aten::linear").self_us, 3);
  EXPECT_EQ(by_name.at("aten::linear").total_us, 10);
  EXPECT_EQ(by_name.at("aten::addmm").calls, 2);
  EXPECT_EQ(by_name.at("aten::addmm").self_us, 5);
  EXPECT_EQ(by_name.at("aten::t").self_us, 3);
  EXPECT_EQ(by_name.at("aten::transpose").self_us, 1);
  EXPECT_EQ(by_name.at("gemm_kernel").device_us, 0.5);
  EXPECT_EQ(by_name.at("gemm_kernel").self_us, 0);
  // Device time first, then self time.
  ASSERT_EQ(rows.size(), 5u);
  EXPECT_EQ(rows[0].name, "gemm_kernel");
  EXPECT_EQ(rows[1].name, "aten::addmm");
  EXPECT_EQ(rows[4].name, "aten::transpose");

  const std::string table = fulgur::detail::operator_table(rows, 2, "the title");
  EXPECT_THAT(table, testing::StartsWith("the title\n"));
  EXPECT_THAT(table, testing::HasSubstr("device ms"));
  EXPECT_THAT(table, testing::HasSubstr("(3 more operators: 0.007 ms self, 58.3%)"));
  EXPECT_THAT(table, testing::HasSubstr("all operators, self"));
}

TEST(TorchProfiler, TheTraceWrittenFromRecordsIsJsonWithEscapedNames) {
  TempDir dir;
  const std::string path = dir.path() + "/trace.json";
  std::string error;
  ASSERT_TRUE(fulgur::detail::write_chrome_trace(
      {host("a \"quoted\" \\ name\n", 3, 1.25, 2.5), host("aten::mm", 3, 2, 1)}, 1, path, error))
      << error;
  const auto events = trace_events(path);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].name, "a \"quoted\" \\ name\n");
  EXPECT_EQ(events[0].ts, 1.25);
  EXPECT_EQ(events[0].dur, 2.5);
  EXPECT_EQ(events[0].tid, "3");
  EXPECT_THAT(read_file(path), testing::HasSubstr("\"fulgur rank 1\""));
  EXPECT_FALSE(
      fulgur::detail::write_chrome_trace({}, 0, dir.path() + "/no/such/dir/t.json", error));
  EXPECT_THAT(error, testing::HasSubstr("could not write " + dir.path() + "/no/such/dir/t.json"));
}

}  // namespace torch_profiler_test
