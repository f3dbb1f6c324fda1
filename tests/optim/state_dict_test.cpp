// optimizer_state_dict / load_optimizer_state_dict (fulgur/optim/state_dict.h):
// for torch::optim's SGD, Adam, AdamW, RMSprop and Adagrad and fulgur's Adam
// the dict is what LibTorch's Optimizer::save writes (read back), holding the
// optimizer's own state tensors; a load into a fresh optimizer restores every
// parameter's state and the groups' options (LibTorch's own load drops
// them), so the next step is bit-identical; LBFGS and an optimizer of one's
// own go through their own save and load; a state that does not fit is
// refused, naming what differs, before anything changes.
#include "fulgur/optim/state_dict.h"

#include <gtest/gtest.h>
#include <torch/optim/serialize.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "fulgur/fulgur.h"
#include "fulgur/optim/optimizers.h"
#include "fulgur/utilities/torch_compat.h"
#include "support/test_support.h"

namespace {

using fulgur::test::archived;
using TensorVector = std::vector<at::Tensor>;
using torch::optim::OptimizerParamState;

// Two parameters of `seed`.
TensorVector make_params(uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({3, 4}).requires_grad_(), torch::randn({4}).requires_grad_()};
}

// Parameters of the same values, of their own.
TensorVector copies_of(const TensorVector& params) {
  TensorVector out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_());
  return out;
}

// `steps` steps of a fixed loss that gives both parameters a gradient.
void train(torch::optim::Optimizer& optimizer, const TensorVector& params, int steps) {
  const at::Tensor x = torch::linspace(-1, 1, 15).reshape({5, 3});
  for (int i = 0; i < steps; ++i) {
    optimizer.zero_grad();
    const at::Tensor loss =
        (torch::matmul(x, params[0]) + params[1]).pow(2).mean() + params[1].sum() * 0.1;
    loss.backward();
    optimizer.step();
  }
}

// A checkpoint's copy of `state`: written and read back.
fulgur::StateDict through_bytes(const fulgur::StateDict& state) {
  return fulgur::from_bytes(fulgur::to_bytes(state));
}

// The same keys (in the same order, but for the parameters' states, which
// LibTorch writes in its hash map's order), sections where sections are,
// equal values, and equal tensors of the same dtype and shape.
void expect_same_structure(const fulgur::StateDict& a, const fulgur::StateDict& b,
                           const std::string& where, bool ordered = true, bool top = true) {
  auto ka = a.keys(), kb = b.keys();
  if (!ordered) {
    std::sort(ka.begin(), ka.end());
    std::sort(kb.begin(), kb.end());
  }
  ASSERT_EQ(ka, kb) << where;
  for (const auto& key : ka) {
    const std::string here = where + "/" + key;
    if (const fulgur::StateDict* sa = a.find_section(key)) {
      const fulgur::StateDict* sb = b.find_section(key);
      ASSERT_NE(sb, nullptr) << here << " is a section on one side only";
      expect_same_structure(*sa, *sb, here, /*ordered=*/!(top && key == "state"), /*top=*/false);
      continue;
    }
    ASSERT_EQ(b.find_section(key), nullptr) << here << " is a section on one side only";
    const c10::IValue& va = a.at(key);
    const c10::IValue& vb = b.at(key);
    if (va.isTensor()) {
      ASSERT_TRUE(vb.isTensor()) << here;
      const at::Tensor ta = va.toTensor(), tb = vb.toTensor();
      EXPECT_EQ(ta.scalar_type(), tb.scalar_type()) << here;
      EXPECT_EQ(ta.sizes(), tb.sizes()) << here;
      EXPECT_TRUE(torch::equal(ta, tb)) << here;
    } else {
      EXPECT_TRUE(va == vb) << here << ": " << va << " vs " << vb;
    }
  }
}

// The options of the first parameter group, as the dict holds them.
fulgur::StateDict options_of(torch::optim::Optimizer& optimizer) {
  return fulgur::optimizer_state_dict(optimizer)
      .section_at("param_groups")
      .section_at("param_groups/0")
      .section_at("options");
}

