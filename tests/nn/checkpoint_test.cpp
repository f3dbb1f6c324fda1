// Activation checkpointing (fulgur/nn/checkpoint.h): the gradients of a block
// run without its activations are those of the plain block, bitwise on the
// CPU (dropout and autocast included); its activations are freed after the
// first run; buffers are updated once; without gradients it runs once; bad
// blocks are named. A Trainer fit with checkpointed blocks ends with the plain
// model's weights.
#include "fulgur/nn/checkpoint.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>

#include "fulgur/fulgur.h"
#include "fulgur/utilities/torch_compat.h"
#include "support/test_support.h"

namespace {

using fulgur::test::TempDir;
using fulgur::test::test_options;

torch::nn::Sequential block(bool dropout = false, bool batch_norm = false) {
  torch::nn::Sequential s;
  s->push_back(torch::nn::Linear(16, 32));
  if (batch_norm) s->push_back(torch::nn::BatchNorm1d(32));
  s->push_back(torch::nn::Tanh());
  if (dropout) s->push_back(torch::nn::Dropout(0.5));
  s->push_back(torch::nn::Linear(32, 8));
  return s;
}

torch::nn::Sequential copy_of(const torch::nn::Sequential& s) {
  return torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(s->clone()));
}

// Gradients of sum(f(x)^2) for the parameters of `m` and for x.
std::vector<at::Tensor> gradients(torch::nn::Module& m, const std::function<at::Tensor(at::Tensor)>& f,
                                  const at::Tensor& x0) {
  m.zero_grad();
  auto x = x0.clone().requires_grad_(true);
  f(x).pow(2).sum().backward();
  std::vector<at::Tensor> out = {x.grad()};
  for (const auto& p : m.parameters()) out.push_back(p.grad());
  return out;
}

void expect_bitwise(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(a[i].defined() && b[i].defined()) << "gradient " << i;
    EXPECT_TRUE(torch::equal(a[i], b[i])) << "gradient " << i << "\n" << a[i] - b[i];
  }
}

TEST(ActivationCheckpointing, GradientsAreThePlainBlocksBitwise) {
  torch::manual_seed(1);
  auto plain = block();
  auto inner = copy_of(plain);
  fulgur::nn::Checkpoint wrapped(inner);
  auto x = torch::randn({4, 16});
  auto expected = gradients(*plain, [&](at::Tensor in) { return plain->forward(in); }, x);
  auto got = gradients(*wrapped, [&](at::Tensor in) { return wrapped->forward(in); }, x);
  expect_bitwise(got, expected);
  // The same through the function form, given the parameters it uses.
  auto fn = [&](at::Tensor in) {
    return fulgur::nn::checkpoint(
        [&](const std::vector<at::Tensor>& v) { return std::vector{inner->forward(v[0])}; }, {in},
        inner->parameters())[0];
  };
  expect_bitwise(gradients(*inner, fn, x), expected);
  // Parameter names keep the wrapped module's, under "module.".
  EXPECT_TRUE(wrapped->named_parameters().contains("module.0.weight"));
}

TEST(ActivationCheckpointing, TheBlocksActivationsAreFreedAfterItsFirstRun) {
  torch::manual_seed(2);
  auto net = block();
  auto x = torch::randn({4, 16}).requires_grad_(true);
  // The activation between the two layers: kept by the plain block's graph
  // (Tanh saves it for backward), freed by the checkpointed one.
  auto activation_kept = [&](bool checkpointed) {
    c10::weak_intrusive_ptr<c10::TensorImpl> hidden(c10::intrusive_ptr<c10::TensorImpl>{});
    int runs = 0;
    auto body = [&](const std::vector<at::Tensor>& in) {
      auto h = torch::tanh(net[0]->as<torch::nn::Linear>()->forward(in[0]));
      if (runs++ == 0) hidden = c10::weak_intrusive_ptr<c10::TensorImpl>(h.getIntrusivePtr());
      return std::vector{net[2]->as<torch::nn::Linear>()->forward(h)};
    };
    at::Tensor y = checkpointed ? fulgur::nn::checkpoint(body, {x}, net->parameters())[0]
                                : body({x})[0];
    const bool kept = !hidden.expired();
    y.sum().backward();
    EXPECT_EQ(runs, checkpointed ? 2 : 1) << "backward runs a checkpointed block again";
    return kept;
  };
  EXPECT_TRUE(activation_kept(false));
  EXPECT_FALSE(activation_kept(true));
}

