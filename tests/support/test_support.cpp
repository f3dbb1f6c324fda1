#include "support/test_support.h"

#include <c10/util/Type.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "fulgur/distributed/process_group.h"
#include "utilities/remove_tree.h"

namespace fulgur::test {

namespace fs = std::filesystem;

// ---- Exceptions.

::testing::AssertionResult message_contains(const std::string& what,
                                            const std::vector<std::string>& substrings) {
  std::vector<std::string> missing;
  for (const auto& s : substrings) {
    if (what.find(s) == std::string::npos) missing.push_back(s);
  }
  if (missing.empty()) return ::testing::AssertionSuccess();
  auto failure = ::testing::AssertionFailure();
  failure << "the message lacks";
  for (const auto& s : missing) failure << " \"" << s << "\"";
  failure << "\n  message: " << what;
  return failure;
}

std::string type_name(const std::type_info& type) { return c10::demangle(type.name()); }

// ---- Files.

TempDir::TempDir() {
  std::string pattern = "/tmp/fulgur_test_XXXXXX";
  std::vector<char> buffer(pattern.begin(), pattern.end());
  buffer.push_back('\0');
  if (::mkdtemp(buffer.data()) == nullptr) {
    throw std::runtime_error(std::string("TempDir: mkdtemp failed: ") + std::strerror(errno));
  }
  path_ = buffer.data();
}

TempDir::~TempDir() {
  std::error_code ec;
  fulgur::detail::remove_tree(path_, ec);
}

std::string TempDir::file(const std::string& relative) const {
  return (fs::path(path_) / relative).string();
}

std::vector<std::string> list_files(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return out;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) {
      out.push_back(fs::relative(entry.path(), dir).string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> entries_of(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("read_text: cannot open " + path);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::vector<std::string> read_lines(const std::string& path) {
  std::vector<std::string> lines;
  std::istringstream in(read_text(path));
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(line);
  }
  return lines;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("write_text: cannot create " + path);
  out << text;
}

void save_tensor(fulgur::CheckpointIO& io, const at::Tensor& value, const std::string& path) {
  fulgur::StateDict checkpoint;
  checkpoint.set("value", value);
  io.save_checkpoint(checkpoint, path);
}

at::Tensor load_tensor(fulgur::CheckpointIO& io, const std::string& path) {
  return io.load_checkpoint(path).tensor("value");
}

pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(std::string("dead_pid: fork: ") + std::strerror(errno));
  if (pid == 0) ::_exit(0);
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) throw std::runtime_error("dead_pid: waitpid failed");
  return pid;  // reaped: free now
}

std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) {
    throw std::runtime_error(std::string("host_name: ") + std::strerror(errno));
  }
  return host;
}

void damage_middle_byte(const std::string& path) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  if (!file) throw std::runtime_error("damage_middle_byte: cannot open " + path);
  const auto middle = static_cast<std::streamoff>(std::filesystem::file_size(path) / 2);
  file.seekg(middle);
  const char byte = static_cast<char>(file.get() ^ 0x5A);
  file.seekp(middle);
  file.put(byte);
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::string current;
  for (char c : text) {
    if (c == sep) {
      out.push_back(current);
      current.clear();
    } else {
      current += c;
    }
  }
  out.push_back(current);
  return out;
}

// ---- Trainer options.

fulgur::TrainerOptions test_options(const TempDir& dir) {
  // deterministic=false: every test's Trainer turns off what an earlier
  // test of the same process turned on (unset would leave it).
  return fulgur::TrainerOptions{.accelerator = "cpu",
                                .deterministic = false,
                                .max_epochs = 1,
                                .default_root_dir = dir.path(),
                                .enable_checkpointing = false,
                                .enable_progress_bar = false,
                                .logger = false};
}

fulgur::TrainerOptions checkpointed_options(const TempDir& dir,
                                            fulgur::ModelCheckpointOptions checkpoint,
                                            std::shared_ptr<fulgur::ModelCheckpoint>* callback) {
  auto model_checkpoint = std::make_shared<fulgur::ModelCheckpoint>(std::move(checkpoint));
  if (callback != nullptr) *callback = model_checkpoint;
  auto options = test_options(dir);
  options.enable_checkpointing = true;
  options.callbacks = {std::move(model_checkpoint)};
  return options;
}