// ---- Comparing parameter states through their accessors.

::testing::AssertionResult same_tensor(const char* name, const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) {
    return ::testing::AssertionFailure()
           << name << " is defined on " << (a.defined() ? "the first" : "the second") << " only";
  }
  if (a.defined() && !torch::equal(a, b)) return ::testing::AssertionFailure() << name;
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same_step(int64_t a, int64_t b) {
  if (a != b) return ::testing::AssertionFailure() << "step " << a << " != " << b;
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult every(std::initializer_list<::testing::AssertionResult> results) {
  for (const auto& r : results) {
    if (!r) return r;
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same(const torch::optim::SGDParamState& a,
                                const torch::optim::SGDParamState& b) {
  return every({same_tensor("momentum_buffer", a.momentum_buffer(), b.momentum_buffer()),
                ::testing::AssertionResult(a.momentum_buffer().defined())
                    << "no momentum_buffer: the test meant SGD with momentum"});
}

template <class AdamState>
::testing::AssertionResult same_moments(const AdamState& a, const AdamState& b) {
  return every({same_step(a.step(), b.step()), same_tensor("exp_avg", a.exp_avg(), b.exp_avg()),
                same_tensor("exp_avg_sq", a.exp_avg_sq(), b.exp_avg_sq()),
                same_tensor("max_exp_avg_sq", a.max_exp_avg_sq(), b.max_exp_avg_sq())});
}

::testing::AssertionResult same(const torch::optim::AdamParamState& a,
                                const torch::optim::AdamParamState& b) {
  return same_moments(a, b);
}

::testing::AssertionResult same(const torch::optim::AdamWParamState& a,
                                const torch::optim::AdamWParamState& b) {
  return same_moments(a, b);
}

::testing::AssertionResult same(const torch::optim::RMSpropParamState& a,
                                const torch::optim::RMSpropParamState& b) {
  return every({same_step(a.step(), b.step()),
                same_tensor("square_avg", a.square_avg(), b.square_avg()),
                same_tensor("momentum_buffer", a.momentum_buffer(), b.momentum_buffer()),
                same_tensor("grad_avg", a.grad_avg(), b.grad_avg())});
}

::testing::AssertionResult same(const torch::optim::AdagradParamState& a,
                                const torch::optim::AdagradParamState& b) {
  return every({same_step(a.step(), b.step()), same_tensor("sum", a.sum(), b.sum())});
}

using SameState = std::function<::testing::AssertionResult(const OptimizerParamState&,
                                                           const OptimizerParamState&)>;

// Both states are `State`s, equal entry by entry.
template <class State>
SameState compare_as() {
  return [](const OptimizerParamState& a, const OptimizerParamState& b) {
    const auto* sa = dynamic_cast<const State*>(&a);
    const auto* sb = dynamic_cast<const State*>(&b);
    if (sa == nullptr || sb == nullptr) {
      return ::testing::AssertionFailure() << "a state of another type";
    }
    return same(*sa, *sb);
  };
}

const OptimizerParamState* state_of(const torch::optim::Optimizer& optimizer,
                                    const at::Tensor& param) {
  const auto& state = optimizer.state();
  auto it = state.find(fulgur::compat::optimizer_state_key(param));
  return it == state.end() ? nullptr : it->second.get();
}

// Every parameter's state equal, pairwise.
void expect_same_states(const torch::optim::Optimizer& a, const TensorVector& a_params,
                        const torch::optim::Optimizer& b, const TensorVector& b_params,
                        const SameState& same_state, const std::string& when) {
  EXPECT_EQ(a.state().size(), b.state().size()) << when;
  for (size_t j = 0; j < a_params.size(); ++j) {
    const OptimizerParamState* sa = state_of(a, a_params[j]);
    const OptimizerParamState* sb = state_of(b, b_params[j]);
    ASSERT_NE(sa, nullptr) << when << ": parameter " << j << " has no state";
    ASSERT_NE(sb, nullptr) << when << ": parameter " << j << " has no state after the load";
    EXPECT_TRUE(same_state(*sa, *sb)) << when << ": parameter " << j;
  }
}

// ---- The optimizers whose states fulgur writes itself.

using Make =
    std::function<std::unique_ptr<torch::optim::Optimizer>(const TensorVector& params, double lr)>;

struct Case {
  const char* name;
  Make make;
  SameState same_state;
};

std::vector<Case> cases() {
  namespace o = torch::optim;
  return {
      {"SGD",
       [](const TensorVector& p, double lr) {
         return std::make_unique<o::SGD>(p, o::SGDOptions(lr).momentum(0.9).weight_decay(0.01));
       },
       compare_as<o::SGDParamState>()},
      {"Adam",
       [](const TensorVector& p, double lr) {
         return std::make_unique<o::Adam>(p, o::AdamOptions(lr).amsgrad(true).weight_decay(0.01));
       },
       compare_as<o::AdamParamState>()},
      {"AdamW",
       [](const TensorVector& p, double lr) {
         return std::make_unique<o::AdamW>(
             p, o::AdamWOptions(lr).betas(std::make_tuple(0.8, 0.99)).weight_decay(0.05));
       },
       compare_as<o::AdamWParamState>()},
      {"RMSprop",
       [](const TensorVector& p, double lr) {
         return std::make_unique<o::RMSprop>(
             p, o::RMSpropOptions(lr).momentum(0.9).centered(true).alpha(0.95));
       },
       compare_as<o::RMSpropParamState>()},
      {"Adagrad",
       [](const TensorVector& p, double lr) {
         return std::make_unique<o::Adagrad>(
             p, o::AdagradOptions(lr).lr_decay(0.01).initial_accumulator_value(0.1));
       },
       compare_as<o::AdagradParamState>()},
      {"FulgurAdam",
       [](const TensorVector& p, double lr) {
         return std::make_unique<fulgur::optim::Adam>(p, o::AdamOptions(lr).amsgrad(true));
       },
       compare_as<o::AdamParamState>()},
  };
}

class OptimizerStateDictOf : public ::testing::TestWithParam<Case> {};

TEST_P(OptimizerStateDictOf, IsWhatOptimizerSaveWrites) {
  const Case& c = GetParam();
  const TensorVector params = make_params(1);
  auto optimizer = c.make(params, 0.05);
  train(*optimizer, params, 2);
  const fulgur::StateDict with_kind = fulgur::optimizer_state_dict(*optimizer);
  // The optimizer it is of (Adam and AdamW have the same entries), then
  // what Optimizer::save writes.
  const std::string kind = c.name == std::string("FulgurAdam") ? "Adam" : c.name;
  EXPECT_EQ(with_kind.string("optimizer"), kind);
  fulgur::StateDict ours = with_kind;
  ours.erase("optimizer");
  const fulgur::StateDict theirs = archived([&](auto& archive) { optimizer->save(archive); });
  expect_same_structure(ours, theirs, "");
  expect_same_structure(through_bytes(ours), theirs, "(through bytes)");
  // A state per parameter, under the key param_groups give it.
  const fulgur::StateDict& group = ours.section_at("param_groups").section_at("param_groups/0");
  ASSERT_EQ(group.tensor("params/size").item<int64_t>(), 2);
  EXPECT_EQ(ours.section_at("state").size(), 2u);
  for (const char* j : {"params/0", "params/1"}) {
    EXPECT_NE(ours.section_at("state").find_section(group.string(j)), nullptr) << j;
  }
  // The optimizer keeps its state.
  EXPECT_EQ(optimizer->state().size(), 2u);
}

TEST_P(OptimizerStateDictOf, ALoadRestoresEveryStateAndTheOptions) {
  const Case& c = GetParam();
  const TensorVector params = make_params(1);
  auto original = c.make(params, 0.05);
  train(*original, params, 2);
  const fulgur::StateDict saved = through_bytes(fulgur::optimizer_state_dict(*original));

  const TensorVector fresh = copies_of(params);
  auto loaded = c.make(fresh, 0.5);  // another learning rate
  fulgur::load_optimizer_state_dict(*loaded, saved);
  expect_same_states(*original, params, *loaded, fresh, c.same_state, "after the load");
  // The options too: LibTorch's own load keeps the optimizer's.
  EXPECT_EQ(loaded->param_groups()[0].options().get_lr(), 0.05);
  expect_same_structure(options_of(*original), options_of(*loaded), "options");

  // The next step is the one the original takes.
  train(*original, params, 1);
  train(*loaded, fresh, 1);
  for (size_t j = 0; j < params.size(); ++j) {
    EXPECT_TRUE(torch::equal(params[j], fresh[j])) << "parameter " << j << " after one more step";
  }
  expect_same_states(*original, params, *loaded, fresh, c.same_state, "after one more step");
}

INSTANTIATE_TEST_SUITE_P(Optimizers, OptimizerStateDictOf, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.name);
                         });

// The dict holds Adam's state tensors themselves, not copies.
TEST(OptimizerStateDict, HoldsTheOptimizersOwnStateTensors) {
  const TensorVector params = make_params(1);
  torch::optim::Adam adam(params, torch::optim::AdamOptions(0.05).amsgrad(true));
  train(adam, params, 2);
  const fulgur::StateDict state = fulgur::optimizer_state_dict(adam);
  const fulgur::StateDict& group = state.section_at("param_groups").section_at("param_groups/0");
  for (size_t j = 0; j < params.size(); ++j) {
    const fulgur::StateDict& saved =
        state.section_at("state").section_at(group.string("params/" + std::to_string(j)));
    const auto* own = dynamic_cast<const torch::optim::AdamParamState*>(state_of(adam, params[j]));
    ASSERT_NE(own, nullptr) << "parameter " << j;
    EXPECT_EQ(saved.integer("step"), own->step()) << "parameter " << j;
    EXPECT_TRUE(saved.tensor("exp_avg").is_same(own->exp_avg())) << "parameter " << j;
    EXPECT_TRUE(saved.tensor("exp_avg_sq").is_same(own->exp_avg_sq())) << "parameter " << j;
    EXPECT_TRUE(saved.tensor("max_exp_avg_sq").is_same(own->max_exp_avg_sq())) << "parameter " << j;
  }
  EXPECT_EQ(adam.state().size(), 2u);
}

// A load replaces the optimizer's states, as PyTorch's load_state_dict
// does: a parameter the saved state holds nothing for had kept the momentum
// of the optimizer's own earlier steps.
TEST(OptimizerStateDict, ALoadReplacesEveryStateOfTheOptimizer) {
  const TensorVector params = make_params(1);
  torch::optim::Adam one(params, torch::optim::AdamOptions(0.05));
  params[0].mutable_grad() = torch::ones_like(params[0]);
  one.step();  // params[1] has no gradient: no state
  ASSERT_EQ(one.state().size(), 1u);
  const fulgur::StateDict saved = through_bytes(fulgur::optimizer_state_dict(one));
  torch::optim::Adam both(params, torch::optim::AdamOptions(0.05));
  train(both, params, 2);
  ASSERT_EQ(both.state().size(), 2u);
  fulgur::load_optimizer_state_dict(both, saved);
  EXPECT_EQ(both.state().size(), 1u);
  EXPECT_EQ(state_of(both, params[1]), nullptr);
  EXPECT_NE(state_of(both, params[0]), nullptr);
}

// A checkpoint's tensors come back on the device that saved them (rank 0's
// GPU, for every rank of a DDP run); the state loads onto each parameter's
// device. On the CPU, parameters on the "meta" device show it.
void expect_state_follows_the_parameters(const c10::Device& to) {
  const TensorVector params = make_params(1);
  torch::optim::Adam saved_from(params, torch::optim::AdamOptions(0.05).amsgrad(true));
  train(saved_from, params, 2);
  const fulgur::StateDict saved = through_bytes(fulgur::optimizer_state_dict(saved_from));
  TensorVector elsewhere;
  for (const auto& p : params) elsewhere.push_back(p.detach().to(to).requires_grad_());
  torch::optim::Adam loaded(elsewhere, torch::optim::AdamOptions(0.05).amsgrad(true));
  fulgur::load_optimizer_state_dict(loaded, saved);
  for (size_t j = 0; j < elsewhere.size(); ++j) {
    const auto* state =
        dynamic_cast<const torch::optim::AdamParamState*>(state_of(loaded, elsewhere[j]));
    ASSERT_NE(state, nullptr) << "parameter " << j;
    EXPECT_EQ(state->exp_avg().device(), to) << "parameter " << j;
    EXPECT_EQ(state->exp_avg_sq().device(), to) << "parameter " << j;
    EXPECT_EQ(state->max_exp_avg_sq().device(), to) << "parameter " << j;
  }
}

TEST(OptimizerStateDict, TheStateLoadsOntoEachParametersDevice) {
  expect_state_follows_the_parameters(c10::Device(c10::kMeta));
}

TEST(OptimizerStateDict, TheStateLoadsOntoEachParametersDevice_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  const c10::Device last(c10::kCUDA,
                         static_cast<c10::DeviceIndex>(torch::cuda::device_count() - 1));
  expect_state_follows_the_parameters(last);
}

// A state that does not fit the optimizer: a CheckpointError naming what
// differs, and the optimizer as it was (no state, its own options).
TEST(OptimizerStateDict, ALoadThatDoesNotFitNamesTheDifferenceAndChangesNothing) {
  const TensorVector params = make_params(1);
  torch::optim::Adam adam(params, torch::optim::AdamOptions(0.05));
  train(adam, params, 2);
  const fulgur::StateDict saved = through_bytes(fulgur::optimizer_state_dict(adam));
  const TensorVector fresh = copies_of(params);

  {  // Another number of parameter groups.
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(TensorVector{fresh[0]});
    groups.emplace_back(TensorVector{fresh[1]});
    torch::optim::Adam two_groups(std::move(groups), torch::optim::AdamOptions(0.5));
    EXPECT_THROWS_WITH(fulgur::CheckpointError,
                       fulgur::load_optimizer_state_dict(two_groups, saved),
                       {"the optimizer state has 1 parameter group(s); the optimizer has 2"});
    EXPECT_TRUE(two_groups.state().empty());
    for (const auto& group : two_groups.param_groups()) EXPECT_EQ(group.options().get_lr(), 0.5);
  }
  {  // Another number of parameters in the group.
    torch::optim::Adam one_param(TensorVector{fresh[0]}, torch::optim::AdamOptions(0.5));
    EXPECT_THROWS_WITH(
        fulgur::CheckpointError, fulgur::load_optimizer_state_dict(one_param, saved),
        {"parameter group 0 has 2 parameter(s) in the optimizer state and 1 in the optimizer"});
    EXPECT_TRUE(one_param.state().empty());
    EXPECT_EQ(one_param.param_groups()[0].options().get_lr(), 0.5);
  }
  {  // Another optimizer's state: SGD's options and states into Adam.
    const TensorVector sgd_params = make_params(2);
    torch::optim::SGD sgd(sgd_params, torch::optim::SGDOptions(0.1).momentum(0.9));
    train(sgd, sgd_params, 2);
    const fulgur::StateDict sgd_state = through_bytes(fulgur::optimizer_state_dict(sgd));
    torch::optim::Adam other(fresh, torch::optim::AdamOptions(0.5));
    EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::load_optimizer_state_dict(other, sgd_state),
                       {"parameter group 0 of the optimizer state has the options lr, momentum",
                        "without betas, eps, amsgrad",
                        "which this optimizer has (lr, betas, eps, weight_decay, amsgrad)",
                        "another kind of optimizer"});
    EXPECT_TRUE(other.state().empty());
    EXPECT_EQ(other.param_groups()[0].options().get_lr(), 0.5);
    // And Adam's into SGD (LibTorch's own load fails an internal assert).
    torch::optim::SGD sgd_again(copies_of(sgd_params), torch::optim::SGDOptions(0.7));
    EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::load_optimizer_state_dict(sgd_again, saved),
                       {"without momentum, dampening, nesterov", "another kind of optimizer"});
    EXPECT_TRUE(sgd_again.state().empty());
    EXPECT_EQ(sgd_again.param_groups()[0].options().get_lr(), 0.7);
  }
  {  // Adam's state into AdamW (same options, same state entries) and back.
    torch::optim::AdamW adamw(fresh, torch::optim::AdamWOptions(0.5));
    EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::load_optimizer_state_dict(adamw, saved),
                       {"the optimizer state is Adam's and the optimizer is AdamW"});
    EXPECT_TRUE(adamw.state().empty());
    EXPECT_EQ(adamw.param_groups()[0].options().get_lr(), 0.5);
    train(adamw, fresh, 1);
    const fulgur::StateDict adamw_state = through_bytes(fulgur::optimizer_state_dict(adamw));
    torch::optim::Adam adam_again(copies_of(params), torch::optim::AdamOptions(0.5));
    EXPECT_THROWS_WITH(fulgur::CheckpointError,
                       fulgur::load_optimizer_state_dict(adam_again, adamw_state),
                       {"is AdamW's and the optimizer is Adam"});
    EXPECT_TRUE(adam_again.state().empty());
    // A state saved before fulgur named its optimizer loads as it is.
    fulgur::StateDict unnamed = saved;
    unnamed.erase("optimizer");
    torch::optim::Adam adam(copies_of(params), torch::optim::AdamOptions(0.5));
    fulgur::load_optimizer_state_dict(adam, unnamed);
    EXPECT_EQ(adam.state().size(), 2u);
  }
  {  // A state entry of another kind than the optimizer's (a damaged file).
    fulgur::StateDict damaged = saved;
    fulgur::StateDict& states = damaged.section("state");
    const std::string first = states.keys().front();
    states.section(first).set("exp_avg", int64_t{3});
    torch::optim::Adam other(fresh, torch::optim::AdamOptions(0.5));
    EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::load_optimizer_state_dict(other, damaged),
                       {"state/" + first + "/exp_avg\" is an integer (3) where a tensor"});
    EXPECT_TRUE(other.state().empty());
  }
}

