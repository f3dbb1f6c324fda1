// module_state_dict / load_module_state_dict (fulgur/nn/state_dict.h): the
// dict has the layout nn::Module::save writes (an entry per parameter and
// buffer, buffers marked, a section per serializable submodule; none for a
// Functional), holds the module's own tensors (no copy), and goes both ways
// with LibTorch's archives; a load copies in place and is strict, checking
// everything before it changes anything.
#include "fulgur/nn/state_dict.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace fulgur_nn_state_dict_test {
namespace {

using fulgur::test::archived;
using Keys = std::vector<std::string>;

// Parameters and buffers of its own, a Sequential with a Linear, a
// BatchNorm1d (buffers) and a Functional (not serializable), and a Linear.
struct Net : torch::nn::Module {
  Net() {
    body = register_module(
        "body",
        torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4),
                              torch::nn::Functional([](at::Tensor x) { return torch::relu(x); })));
    head = register_module("head", torch::nn::Linear(4, 2));
    scale = register_parameter("scale", torch::ones({1}));
    steps = register_buffer("steps", torch::zeros({1}, torch::kLong));
  }
  at::Tensor forward(const at::Tensor& x) { return head->forward(body->forward(x)) * scale; }

  torch::nn::Sequential body{nullptr};
  torch::nn::Linear head{nullptr};
  at::Tensor scale, steps;
};

// A Net with weights of `seed` and running statistics of a forward pass.
std::shared_ptr<Net> trained_net(uint64_t seed) {
  torch::manual_seed(seed);
  auto net = std::make_shared<Net>();
  net->train();
  net->forward(torch::randn({8, 3}));
  {
    torch::NoGradGuard no_grad;
    net->steps.fill_(static_cast<int64_t>(seed));
  }
  return net;
}

// Every parameter and buffer, by its dotted name.
std::map<std::string, at::Tensor> tensors_of(const torch::nn::Module& module) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters()) out.emplace(p.key(), p.value());
  for (const auto& b : module.named_buffers()) out.emplace(b.key(), b.value());
  return out;
}

// Copies of them.
std::map<std::string, at::Tensor> clones_of(const torch::nn::Module& module) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, t] : tensors_of(module)) out.emplace(name, t.detach().clone());
  return out;
}

// The tensor under a dotted name ("body.1.running_mean").
at::Tensor tensor_at(const fulgur::StateDict& state, const std::string& dotted) {
  const auto dot = dotted.find('.');
  if (dot == std::string::npos) return state.tensor(dotted);
  return tensor_at(state.section_at(dotted.substr(0, dot)), dotted.substr(dot + 1));
}

// The same keys in the same order, recursively, sections where sections
// are, and equal tensors of the same dtype and shape.
void expect_same_layout(const fulgur::StateDict& a, const fulgur::StateDict& b,
                        const std::string& where) {
  ASSERT_EQ(a.keys(), b.keys()) << where;
  for (const auto& key : a.keys()) {
    const std::string here = where.empty() ? key : where + "." + key;
    if (const fulgur::StateDict* sa = a.find_section(key)) {
      const fulgur::StateDict* sb = b.find_section(key);
      ASSERT_NE(sb, nullptr) << here << " is a section on one side only";
      expect_same_layout(*sa, *sb, here);
      continue;
    }
    ASSERT_EQ(b.find_section(key), nullptr) << here << " is a section on one side only";
    const at::Tensor ta = a.tensor(key), tb = b.tensor(key);
    EXPECT_EQ(ta.scalar_type(), tb.scalar_type()) << here;
    EXPECT_EQ(ta.sizes(), tb.sizes()) << here;
    EXPECT_TRUE(torch::equal(ta, tb)) << here;
  }
}

