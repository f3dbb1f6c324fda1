// Sharded parameters on 2 and 3 ranks (threads, Gloo over 127.0.0.1): after
// steps of SGD with momentum and of Adam on the shards, every rank's model
// equals one process stepping the whole model with the mean gradient, DDP's
// rule included (a parameter some rank has no gradient for counts zeros
// there; one no rank has a gradient for is skipped); uneven shards (sizes
// not divisible by the world), and the errors.
#include "fulgur/distributed/sharded_parameters.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

// The same values in every rank's thread (the random generator is shared
// between the threads, so its draws are not): scale * sin(k * freq + phase),
// a phase of its own for each parameter.
void fill_the_same_everywhere(torch::nn::Module& module, double freq, double scale) {
  torch::NoGradGuard no_grad;
  double phase = 0;
  for (auto& p : module.parameters()) {
    p.copy_(torch::sin(torch::arange(p.numel(), torch::kFloat) * freq + (phase += 1.0))
                .reshape(p.sizes()) *
            scale);
  }
}

// 35 + 7 + 21 + 3 + 4 + 2 elements: none but one divisible by 2 and 3 both.
struct Net : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, sometimes{nullptr};
  Net() {
    a = register_module("a", torch::nn::Linear(5, 7));
    b = register_module("b", torch::nn::Linear(7, 3));
    sometimes = register_module("sometimes", torch::nn::Linear(2, 2));
    fill_the_same_everywhere(*this, 0.7, 0.5);
  }
  // Rank `rank`'s loss at `step`: `sometimes` is used by rank 0 on even
  // steps only (odd steps: no rank has a gradient for it).
  at::Tensor loss(int step, int rank) {
    const at::Tensor x =
        torch::sin(torch::arange(20, torch::kFloat).reshape({4, 5}) * 0.3 + step + 10.0 * rank);
    at::Tensor l = b(torch::relu(a(x))).pow(2).mean();
    if (rank == 0 && step % 2 == 0) l = l + 0.1 * sometimes(x.narrow(1, 0, 2)).sum();
    return l;
  }
};

using MakeOptimizer =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

std::unique_ptr<torch::optim::Optimizer> sgd(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}
std::unique_ptr<torch::optim::Optimizer> adam(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
}

void release_grads(const std::vector<at::Tensor>& params) {
  for (auto p : params) p.mutable_grad().reset();
}

constexpr int kSteps = 6;

// One process, the whole model, the mean of the ranks' gradients.
std::vector<at::Tensor> reference(int world, const MakeOptimizer& make) {
  Net net;
  auto opt = make(net.parameters());
  for (int step = 0; step < kSteps; ++step) {
    release_grads(net.parameters());
    for (int r = 0; r < world; ++r) (net.loss(step, r) / world).backward();
    opt->step();
  }
  return net.parameters();
}

void expect_sharded_equals_reference(int world, const MakeOptimizer& make,
                                     bool share_storage = false) {
  const auto expected = reference(world, make);
  std::vector<std::vector<at::Tensor>> got(static_cast<size_t>(world));
  fulgur::test::on_ranks(world, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    Net net;
    fulgur::ShardedParameters sharded(net.parameters(), group, share_storage);
    auto opt = make(sharded.shards());
    for (int step = 0; step < kSteps; ++step) {
      release_grads(sharded.shards());
      net.loss(step, rank).backward();
      sharded.reduce_scatter_gradients();
      // No rank had a gradient for `sometimes` on odd steps: nothing to step.
      const bool used = step % 2 == 0;
      for (size_t i = 4; i < 6; ++i) EXPECT_EQ(sharded.shards()[i].grad().defined(), used);
      opt->step();
      sharded.all_gather_parameters();
    }
    for (const auto& p : net.parameters()) EXPECT_FALSE(p.grad().defined());  // released
    got[static_cast<size_t>(rank)] = net.parameters();
  });
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_TRUE(torch::allclose(got[static_cast<size_t>(r)][i], expected[i], 1e-5, 1e-6))
          << "rank " << r << " of " << world << ", parameter " << i
          << (share_storage ? " (share_storage)" : "") << ": "
          << (got[static_cast<size_t>(r)][i] - expected[i]).abs().max().item<float>();
    }
  }
}

