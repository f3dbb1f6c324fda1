// fulgur::optim's multi-tensor SGD, Adam and AdamW against torch::optim's:
// the same parameters and gradients give bit-identical parameters and state
// (every tensor and step count) for every option, with several parameter
// groups, parameters without a gradient on some steps (Adam's step counts
// then differ), sparse gradients, a closure, a save in one type loaded into
// the other, an LR scheduler, and a whole Trainer::fit; on a GPU (a _CUDA
// test), equal within float rounding.
#include <ATen/record_function.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace fulgur_optimizers_test {

using fulgur::test::TempDir;
using fulgur::test::test_options;
using torch::optim::OptimizerParamGroup;
using TensorVector = std::vector<at::Tensor>;

constexpr int kSteps = 7;

/// Parameters of assorted shapes (a matrix, a vector, a 3-d tensor, one
/// element), all on the CPU in fp32, drawn from seed 0 (the same every call).
TensorVector initial_parameters() {
  torch::manual_seed(0);
  return {torch::randn({4, 3}), torch::randn({5}), torch::randn({2, 3, 2}), torch::randn({1}),
          torch::randn({3, 3})};
}

TensorVector leaves(const TensorVector& values) {
  TensorVector out;
  for (const auto& v : values) out.push_back(v.clone().requires_grad_(true));
  return out;
}

/// The gradient of parameter `i` at `step`, or an undefined tensor where the
/// parameter has none: parameter 1 has no gradient at steps 0, 2 and 3 (it
/// starts late and skips steps: its Adam step count trails the others'),
/// parameter 4 never has one (it gets no state).
at::Tensor gradient(const at::Tensor& param, size_t i, int step) {
  if (i == 4) return {};
  if (i == 1 && (step == 0 || step == 2 || step == 3)) return {};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + i);
  return at::randn(param.sizes(), gen);
}

/// Sets every parameter's gradient for `step` (made on the CPU, moved to the
/// parameter's device).
void set_gradients(const TensorVector& params, int step) {
  for (size_t i = 0; i < params.size(); ++i) {
    auto grad = gradient(params[i], i, step);
    params[i].mutable_grad() = grad.defined() ? grad.to(params[i].device()) : grad;
  }
}

/// Two groups: parameters 0-1 with `options`, 2-4 with the same options and
/// three times the learning rate.
template <class Options>
std::vector<OptimizerParamGroup> two_groups(const TensorVector& params, const Options& options) {
  auto second = std::make_unique<Options>(options);
  second->lr(options.lr() * 3);
  std::vector<OptimizerParamGroup> groups;
  groups.emplace_back(TensorVector{params[0], params[1]}, std::make_unique<Options>(options));
  groups.emplace_back(TensorVector{params[2], params[3], params[4]}, std::move(second));
  return groups;
}

template <class ParamState>
ParamState* state_of(torch::optim::Optimizer& optimizer, const at::Tensor& param) {
  auto& state = optimizer.state();
  auto it = state.find(fulgur::compat::optimizer_state_key(param));
  return it == state.end() ? nullptr : static_cast<ParamState*>(it->second.get());
}

/// Bit-identical where `tolerance` is 0; else within it, relative and
/// absolute (the fused kernels' rounding).
bool same_tensor(const at::Tensor& a, const at::Tensor& b, double tolerance) {
  return tolerance == 0 ? torch::equal(a, b) : torch::allclose(a, b, tolerance, tolerance);
}

bool same_if_defined(const at::Tensor& a, const at::Tensor& b, double tolerance) {
  if (a.defined() != b.defined()) return false;
  return !a.defined() || same_tensor(a, b, tolerance);
}

::testing::AssertionResult same_state(const torch::optim::SGDParamState& a,
                                      const torch::optim::SGDParamState& b, double tolerance) {
  if (!same_if_defined(a.momentum_buffer(), b.momentum_buffer(), tolerance)) {
    return ::testing::AssertionFailure() << "momentum_buffer differs";
  }
  return ::testing::AssertionSuccess();
}

template <class AdamState>
::testing::AssertionResult same_state(const AdamState& a, const AdamState& b, double tolerance) {
  if (a.step() != b.step()) {
    return ::testing::AssertionFailure() << "step " << a.step() << " != " << b.step();
  }
  if (!same_tensor(a.exp_avg(), b.exp_avg(), tolerance)) {
    return ::testing::AssertionFailure() << "exp_avg";
  }
  if (!same_tensor(a.exp_avg_sq(), b.exp_avg_sq(), tolerance)) {
    return ::testing::AssertionFailure() << "exp_avg_sq";
  }
  if (!same_if_defined(a.max_exp_avg_sq(), b.max_exp_avg_sq(), tolerance)) {
    return ::testing::AssertionFailure() << "max_exp_avg_sq";
  }
  return ::testing::AssertionSuccess();
}

