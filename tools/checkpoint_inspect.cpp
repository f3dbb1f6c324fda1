#include "checkpoint_inspect.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "fulgur/core/errors.h"
#include "fulgur/plugins/io/torch_checkpoint_io.h"
#include "fulgur/strategies/checkpoint_layout.h"
#include "fulgur/strategies/fsdp.h"

namespace fulgur_cli {

namespace {

namespace fs = std::filesystem;
using fulgur::StateDict;
using fulgur::str;

std::string bytes_text(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), unit == 0 ? "%.0f %s" : "%.1f %s", value, units[unit]);
  return buf;
}

std::string shape_text(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t d = 0; d < t.dim(); ++d) out += str(d ? ", " : "", t.size(d));
  return out + "]";
}

std::string value_text(const c10::IValue& v) {
  if (v.isString()) return str("\"", v.toStringRef(), "\"");
  if (v.isInt()) return std::to_string(v.toInt());
  if (v.isDouble()) return str(v.toDouble());
  if (v.isBool()) return v.toBool() ? "true" : "false";
  if (v.isIntList()) {
    std::vector<std::string> items;
    for (int64_t i : v.toIntList()) items.push_back(std::to_string(i));
    return str("[", fulgur::join(items, ", "), "]");
  }
  return v.tagKind();
}

// Every tensor under `state` (sections as dotted prefixes).
struct TensorLine {
  std::string name, dtype, shape;
  uint64_t bytes = 0;
};

void collect_tensors(const StateDict& state, const std::string& prefix,
                     std::vector<TensorLine>& tensors, std::vector<std::string>& values) {
  for (const auto& key : state.keys()) {
    if (const StateDict* sub = state.find_section(key)) {
      collect_tensors(*sub, prefix + key + ".", tensors, values);
      continue;
    }
    const c10::IValue& v = *state.find(key);
    if (v.isTensor()) {
      const at::Tensor t = v.toTensor();
      tensors.push_back({prefix + key, std::string(c10::toString(t.scalar_type())), shape_text(t),
                         static_cast<uint64_t>(t.numel() * t.element_size())});
    } else {
      values.push_back(str(prefix, key, " = ", value_text(v)));
    }
  }
}

uint64_t total_bytes(const std::vector<TensorLine>& tensors) {
  uint64_t total = 0;
  for (const auto& t : tensors) total += t.bytes;
  return total;
}

void print_section(const StateDict& state, const std::string& key, const std::string& title,
                   bool list_tensors, std::ostream& out) {
  const StateDict* section = state.find_section(key);
  if (section == nullptr) return;
  std::vector<TensorLine> tensors;
  std::vector<std::string> values;
  collect_tensors(*section, "", tensors, values);
  const uint64_t total = total_bytes(tensors);
  out << title << ": ";
  if (tensors.empty() && values.empty()) {
    out << "empty\n";
    return;
  }
  out << tensors.size() << " tensor(s), " << bytes_text(total);
  if (!values.empty()) out << ", " << values.size() << " value(s)";
  out << "\n";
  if (list_tensors) {
    size_t width = 0;
    for (const auto& t : tensors) width = std::max(width, t.name.size());
    for (const auto& t : tensors) {
      out << "  " << t.name << std::string(width + 2 - t.name.size(), ' ') << t.dtype << " "
          << t.shape << "  " << bytes_text(t.bytes) << "\n";
    }
  }
  for (const auto& v : values) out << "  " << v << "\n";
}