TEST(ShardedParameters, SgdWithMomentumOnTwoAndThreeRanksEqualsOneProcess) {
  expect_sharded_equals_reference(2, sgd);
  expect_sharded_equals_reference(3, sgd);
}

TEST(ShardedParameters, AdamOnTwoAndThreeRanksEqualsOneProcess) {
  expect_sharded_equals_reference(2, adam);
  expect_sharded_equals_reference(3, adam);
}

// ZeRO 2's layout: the same steps with shards that are views of the whole
// parameters where no padding is needed.
TEST(ShardedParameters, SharedStorageShardsStepAsCopiesDo) {
  expect_sharded_equals_reference(2, sgd, /*share_storage=*/true);
  expect_sharded_equals_reference(3, adam, /*share_storage=*/true);
}

// A shared shard is the parameter's own chunk (no memory of its own, a step
// on it writes the parameter); one needing padding is a copy; neither kind's
// parameter can be released.
TEST(ShardedParameters, SharedStorageShardsAreViewsOfTheirParameters) {
  std::vector<char> shared[3];
  int64_t shard_bytes[3] = {0, 0, 0};
  bool wrote[3] = {false, false, false};
  std::string release_error[3];
  fulgur::test::on_ranks(3, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    Net net;
    fulgur::ShardedParameters sharded(net.parameters(), group, /*share_storage=*/true);
    for (size_t i = 0; i < net.parameters().size(); ++i)
      shared[rank].push_back(sharded.shares_storage(i) ? 1 : 0);
    shard_bytes[rank] = sharded.shard_bytes();
    {
      torch::NoGradGuard no_grad;
      sharded.shards()[0].fill_(7.0f);  // a.weight: 35 elements, chunks of 12
      wrote[rank] = net.parameters()[0].reshape({-1}).narrow(0, 12 * rank, 1).item<float>() == 7.0f;
    }
    try {
      sharded.release_parameters({0});
    } catch (const fulgur::ConfigError& e) {
      release_error[rank] = e.what();
    }
  });
  // Chunks 12, 3, 7, 1, 2, 1 of 35, 7, 21, 3, 4, 2 elements: rank 2's chunks
  // of a.weight (24..36), a.bias (6..9), sometimes.weight (4..6) and
  // sometimes.bias (2..3) run past their parameters and need padding.
  EXPECT_EQ(shared[0], (std::vector<char>{1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(shared[1], (std::vector<char>{1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(shared[2], (std::vector<char>{0, 0, 1, 1, 0, 0}));
  EXPECT_EQ(shard_bytes[0], 0);
  EXPECT_EQ(shard_bytes[2], (12 + 3 + 2 + 1) * 4);
  EXPECT_TRUE(wrote[0]);
  EXPECT_TRUE(wrote[1]);
  EXPECT_FALSE(wrote[2]);  // a copy: the parameter is written by the next all-gather
  for (int rank : {0, 1}) {
    EXPECT_TRUE(fulgur::test::message_contains(release_error[rank],
                                               {"parameter 0 ([7, 5])", "share_storage"}))
        << release_error[rank];
  }
  EXPECT_EQ(release_error[2], "");  // its shard of a.weight is a copy
}

// A parameter of kDirectElements or more, divisible by the world size, is
// exchanged on its own, straight from its gradient and into its storage;
// the rest are packed. Both kinds, released and gathered again between
// steps (into the released storage), step as one process does.
struct Wide : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  Wide() {
    a = register_module("a", torch::nn::Linear(256, 256));  // 65536 + 256
    b = register_module("b", torch::nn::Linear(256, 3));    // 768 + 3
    fill_the_same_everywhere(*this, 0.01, 0.05);
  }
  at::Tensor loss(int step, int rank) {
    const at::Tensor x =
        torch::sin(torch::arange(4 * 256, torch::kFloat).reshape({4, 256}) * 0.02 + step + 3.0 * rank);
    return b(torch::relu(a(x))).pow(2).mean();
  }
};

TEST(ShardedParameters, LargeParametersExchangedOnTheirOwnStepAsOneProcess) {
  ASSERT_GE(256 * 256, fulgur::ShardedParameters::kDirectElements);
  constexpr int kWorld = 2;
  Wide whole;
  auto opt = adam(whole.parameters());
  for (int step = 0; step < kSteps; ++step) {
    release_grads(whole.parameters());
    for (int r = 0; r < kWorld; ++r) (whole.loss(step, r) / kWorld).backward();
    opt->step();
  }
  for (bool share : {false, true}) {
    std::vector<std::vector<at::Tensor>> got(kWorld);
    fulgur::test::on_ranks(kWorld, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
      Wide net;
      fulgur::ShardedParameters sharded(net.parameters(), group, share);
      auto o = adam(sharded.shards());
      for (int step = 0; step < kSteps; ++step) {
        release_grads(sharded.shards());
        net.loss(step, rank).backward();
        sharded.reduce_scatter_gradients();
        o->step();
        if (!share) sharded.release_parameters({0, 2});  // a.weight (direct), b.weight (packed)
        sharded.all_gather_parameters();
      }
      got[static_cast<size_t>(rank)] = net.parameters();
    });
    for (int r = 0; r < kWorld; ++r) {
      for (size_t i = 0; i < whole.parameters().size(); ++i) {
        EXPECT_TRUE(torch::allclose(got[static_cast<size_t>(r)][i], whole.parameters()[i], 1e-5, 1e-6))
            << "rank " << r << ", parameter " << i << (share ? " (share_storage)" : "") << ": "
            << (got[static_cast<size_t>(r)][i] - whole.parameters()[i]).abs().max().item<float>();
      }
    }
  }
}

TEST(ShardedParameters, EachRankHoldsItsChunkOfEveryParameter) {
  std::vector<int64_t> chunks[3];
  std::vector<at::Tensor> shards[3];
  int64_t shard_bytes[3] = {0, 0, 0}, parameter_bytes = 0;
  fulgur::test::on_ranks(3, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    Net net;
    fulgur::ShardedParameters sharded(net.parameters(), group);
    for (size_t i = 0; i < net.parameters().size(); ++i) chunks[rank].push_back(sharded.chunk(i));
    shards[rank] = sharded.shards();
    shard_bytes[rank] = sharded.shard_bytes();
    if (rank == 0) parameter_bytes = sharded.parameter_bytes();
  });
  Net net;
  const auto params = net.parameters();
  // a.weight has 35 elements: chunks of 12, the last one 11 and a zero pad.
  EXPECT_EQ(chunks[0], (std::vector<int64_t>{12, 3, 7, 1, 2, 1}));
  EXPECT_EQ(shard_bytes[1], (12 + 3 + 7 + 1 + 2 + 1) * 4);
  EXPECT_EQ(parameter_bytes, (35 + 7 + 21 + 3 + 4 + 2) * 4);
  const at::Tensor flat = params[0].detach().reshape({-1});
  EXPECT_TRUE(torch::equal(shards[1][0].detach(), flat.narrow(0, 12, 12)));
  EXPECT_TRUE(torch::equal(shards[2][0].detach().narrow(0, 0, 11), flat.narrow(0, 24, 11)));
  EXPECT_EQ(shards[2][0][11].item<float>(), 0.0f);
  for (const auto& s : shards[0]) {
    EXPECT_TRUE(s.is_leaf());
    EXPECT_TRUE(s.requires_grad());
  }
}

TEST(ShardedParameters, FrozenOrMissingParametersAreRefused) {
  fulgur::test::on_ranks(1, [&](int, std::shared_ptr<fulgur::ProcessGroup> group) {
    Net net;
    net.a->weight.requires_grad_(false);
    EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::ShardedParameters(net.parameters(), group),
                       {"parameter 0 ([7, 5])", "does not require a gradient", "frozen"});
    EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::ShardedParameters({}, group),
                       {"no parameters to shard"});
    EXPECT_THROWS_WITH(fulgur::ConfigError, fulgur::ShardedParameters(net.parameters(), nullptr),
                       {"process group"});
  });
}