/// Parameters bit-identical (within `tolerance` where it is not 0),
/// pairwise, and so is every state entry (both optimizers have one for the
/// same parameters).
template <class ParamState>
::testing::AssertionResult same_parameters_and_state(torch::optim::Optimizer& a,
                                                     const TensorVector& a_params,
                                                     torch::optim::Optimizer& b,
                                                     const TensorVector& b_params,
                                                     double tolerance = 0) {
  if (a.state().size() != b.state().size()) {
    return ::testing::AssertionFailure()
           << "state entries " << a.state().size() << " != " << b.state().size();
  }
  for (size_t i = 0; i < a_params.size(); ++i) {
    if (!same_tensor(a_params[i], b_params[i], tolerance)) {
      return ::testing::AssertionFailure() << "parameter " << i << " differs: max |diff| "
                                           << (a_params[i] - b_params[i]).abs().max().item<float>();
    }
    auto* sa = state_of<ParamState>(a, a_params[i]);
    auto* sb = state_of<ParamState>(b, b_params[i]);
    if ((sa == nullptr) != (sb == nullptr)) {
      return ::testing::AssertionFailure() << "parameter " << i << ": state in one only";
    }
    if (sa != nullptr) {
      auto same = same_state(*sa, *sb, tolerance);
      if (!same) return same << " (parameter " << i << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

/// Runs kSteps of fulgur's Fulgur and LibTorch's Torch over two groups of
/// the same initial parameters with `options`, the same gradients, and
/// compares parameters and state after every step.
template <class Fulgur, class Torch, class ParamState, class Options>
void expect_bit_identical_runs(const Options& options) {
  auto initial = initial_parameters();
  auto ours = leaves(initial);
  auto theirs = leaves(initial);
  Fulgur fulgur_optimizer(two_groups(ours, options), options);
  Torch torch_optimizer(two_groups(theirs, options), options);
  for (int step = 0; step < kSteps; ++step) {
    set_gradients(ours, step);
    set_gradients(theirs, step);
    fulgur_optimizer.step();
    torch_optimizer.step();
    ASSERT_TRUE(
        same_parameters_and_state<ParamState>(fulgur_optimizer, ours, torch_optimizer, theirs))
        << "after step " << step;
  }
  // The steps did move the parameters (the comparison is not of no-ops),
  // and the one without a gradient stayed.
  EXPECT_FALSE(torch::equal(ours[0], initial[0]));
  EXPECT_FALSE(torch::equal(ours[1], initial[1]));
  EXPECT_TRUE(torch::equal(ours[4], initial[4]));
}

// ---- Every option against torch::optim.

struct SGDCase {
  const char* name;
  torch::optim::SGDOptions options;
};

class SGDMatchesTorch : public ::testing::TestWithParam<SGDCase> {};

TEST_P(SGDMatchesTorch, BitIdenticalParametersAndMomentumBuffers) {
  expect_bit_identical_runs<fulgur::optim::SGD, torch::optim::SGD, torch::optim::SGDParamState>(
      GetParam().options);
}

INSTANTIATE_TEST_SUITE_P(
    Options, SGDMatchesTorch,
    ::testing::Values(
        SGDCase{"plain", torch::optim::SGDOptions(0.1)},
        SGDCase{"weight_decay", torch::optim::SGDOptions(0.1).weight_decay(0.01)},
        SGDCase{"momentum", torch::optim::SGDOptions(0.1).momentum(0.9)},
        SGDCase{"dampening", torch::optim::SGDOptions(0.1).momentum(0.9).dampening(0.3)},
        SGDCase{"nesterov", torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true)},
        SGDCase{"nesterov_weight_decay",
                torch::optim::SGDOptions(0.05).momentum(0.8).nesterov(true).weight_decay(0.1)},
        SGDCase{"all_but_nesterov",
                torch::optim::SGDOptions(0.05).momentum(0.5).dampening(0.1).weight_decay(0.2)}),
    [](const ::testing::TestParamInfo<SGDCase>& info) { return std::string(info.param.name); });

struct AdamCase {
  const char* name;
  torch::optim::AdamOptions options;
};

class AdamMatchesTorch : public ::testing::TestWithParam<AdamCase> {};

TEST_P(AdamMatchesTorch, BitIdenticalParametersMomentsAndStepCounts) {
  expect_bit_identical_runs<fulgur::optim::Adam, torch::optim::Adam, torch::optim::AdamParamState>(
      GetParam().options);
}

INSTANTIATE_TEST_SUITE_P(
    Options, AdamMatchesTorch,
    ::testing::Values(
        AdamCase{"defaults", torch::optim::AdamOptions(1e-2)},
        AdamCase{"weight_decay", torch::optim::AdamOptions(1e-2).weight_decay(0.1)},
        AdamCase{"amsgrad", torch::optim::AdamOptions(1e-2).amsgrad(true)},
        AdamCase{"amsgrad_weight_decay",
                 torch::optim::AdamOptions(1e-2).amsgrad(true).weight_decay(0.05)},
        AdamCase{"betas_eps",
                 torch::optim::AdamOptions(3e-2).betas(std::make_tuple(0.5, 0.9)).eps(1e-3)}),
    [](const ::testing::TestParamInfo<AdamCase>& info) { return std::string(info.param.name); });

struct AdamWCase {
  const char* name;
  torch::optim::AdamWOptions options;
};

class AdamWMatchesTorch : public ::testing::TestWithParam<AdamWCase> {};

TEST_P(AdamWMatchesTorch, BitIdenticalParametersMomentsAndStepCounts) {
  expect_bit_identical_runs<fulgur::optim::AdamW, torch::optim::AdamW,
                            torch::optim::AdamWParamState>(GetParam().options);
}

INSTANTIATE_TEST_SUITE_P(
    Options, AdamWMatchesTorch,
    ::testing::Values(
        AdamWCase{"defaults", torch::optim::AdamWOptions(1e-2)},
        AdamWCase{"no_weight_decay", torch::optim::AdamWOptions(1e-2).weight_decay(0)},
        AdamWCase{"amsgrad", torch::optim::AdamWOptions(1e-2).amsgrad(true)},
        AdamWCase{"amsgrad_strong_decay",
                  torch::optim::AdamWOptions(1e-2).amsgrad(true).weight_decay(0.3)},
        AdamWCase{"betas_eps",
                  torch::optim::AdamWOptions(3e-2).betas(std::make_tuple(0.5, 0.9)).eps(1e-3)}),
    [](const ::testing::TestParamInfo<AdamWCase>& info) { return std::string(info.param.name); });

// ---- The step runs multi-tensor operators (and the parent's loop where it
// must).

/// Counts the ATen operators whose name starts with `prefix` while alive (a
/// RecordFunction callback on this process; one counter at a time).
class OpCounter {
 public:
  explicit OpCounter(const char* prefix) {
    prefix_ = prefix;
    count_ = 0;
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback(&OpCounter::on_start).scopes({at::RecordScope::FUNCTION}));
  }
  ~OpCounter() { at::removeCallback(handle_); }
  int64_t count() const { return count_.load(); }

 private:
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    if (std::strncmp(fn.name(), prefix_, std::strlen(prefix_)) == 0) ++count_;
    return nullptr;
  }
  static inline const char* prefix_ = "";
  static inline std::atomic<int64_t> count_{0};
  at::CallbackHandle handle_;
};

