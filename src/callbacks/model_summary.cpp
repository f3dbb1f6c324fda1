#include "fulgur/callbacks/model_summary.h"

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <set>
#include <vector>

#include <torch/torch.h>

#include "fulgur/core/errors.h"
#include "fulgur/core/module.h"
#include "fulgur/data/batch.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"

namespace fulgur {

namespace {

std::string human_count(int64_t n) {
  char buf[32];
  if (n >= 1000000000) {
    std::snprintf(buf, sizeof buf, "%.1f B", static_cast<double>(n) / 1e9);
  } else if (n >= 1000000) {
    std::snprintf(buf, sizeof buf, "%.1f M", static_cast<double>(n) / 1e6);
  } else if (n >= 1000) {
    std::snprintf(buf, sizeof buf, "%.1f K", static_cast<double>(n) / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(n));
  }
  return buf;
}

// "torch::nn::Linear" -> "Linear"; a user's class keeps its own name.
std::string short_type(const torch::nn::Module& m) {
  std::string name = m.name();
  if (name.rfind("torch::nn::", 0) == 0) name = name.substr(11);
  return name;
}

}  // namespace

ModelSummary::ModelSummary(ModelSummaryOptions options) : options_(options) {
  if (options_.max_depth < 0) {
    throw ConfigError(str("ModelSummary(max_depth=", options_.max_depth,
                          "): must be >= 0 (0: the totals only)."));
  }
}

void ModelSummary::on_fit_start(Trainer& trainer, Module& module) {
  if (trainer.strategy().is_global_zero()) {
    std::cout << summarize(module, options_.max_depth) << std::flush;
  }
}

std::string ModelSummary::summarize(const torch::nn::Module& module, int max_depth) {
  struct Row {
    std::string name, type;
    int64_t params = 0, trainable = 0, bytes = 0;
  };
  auto count = [](const torch::nn::Module& m, Row& row) {
    // A parameter shared by two submodules (tied weights) counts once, as
    // Lightning's.
    std::set<const void*> seen;
    for (const auto& p : m.parameters(/*recurse=*/true)) {
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      row.params += p.numel();
      if (p.requires_grad()) row.trainable += p.numel();
      row.bytes += p.numel() * static_cast<int64_t>(p.element_size());
    }
  };
  std::vector<Row> rows;
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    const std::string& name = item.key();
    const int depth = 1 + static_cast<int>(std::count(name.begin(), name.end(), '.'));
    if (depth > max_depth) continue;
    Row row{name, short_type(*item.value())};
    count(*item.value(), row);
    rows.push_back(row);
  }
  Row total;
  count(module, total);
  size_t name_w = 4, type_w = 4;
  for (const auto& r : rows) {
    name_w = std::max(name_w, r.name.size());
    type_w = std::max(type_w, r.type.size());
  }
  std::string out;
  // Appends a formatted line to `out`, whatever its length (long names of
  // nested submodules).
  auto add = [&out](const char* format, auto... args) {
    const int n = std::snprintf(nullptr, 0, format, args...);
    if (n <= 0) return;
    const size_t at = out.size();
    out.resize(at + static_cast<size_t>(n) + 1);
    std::snprintf(out.data() + at, static_cast<size_t>(n) + 1, format, args...);
    out.resize(at + static_cast<size_t>(n));
  };
  if (!rows.empty()) {
    add("   | %-*s | %-*s | %9s | %-9s | %9s\n", static_cast<int>(name_w), "Name",
        static_cast<int>(type_w), "Type", "Params", "Mode", "Size (MB)");
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      const char* mode = r.params == 0             ? "-"
                         : r.trainable == r.params ? "trainable"
                         : r.trainable == 0        ? "frozen"
                                                   : "partly";
      add("%2zu | %-*s | %-*s | %9s | %-9s | %9.3f\n", i, static_cast<int>(name_w), r.name.c_str(),
          static_cast<int>(type_w), r.type.c_str(), human_count(r.params).c_str(), mode,
          static_cast<double>(r.bytes) / 1e6);
    }
  }
  add("%s trainable params, %s frozen params, %s total params, %.3f MB of parameters\n",
      human_count(total.trainable).c_str(), human_count(total.params - total.trainable).c_str(),
      human_count(total.params).c_str(), static_cast<double>(total.bytes) / 1e6);
  return out;
}

}  // namespace fulgur