// LBFGS (a state fulgur does not write itself) goes through its own save
// and load; the options are restored. Not stepped: LibTorch 1.13 cannot
// save an LBFGS that has stepped (its state's `al` is undefined).
TEST(OptimizerStateDict, LBFGSRoundTripsThroughItsOwnSaveWithItsOptions) {
  const TensorVector params = make_params(1);
  torch::optim::LBFGS lbfgs(params, torch::optim::LBFGSOptions(0.05).history_size(7).max_iter(3));
  const fulgur::StateDict state = fulgur::optimizer_state_dict(lbfgs);
  expect_same_structure(state, archived([&](auto& archive) { lbfgs.save(archive); }), "");
  const TensorVector fresh = copies_of(params);
  torch::optim::LBFGS loaded(fresh, torch::optim::LBFGSOptions(0.5));
  EXPECT_NO_THROW(fulgur::load_optimizer_state_dict(loaded, through_bytes(state)));
  const auto& options =
      static_cast<const torch::optim::LBFGSOptions&>(loaded.param_groups()[0].options());
  EXPECT_EQ(options.lr(), 0.05);
  EXPECT_EQ(options.history_size(), 7);
  EXPECT_EQ(options.max_iter(), 3);
  expect_same_structure(options_of(lbfgs), options_of(loaded), "options");
}