TEST(FulgurOptimizers, StepRunsForeachOperatorsNotOnePerParameter) {
  auto params = leaves(initial_parameters());
  fulgur::optim::Adam adam(params, torch::optim::AdamOptions(1e-2));
  set_gradients(params, 5);
  OpCounter counter("aten::_foreach_");
  adam.step();
  // mul_, add_, mul_, addcmul_, sqrt, div_, add_, addcdiv_: 8 for 4
  // parameters in one group with one step count.
  EXPECT_EQ(counter.count(), 8);
}

// ---- State that cannot work.

TEST(FulgurOptimizers, AmsgradSwitchedOnAfterTheFirstStepIsAnErrorNamingTheFix) {
  auto params = leaves(initial_parameters());
  fulgur::optim::Adam adam(params, torch::optim::AdamOptions(1e-2));
  set_gradients(params, 0);
  adam.step();
  static_cast<torch::optim::AdamOptions&>(adam.param_groups()[0].options()).amsgrad(true);
  EXPECT_THROWS_WITH(c10::Error, adam.step(),
                     {"fulgur::optim::Adam", "no max_exp_avg_sq", "amsgrad=true before the first"});
}

// ---- On a GPU: the multi-tensor kernels compute the same expressions.

TEST(FulgurOptimizers, MatchesTorchOptimWithinFloatRounding_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  auto check = [](auto make_fulgur, auto make_torch) {
    TensorVector initial;
    for (const auto& p : initial_parameters()) initial.push_back(p.to(torch::kCUDA));
    auto ours = leaves(initial);
    auto theirs = leaves(initial);
    auto fulgur_optimizer = make_fulgur(ours);
    auto torch_optimizer = make_torch(theirs);
    for (int step = 0; step < kSteps; ++step) {
      set_gradients(ours, step);
      set_gradients(theirs, step);
      fulgur_optimizer->step();
      torch_optimizer->step();
    }
    for (size_t i = 0; i < ours.size(); ++i) {
      EXPECT_TRUE(torch::allclose(ours[i], theirs[i], /*rtol=*/1e-5, /*atol=*/1e-6))
          << "parameter " << i;
    }
    EXPECT_FALSE(torch::equal(ours[0], initial[0]));
  };
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(0.01);
  check([&](const TensorVector& p) { return std::make_unique<fulgur::optim::SGD>(p, sgd); },
        [&](const TensorVector& p) { return std::make_unique<torch::optim::SGD>(p, sgd); });
  const auto adam = torch::optim::AdamOptions(1e-2).amsgrad(true).weight_decay(0.01);
  check([&](const TensorVector& p) { return std::make_unique<fulgur::optim::Adam>(p, adam); },
        [&](const TensorVector& p) { return std::make_unique<torch::optim::Adam>(p, adam); });
  const auto adamw = torch::optim::AdamWOptions(1e-2);
  check([&](const TensorVector& p) { return std::make_unique<fulgur::optim::AdamW>(p, adamw); },
        [&](const TensorVector& p) { return std::make_unique<torch::optim::AdamW>(p, adamw); });
}

// ---- Sparse gradients.

TEST(FulgurOptimizers, SGDWithASparseGradientRunsTorchsStepAndMatchesIt) {
  auto make = [] {
    torch::manual_seed(1);
    return torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 3).sparse(true));
  };
  auto ours = make();
  auto theirs = make();
  auto options = torch::optim::SGDOptions(0.1).momentum(0.9);
  fulgur::optim::SGD fulgur_sgd(ours->parameters(), options);
  torch::optim::SGD torch_sgd(theirs->parameters(), options);
  auto indices = torch::tensor({1, 4, 4, 7}, torch::kLong);
  for (int step = 0; step < 3; ++step) {
    fulgur_sgd.zero_grad();
    torch_sgd.zero_grad();
    ours(indices).pow(2).sum().backward();
    theirs(indices).pow(2).sum().backward();
    ASSERT_TRUE(ours->weight.grad().is_sparse());
    OpCounter counter("aten::_foreach_");
    fulgur_sgd.step();
    EXPECT_EQ(counter.count(), 0) << "a sparse gradient takes torch::optim::SGD's own step";
    torch_sgd.step();
    ASSERT_TRUE(torch::equal(ours->weight, theirs->weight)) << "after step " << step;
  }
}

TEST(FulgurOptimizers, AdamAndAdamWRefuseASparseGradientBeforeChangingAnything) {
  torch::nn::Embedding embedding(torch::nn::EmbeddingOptions(10, 3).sparse(true));
  auto dense = torch::zeros({2}, torch::requires_grad());
  embedding(torch::tensor({2}, torch::kLong)).sum().backward();
  dense.mutable_grad() = torch::ones({2});
  auto before = embedding->weight.detach().clone();
  // The dense parameter comes first: it is not stepped either.
  std::vector<at::Tensor> params{dense, embedding->weight};
  fulgur::optim::Adam adam(params, torch::optim::AdamOptions(0.1));
  EXPECT_THROWS_WITH(c10::Error, adam.step(), {"fulgur::optim::Adam", "sparse gradients"});
  fulgur::optim::AdamW adamw(params, torch::optim::AdamWOptions(0.1));
  EXPECT_THROWS_WITH(c10::Error, adamw.step(), {"fulgur::optim::AdamW", "sparse gradients"});
  EXPECT_TRUE(torch::equal(dense, torch::zeros({2})));
  EXPECT_TRUE(torch::equal(embedding->weight, before));
  EXPECT_TRUE(adam.state().empty());
  EXPECT_TRUE(adamw.state().empty());
}