fulgur::TrainerOptions checkpoint_every_step_options(const TempDir& root, const std::string& dir) {
  auto options = test_options(root);
  options.num_sanity_val_steps = 0;
  options.enable_checkpointing = true;
  options.callbacks = {
      std::make_shared<fulgur::ModelCheckpoint>(fulgur::ModelCheckpointOptions{
          .dirpath = root.file(dir + "/steps"), .save_top_k = -1, .every_n_train_steps = 1}),
      std::make_shared<fulgur::ModelCheckpoint>(fulgur::ModelCheckpointOptions{
          .dirpath = root.file(dir + "/validated"), .monitor = "val_loss", .save_top_k = -1})};
  return options;
}

int count_occurrences(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// ---- Data.

std::shared_ptr<fulgur::TensorDataset> regression_dataset(int64_t n, int64_t in_features) {
  auto index = torch::arange(n * in_features, torch::kFloat32).reshape({n, in_features});
  auto x = torch::sin(index * 0.37 + 0.1);
  auto w = torch::linspace(-1.0, 1.0, in_features, torch::kFloat32).reshape({in_features, 1});
  auto y = x.matmul(w) + 0.3;
  return std::make_shared<fulgur::TensorDataset>(x, y);
}

std::shared_ptr<fulgur::DatasetLoader> regression_loader(int64_t num_batches, int64_t batch_size,
                                                         bool shuffle) {
  return fulgur::make_data_loader(regression_dataset(num_batches * batch_size),
                                  {.batch_size = batch_size, .shuffle = shuffle});
}

std::shared_ptr<fulgur::DatasetLoader> uneven_loader() {
  return fulgur::make_data_loader(regression_dataset(10), {.batch_size = 4});
}

std::shared_ptr<fulgur::IterableLoader> generator_loader(int64_t num_batches) {
  auto data = regression_dataset(num_batches * 2);
  at::Tensor x = data->tensors()[0];
  at::Tensor y = data->tensors()[1];
  return fulgur::make_iterable_loader([x, y, num_batches](int64_t) -> fulgur::BatchGenerator {
    return [x, y, num_batches, i = int64_t{0}]() mutable -> std::optional<fulgur::Batch> {
      if (i >= num_batches) return std::nullopt;
      int64_t k = i++;
      return fulgur::Batch(x.slice(0, 2 * k, 2 * k + 2), y.slice(0, 2 * k, 2 * k + 2));
    };
  });
}

std::shared_ptr<fulgur::TensorDataset> index_dataset(int64_t n) {
  return std::make_shared<fulgur::TensorDataset>(
      std::vector<at::Tensor>{torch::arange(n, torch::kLong)});
}

std::vector<int64_t> to_vector(const at::Tensor& tensor) {
  auto t = tensor.to(torch::kLong).contiguous().reshape({-1});
  const int64_t* data = t.data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + t.numel());
}

// ---- Parameters.

fulgur::StateDict archived(const std::function<void(torch::serialize::OutputArchive&)>& write) {
  torch::serialize::OutputArchive archive;
  write(archive);
  std::ostringstream out;
  archive.save_to(out);
  std::istringstream in(out.str());
  torch::serialize::InputArchive read;
  read.load_from(in);
  return fulgur::read_archive(read);
}

namespace {
// Matches parameters by name and shape, then applies `same`; `how` describes
// the comparison in the failure message.
::testing::AssertionResult compare_parameters(
    const torch::nn::Module& a, const torch::nn::Module& b,
    const std::function<bool(const at::Tensor&, const at::Tensor&)>& same, const std::string& how) {
  auto pa = a.named_parameters();
  auto pb = b.named_parameters();
  if (pa.size() != pb.size()) {
    return ::testing::AssertionFailure()
           << "different parameter counts: " << pa.size() << " vs " << pb.size();
  }
  for (const auto& item : pa) {
    const at::Tensor* other = pb.find(item.key());
    if (other == nullptr) {
      return ::testing::AssertionFailure() << "parameter " << item.key() << " missing";
    }
    if (!item.value().sizes().equals(other->sizes())) {
      return ::testing::AssertionFailure() << "parameter " << item.key() << " has shape "
                                           << item.value().sizes() << " vs " << other->sizes();
    }
    if (!same(item.value(), *other)) {
      return ::testing::AssertionFailure()
             << "parameter " << item.key() << " differs" << how
             << "; max |a - b| = " << (item.value() - *other).abs().max().item<double>();
    }
  }
  return ::testing::AssertionSuccess();
}
}  // namespace