TEST(ActivationCheckpointing, DropoutDrawsTheSameNumbersInTheSecondRun) {
  torch::manual_seed(3);
  auto plain = block(/*dropout=*/true);
  auto x = torch::randn({8, 16});
  torch::manual_seed(11);
  auto expected = gradients(*plain, [&](at::Tensor in) { return plain->forward(in); }, x);
  const auto after_plain = torch::rand({3});

  fulgur::nn::Checkpoint wrapped(copy_of(plain));
  torch::manual_seed(11);
  auto got = gradients(*wrapped, [&](at::Tensor in) { return wrapped->forward(in); }, x);
  expect_bitwise(got, expected);
  // The generator goes on from where the first run left it.
  EXPECT_TRUE(torch::equal(torch::rand({3}), after_plain));

  // Without preserve_rng_state the second run draws other numbers: the
  // gradients are not the plain block's (what the option is for).
  fulgur::nn::Checkpoint unpreserved(copy_of(plain),
                                     fulgur::nn::CheckpointOptions{.preserve_rng_state = false});
  torch::manual_seed(11);
  auto wrong = gradients(*unpreserved, [&](at::Tensor in) { return unpreserved->forward(in); }, x);
  EXPECT_FALSE(torch::equal(wrong[1], expected[1]));
}

TEST(ActivationCheckpointing, BatchNormStatisticsAreUpdatedOnce) {
  torch::manual_seed(4);
  auto plain = block(false, /*batch_norm=*/true);
  fulgur::nn::Checkpoint wrapped(copy_of(plain));
  auto x = torch::randn({8, 16});
  auto expected = gradients(*plain, [&](at::Tensor in) { return plain->forward(in); }, x);
  auto got = gradients(*wrapped, [&](at::Tensor in) { return wrapped->forward(in); }, x);
  expect_bitwise(got, expected);
  auto plain_buffers = plain->named_buffers();
  auto wrapped_buffers = wrapped->named_buffers();
  for (const auto& item : plain_buffers) {
    const auto& b = wrapped_buffers["module." + item.key()];
    EXPECT_TRUE(torch::equal(b, item.value())) << item.key() << ": " << b << " vs " << item.value();
  }
  EXPECT_EQ(wrapped_buffers["module.1.num_batches_tracked"].item<int64_t>(), 1);
}

TEST(ActivationCheckpointing, UnderAutocastTheSecondRunCastsAsTheFirst) {
  torch::manual_seed(5);
  auto plain = block();
  fulgur::nn::Checkpoint wrapped(copy_of(plain));
  auto x = torch::randn({4, 16});
  // Forward under bfloat16 autocast, backward after it ended (as the
  // precision plugins do).
  auto in_autocast = [](const std::function<at::Tensor(at::Tensor)>& f) {
    return [f](at::Tensor in) {
      fulgur::compat::set_autocast_dtype(c10::DeviceType::CPU, at::kBFloat16);
      fulgur::compat::set_autocast_enabled(c10::DeviceType::CPU, true);
      at::Tensor y = f(in);
      fulgur::compat::set_autocast_enabled(c10::DeviceType::CPU, false);
      EXPECT_EQ(y.scalar_type(), at::kBFloat16);
      return y.to(at::kFloat);
    };
  };
  auto expected =
      gradients(*plain, in_autocast([&](at::Tensor in) { return plain->forward(in); }), x);
  auto got =
      gradients(*wrapped, in_autocast([&](at::Tensor in) { return wrapped->forward(in); }), x);
  expect_bitwise(got, expected);
  EXPECT_FALSE(fulgur::compat::autocast_enabled(c10::DeviceType::CPU));
}