// A gradient of another dtype than its parameter's (set by hand): named,
// nothing stepped (Adam's kernel failed an internal assert on it, as
// torch::optim's does).
TEST(FulgurOptimizers, AdamAndAdamWNameAGradientOfAnotherDtype) {
  auto p = torch::zeros({2, 3}, torch::requires_grad());
  p.mutable_grad() = torch::ones({2, 3}, torch::kDouble);
  fulgur::optim::Adam adam(std::vector<at::Tensor>{p}, torch::optim::AdamOptions(0.1));
  EXPECT_THROWS_WITH(c10::Error, adam.step(),
                     {"fulgur::optim::Adam: a parameter of shape [2, 3] and dtype Float (group 0) "
                      "has a gradient of dtype Double",
                      "grad.to(param.scalar_type())"});
  fulgur::optim::AdamW adamw(std::vector<at::Tensor>{p}, torch::optim::AdamWOptions(0.1));
  EXPECT_THROWS_WITH(c10::Error, adamw.step(), {"fulgur::optim::AdamW", "Double"});
  EXPECT_TRUE(torch::equal(p, torch::zeros({2, 3})));
  EXPECT_TRUE(adam.state().empty());
}

// ---- A parameter listed twice in one group.

TEST(FulgurOptimizers, AParameterListedTwiceIsSteppedTwiceAsTorchDoes) {
  auto initial = initial_parameters();
  auto ours = leaves(initial);
  auto theirs = leaves(initial);
  TensorVector ours_twice{ours[0], ours[1], ours[0]};
  TensorVector theirs_twice{theirs[0], theirs[1], theirs[0]};
  fulgur::optim::Adam fulgur_adam(ours_twice, torch::optim::AdamOptions(0.1));
  torch::optim::Adam torch_adam(theirs_twice, torch::optim::AdamOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    ours[0].mutable_grad() = gradient(ours[0], 0, step);
    theirs[0].mutable_grad() = gradient(theirs[0], 0, step);
    ours[1].mutable_grad() = gradient(ours[1], 2, step);
    theirs[1].mutable_grad() = gradient(theirs[1], 2, step);
    fulgur_adam.step();
    torch_adam.step();
  }
  EXPECT_TRUE(torch::equal(ours[0], theirs[0]));
  EXPECT_TRUE(torch::equal(ours[1], theirs[1]));
  EXPECT_EQ(state_of<torch::optim::AdamParamState>(fulgur_adam, ours[0])->step(), 6);
}

// ---- The closure.

TEST(FulgurOptimizers, ClosureRunsOnceWithGradientsEnabledAndItsLossIsReturned) {
  auto initial = initial_parameters();
  auto ours = leaves(initial);
  auto theirs = leaves(initial);
  fulgur::optim::SGD fulgur_sgd(ours, torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD torch_sgd(theirs, torch::optim::SGDOptions(0.1).momentum(0.9));
  auto closure_over = [](const TensorVector& params, int* calls) {
    return [params, calls] {
      ++*calls;
      EXPECT_TRUE(torch::GradMode::is_enabled());
      for (const auto& p : params) p.mutable_grad() = at::Tensor();
      auto loss = params[0].pow(2).sum() + params[2].sin().sum();
      loss.backward();
      return loss;
    };
  };
  int fulgur_calls = 0;
  int torch_calls = 0;
  for (int step = 0; step < 3; ++step) {
    torch::NoGradGuard no_grad;  // step() enables gradients for the closure
    auto fulgur_loss = fulgur_sgd.step(closure_over(ours, &fulgur_calls));
    auto torch_loss = torch_sgd.step(closure_over(theirs, &torch_calls));
    EXPECT_TRUE(torch::equal(fulgur_loss, torch_loss));
  }
  EXPECT_EQ(fulgur_calls, 3);
  EXPECT_EQ(torch_calls, 3);
  EXPECT_TRUE(
      same_parameters_and_state<torch::optim::SGDParamState>(fulgur_sgd, ours, torch_sgd, theirs));
  EXPECT_FALSE(fulgur_sgd.step().defined()) << "no closure, no loss";
}

// ---- Save and load across the two types.

/// Steps `optimizer` over `params` for steps [from, to).
void run_steps(torch::optim::Optimizer& optimizer, const TensorVector& params, int from, int to) {
  for (int step = from; step < to; ++step) {
    set_gradients(params, step);
    optimizer.step();
  }
}

template <class Saved, class Loaded, class ParamState, class Options>
void expect_round_trip(const Options& options) {
  TempDir dir;
  const auto path = dir.file("optimizer.pt");
  auto initial = initial_parameters();
  // The reference: one optimizer of the saved type, never saved.
  auto reference_params = leaves(initial);
  Saved reference(two_groups(reference_params, options), options);
  run_steps(reference, reference_params, 0, kSteps);

  // Three steps, saved; the parameters and the archive go to an optimizer of
  // the other type, which takes the remaining steps.
  auto saved_params = leaves(initial);
  Saved saved(two_groups(saved_params, options), options);
  run_steps(saved, saved_params, 0, 3);
  torch::save(saved, path);
  auto loaded_params = leaves(initial);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < loaded_params.size(); ++i) loaded_params[i].copy_(saved_params[i]);
  }
  Loaded loaded(two_groups(loaded_params, options), options);
  torch::load(loaded, path);
  ASSERT_TRUE(same_parameters_and_state<ParamState>(saved, saved_params, loaded, loaded_params));
  run_steps(loaded, loaded_params, 3, kSteps);
  EXPECT_TRUE(
      same_parameters_and_state<ParamState>(reference, reference_params, loaded, loaded_params));
}