std::vector<at::Tensor> load_tensors(const std::string& path) {
  std::vector<at::Tensor> tensors;
  torch::load(tensors, path);
  return tensors;
}

::testing::AssertionResult same_params(const std::string& a, const std::string& b,
                                       TensorMatch match) {
  auto pa = load_tensors(a);
  auto pb = load_tensors(b);
  if (pa.size() != pb.size()) {
    return ::testing::AssertionFailure() << pa.size() << " vs " << pb.size() << " parameters";
  }
  for (size_t i = 0; i < pa.size(); ++i) {
    const bool same = match.exact ? torch::equal(pa[i], pb[i])
                                  : torch::allclose(pa[i], pb[i], /*rtol=*/1e-4, match.atol);
    if (!same) {
      return ::testing::AssertionFailure() << "parameter " << i << " differs by up to "
                                           << (pa[i] - pb[i]).abs().max().item<double>();
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult parameters_equal(const torch::nn::Module& a,
                                            const torch::nn::Module& b) {
  return compare_parameters(
      a, b, [](const at::Tensor& x, const at::Tensor& y) { return torch::equal(x, y); }, "");
}

void expect_tensors_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << i;
}

::testing::AssertionResult parameters_close(const torch::nn::Module& a, const torch::nn::Module& b,
                                            double rtol, double atol) {
  return compare_parameters(
      a, b,
      [&](const at::Tensor& x, const at::Tensor& y) { return torch::allclose(x, y, rtol, atol); },
      fulgur::str(" beyond rtol=", rtol, " atol=", atol));
}

void copy_parameters(const torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto source = from.named_parameters();
  auto target = to.named_parameters();
  for (const auto& item : source) target[item.key()].copy_(item.value());
}

std::vector<at::Tensor> clone_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const auto& p : module.parameters()) out.push_back(p.detach().clone());
  return out;
}

double sgd_lr(torch::optim::Optimizer& optimizer) {
  return static_cast<torch::optim::SGDOptions&>(optimizer.param_groups()[0].options()).lr();
}

// ---- Recording fixtures.

std::vector<std::string> only(const std::vector<std::string>& events,
                              std::initializer_list<std::string_view> names) {
  std::vector<std::string> out;
  for (const auto& e : events) {
    if (std::find(names.begin(), names.end(), std::string_view(e)) != names.end()) {
      out.push_back(e);
    }
  }
  return out;
}

std::vector<std::string> with_prefix(const std::vector<std::string>& events,
                                     std::string_view prefix) {
  return with_prefix(events, {prefix});
}

std::vector<std::string> with_prefix(const std::vector<std::string>& events,
                                     std::initializer_list<std::string_view> prefixes) {
  std::vector<std::string> out;
  for (const auto& e : events) {
    for (std::string_view prefix : prefixes) {
      if (std::string_view(e).substr(0, prefix.size()) == prefix) {
        out.push_back(e);
        break;
      }
    }
  }
  return out;
}

LinearRegression::LinearRegression(LinearRegressionOptions options)
    : fulgur::Module("LinearRegression"), config(options) {
  fc = register_module(
      "fc", torch::nn::Linear(torch::nn::LinearOptions(config.in_features, 1).bias(config.bias)));
}

at::Tensor LinearRegression::forward(const at::Tensor& x) { return fc(x); }

at::Tensor LinearRegression::training_step(fulgur::Batch& batch, int64_t batch_idx) {
  events.emplace_back("training_step");
  ++training_steps;
  if (train_hook) train_hook(*this, batch, batch_idx);
  const auto& [x, y] = batch.pair();
  auto loss = torch::nn::functional::mse_loss(forward(x), y);
  log("train_loss", loss);
  return loss;
}

void LinearRegression::validation_step(fulgur::Batch& batch, int64_t batch_idx) {
  events.emplace_back("validation_step");
  if (trainer().sanity_checking()) {
    ++sanity_steps;
  } else {
    ++validation_steps;
  }
  if (is_training()) validated_in_training_mode = true;
  if (val_hook) val_hook(*this, batch, batch_idx);
  const auto& [x, y] = batch.pair();
  log("val_loss", torch::nn::functional::mse_loss(forward(x), y));
}

void LinearRegression::test_step(fulgur::Batch& batch, int64_t batch_idx) {
  events.emplace_back("test_step");
  ++test_steps;
  if (test_hook) test_hook(*this, batch, batch_idx);
  const auto& [x, y] = batch.pair();
  log("test_loss", torch::nn::functional::mse_loss(forward(x), y));
}

