// File: fulgur/accelerators/accelerator.h
//
// An Accelerator knows one kind of device and nothing else: how to parse a
// `devices` spec for it, which devices exist, how to prepare one. Ranks,
// collectives and modules belong to the Strategy that owns it.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fulgur/core/registry.h"

namespace fulgur {

/// What the user passed as `devices`: "auto", a count, -1 (all), or indices.
/// A malformed spec does not throw here: problem() says what is wrong, and
/// the connector reports it with every other problem of the flags.
class DevicesSpec {
 public:
  DevicesSpec() = default;  // "auto"
  DevicesSpec(int count)
      : is_auto_(false), count_(count), text_(std::to_string(count)) {}  // NOLINT
  DevicesSpec(const char* text);  // NOLINT: "auto", "2", "0,2", "0,", "-1"
  DevicesSpec(std::string text) : DevicesSpec(text.c_str()) {}  // NOLINT
  DevicesSpec(std::vector<int> indices);                        // NOLINT: {0, 2}

  bool is_auto() const { return is_auto_; }
  /// A plain count (N or -1); nullopt for "auto" and for index lists.
  std::optional<int> count() const { return count_; }
  /// Explicit indices ([0,2], "0,2", "0,"); empty otherwise.
  const std::vector<int>& indices() const { return indices_; }
  bool is_index_list() const { return index_list_; }
  /// The spec as the user wrote it, for messages.
  const std::string& text() const { return text_; }
  /// What is wrong with the spec regardless of the accelerator (malformed,
  /// 0, < -1, a negative index); empty when nothing is.
  std::string problem() const;

 private:
  bool is_auto_ = true;
  bool index_list_ = false;
  std::optional<int> count_;
  std::vector<int> indices_;
  std::string text_ = "auto";
  std::string error_;
};

class Accelerator {
 public:
  virtual ~Accelerator() = default;
  /// The registered name ("cpu", "cuda").
  virtual std::string_view name() const = 0;
  /// Whether this machine (and this LibTorch build) can run it.
  virtual bool is_available() const = 0;
  /// Why it is not available ("LibTorch was built without CUDA"), for messages.
  virtual std::string unavailable_reason() const { return {}; }
  /// How many devices "auto" means.
  virtual int auto_device_count() const = 0;
  /// Resolves a devices spec to the devices this process group uses.
  /// Throws ConfigError naming the spec when it is invalid here.
  virtual std::vector<c10::Device> parse_devices(const DevicesSpec& spec) const = 0;
  /// Prepares `device` in this process (set the current CUDA device, ...).
  virtual void setup_device(c10::Device /*device*/) {}
  virtual void teardown() {}
  /// Statistics of `device` for logging (DeviceStatsMonitor): its memory in
  /// use, ..., by name (the CPU: HostStats; CUDA: the caching allocator's
  /// counters and the device's free memory). None by default.
  virtual std::map<std::string, double> device_stats(c10::Device /*device*/) const { return {}; }

  // ---- Capabilities: what the connector and the precision plugins ask,
  // instead of comparing names (a subclass answers for itself).
  /// Whether its float16 kernels (and float16 autocast) cover training:
  /// false on the CPU, where LibTorch has few and autocasts to bfloat16 only.
  virtual bool supports_float16() const { return true; }
  /// Whether benchmark=true means something: cuDNN's autotuner (CUDA).
  virtual bool has_cudnn_autotuner() const { return false; }
  /// What the device needs for deterministic=true beyond LibTorch's own
  /// switch, done before its first kernel (CUDA: cuBLAS's fixed workspace,
  /// CUBLAS_WORKSPACE_CONFIG). Default: nothing.
  virtual void prepare_determinism() {}
};

using AcceleratorRegistry = Registry<Accelerator>;
/// The global accelerator registry, with the built-ins registered.
AcceleratorRegistry& accelerator_registry();

}  // namespace fulgur