TEST(FulgurOptimizers, SavedByFulgurLoadsIntoTorchOptimAndGoesOnIdentically) {
  expect_round_trip<fulgur::optim::SGD, torch::optim::SGD, torch::optim::SGDParamState>(
      torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
  expect_round_trip<fulgur::optim::Adam, torch::optim::Adam, torch::optim::AdamParamState>(
      torch::optim::AdamOptions(1e-2).amsgrad(true).weight_decay(0.01));
  expect_round_trip<fulgur::optim::AdamW, torch::optim::AdamW, torch::optim::AdamWParamState>(
      torch::optim::AdamWOptions(1e-2));
}

TEST(FulgurOptimizers, SavedByTorchOptimLoadsIntoFulgurAndGoesOnIdentically) {
  expect_round_trip<torch::optim::SGD, fulgur::optim::SGD, torch::optim::SGDParamState>(
      torch::optim::SGDOptions(0.1).momentum(0.9).dampening(0.2));
  expect_round_trip<torch::optim::Adam, fulgur::optim::Adam, torch::optim::AdamParamState>(
      torch::optim::AdamOptions(1e-2));
  expect_round_trip<torch::optim::AdamW, fulgur::optim::AdamW, torch::optim::AdamWParamState>(
      torch::optim::AdamWOptions(1e-2).amsgrad(true));
}

// ---- Schedulers.

TEST(FulgurOptimizers, StepLRChangesTheLearningRateTheStepUses) {
  auto initial = initial_parameters();
  auto ours = leaves(initial);
  auto theirs = leaves(initial);
  auto options = torch::optim::AdamOptions(1e-2);
  fulgur::optim::Adam fulgur_adam(two_groups(ours, options), options);
  torch::optim::Adam torch_adam(two_groups(theirs, options), options);
  torch::optim::StepLR fulgur_schedule(fulgur_adam, /*step_size=*/2, /*gamma=*/0.5);
  torch::optim::StepLR torch_schedule(torch_adam, /*step_size=*/2, /*gamma=*/0.5);
  for (int step = 0; step < kSteps; ++step) {
    set_gradients(ours, step);
    set_gradients(theirs, step);
    fulgur_adam.step();
    torch_adam.step();
    fulgur_schedule.step();
    torch_schedule.step();
  }
  // 7 scheduler steps: the lr was halved three times, in both groups.
  EXPECT_DOUBLE_EQ(fulgur_adam.param_groups()[0].options().get_lr(), 1e-2 / 8);
  EXPECT_DOUBLE_EQ(fulgur_adam.param_groups()[1].options().get_lr(), 3e-2 / 8);
  EXPECT_TRUE(same_parameters_and_state<torch::optim::AdamParamState>(fulgur_adam, ours, torch_adam,
                                                                      theirs));
}

// ---- A whole fit.

/// A 3-8-8-1 MLP on the regression data, with Adam from fulgur or LibTorch.
class AdamMLP : public fulgur::Module {
 public:
  explicit AdamMLP(bool fulgur_adam) : fulgur::Module("AdamMLP"), fulgur_adam_(fulgur_adam) {
    torch::manual_seed(7);
    net = register_module("net", torch::nn::Sequential(torch::nn::Linear(3, 8), torch::nn::Tanh(),
                                                       torch::nn::Linear(8, 8), torch::nn::Tanh(),
                                                       torch::nn::Linear(8, 1)));
  }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    const auto& [x, y] = batch.pair();
    return torch::nn::functional::mse_loss(net->forward(x), y);
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    auto options = torch::optim::AdamOptions(1e-2).weight_decay(1e-3);
    if (fulgur_adam_) {
      return fulgur::OptimizerConfig(std::make_shared<fulgur::optim::Adam>(parameters(), options));
    }
    return fulgur::OptimizerConfig(std::make_shared<torch::optim::Adam>(parameters(), options));
  }
  torch::nn::Sequential net{nullptr};

 private:
  bool fulgur_adam_;
};

TEST(FulgurOptimizers, TrainerFitWithFulgurAdamEqualsFitWithTorchAdam) {
  AdamMLP ours(/*fulgur_adam=*/true);
  AdamMLP theirs(/*fulgur_adam=*/false);
  ASSERT_TRUE(fulgur::test::parameters_equal(ours, theirs));
  TempDir dir_a;
  TempDir dir_b;
  auto options_a = test_options(dir_a);
  options_a.max_epochs = 3;
  auto options_b = test_options(dir_b);
  options_b.max_epochs = 3;
  fulgur::Trainer(options_a).fit(ours, fulgur::test::regression_loader(/*num_batches=*/6));
  fulgur::Trainer(options_b).fit(theirs, fulgur::test::regression_loader(/*num_batches=*/6));
  EXPECT_TRUE(fulgur::test::parameters_equal(ours, theirs));
  AdamMLP untrained(/*fulgur_adam=*/true);
  EXPECT_FALSE(fulgur::test::parameters_equal(ours, untrained)) << "the fit moved nothing";
}

// ---- Device-scalar steps (what a CUDA-graph step uses), on the CPU.

/// Every parameter but the last (which never has one) gets a gradient.
void set_all_gradients(const TensorVector& params, int step) {
  for (size_t i = 0; i < params.size(); ++i) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + i);
    params[i].mutable_grad() =
        i + 1 == params.size() ? at::Tensor() : at::randn(params[i].sizes(), gen);
  }
}