// One optimizer's state as LibTorch's optimizers write it: each parameter
// group's parameter count and options, then the per-parameter state tensors.
// (The groups name their parameters by keys LibTorch makes from addresses,
// which mean nothing in a file.) Another layout (an optimizer that saves
// itself, e.g. LBFGS) is listed entry by entry.
void print_optimizer(const StateDict& optimizers, const std::string& key, std::ostream& out) {
  const StateDict* optimizer = optimizers.find_section(key);
  const StateDict* groups = optimizer ? optimizer->find_section("param_groups") : nullptr;
  const c10::IValue* size = groups ? groups->find("param_groups/size") : nullptr;
  if (size == nullptr || !size->isTensor()) {
    print_section(optimizers, key, str("  optimizer ", key), false, out);
    return;
  }
  std::vector<TensorLine> tensors;
  std::vector<std::string> values;
  if (const StateDict* state = optimizer->find_section("state")) {
    collect_tensors(*state, "", tensors, values);
  }
  const uint64_t total = total_bytes(tensors);
  const int64_t count = size->toTensor().item<int64_t>();
  out << "  optimizer " << key << ": " << count << " parameter group(s); state " << tensors.size()
      << " tensor(s), " << bytes_text(total) << "\n";
  for (int64_t i = 0; i < count; ++i) {
    const StateDict* group = groups->find_section(str("param_groups/", i));
    if (group == nullptr) continue;
    int64_t params = 0;
    std::vector<std::string> options;
    for (const auto& entry : group->keys()) {
      // "params/0", "params/1", ... (and "params/size", their count).
      if (entry.rfind("params/", 0) == 0 && entry != "params/size") ++params;
    }
    if (const StateDict* opts = group->find_section("options")) {
      for (const auto& name : opts->keys()) {
        if (const c10::IValue* v = opts->find(name); v != nullptr && !v->isTensor()) {
          options.push_back(str(name, " = ", value_text(*v)));
        }
      }
    }
    out << "    group " << i << ": " << params << " parameter(s)" << (options.empty() ? "" : "; ")
        << fulgur::join(options, ", ") << "\n";
  }
}

// The contents of one verified (or unverifiable, older) checkpoint file.
void print_contents(const std::string& file, std::ostream& out) {
  fulgur::TorchCheckpointIO io;
  const StateDict checkpoint = io.load_checkpoint(file);
  auto value = [](const StateDict* state, const std::string& key) {
    const c10::IValue* v = state ? state->find(key) : nullptr;
    return v ? *v : c10::IValue();
  };
  const c10::IValue version = value(&checkpoint, "fulgur_format_version");
  if (version.isInt()) {
    out << "format: fulgur checkpoint version " << version.toInt();
    const c10::IValue written_by = value(&checkpoint, "fulgur_version");
    if (written_by.isString()) out << ", written by fulgur " << written_by.toStringRef();
    out << "\n";
  } else {
    out << "format: not a fulgur Trainer checkpoint (keys: " << fulgur::join(checkpoint.keys())
        << ")\n";
  }
  if (const StateDict* loops = checkpoint.find_section("loops")) {
    out << "progress: epoch " << value_text(value(loops, "epoch")) << ", global step "
        << value_text(value(loops, "global_step")) << ", batch position "
        << value_text(value(loops, "batch_position")) << "\n";
  }
  print_section(checkpoint, "state_dict", "module state", /*list_tensors=*/true, out);
  if (const StateDict* optimizers = checkpoint.find_section("optimizer_states")) {
    const c10::IValue count = value(optimizers, "count");
    out << "optimizers: " << value_text(count) << "\n";
    if (count.isInt()) {
      for (int64_t i = 0; i < count.toInt(); ++i) {
        print_optimizer(*optimizers, std::to_string(i), out);
      }
    }
    const StateDict* first = optimizers->find_section("0");
    if (first != nullptr && first->contains(fulgur::FSDPStrategy::kShardRecordKey)) {
      out << "  (strategy fsdp, sharded: each rank's file holds its part of the optimizer "
             "state; `fulgur checkpoint consolidate DIR FILE` makes one file that loads on any "
             "world size)\n";
    }
  }
  if (const c10::IValue* schedulers = checkpoint.find("lr_schedulers")) {
    out << "lr schedulers (step counts): " << value_text(*schedulers) << "\n";
  }
  print_section(checkpoint, "precision", "precision", false, out);
  print_section(checkpoint, "train_loader", "training loader", false, out);
  if (const StateDict* callbacks = checkpoint.find_section("callbacks")) {
    const auto keys = callbacks->keys();
    out << "callbacks: " << (keys.empty() ? std::string("none") : fulgur::join(keys)) << "\n";
  }
  print_section(checkpoint, "rng", "RNG states", false, out);
  print_section(checkpoint, "hparams", "hyper-parameters", false, out);
  print_section(checkpoint, "module", "the module's own (on_save_checkpoint)", false, out);
}

