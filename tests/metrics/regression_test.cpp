// Regression metrics and the aggregations against their formulas.
#include "fulgur/metrics/regression.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

namespace M = fulgur::metrics;

TEST(Metrics, MeanSquaredAndAbsoluteErrorOverEveryElement) {
  M::MeanSquaredError mse;
  M::MeanAbsoluteError mae;
  // Errors 1, -2, 0 | 3 (two updates of different sizes): every element
  // counts once, not every batch.
  for (M::PredictionMetric* m : std::initializer_list<M::PredictionMetric*>{&mse, &mae}) {
    m->update(torch::tensor({2.0, 0.0, 5.0}), torch::tensor({1.0, 2.0, 5.0}));
    m->update(torch::tensor({{4.0}}), torch::tensor({{1.0}}));
  }
  EXPECT_DOUBLE_EQ(mse.compute().item<double>(), (1.0 + 4.0 + 0.0 + 9.0) / 4);
  EXPECT_DOUBLE_EQ(mae.compute().item<double>(), (1.0 + 2.0 + 0.0 + 3.0) / 4);
  EXPECT_THROWS_WITH(fulgur::ConfigError, mse.update(torch::zeros({3}), torch::zeros({2})),
                     {"MeanSquaredError.update", "[3]", "[2]"});
}

TEST(Metrics, MeanMetricWeighsAndSumMetricAdds) {
  M::MeanMetric mean;
  EXPECT_TRUE(std::isnan(mean.compute().item<double>()));
  mean.update(torch::tensor({1.0, 3.0}));   // two values of weight 1
  mean.update(10.0, /*weight=*/2.0);         // a batch mean of a batch of 2
  EXPECT_DOUBLE_EQ(mean.compute().item<double>(), (1.0 + 3.0 + 20.0) / 4);
  EXPECT_THROWS_WITH(fulgur::ConfigError, mean.update(1.0, -1.0), {"weight=-1"});
  M::SumMetric sum;
  sum.update(torch::tensor({1.5, 2.5}));
  sum.update(4.0);
  EXPECT_DOUBLE_EQ(sum.compute().item<double>(), 8.0);
}

// An update keeps none of its input's autograd history: a loss that needs
// gradients, passed as it is, let every batch's graph (and the tensors it
// saved) live on in the metric's sums, across reset().
TEST(Metrics, AnUpdateKeepsNoAutogradHistory) {
  const auto w = torch::ones({1}, torch::requires_grad());
  M::MeanMetric mean;
  M::SumMetric sum;
  M::MeanSquaredError mse;
  const at::Tensor saved = torch::rand({64});
  {
    const at::Tensor loss = (saved * w).exp();  // mul saves `saved`
    mean.update(loss.mean());
    sum.update(loss);
    mse.update(loss, torch::zeros({64}));
  }
  EXPECT_EQ(saved.use_count(), 1);  // no graph holds it
  mean.reset();
  EXPECT_EQ(mean.update_count(), 0);
  EXPECT_THROWS_WITH(fulgur::ConfigError, mean.update(at::Tensor()),
                     {"MeanMetric.update(values)", "undefined"});
}

}  // namespace