// ---- An optimizer of one's own, with a state LibTorch's optimizers do not
// have: plain SGD that counts each parameter's steps and sums its gradients.

struct CountingState : torch::optim::OptimizerCloneableParamState<CountingState> {
  int64_t count = 0;
  at::Tensor total;

  void serialize(torch::serialize::OutputArchive& archive) const override {
    archive.write("count", c10::IValue(count));
    archive.write("total", c10::IValue(total));
  }
  void serialize(torch::serialize::InputArchive& archive) override {
    c10::IValue value;
    archive.read("count", value);
    count = value.toInt();
    archive.read("total", value);
    total = value.toTensor();
  }
};

class CountingSGD : public torch::optim::Optimizer {
 public:
  CountingSGD(const TensorVector& params, double lr)
      : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(params)},
                                std::make_unique<torch::optim::SGDOptions>(lr)) {}

  at::Tensor step(LossClosure closure = nullptr) override {
    (void)closure;
    torch::NoGradGuard no_grad;
    for (auto& group : param_groups()) {
      const double lr = static_cast<torch::optim::SGDOptions&>(group.options()).lr();
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& slot = state()[fulgur::compat::optimizer_state_key(p)];
        if (!slot) {
          auto fresh = std::make_unique<CountingState>();
          fresh->total = torch::zeros_like(p);
          slot = std::move(fresh);
        }
        auto& s = static_cast<CountingState&>(*slot);
        s.count += 1;
        s.total.add_(p.grad());
        p.add_(p.grad(), -lr);
      }
    }
    return {};
  }
  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<CountingState, torch::optim::SGDOptions>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<CountingState, torch::optim::SGDOptions>(archive, *this);
  }
};