TEST(ActivationCheckpointing, WithoutGradientsTheBlockRunsOnceAndKeepsNothing) {
  auto net = block();
  int runs = 0;
  auto body = [&](const std::vector<at::Tensor>& in) {
    ++runs;
    return std::vector{net->forward(in[0])};
  };
  torch::NoGradGuard no_grad;
  auto y = fulgur::nn::checkpoint(body, {torch::randn({2, 16})}, net->parameters())[0];
  EXPECT_EQ(runs, 1);
  EXPECT_FALSE(y.requires_grad());
}

// What a module inside the block sees (an fsdp unit keeps its parameters
// gathered from the second run to its backward): the first run, the second
// in backward, neither outside the block or without gradients; a block
// inside another's second run has its own two.
TEST(ActivationCheckpointing, TheBlockKnowsWhichRunItIsIn) {
  using fulgur::nn::CheckpointRun;
  auto net = block();
  std::vector<CheckpointRun> seen;
  std::vector<bool> recomputing;  // in_checkpoint_recomputation() at each run
  auto body = [&](const std::vector<at::Tensor>& in) {
    seen.push_back(fulgur::nn::current_checkpoint_run());
    recomputing.push_back(fulgur::nn::in_checkpoint_recomputation());
    return std::vector{net->forward(in[0])};
  };
  auto x = torch::randn({2, 16}, torch::requires_grad());
  EXPECT_EQ(fulgur::nn::current_checkpoint_run(), CheckpointRun::kNone);
  auto y = fulgur::nn::checkpoint(body, {x}, net->parameters())[0];
  EXPECT_EQ(seen, std::vector<CheckpointRun>{CheckpointRun::kFirst});
  EXPECT_EQ(fulgur::nn::current_checkpoint_run(), CheckpointRun::kNone);
  y.sum().backward();
  EXPECT_EQ(seen, (std::vector<CheckpointRun>{CheckpointRun::kFirst, CheckpointRun::kSecond}));
  EXPECT_EQ(recomputing, (std::vector<bool>{false, true}));
  EXPECT_EQ(fulgur::nn::current_checkpoint_run(), CheckpointRun::kNone);
  EXPECT_FALSE(fulgur::nn::in_checkpoint_recomputation());

  seen.clear();
  recomputing.clear();
  std::vector<CheckpointRun> outer_seen;
  auto outer = [&](const std::vector<at::Tensor>& in) {
    outer_seen.push_back(fulgur::nn::current_checkpoint_run());
    auto h = fulgur::nn::checkpoint(body, {in[0]}, net->parameters())[0];
    outer_seen.push_back(fulgur::nn::current_checkpoint_run());
    return std::vector{h};
  };
  fulgur::nn::checkpoint(outer, {x}, net->parameters())[0].sum().backward();
  EXPECT_EQ(outer_seen,
            (std::vector<CheckpointRun>{CheckpointRun::kFirst, CheckpointRun::kFirst,
                                        CheckpointRun::kSecond, CheckpointRun::kSecond}));
  // The inner block: run once in the outer's first run (no gradients
  // there), then first and second in the outer's second run.
  EXPECT_EQ(seen, (std::vector<CheckpointRun>{CheckpointRun::kFirst, CheckpointRun::kFirst,
                                              CheckpointRun::kSecond}));
  // Its first run inside the outer's second is part of the recomputation.
  EXPECT_EQ(recomputing, (std::vector<bool>{false, true, true}));
  EXPECT_FALSE(fulgur::nn::in_checkpoint_recomputation());

  seen.clear();
  torch::NoGradGuard no_grad;
  fulgur::nn::checkpoint(body, {x}, net->parameters());
  EXPECT_EQ(seen, std::vector<CheckpointRun>{CheckpointRun::kNone});
}