TEST(ModuleStateDict, HasTheLayoutOfModuleSave) {
  const auto net = trained_net(1);
  const fulgur::StateDict state = fulgur::module_state_dict(*net);
  EXPECT_EQ(state.keys(), (Keys{"scale", "steps", "body", "head"}));
  EXPECT_EQ(state.section_at("body").keys(), (Keys{"0", "1"}));  // no entry for the Functional
  EXPECT_EQ(state.section_at("body").section_at("1").keys(),
            (Keys{"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}));
  EXPECT_EQ(state.section_at("head").keys(), (Keys{"weight", "bias"}));
  // What nn::Module::save writes, read back.
  const fulgur::StateDict saved = archived([&](auto& archive) { net->save(archive); });
  expect_same_layout(state, saved, "");
  // And what the dict writes is what nn::Module::save wrote.
  expect_same_layout(fulgur::from_bytes(fulgur::to_bytes(state)), saved, "");
}

TEST(ModuleStateDict, MarksBuffers) {
  const auto net = trained_net(1);
  const fulgur::StateDict state = fulgur::module_state_dict(*net);
  const fulgur::StateDict& bn = state.section_at("body").section_at("1");
  EXPECT_TRUE(bn.is_buffer("running_mean"));
  EXPECT_TRUE(bn.is_buffer("running_var"));
  EXPECT_TRUE(bn.is_buffer("num_batches_tracked"));
  EXPECT_FALSE(bn.is_buffer("weight"));
  EXPECT_FALSE(bn.is_buffer("bias"));
  EXPECT_TRUE(state.is_buffer("steps"));
  EXPECT_FALSE(state.is_buffer("scale"));
  EXPECT_FALSE(state.section_at("head").is_buffer("weight"));
}

TEST(ModuleStateDict, HoldsTheModulesOwnTensors) {
  const auto net = trained_net(1);
  const fulgur::StateDict state = fulgur::module_state_dict(*net);
  size_t in_dict = 0;
  state.for_each_tensor([&in_dict](const at::Tensor&) { ++in_dict; });
  const auto tensors = tensors_of(*net);
  EXPECT_EQ(in_dict, tensors.size());
  for (const auto& [name, t] : tensors) {
    const at::Tensor held = tensor_at(state, name);
    EXPECT_TRUE(held.is_same(t)) << name << " was copied";
    EXPECT_EQ(held.data_ptr(), t.data_ptr()) << name;
  }
  // A change to the module shows in the dict.
  {
    torch::NoGradGuard no_grad;
    net->head->weight.add_(1);
  }
  EXPECT_TRUE(torch::equal(state.section_at("head").tensor("weight"), net->head->weight));
}

TEST(ModuleStateDict, LoadCopiesInPlace) {
  const auto source = trained_net(1);
  const auto target = trained_net(2);
  const auto before = tensors_of(*target);
  // From the source's dict, and from one read back from bytes.
  for (const bool through_bytes : {false, true}) {
    fulgur::StateDict state = fulgur::module_state_dict(*source);
    if (through_bytes) {
      {
        torch::NoGradGuard no_grad;
        for (const auto& [name, t] : tensors_of(*target)) t.zero_();
      }
      state = fulgur::from_bytes(fulgur::to_bytes(state));
    }
    fulgur::load_module_state_dict(*target, state);
    const auto after = tensors_of(*target);
    ASSERT_EQ(after.size(), before.size());
    for (const auto& [name, t] : after) {
      EXPECT_EQ(t.unsafeGetTensorImpl(), before.at(name).unsafeGetTensorImpl())
          << name << " was replaced, not copied into";
      EXPECT_FALSE(t.is_same(tensor_at(state, name))) << name << " now is the dict's tensor";
      EXPECT_TRUE(torch::equal(t, tensors_of(*source).at(name)))
          << name << (through_bytes ? " (through bytes)" : "");
    }
  }
  EXPECT_TRUE(fulgur::test::parameters_equal(*source, *target));
  EXPECT_TRUE(target->scale.requires_grad());
  // LibTorch's own load reads what the dict writes.
  auto other = trained_net(3);
  torch::serialize::InputArchive archive;
  std::istringstream bytes(fulgur::to_bytes(fulgur::module_state_dict(*source)));
  archive.load_from(bytes);
  other->load(archive);
  for (const auto& [name, t] : tensors_of(*other)) {
    EXPECT_TRUE(torch::equal(t, tensors_of(*source).at(name))) << name << " (nn::Module::load)";
  }
}

// Each way a state may not fit: a CheckpointError naming the difference,
// and not one tensor of the module changed (everything is checked before
// the first copy; the differences are in the last submodules, after
// tensors that fit).
TEST(ModuleStateDict, LoadIsStrictAndChangesNothingWhenItFails) {
  const auto source = trained_net(1);
  const auto target = trained_net(2);
  const fulgur::StateDict good = fulgur::module_state_dict(*source);
  const auto before = clones_of(*target);
  auto expect_unchanged = [&](const std::string& what) {
    for (const auto& [name, t] : tensors_of(*target)) {
      EXPECT_TRUE(torch::equal(t, before.at(name))) << name << " changed by " << what;
    }
  };

  {  // A parameter missing.
    fulgur::StateDict bad = good;
    bad.section("head").erase("weight");
    EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::load_module_state_dict(*target, bad),
                       {"parameter \"head.weight\" is missing from the checkpoint"});
    expect_unchanged("a missing parameter");
  }
  {  // A buffer missing.
    fulgur::StateDict bad = good;
    bad.section("body").section("1").erase("running_var");
    EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::load_module_state_dict(*target, bad),
                       {"buffer \"body.1.running_var\" is missing from the checkpoint"});
    expect_unchanged("a missing buffer");
  }
  {  // A value where a parameter should be.
    fulgur::StateDict bad = good;
    bad.section("head").set("bias", int64_t{1});
    EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::load_module_state_dict(*target, bad),
                       {"parameter \"head.bias\" is missing from the checkpoint"});
    expect_unchanged("a value for a parameter");
  }
  {  // Another shape.
    fulgur::StateDict bad = good;
    bad.section("head").set("weight", torch::zeros({2, 5}));
    EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::load_module_state_dict(*target, bad),
                       {"parameter \"head.weight\" is Float[2, 4] in the module but Float[2, 5] "
                        "in the checkpoint"});
    expect_unchanged("a wrong shape");
  }
  {  // Another dtype.
    fulgur::StateDict bad = good;
    bad.section("head").set("bias", torch::zeros({2}, torch::kDouble));
    EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::load_module_state_dict(*target, bad),
                       {"parameter \"head.bias\" is Float[2] in the module but Double[2] in the "
                        "checkpoint"});
    expect_unchanged("a wrong dtype");
  }
  {  // A buffer of another dtype.
    fulgur::StateDict bad = good;
    bad.section("body").section("1").set_buffer("num_batches_tracked",
                                                torch::scalar_tensor(0.0, torch::kFloat));
    EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::load_module_state_dict(*target, bad),
                       {"buffer \"body.1.num_batches_tracked\" is Long[] in the module but "
                        "Float[] in the checkpoint"});
    expect_unchanged("a buffer's wrong dtype");
  }
  {  // An entry the module does not have, in a submodule and at the top.
    fulgur::StateDict bad = good;
    bad.section("head").set("extra", torch::ones({2}));
    EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::load_module_state_dict(*target, bad),
                       {"the checkpoint has \"head.extra\", which the module does not"});
    expect_unchanged("an extra key");
    fulgur::StateDict extra_section = good;
    extra_section.section("decoder").set("weight", torch::ones({2}));
    EXPECT_THROWS_WITH(fulgur::CheckpointError,
                       fulgur::load_module_state_dict(*target, extra_section),
                       {"the checkpoint has \"decoder\", which the module does not"});
    expect_unchanged("an extra submodule");
  }
  {  // A submodule missing.
    fulgur::StateDict bad = good;
    bad.erase("head");
    EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::load_module_state_dict(*target, bad),
                       {"submodule \"head\" is missing from the checkpoint"});
    expect_unchanged("a missing submodule");
  }
  {  // A nested submodule missing.
    fulgur::StateDict bad = good;
    bad.section("body").erase("1");
    EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::load_module_state_dict(*target, bad),
                       {"submodule \"body.1\" is missing from the checkpoint"});
    expect_unchanged("a missing nested submodule");
  }
  // The good one loads.
  fulgur::load_module_state_dict(*target, good);
  for (const auto& [name, t] : tensors_of(*target)) {
    EXPECT_TRUE(torch::equal(t, tensors_of(*source).at(name))) << name;
  }
}

}  // namespace
}  // namespace fulgur_nn_state_dict_test
