#include "fulgur/plugins/precision/grad_scaler.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "fulgur/core/errors.h"
#include "fulgur/optim/optimizers.h"

namespace fulgur {

namespace {

// What the scaler unscales of each gradient: the gradient, or a sparse
// one's values (a float16 one coalesced first, as PyTorch's scaler does:
// values of one index summed later could overflow).
std::vector<at::Tensor> gradients(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (!p.grad().is_sparse()) {
        grads.push_back(p.grad());
        continue;
      }
      if (p.grad().scalar_type() == at::kHalf) p.mutable_grad() = p.grad().coalesce();
      grads.push_back(p.grad()._values());
    }
  }
  return grads;
}

// `grads` grouped by device and dtype (ATen's unscale kernel takes one of each).
std::vector<std::vector<at::Tensor>> by_device_and_dtype(const std::vector<at::Tensor>& grads) {
  std::vector<std::vector<at::Tensor>> groups;
  for (const auto& g : grads) {
    auto same = [&](const std::vector<at::Tensor>& group) {
      return group.front().device() == g.device() && group.front().scalar_type() == g.scalar_type();
    };
    auto it = std::find_if(groups.begin(), groups.end(), same);
    if (it == groups.end()) {
      groups.push_back({g});
    } else {
      it->push_back(g);
    }
  }
  return groups;
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  std::vector<std::string> problems;
  if (!(options.init_scale > 0.0) || !std::isfinite(options.init_scale)) {
    problems.push_back(str("init_scale=", options.init_scale, " must be a finite number > 0"));
  }
  if (!(options.growth_factor > 1.0)) {
    problems.push_back(str("growth_factor=", options.growth_factor, " must be > 1"));
  }
  if (!(options.backoff_factor > 0.0 && options.backoff_factor < 1.0)) {
    problems.push_back(str("backoff_factor=", options.backoff_factor, " must be in (0, 1)"));
  }
  if (options.growth_interval < 1) {
    problems.push_back(str("growth_interval=", options.growth_interval, " must be >= 1"));
  }
  if (!problems.empty()) {
    throw ConfigError(str("GradScaler(", join(problems, "; "),
                          "). The defaults (65536, 2.0, 0.5, 2000) suit most models."));
  }
}

void GradScaler::ensure_state(const at::Device& device) {
  if (!scale_.defined()) {
    scale_ = torch::full({1}, options_.init_scale, torch::dtype(torch::kFloat32).device(device));
    growth_tracker_ = torch::zeros({1}, torch::dtype(torch::kInt32).device(device));
  } else if (scale_.device() != device) {
    scale_ = scale_.to(device);
    growth_tracker_ = growth_tracker_.to(device);
  }
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  ensure_state(loss.device());
  return loss * scale_.to(loss.scalar_type());
}

void GradScaler::unscale(torch::optim::Optimizer& optimizer) {
  if (found_inf_.count(&optimizer) != 0) {
    throw ConfigError(
        "GradScaler::unscale(optimizer): this optimizer's gradients were already "
        "unscaled in this iteration. Unscale once per optimizer between "
        "update() calls.");
  }
  auto grads = gradients(optimizer);
  const at::Device device =
      grads.empty() ? (scale_.defined() ? scale_.device() : at::kCPU) : grads.front().device();
  ensure_state(device);
  at::Tensor found_inf = torch::zeros({1}, torch::dtype(torch::kFloat32).device(device));
  // The reciprocal in double, then float32, as PyTorch's scaler computes it.
  const at::Tensor inv_scale = scale_.to(torch::kFloat64).reciprocal().to(torch::kFloat32);
  torch::NoGradGuard no_grad;
  // Per device (a module placed on several GPUs) and dtype, each group's
  // verdict joined on the scale's device.
  for (auto& group : by_device_and_dtype(grads)) {
    const at::Device where = group.front().device();
    at::Tensor group_found = torch::zeros({1}, torch::dtype(torch::kFloat32).device(where));
    const at::Tensor group_inv = inv_scale.to(where);
    if (where.is_cuda()) {
      at::_amp_foreach_non_finite_check_and_unscale_(group, group_found, group_inv);
    } else {
      for (auto& g : group) {
        group_found.add_(g.isfinite().logical_not().any().to(torch::kFloat32));
        g.mul_(group_inv.to(g.scalar_type()));
      }
    }
    found_inf.add_(group_found.to(device));
  }
  found_inf.clamp_max_(1.0);
  found_inf_.emplace(&optimizer, found_inf);
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (found_inf_.count(&optimizer) == 0) unscale(optimizer);
  const at::Tensor& found_inf = found_inf_.at(&optimizer);
  // fulgur::optim's optimizers take the verdict to the device: no read.
  if (auto* skipping = dynamic_cast<optim::DeviceSkippedSteps*>(&optimizer)) {
    return skipping->step_unless(found_inf);
  }
  if (found_inf.item<float>() != 0.0f) return false;
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (found_inf_.empty()) return;  // nothing was unscaled: no step to judge
  at::Tensor found = torch::zeros_like(found_inf_.begin()->second);
  for (auto& [_, f] : found_inf_) found.add_(f.to(found.device()));
  found_inf_.clear();
  last_found_ = found;
  if (scale_.is_cuda()) {
    // On the device, without reading `found` back: no host synchronisation.
    at::_amp_update_scale_(scale_, growth_tracker_, found, options_.growth_factor,
                           options_.backoff_factor, options_.growth_interval);
    return;
  }
  // The same rule as ATen's _amp_update_scale_ kernel.
  float scale = scale_.item<float>();
  int32_t tracker = growth_tracker_.item<int32_t>();
  if (found.item<float>() != 0.0f) {
    scale = static_cast<float>(scale * options_.backoff_factor);
    tracker = 0;
  } else if (tracker + 1 == options_.growth_interval) {
    const float grown = static_cast<float>(scale * options_.growth_factor);
    if (std::isfinite(grown)) scale = grown;
    tracker = 0;
  } else {
    ++tracker;
  }
  scale_.fill_(scale);
  growth_tracker_.fill_(tracker);
}

bool GradScaler::last_step_skipped() const {
  return last_found_.defined() && last_found_.item<float>() != 0.0f;
}

double GradScaler::get_scale() const {
  return scale_.defined() ? scale_.item<double>() : options_.init_scale;
}

int64_t GradScaler::growth_tracker() const {
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : 0;
}

StateDict GradScaler::state_dict() const {
  StateDict state;
  state.set("scale", scale_.defined() ? scale_.cpu() : torch::full({1}, options_.init_scale));
  state.set("growth_tracker",
            growth_tracker_.defined() ? growth_tracker_.cpu() : torch::zeros({1}, torch::kInt32));
  return state;
}

void GradScaler::load_state_dict(const StateDict& state) {
  if (!state.contains("scale") || !state.contains("growth_tracker")) {
    throw CheckpointError(
        "the checkpoint has no GradScaler state (scale, growth_tracker): it was "
        "not written with precision=\"16-mixed\". Resume with the precision it "
        "was trained with.");
  }
  const at::Tensor scale = state.tensor("scale");
  const at::Tensor tracker = state.tensor("growth_tracker");
  const at::Device device = scale_.defined() ? scale_.device() : at::Device(at::kCPU);
  scale_ = scale.to(device, torch::kFloat32).reshape({1});
  growth_tracker_ = tracker.to(device, torch::kInt32).reshape({1});
  found_inf_.clear();
}

}  // namespace fulgur