/// Two host steps on both, then `device_steps` steps with fulgur's in
/// device-scalar mode (prepare_step, step, finish_step) and a learning rate
/// scaled by 0.7 after each step in both groups (a schedule): parameters
/// within float rounding of torch::optim's, step counts equal.
template <class Fulgur, class Torch, class ParamState, class Options>
void expect_device_scalar_steps_match(const Options& options) {
  auto initial = initial_parameters();
  auto ours = leaves(initial);
  auto theirs = leaves(initial);
  Fulgur fulgur_optimizer(two_groups(ours, options), options);
  Torch torch_optimizer(two_groups(theirs, options), options);
  for (int step = 0; step < 2; ++step) {
    set_all_gradients(ours, step);
    set_all_gradients(theirs, step);
    fulgur_optimizer.step();
    torch_optimizer.step();
  }
  ASSERT_EQ(fulgur_optimizer.why_not_device_scalars(), "");
  fulgur_optimizer.set_device_scalars(c10::Device(c10::kCPU));
  for (int step = 2; step < 8; ++step) {
    set_all_gradients(ours, step);
    set_all_gradients(theirs, step);
    fulgur_optimizer.prepare_step();
    fulgur_optimizer.step();
    fulgur_optimizer.finish_step();
    torch_optimizer.step();
    for (auto* opt : std::vector<torch::optim::Optimizer*>{&fulgur_optimizer, &torch_optimizer}) {
      for (auto& group : opt->param_groups()) {
        group.options().set_lr(group.options().get_lr() * 0.7);
      }
    }
    for (size_t i = 0; i < ours.size(); ++i) {
      ASSERT_TRUE(torch::allclose(ours[i], theirs[i], 1e-5, 1e-6))
          << "parameter " << i << " after step " << step << ": max |diff| "
          << (ours[i] - theirs[i]).abs().max().item<float>();
    }
  }
  if constexpr (!std::is_same_v<ParamState, torch::optim::SGDParamState>) {
    for (size_t i = 0; i + 1 < ours.size(); ++i) {
      EXPECT_EQ(state_of<ParamState>(fulgur_optimizer, ours[i])->step(), 8) << "parameter " << i;
    }
  }
  // The steps moved the parameters with the scheduled rates: host steps at
  // the rate of the first step would end elsewhere.
  fulgur_optimizer.set_device_scalars(std::nullopt);
  EXPECT_FALSE(fulgur_optimizer.uses_device_scalars());
}