// Why `file` cannot be checked at all (it is not there, not a file, or
// not readable: none of which is corruption), "" when it can.
std::string unreadable_label(const std::string& file) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) {
    const int err = errno;
    return err == ENOENT
               ? str("MISSING: \"", file, "\" does not exist")
               : str("UNREADABLE: \"", file, "\" cannot be looked up: ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    return str("NOT A FILE: \"", file, "\" is ",
               S_ISDIR(st.st_mode)    ? "a directory"
               : S_ISFIFO(st.st_mode) ? "a FIFO (named pipe)"
               : S_ISCHR(st.st_mode)  ? "a character device"
               : S_ISSOCK(st.st_mode) ? "a socket"
                                      : "not a regular file",
               ", not a checkpoint file");
  }
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    return str("UNREADABLE: \"", file, "\" cannot be opened for reading: ", std::strerror(err));
  }
  ::close(fd);
  return "";
}

// One file's size and checksum line; false when it does not verify.
bool print_file_check(const std::string& file, const std::string& label, std::ostream& out) {
  if (const std::string problem = unreadable_label(file); !problem.empty()) {
    out << label << ": " << problem << "\n";
    return false;
  }
  fulgur::TorchCheckpointIO io;
  std::error_code ec;
  const auto size = fs::file_size(file, ec);
  out << label << ": " << (ec ? std::string("?") : bytes_text(size)) << ", ";
  const std::string problem = io.verify(file);
  if (!problem.empty()) {
    out << "CORRUPT: " << problem << "\n";
    return false;
  }
  out << (fulgur::TorchCheckpointIO::has_checksum(file)
              ? "CRC32C verified"
              : "no checksum (written before fulgur 0.2): unverified")
      << "\n";
  return true;
}

}  // namespace

int inspect_checkpoint(const std::string& path, std::ostream& out) {
  try {
    out << "checkpoint: " << path << "\n";
    std::error_code ec;
    if (!fs::exists(path, ec) && !ec && !fs::is_symlink(path, ec)) {
      out << "not found: \"" << path
          << "\" does not exist. Pass a checkpoint file, or a sharded checkpoint's directory (a "
             "run's are under <default_root_dir>/checkpoints).\n";
      return 1;
    }
    if (!fs::is_directory(path, ec)) {
      if (!print_file_check(path, "file", out)) return 1;
      print_contents(path, out);
      return 0;
    }
    // A directory of per-rank shards (strategies "manual" and "fsdp").
    const auto manifest = fulgur::ShardedCheckpoint::read_manifest(path);
    out << "per-rank checkpoint: " << manifest.world_size << " shard(s), "
        << fulgur::ShardedCheckpoint::kManifest << " verified\n";
    bool all = true;
    fulgur::TorchCheckpointIO io;
    for (size_t i = 0; i < manifest.shards.size(); ++i) {
      const std::string& shard = manifest.shards[i];
      if (!print_file_check((fs::path(path) / shard).string(), str("shard ", shard), out)) {
        all = false;
      } else if (auto foreign = fulgur::ShardedCheckpoint::foreign_shard(io, path, manifest, i);
                 !foreign.empty()) {
        out << "shard " << shard << ": FROM ANOTHER SAVE: " << foreign << "\n";
        all = false;
      }
    }
    if (manifest.fingerprints.empty()) {
      out << fulgur::ShardedCheckpoint::kManifest
          << " records no fingerprints (an older fulgur wrote it): a shard of another save "
             "cannot be told apart\n";
    }
    if (!all) return 1;
    out << "contents of shard " << manifest.shards.front() << ":\n";
    print_contents((fs::path(path) / manifest.shards.front()).string(), out);
    return 0;
  } catch (const std::exception& e) {
    out << "CORRUPT or unreadable: " << fulgur::error_message(e) << "\n";
    return 1;
  }
}

}  // namespace fulgur_cli