TEST(OptimizerStateDict, AnOptimizerOfOnesOwnRoundTripsThroughItsOwnSave) {
  const TensorVector params = make_params(1);
  CountingSGD original(params, 0.05);
  train(original, params, 2);
  const fulgur::StateDict state = fulgur::optimizer_state_dict(original);
  expect_same_structure(state, archived([&](auto& archive) { original.save(archive); }), "");
  const TensorVector fresh = copies_of(params);
  CountingSGD loaded(fresh, 0.5);
  fulgur::load_optimizer_state_dict(loaded, through_bytes(state));
  EXPECT_EQ(loaded.param_groups()[0].options().get_lr(), 0.05);
  for (size_t j = 0; j < params.size(); ++j) {
    const auto* a = dynamic_cast<const CountingState*>(state_of(original, params[j]));
    const auto* b = dynamic_cast<const CountingState*>(state_of(loaded, fresh[j]));
    ASSERT_NE(a, nullptr) << "parameter " << j;
    ASSERT_NE(b, nullptr) << "parameter " << j << " has no state after the load";
    EXPECT_EQ(b->count, 2) << "parameter " << j;
    EXPECT_TRUE(torch::equal(a->total, b->total)) << "parameter " << j;
  }
  train(original, params, 1);
  train(loaded, fresh, 1);
  for (size_t j = 0; j < params.size(); ++j) {
    EXPECT_TRUE(torch::equal(params[j], fresh[j])) << "parameter " << j << " after one more step";
  }
}