TEST(ActivationCheckpointing, ParametersGetGradientsWhenTheInputNeedsNone) {
  torch::manual_seed(6);
  auto plain = block();
  fulgur::nn::Checkpoint wrapped(copy_of(plain));
  auto x = torch::randn({4, 16});  // no gradient: the first block of a model
  plain->forward(x).sum().backward();
  wrapped->forward(x).sum().backward();
  auto p = plain->parameters(), w = wrapped->parameters();
  ASSERT_EQ(p.size(), w.size());
  for (size_t i = 0; i < p.size(); ++i) {
    ASSERT_TRUE(w[i].grad().defined()) << i;
    EXPECT_TRUE(torch::equal(w[i].grad(), p[i].grad())) << i;
  }
}

TEST(ActivationCheckpointing, ABlockThatReturnsNoFloatingPointTensorIsNamed) {
  auto net = block();
  auto x = torch::randn({2, 16}).requires_grad_(true);
  try {
    fulgur::nn::checkpoint(
        [&](const std::vector<at::Tensor>& in) {
          return std::vector{net->forward(in[0]), net->forward(in[0]).argmax(1)};
        },
        {x}, net->parameters());
    FAIL() << "an integer output was accepted";
  } catch (const fulgur::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("output 1 of the checkpointed function is not a "
                                         "floating-point tensor (Long)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(fulgur::nn::checkpoint(nullptr, {x}, {}), fulgur::ConfigError);
  EXPECT_THROW(fulgur::nn::Checkpoint(torch::nn::AnyModule()), fulgur::ConfigError);
}

// A small classifier whose hidden block may be checkpointed.
class Classifier : public fulgur::Module {
 public:
  explicit Classifier(bool checkpointed) : fulgur::Module("Classifier") {
    torch::manual_seed(7);
    auto hidden = block(/*dropout=*/true);
    if (checkpointed) {
      net = register_module("net", fulgur::nn::Checkpoint(hidden).ptr());
    } else {
      net = register_module("net", hidden.ptr());
    }
  }
  at::Tensor training_step(fulgur::Batch& batch, int64_t) override {
    const auto& [x, y] = batch.pair();
    auto logits = run(x);
    return torch::nn::functional::cross_entropy(logits, y);
  }
  fulgur::OptimizerConfig configure_optimizers() override {
    return fulgur::OptimizerConfig(
        std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(1e-2)));
  }
  at::Tensor run(const at::Tensor& x) {
    if (auto c = std::dynamic_pointer_cast<fulgur::nn::CheckpointImpl>(net)) return c->forward(x);
    return std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net)->forward(x);
  }
  std::shared_ptr<torch::nn::Module> net;
};

TEST(ActivationCheckpointing, ATrainerFitEndsWithThePlainModelsWeights) {
  torch::manual_seed(8);
  auto x = torch::randn({64, 16});
  auto y = torch::randint(0, 8, {64});
  auto data = std::make_shared<fulgur::TensorDataset>(x, y);
  auto train = [&](bool checkpointed) {
    TempDir dir;
    Classifier model(checkpointed);
    auto options = test_options(dir);
    options.max_epochs = 3;
    options.seed = 5;
    fulgur::Trainer trainer(options);
    auto result = trainer.fit(model, fulgur::make_data_loader(data, {.batch_size = 16}));
    EXPECT_EQ(result.global_step, 12);
    return model.parameters();
  };
  auto plain = train(false);
  auto checkpointed = train(true);
  ASSERT_EQ(plain.size(), checkpointed.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(torch::equal(plain[i], checkpointed[i])) << "parameter " << i;
  }
}

}  // namespace