fulgur::Batch LinearRegression::predict_step(fulgur::Batch& batch, int64_t) {
  events.emplace_back("predict_step");
  ++predict_steps;
  return fulgur::Batch(forward(batch.pair().first));
}

fulgur::OptimizerConfig LinearRegression::configure_optimizers() {
  events.emplace_back("configure_optimizers");
  optimizer = std::make_shared<torch::optim::SGD>(
      parameters(), torch::optim::SGDOptions(config.lr).momentum(config.momentum));
  if (make_schedulers) {
    std::vector<std::shared_ptr<torch::optim::Optimizer>> optimizers{optimizer};
    return fulgur::OptimizerConfig(std::move(optimizers), make_schedulers(*optimizer));
  }
  return fulgur::OptimizerConfig(optimizer);
}

void LinearRegression::configure_model() { events.emplace_back("configure_model"); }
void LinearRegression::on_fit_start() { events.emplace_back("on_fit_start"); }
void LinearRegression::on_fit_end() { events.emplace_back("on_fit_end"); }
void LinearRegression::on_train_start() { events.emplace_back("on_train_start"); }
void LinearRegression::on_train_end() { events.emplace_back("on_train_end"); }
void LinearRegression::on_train_epoch_start() { events.emplace_back("on_train_epoch_start"); }
void LinearRegression::on_train_epoch_end() {
  events.emplace_back("on_train_epoch_end");
  if (train_epoch_end_hook) train_epoch_end_hook(*this);
}
void LinearRegression::on_train_batch_start(const fulgur::Batch&, int64_t) {
  events.emplace_back("on_train_batch_start");
}
void LinearRegression::on_train_batch_end(const at::Tensor&, const fulgur::Batch&, int64_t) {
  events.emplace_back("on_train_batch_end");
}
void LinearRegression::on_validation_epoch_start() {
  events.emplace_back("on_validation_epoch_start");
}
void LinearRegression::on_validation_epoch_end() { events.emplace_back("on_validation_epoch_end"); }
void LinearRegression::on_test_epoch_start() { events.emplace_back("on_test_epoch_start"); }
void LinearRegression::on_test_epoch_end() { events.emplace_back("on_test_epoch_end"); }
void LinearRegression::on_predict_epoch_start() { events.emplace_back("on_predict_epoch_start"); }
void LinearRegression::on_predict_epoch_end() { events.emplace_back("on_predict_epoch_end"); }
void LinearRegression::on_before_backward(const at::Tensor&) {
  events.emplace_back("on_before_backward");
}
void LinearRegression::on_after_backward() { events.emplace_back("on_after_backward"); }
void LinearRegression::on_before_optimizer_step(torch::optim::Optimizer&) {
  events.emplace_back("on_before_optimizer_step");
}
void LinearRegression::on_before_zero_grad(torch::optim::Optimizer&) {
  events.emplace_back("on_before_zero_grad");
}
void LinearRegression::on_save_checkpoint(fulgur::StateDict&) {
  events.emplace_back("on_save_checkpoint");
}
void LinearRegression::on_load_checkpoint(const fulgur::StateDict&) {
  events.emplace_back("on_load_checkpoint");
}

int64_t LinearRegression::count(const std::string& event) const {
  return static_cast<int64_t>(std::count(events.begin(), events.end(), event));
}

void RecordingCallback::record(const char* hook) { events_->push_back(std::string("cb:") + hook); }
void RecordingCallback::on_fit_start(fulgur::Trainer&, fulgur::Module&) { record("on_fit_start"); }
void RecordingCallback::on_fit_end(fulgur::Trainer&, fulgur::Module&) { record("on_fit_end"); }
void RecordingCallback::on_train_start(fulgur::Trainer&, fulgur::Module&) {
  record("on_train_start");
}
void RecordingCallback::on_train_end(fulgur::Trainer&, fulgur::Module&) { record("on_train_end"); }
void RecordingCallback::on_train_epoch_start(fulgur::Trainer&, fulgur::Module&) {
  record("on_train_epoch_start");
}
void RecordingCallback::on_train_epoch_end(fulgur::Trainer&, fulgur::Module&) {
  record("on_train_epoch_end");
}
void RecordingCallback::on_train_batch_start(fulgur::Trainer&, fulgur::Module&,
                                             const fulgur::Batch&, int64_t) {
  record("on_train_batch_start");
}
void RecordingCallback::on_train_batch_end(fulgur::Trainer&, fulgur::Module&, const at::Tensor&,
                                           const fulgur::Batch&, int64_t) {
  record("on_train_batch_end");
}
void RecordingCallback::on_validation_start(fulgur::Trainer&, fulgur::Module&) {
  record("on_validation_start");
}
void RecordingCallback::on_validation_end(fulgur::Trainer&, fulgur::Module&) {
  record("on_validation_end");
}
void RecordingCallback::on_before_optimizer_step(fulgur::Trainer&, fulgur::Module&,
                                                 torch::optim::Optimizer&) {
  record("on_before_optimizer_step");
}