// Its state lands on its parameters' device (a checkpoint's tensors are
// read into host memory; its own load keeps them where the archive has
// them, and its step would mix a GPU's gradients with host tensors). The
// meta device stands in for a GPU here; the _CUDA case runs on one.
void expect_own_state_follows_the_parameters(const c10::Device& to) {
  const TensorVector params = make_params(1);
  CountingSGD original(params, 0.05);
  train(original, params, 2);
  const fulgur::StateDict state = through_bytes(fulgur::optimizer_state_dict(original));
  TensorVector elsewhere;
  for (const auto& p : params) elsewhere.push_back(p.detach().to(to).requires_grad_());
  CountingSGD loaded(elsewhere, 0.5);
  fulgur::load_optimizer_state_dict(loaded, state);
  for (size_t j = 0; j < elsewhere.size(); ++j) {
    const auto* s = dynamic_cast<const CountingState*>(state_of(loaded, elsewhere[j]));
    ASSERT_NE(s, nullptr) << "parameter " << j;
    EXPECT_EQ(s->total.device(), to) << "parameter " << j;
  }
}

TEST(OptimizerStateDict, AnOptimizerOfOnesOwnLoadsItsStateOntoItsParametersDevice) {
  expect_own_state_follows_the_parameters(c10::Device(c10::kMeta));
}

TEST(OptimizerStateDict, AnOptimizerOfOnesOwnLoadsItsStateOntoItsParametersDevice_CUDA) {
  FULGUR_SKIP_UNLESS_CUDA(1);
  expect_own_state_follows_the_parameters(c10::Device(c10::kCUDA, 0));
}

}  // namespace