// Sharding between uses (FULL_SHARD's mechanism), on 3 ranks (uneven
// chunks): the memory of released parameters is freed, one shows no
// elements (an op on it is a shape error, not a read of freed memory), and
// the gather brings the values back into the same storage, so
// a graph recorded before the release computes the same gradients (a
// version bump would make autograd refuse it).
TEST(ShardedParameters, ReleasedParametersComeBackForTheGraphThatSavedThem) {
  fulgur::test::on_ranks(3, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    Net reference, net;
    reference.loss(0, rank).backward();
    fulgur::ShardedParameters sharded(net.parameters(), group);
    const int64_t all = sharded.parameter_bytes();
    EXPECT_EQ(sharded.held_parameter_bytes(), all);
    const std::vector<size_t> a_params = {0, 1};  // a.weight, a.bias
    at::Tensor loss = net.loss(0, rank);  // the graph saves a's weight
    sharded.release_parameters(a_params);
    EXPECT_TRUE(sharded.released(0) && sharded.released(1) && !sharded.released(2));
    EXPECT_EQ(sharded.held_parameter_bytes(), all - (35 + 7) * 4);
    EXPECT_EQ(net.a->weight.storage().nbytes(), 0u);
    EXPECT_EQ(net.a->weight.numel(), 0);
    EXPECT_THROWS_WITH(c10::Error, net.a(torch::ones({1, 5})), {"must be a matrix"});
    sharded.release_parameters(a_params);  // twice: nothing more to free
    sharded.all_gather_parameters(a_params);
    EXPECT_EQ(sharded.held_parameter_bytes(), all);
    EXPECT_TRUE(torch::equal(net.a->weight, reference.a->weight));
    loss.backward();
    for (size_t i = 0; i < net.parameters().size(); ++i) {
      const at::Tensor got = net.parameters()[i].grad(), want = reference.parameters()[i].grad();
      ASSERT_EQ(got.defined(), want.defined()) << i;  // `sometimes`: rank 0 only
      if (want.defined()) {
        EXPECT_TRUE(torch::equal(got, want)) << i;
      }
    }
    // Only the released subset is reduced and gathered: b keeps its
    // gradient until its own turn.
    sharded.reduce_scatter_gradients(a_params);
    EXPECT_FALSE(net.a->weight.grad().defined());
    EXPECT_TRUE(net.b->weight.grad().defined());
    EXPECT_TRUE(sharded.shards()[0].grad().defined());
    EXPECT_FALSE(sharded.shards()[2].grad().defined());
  });
}

TEST(ShardedParameters, AParameterThatIsAViewOrBorrowedMemoryIsNotReleased) {
  fulgur::test::on_ranks(1, [&](int, std::shared_ptr<fulgur::ProcessGroup> group) {
    at::Tensor flat = torch::zeros({10}, torch::kFloat);
    at::Tensor half = flat.narrow(0, 5, 5).detach().requires_grad_(true);
    fulgur::ShardedParameters sharded({half}, group);
    EXPECT_THROWS_WITH(fulgur::ConfigError, sharded.release_parameters({0}),
                       {"parameter 0 ([5])", "view of a storage of 40 bytes", "its own tensor"});
    EXPECT_FALSE(sharded.released(0));
    // Memory fulgur did not allocate (from_blob) cannot be allocated again.
    std::vector<float> values(4, 1.0f);
    at::Tensor wrapped = torch::from_blob(values.data(), {4}).requires_grad_(true);
    fulgur::ShardedParameters borrowed({wrapped}, group);
    EXPECT_THROWS_WITH(fulgur::ConfigError, borrowed.release_parameters({0}),
                       {"parameter 0 ([4])", "cannot allocate again (from_blob)"});
    EXPECT_FALSE(borrowed.released(0));
  });
}

}  // namespace