void ValidationRecorder::on_validation_start(fulgur::Trainer& trainer, fulgur::Module&) {
  if (trainer.sanity_checking()) {
    ++sanity_runs;
    return;
  }
  steps_at_validation.push_back(trainer.global_step());
  positions.emplace_back(trainer.current_epoch(), trainer.batch_idx());
}

RecordingDataModule::RecordingDataModule(int64_t train, int64_t val, int64_t size)
    : train_batches(train), val_batches(val), batch_size(size) {}

void RecordingDataModule::prepare_data() { events.emplace_back("prepare_data"); }
void RecordingDataModule::setup(fulgur::Stage stage) {
  events.push_back(std::string("setup:") + fulgur::to_string(stage));
}
void RecordingDataModule::teardown(fulgur::Stage stage) {
  events.push_back(std::string("teardown:") + fulgur::to_string(stage));
}
std::shared_ptr<fulgur::DataLoader> RecordingDataModule::train_dataloader() {
  events.emplace_back("train_dataloader");
  return regression_loader(train_batches, batch_size);
}
std::shared_ptr<fulgur::DataLoader> RecordingDataModule::val_dataloader() {
  events.emplace_back("val_dataloader");
  if (val_batches == 0) return nullptr;
  return regression_loader(val_batches, batch_size);
}
std::shared_ptr<fulgur::DataLoader> RecordingDataModule::test_dataloader() {
  events.emplace_back("test_dataloader");
  return regression_loader(val_batches, batch_size);
}
std::shared_ptr<fulgur::DataLoader> RecordingDataModule::predict_dataloader() {
  events.emplace_back("predict_dataloader");
  return regression_loader(val_batches, batch_size);
}

void on_ranks(int world,
              const std::function<void(int, std::shared_ptr<fulgur::ProcessGroup>)>& body) {
  const int port = fulgur::find_free_port();
  std::vector<std::exception_ptr> failure(static_cast<size_t>(world));
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < world; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        fulgur::ProcessGroupOptions o;
        o.main_port = port;
        o.world_size = world;
        o.rank = rank;
        o.timeout = std::chrono::seconds(20);
        body(rank, fulgur::ProcessGroup::connect(o));
      } catch (...) {
        failure[static_cast<size_t>(rank)] = std::current_exception();
      }
    });
  }
  for (auto& t : ranks) t.join();
  // Every rank's error: the first one is often a peer's echo of the cause.
  std::string messages;
  for (size_t rank = 0; rank < failure.size(); ++rank) {
    if (!failure[rank]) continue;
    try {
      std::rethrow_exception(failure[rank]);
    } catch (const std::exception& e) {
      messages += fulgur::str("\nrank ", rank, ": ", e.what());
    } catch (...) {
      messages += fulgur::str("\nrank ", rank, ": an exception that is not a std::exception");
    }
  }
  if (!messages.empty()) throw std::runtime_error("on_ranks: a rank failed:" + messages);
}

std::vector<std::pair<int64_t, double>> RecordingLogger::series(const std::string& key) const {
  std::vector<std::pair<int64_t, double>> out;
  for (const auto& [step, m] : calls) {
    if (auto it = m.find(key); it != m.end()) out.emplace_back(step, it->second);
  }
  return out;
}

fulgur::TrainerOptions logged_options(const TempDir& dir, std::shared_ptr<RecordingLogger> logger,
                                      std::shared_ptr<fulgur::Callback> callback) {
  auto options = test_options(dir);
  options.logger = true;
  options.loggers = {std::move(logger)};
  options.log_every_n_steps = 1;
  options.callbacks = {std::move(callback)};
  return options;
}

}  // namespace fulgur::test