TEST(FulgurOptimizers, DeviceScalarStepsMatchTorchOptimWithAChangingRate) {
  expect_device_scalar_steps_match<fulgur::optim::SGD, torch::optim::SGD,
                                   torch::optim::SGDParamState>(
      torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-2));
  expect_device_scalar_steps_match<fulgur::optim::SGD, torch::optim::SGD,
                                   torch::optim::SGDParamState>(
      torch::optim::SGDOptions(0.05).momentum(0.5).dampening(0.1));
  expect_device_scalar_steps_match<fulgur::optim::Adam, torch::optim::Adam,
                                   torch::optim::AdamParamState>(
      torch::optim::AdamOptions(1e-2).weight_decay(1e-2).amsgrad(true));
  expect_device_scalar_steps_match<fulgur::optim::AdamW, torch::optim::AdamW,
                                   torch::optim::AdamWParamState>(
      torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

TEST(FulgurOptimizers, DeviceScalarStepsSayWhyTheyCannotRun) {
  {
    // Parameter 1 misses steps (gradient()): its Adam step count trails.
    auto params = leaves(initial_parameters());
    fulgur::optim::Adam adam(two_groups(params, torch::optim::AdamOptions(1e-2)),
                             torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      set_gradients(params, step);
      adam.step();
    }
    EXPECT_THAT(adam.why_not_device_scalars(),
                ::testing::HasSubstr("parameter group 0 holds parameters with different step "
                                     "counts"));
  }
  {
    // Momentum buffers exist only for parameters that had a gradient (the
    // last one had none: a frozen parameter, which is no reason to refuse).
    auto params = leaves(initial_parameters());
    fulgur::optim::SGD sgd(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    set_all_gradients(params, 0);
    sgd.step();
    EXPECT_EQ(sgd.why_not_device_scalars(), "");
    // A parameter with a gradient but no buffer cannot get one in a
    // device-scalar step (a captured step would set it again each replay).
    sgd.set_device_scalars(c10::Device(c10::kCPU));
    sgd.prepare_step();
    params.back().mutable_grad() = torch::ones_like(params.back());
    EXPECT_THROWS_WITH(c10::Error, sgd.step(), {"has a gradient but no momentum buffer"});
  }
}

TEST(FulgurOptimizers, BakedOptionsChangeWithTheConstantsNotWithTheRate) {
  auto params = leaves(initial_parameters());
  fulgur::optim::AdamW adamw(params, torch::optim::AdamWOptions(1e-2));
  const auto before = adamw.baked_options();
  adamw.param_groups()[0].options().set_lr(1.0);
  EXPECT_EQ(adamw.baked_options(), before);
  static_cast<torch::optim::AdamWOptions&>(adamw.param_groups()[0].options()).weight_decay(0.5);
  EXPECT_NE(adamw.baked_options(), before);
}

// ---- Device-skipped steps: the loss scaler's verdict read by the kernels
// (LibTorch 2.6+); elsewhere read by the host, then step().

bool fused_kernels() { return fulgur::optim::DeviceSkippedSteps::available(); }

/// found_inf as GradScaler::unscale makes it: float32 [1], 1 for inf/NaN.
at::Tensor verdict(bool found_inf) { return torch::full({1}, found_inf ? 1.0f : 0.0f); }

/// kSteps of step_unless() on fulgur's optimizer, whose gradients hold an
/// inf on `inf_steps`, against torch::optim's step() on the others, on
/// `device`. Parameters are compared after every step; the state after
/// settle() on odd steps (on even ones the next step_unless() learns the
/// verdict itself, as in training) and at the end. With the kernels, equal
/// within float rounding; without them (the host reads, then steps)
/// bit-identical. inf_steps {0, 4}: a first step is skipped and must leave
/// no state; {1, 4}: parameter 1's first step comes with others' later ones
/// (one kernel each), and a skip erases only what it made.
template <class Fulgur, class Torch, class ParamState, class Options>
void expect_device_skipped_runs(const Options& options, const std::vector<int>& inf_steps,
                                c10::Device device = c10::kCPU) {
  TensorVector initial;
  for (const auto& p : initial_parameters()) initial.push_back(p.to(device));
  auto ours = leaves(initial);
  auto theirs = leaves(initial);
  Fulgur fulgur_optimizer(two_groups(ours, options), options);
  Torch torch_optimizer(two_groups(theirs, options), options);
  const double tolerance = fused_kernels() || device.is_cuda() ? 1e-5 : 0;
  const auto at = [&](int step) { return "after step " + std::to_string(step); };
  for (int step = 0; step < kSteps; ++step) {
    set_gradients(ours, step);
    set_gradients(theirs, step);
    const bool inf = std::find(inf_steps.begin(), inf_steps.end(), step) != inf_steps.end();
    if (inf) ours[2].mutable_grad()[0][0][1] = std::numeric_limits<float>::infinity();
    // Queued for the device to decide, or skipped by the host that read.
    EXPECT_EQ(fulgur_optimizer.step_unless(verdict(inf).to(device)), !inf || fused_kernels());
    if (!inf) torch_optimizer.step();
    for (size_t i = 0; i < ours.size(); ++i) {
      ASSERT_TRUE(same_tensor(ours[i], theirs[i], tolerance))
          << "parameter " << i << " " << at(step);
    }
    if (step % 2 == 1) {
      fulgur_optimizer.settle();
      ASSERT_TRUE(same_parameters_and_state<ParamState>(fulgur_optimizer, ours, torch_optimizer,
                                                        theirs, tolerance))
          << at(step);
    }
  }
  fulgur_optimizer.settle();
  EXPECT_TRUE(same_parameters_and_state<ParamState>(fulgur_optimizer, ours, torch_optimizer, theirs,
                                                    tolerance));
  EXPECT_FALSE(torch::equal(ours[0], initial[0]));
  EXPECT_TRUE(torch::equal(ours[4], initial[4]));
}

/// Every optimizer and its main options through expect_device_skipped_runs.
void expect_device_skipped_runs_of_each(c10::Device device) {
  using torch::optim::AdamOptions;
  using torch::optim::AdamWOptions;
  using torch::optim::SGDOptions;
  for (const std::vector<int>& inf_steps : {std::vector<int>{0, 4}, std::vector<int>{1, 4}}) {
    SCOPED_TRACE("inf at steps " + std::to_string(inf_steps[0]) + " and 4");
    // Dampening: a first step after a skipped one still makes the buffer
    // the gradient itself.
    for (const auto& options :
         {SGDOptions(0.1), SGDOptions(0.1).momentum(0.9).dampening(0.3).weight_decay(0.01),
          SGDOptions(0.05).momentum(0.8).nesterov(true)}) {
      SCOPED_TRACE("SGD momentum " + std::to_string(options.momentum()));
      expect_device_skipped_runs<fulgur::optim::SGD, torch::optim::SGD,
                                 torch::optim::SGDParamState>(options, inf_steps, device);
    }
    for (const auto& options :
         {AdamOptions(1e-2), AdamOptions(1e-2).amsgrad(true).weight_decay(0.1)}) {
      SCOPED_TRACE(std::string("Adam amsgrad ") + (options.amsgrad() ? "on" : "off"));
      expect_device_skipped_runs<fulgur::optim::Adam, torch::optim::Adam,
                                 torch::optim::AdamParamState>(options, inf_steps, device);
    }
    expect_device_skipped_runs<fulgur::optim::AdamW, torch::optim::AdamW,
                               torch::optim::AdamWParamState>(AdamWOptions(1e-2).weight_decay(0.1),
                                                              inf_steps, device);
  }
}

TEST(FulgurOptimizers, DeviceSkippedStepsMatchTorchOptimOnTheStepsTheVerdictLetsThrough) {
  expect_device_skipped_runs_of_each(c10::kCPU);
}

TEST(FulgurOptimizers, DeviceSkippedStepsMatchTorchOptimWithinFloatRounding_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  expect_device_skipped_runs_of_each(c10::Device(c10::kCUDA, 0));
}

TEST(FulgurOptimizers, DeviceSkippedStepsOfMixedDtypesAndSharedTensorsMatchTorchOptim) {
  // One group of float32 and float64 parameters (one kernel per dtype), and
  // a tensor in two groups (stepped twice, the second step seeing the
  // first: the host reads the verdict and steps as torch::optim does).
  auto check = [](auto make_fulgur, auto make_torch, const std::string& what) {
    SCOPED_TRACE(what);
    std::vector<c10::Device> devices = {c10::kCPU};
    if (torch::cuda::is_available()) devices.emplace_back(c10::kCUDA, 0);
    for (const auto& device : devices) {
      torch::manual_seed(3);
      const TensorVector initial = {torch::randn({3, 2}).to(device),
                                    torch::randn({4}, torch::kDouble).to(device)};
      auto ours = leaves(initial);
      auto theirs = leaves(initial);
      auto fulgur_optimizer = make_fulgur(ours);
      auto torch_optimizer = make_torch(theirs);
      for (int step = 0; step < 4; ++step) {
        for (size_t i = 0; i < ours.size(); ++i) {
          // Of each parameter's dtype, as autograd makes them.
          const auto grad = torch::randn_like(initial[i]);
          ours[i].mutable_grad() = grad.clone();
          theirs[i].mutable_grad() = grad.clone();
        }
        ASSERT_TRUE(fulgur_optimizer->step_unless(verdict(false).to(device)));
        torch_optimizer->step();
        fulgur_optimizer->settle();
        for (size_t i = 0; i < ours.size(); ++i) {
          ASSERT_TRUE(torch::allclose(ours[i], theirs[i], 1e-5, 1e-5))
              << "parameter " << i << " after step " << step << " on " << device;
        }
      }
      EXPECT_FALSE(torch::equal(ours[1], initial[1]));
    }
  };
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  check([&](const TensorVector& p) { return std::make_unique<fulgur::optim::SGD>(p, sgd); },
        [&](const TensorVector& p) { return std::make_unique<torch::optim::SGD>(p, sgd); },
        "SGD, mixed dtypes");
  const auto adam = torch::optim::AdamOptions(1e-2);
  check([&](const TensorVector& p) { return std::make_unique<fulgur::optim::Adam>(p, adam); },
        [&](const TensorVector& p) { return std::make_unique<torch::optim::Adam>(p, adam); },
        "Adam, mixed dtypes");
  auto shared = [&](auto tag) {
    return [&, tag](const TensorVector& p) {
      using Optimizer = typename decltype(tag)::type;
      std::vector<OptimizerParamGroup> groups;
      groups.emplace_back(TensorVector{p[0], p[1]},
                          std::make_unique<torch::optim::AdamOptions>(adam));
      groups.emplace_back(TensorVector{p[0]}, std::make_unique<torch::optim::AdamOptions>(adam));
      return std::make_unique<Optimizer>(std::move(groups), adam);
    };
  };
  check(shared(std::type_identity<fulgur::optim::Adam>{}),
        shared(std::type_identity<torch::optim::Adam>{}), "Adam, a tensor in two groups");
}

TEST(FulgurOptimizers, TheHostLearnsADeviceSkippedStepsVerdictAtTheNextStepOrWhenSaved) {
  if (!fused_kernels()) {
    GTEST_SKIP() << "LibTorch " << fulgur::compat::torch_version()
                 << " has no fused kernels: step_unless reads the verdict at once";
  }
  auto params = leaves(initial_parameters());
  fulgur::optim::Adam adam(params, torch::optim::AdamOptions(1e-2));
  auto count = [&] { return state_of<torch::optim::AdamParamState>(adam, params[0])->step(); };
  set_gradients(params, 5);
  ASSERT_TRUE(adam.step_unless(verdict(false)));
  EXPECT_EQ(count(), 0) << "the host does not wait for the verdict";
  fulgur::optimizer_state_dict(adam);  // settles first
  EXPECT_EQ(count(), 1);
  ASSERT_TRUE(adam.step_unless(verdict(true)));
  EXPECT_EQ(count(), 1);
  ASSERT_TRUE(adam.step_unless(verdict(false)));  // learns the skip, then steps
  EXPECT_EQ(count(), 1);
  adam.settle();
  EXPECT_EQ(count(), 2);

  // A skipped first step: the buffers it made are gone once it is known.
  fulgur::optim::SGD sgd(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  ASSERT_TRUE(sgd.step_unless(verdict(true)));
  EXPECT_FALSE(sgd.state().empty()) << "made for the kernel, before the verdict";
  sgd.settle();
  EXPECT_TRUE(sgd.state().empty());
  // The verdict of the last step before a save is in the save.
  ASSERT_TRUE(sgd.step_unless(verdict(true)));
  torch::serialize::OutputArchive archive;
  sgd.save(archive);
  EXPECT_TRUE(sgd.state().empty());
}

TEST(FulgurOptimizers, GradScalerStepsAFulgurOptimizerWithoutReadingItsVerdict) {
  if (!fused_kernels()) {
    GTEST_SKIP() << "LibTorch " << fulgur::compat::torch_version()
                 << " has no fused kernels: GradScaler reads the verdict, then steps";
  }
  auto initial = initial_parameters();
  auto ours = leaves(initial);
  auto theirs = leaves(initial);
  // SGD: the CPU's fused Adam reads its step counts with item() inside the
  // kernel (the CUDA one reads them on the device), which would count.
  const auto options = torch::optim::SGDOptions(1e-2).momentum(0.9).weight_decay(0.01);
  fulgur::optim::SGD fulgur_sgd(ours, options);
  torch::optim::SGD torch_sgd(theirs, options);
  fulgur::GradScaler fulgur_scaler({.init_scale = 1024.0});
  fulgur::GradScaler torch_scaler({.init_scale = 1024.0});
  int64_t reads = 0;
  for (int step = 0; step < kSteps; ++step) {
    for (auto [params, scaler] :
         {std::pair{&ours, &fulgur_scaler}, std::pair{&theirs, &torch_scaler}}) {
      at::Tensor loss = torch::zeros({});
      for (const auto& p : *params) loss = loss + (p * p).sum();
      // Step 3's gradients overflow: the scaler skips it and backs off.
      if (step == 3) loss = loss * std::numeric_limits<float>::infinity();
      for (const auto& p : *params) p.mutable_grad() = at::Tensor();
      scaler->scale(loss).backward();
    }
    {
      OpCounter item("aten::_local_scalar_dense");  // what .item() runs
      EXPECT_TRUE(fulgur_scaler.step(fulgur_sgd)) << "queued, not skipped by the host";
      reads += item.count();
    }
    EXPECT_EQ(torch_scaler.step(torch_sgd), step != 3);
    fulgur_scaler.update();
    torch_scaler.update();
    EXPECT_EQ(fulgur_scaler.last_step_skipped(), step == 3);
  }
  EXPECT_EQ(reads, 0) << "GradScaler::step read a tensor back with a fulgur::optim optimizer";
  EXPECT_EQ(fulgur_scaler.get_scale(), torch_scaler.get_scale());
  fulgur_sgd.settle();
  EXPECT_TRUE(same_parameters_and_state<torch::optim::SGDParamState>(fulgur_sgd, ours, torch_sgd,
                                                                     theirs, 1e-5));
  EXPECT_FALSE(torch::equal(ours[0], initial[0]));
}

}  // namespace fulgur_optimizers_test
