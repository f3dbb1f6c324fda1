// fulgur::nn::FSDPUnit in one process: the module it holds, under the same
// names, with the same forward (a unit no strategy attached costs nothing
// and changes nothing); the hooks a strategy attaches see every forward and
// the tensors it returned (a tensor, a vector, a tuple; none for another
// result). Sharding on real ranks: tests/distributed/fsdp_test.cpp.
#include "fulgur/nn/fsdp_unit.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>
#include <tuple>
#include <vector>

#include "support/test_support.h"
#include "support/unit_hooks_recorder.h"

namespace {

using fulgur::test::UnitHooksRecorder;

struct PairImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  PairImpl() { fc = register_module("fc", torch::nn::Linear(3, 2)); }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x) { return {fc(x), fc(x) * 2}; }
};
TORCH_MODULE(Pair);

struct ManyImpl : torch::nn::Module {
  std::vector<at::Tensor> forward(const at::Tensor& x) { return {x, x + 1, x + 2}; }
  int64_t count(const at::Tensor& x) { return x.numel(); }
};
TORCH_MODULE(Many);

TEST(FSDPUnit, HoldsTheModuleUnderTheSameNamesAndForward) {
  torch::nn::Sequential plain;
  auto linear = torch::nn::Linear(4, 3);
  auto unit = fulgur::nn::FSDPUnit(linear);
  static_assert(std::is_same_v<decltype(unit), fulgur::nn::FSDPUnit<torch::nn::Linear>>);
  struct Net : torch::nn::Module {
    fulgur::nn::FSDPUnit<torch::nn::Linear> fc{nullptr};
  } net;
  net.fc = net.register_module("fc", unit);
  std::vector<std::string> names;
  for (const auto& p : net.named_parameters()) names.push_back(p.key());
  EXPECT_EQ(names, (std::vector<std::string>{"fc.weight", "fc.bias"}));
  // The same tensors, not copies: an optimizer or a checkpoint of either sees both.
  EXPECT_TRUE(net.fc->module->weight.is_same(net.named_parameters()["fc.weight"]));
  const at::Tensor x = torch::randn({5, 4});
  EXPECT_TRUE(torch::equal(net.fc(x), linear(x)));
  EXPECT_TRUE(torch::equal(net.fc->forward(x), linear->forward(x)));
  // Evaluation mode reaches the held module itself.
  net.eval();
  EXPECT_FALSE(linear->is_training());
  net.train();
  EXPECT_TRUE(linear->is_training());
  std::ostringstream printed;
  net.fc->pretty_print(printed);
  EXPECT_EQ(printed.str(),
            "fulgur::nn::FSDPUnit(torch::nn::Linear(in_features=4, out_features=3, "
            "bias=true))");
}

TEST(FSDPUnit, NestedChildrenAndBuffersKeepTheirNames) {
  auto block = torch::nn::Sequential(torch::nn::Linear(2, 2), torch::nn::BatchNorm1d(2));
  auto unit = fulgur::nn::FSDPUnit(block);
  std::vector<std::string> names;
  for (const auto& b : unit->named_buffers()) names.push_back(b.key());
  EXPECT_EQ(names,
            (std::vector<std::string>{"1.running_mean", "1.running_var", "1.num_batches_tracked"}));
  EXPECT_EQ(unit->parameters().size(), 4u);
  EXPECT_EQ(unit(torch::randn({3, 2})).sizes(), (std::vector<int64_t>{3, 2}));
}

TEST(FSDPUnit, AttachedHooksSeeEveryForwardAndItsTensors) {
  auto recorder = std::make_shared<UnitHooksRecorder>();
  auto pair = fulgur::nn::FSDPUnit(Pair());
  auto many = fulgur::nn::FSDPUnit(Many());
  pair->set_unit_hooks(recorder);
  many->set_unit_hooks(recorder);
  EXPECT_TRUE(pair->has_unit_hooks());
  auto [a, b] = pair(torch::randn({2, 3}));
  EXPECT_TRUE(torch::allclose(b, a * 2));
  EXPECT_EQ(many(torch::zeros({1})).size(), 3u);
  EXPECT_EQ(recorder->before, 2);
  EXPECT_EQ(recorder->after, 2);
  EXPECT_EQ(recorder->outputs, (std::vector<size_t>{2, 3}));
  pair->set_unit_hooks(nullptr);
  pair(torch::randn({2, 3}));
  EXPECT_EQ(recorder->before, 2);
}

TEST(FSDPUnit, AnEmptyHolderIsRefused) {
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::nn::FSDPUnit(torch::nn::Linear(nullptr)),
                     {"the module to hold is empty", "FSDPUnit(torch::nn::Linear(784, 128))"});
}

}  // namespace
