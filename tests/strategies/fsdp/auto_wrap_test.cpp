// FSDPOptions::auto_wrap_min_params in one process (SequentialAutoWrap):
// which layers of which torch::nn::Sequential become units, under which
// names; the module's names, parameters and forward do not change; the
// hooks a strategy attaches see each wrapped layer's forward; the
// Sequentials get their own entries back. Sharding on real ranks:
// tests/distributed/fsdp_test.cpp.
#include "strategies/fsdp/auto_wrap.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "fulgur/core/errors.h"
#include "support/test_support.h"
#include "support/unit_hooks_recorder.h"

namespace {

using WrapCounter = fulgur::test::UnitHooksRecorder;

// A Sequential inside a module inside a Sequential (LibTorch cannot hold a
// Sequential in a Sequential directly).
struct WrapBlockImpl : torch::nn::Module {
  torch::nn::Sequential inner{nullptr};
  WrapBlockImpl() {
    inner = register_module("inner", torch::nn::Sequential(torch::nn::Linear(64, 64)));
  }
  at::Tensor forward(at::Tensor x) { return inner->forward(x); }
};
TORCH_MODULE(WrapBlock);

// body: Linear 8->64 (576 parameters), ReLU, a block holding
// Sequential(Linear 64->64 (4160)), Linear 64->2 (130), a LayerNorm of 2
// (4); head: a typed member Linear 2->300 (900), which no Sequential holds.
struct WrapNet : torch::nn::Module {
  torch::nn::Sequential body{nullptr};
  torch::nn::Linear head{nullptr};
  WrapNet() {
    body = register_module(
        "body", torch::nn::Sequential(torch::nn::Linear(8, 64), torch::nn::ReLU(), WrapBlock(),
                                      torch::nn::Linear(64, 2),
                                      torch::nn::LayerNorm(torch::nn::LayerNormOptions({2}))));
    head = register_module("head", torch::nn::Linear(2, 300));
  }
  at::Tensor forward(const at::Tensor& x) { return head(body->forward(x)); }
};

std::vector<std::string> wrapped_net_names(const torch::nn::Module& m) {
  std::vector<std::string> names;
  for (const auto& p : m.named_parameters()) names.push_back(p.key());
  return names;
}

TEST(SequentialAutoWrap, WrapsTheLargeLayersOfEverySequentialUnderTheirNames) {
  torch::manual_seed(0);
  WrapNet net;
  const auto names = wrapped_net_names(net);
  const at::Tensor x = torch::randn({5, 8});
  const at::Tensor before = net.forward(x);
  const auto first = net.body->ptr(0);
  {
    fulgur::detail::SequentialAutoWrap wrap(net, 200);
    ASSERT_EQ(wrap.layers().size(), 2u);
    EXPECT_EQ(wrap.layers()[0].name, "body.0");
    EXPECT_EQ(wrap.layers()[0].type, "torch::nn::Linear");
    EXPECT_EQ(wrap.layers()[0].parameters, 576);
    EXPECT_EQ(wrap.layers()[1].name, "body.2.inner.0");
    EXPECT_EQ(wrap.layers()[1].parameters, 4160);
    EXPECT_EQ(wrap.describe(),
              "body.0 (torch::nn::Linear, 576 parameters), body.2.inner.0 (torch::nn::Linear, "
              "4160 parameters)");
    // The entries run the units; the names and tensors are the layers' own.
    EXPECT_NE(dynamic_cast<fulgur::nn::FSDPUnitBase*>(net.body->ptr(0).get()), nullptr);
    EXPECT_EQ(dynamic_cast<fulgur::nn::FSDPUnitBase*>(net.body->ptr(3).get()), nullptr);
    EXPECT_EQ(wrapped_net_names(net), names);
    EXPECT_TRUE(wrap.layers()[0].unit->parameters()[0].is_same(first->parameters()[0]));
    // No hooks: the same forward.
    EXPECT_TRUE(torch::equal(net.forward(x), before));
    // Hooks see each forward of the layer, and its output.
    auto counter = std::make_shared<WrapCounter>();
    wrap.layers()[1].unit->set_unit_hooks(counter);
    EXPECT_TRUE(torch::equal(net.forward(x), before));
    net.forward(x);
    EXPECT_EQ(counter->before, 2);
    EXPECT_EQ(counter->after, 2);
    EXPECT_EQ(counter->outputs, (std::vector<size_t>{1, 1}));
    wrap.layers()[1].unit->set_unit_hooks(nullptr);
  }
  // Put back: the Sequential runs its own entries again.
  EXPECT_EQ(net.body->ptr(0).get(), first.get());
  EXPECT_EQ(wrapped_net_names(net), names);
  EXPECT_TRUE(torch::equal(net.forward(x), before));
}

TEST(SequentialAutoWrap, AThresholdNoLayerReachesWrapsNothingAndALowOneWrapsEveryLayer) {
  WrapNet net;
  EXPECT_TRUE(fulgur::detail::SequentialAutoWrap(net, 5000).layers().empty());
  // Every parameterized entry of a Sequential, the LayerNorm too; never the
  // typed member, nor the ReLU (no parameters), nor the block (not a layer
  // type; the layer of its Sequential is wrapped instead).
  fulgur::detail::SequentialAutoWrap wrap(net, 1);
  std::vector<std::string> wrapped;
  for (const auto& layer : wrap.layers()) wrapped.push_back(layer.name);
  EXPECT_EQ(wrapped, (std::vector<std::string>{"body.0", "body.3", "body.4", "body.2.inner.0"}));
}

// A layer that is an entry of two Sequentials (twice of one) gets one unit,
// which every entry runs; a Sequential a declared unit holds is searched
// too; every entry is put back.
TEST(SequentialAutoWrap, ASharedLayerIsOneUnitEverywhereAndDeclaredUnitsAreSearched) {
  struct Shared : torch::nn::Module {
    torch::nn::Linear shared{nullptr};
    torch::nn::Sequential a{nullptr}, b{nullptr};
    fulgur::nn::FSDPUnit<torch::nn::Sequential> held{nullptr};
    Shared() {
      shared = torch::nn::Linear(4, 4);
      a = register_module("a", torch::nn::Sequential(shared, torch::nn::Tanh(), shared));
      b = register_module("b", torch::nn::Sequential(shared));
      held = register_module("held", fulgur::nn::FSDPUnit(torch::nn::Sequential(
                                          torch::nn::Linear(4, 50), torch::nn::Linear(50, 1))));
    }
  } net;
  const at::Tensor x = torch::randn({3, 4});
  const at::Tensor before = net.held(net.b->forward(net.a->forward(x)));
  {
    fulgur::detail::SequentialAutoWrap wrap(net, 10);
    std::vector<std::string> wrapped;
    for (const auto& layer : wrap.layers()) wrapped.push_back(layer.name);
    EXPECT_EQ(wrapped, (std::vector<std::string>{"a.0", "held.0", "held.1"}));
    // Every entry of the shared layer runs the one unit.
    EXPECT_EQ(net.a->ptr(0).get(), wrap.layers()[0].unit.get());
    EXPECT_EQ(net.a->ptr(2).get(), wrap.layers()[0].unit.get());
    EXPECT_EQ(net.b->ptr(0).get(), wrap.layers()[0].unit.get());
    EXPECT_EQ(wrap.layers()[0].unit->held_module().get(), net.shared.ptr().get());
    auto counter = std::make_shared<WrapCounter>();
    wrap.layers()[0].unit->set_unit_hooks(counter);
    EXPECT_TRUE(torch::equal(net.held(net.b->forward(net.a->forward(x))), before));
    EXPECT_EQ(counter->before, 3);
    wrap.layers()[0].unit->set_unit_hooks(nullptr);
  }
  EXPECT_EQ(net.a->ptr(0).get(), net.shared.ptr().get());
  EXPECT_EQ(net.a->ptr(2).get(), net.shared.ptr().get());
  EXPECT_EQ(net.b->ptr(0).get(), net.shared.ptr().get());
  EXPECT_EQ(net.held->module->ptr(1)->name(), "torch::nn::LinearImpl");
  EXPECT_TRUE(torch::equal(net.held(net.b->forward(net.a->forward(x))), before));
}

TEST(SequentialAutoWrap, ANonPositiveThresholdIsAConfigError) {
  WrapNet net;
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::detail::SequentialAutoWrap(net, -5),
                     {"auto_wrap_min_params is -5", "positive"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::detail::SequentialAutoWrap(net, 0),
                     {"auto_wrap_min_params is 0"});
}

}  // namespace
