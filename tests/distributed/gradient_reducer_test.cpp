// The bucketed gradient reducer between two ranks of one process (a thread
// each, real Gloo over 127.0.0.1): the averages it writes, the ranks that
// join without a backward, and the stop votes its first bucket carries.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/distributed/gradient_reducer.h"
#include "fulgur/distributed/process_group.h"
#include "support/test_support.h"

namespace {

// y = w . x with w = 0 and x = (rank + 1) * ones: dL/dw = (rank + 1).
struct Replica {
  at::Tensor w = torch::zeros({3}, torch::requires_grad());
  at::Tensor loss(int rank) { return (w * torch::full({3}, rank + 1.0)).sum(); }
  std::vector<std::pair<std::string, at::Tensor>> named() { return {{"w", w}}; }
  // One backward through `reducer`: an exchange when sync is on.
  void backward(fulgur::GradientReducer& reducer, int rank) {
    reducer.prepare_for_backward();
    loss(rank).backward();
    reducer.finalize_backward();
  }
};

// One extra scalar (as DDP's stop vote) rides in the first bucket.
fulgur::GradientReducerOptions one_extra() {
  fulgur::GradientReducerOptions options;
  options.extra_scalars = 1;
  return options;
}

TEST(GradientReducer, AveragesGradientsAndSumsTheExtraScalars) {
  at::Tensor grads[2];
  int votes[2] = {-1, -1};
  int64_t exchanges[2] = {-1, -1};
  fulgur::test::on_ranks(2, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    Replica r;
    fulgur::GradientReducer reducer(r.named(), group, one_extra());
    EXPECT_EQ(reducer.exchanges(), 0);
    reducer.set_extra_scalar(0, rank == 1 ? 1.0 : 0.0);
    r.backward(reducer, rank);
    EXPECT_EQ(reducer.contributors(), 2);
    grads[rank] = r.w.grad().clone();
    votes[rank] = static_cast<int>(reducer.extra_scalar_sum(0));
    // A backward without sync exchanges nothing: the last exchange's
    // numbers stay.
    reducer.set_require_sync(false);
    reducer.set_extra_scalar(0, 0.0);
    r.backward(reducer, rank);
    EXPECT_EQ(reducer.contributors(), 2);
    EXPECT_EQ(reducer.extra_scalar_sum(0), 1.0);
    exchanges[rank] = reducer.exchanges();
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(torch::allclose(grads[rank], torch::full({3}, 1.5f))) << grads[rank];
    EXPECT_EQ(votes[rank], 1) << "rank " << rank;
    EXPECT_EQ(exchanges[rank], 1) << "rank " << rank;
  }
}

TEST(GradientReducer, ARankThatJoinsWithoutABackwardVotesAndTakesItsPeersMean) {
  at::Tensor grads[2];
  int contributors[2] = {-1, -1};
  int votes[2] = {-1, -1};
  fulgur::test::on_ranks(2, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    Replica r;
    fulgur::GradientReducer reducer(r.named(), group, one_extra());
    // Two exchanges, gradients not zeroed between them; the sums are per
    // exchange, not accumulated.
    for (int step = 0; step < 2; ++step) {
      reducer.set_extra_scalar(0, step == 1 ? 1.0 : 0.0);  // both ranks vote in the second
      if (rank == 0) {
        r.backward(reducer, rank);
        contributors[rank] = reducer.contributors();
      } else {
        contributors[rank] = reducer.join_without_backward();
      }
      if (step == 0) {
        EXPECT_EQ(reducer.extra_scalar_sum(0), 0.0) << "rank " << rank;
      }
    }
    grads[rank] = r.w.grad().clone();
    votes[rank] = static_cast<int>(reducer.extra_scalar_sum(0));
  });
  // Rank 0 accumulates 1 + 1; rank 1 holds the first mean (1) in its .grad
  // but contributes nothing to the second, so both end with 2.
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(contributors[rank], 1) << "rank " << rank;
    EXPECT_TRUE(torch::allclose(grads[rank], torch::full({3}, 2.0f))) << grads[rank];
    EXPECT_EQ(votes[rank], 2) << "rank " << rank;
  }
}

TEST(GradientReducer, WithoutSyncThereIsNoExchangeAndNoNewVote) {
  int64_t exchanges[2] = {-1, -1};
  at::Tensor grads[2];
  fulgur::test::on_ranks(2, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    Replica r;
    fulgur::GradientReducer reducer(r.named(), group, one_extra());
    reducer.set_require_sync(false);
    reducer.set_extra_scalar(0, 1.0);
    r.backward(reducer, rank);
    EXPECT_EQ(reducer.contributors(), 0);
    EXPECT_EQ(reducer.extra_scalar_sum(0), 0.0);
    // An index beyond the extras asked for is an error naming their number.
    EXPECT_THROWS_WITH(fulgur::ConfigError, reducer.set_extra_scalar(1, 1.0),
                       {"set_extra_scalar(1)", "carries 1 extra scalar(s)"});
    exchanges[rank] = reducer.exchanges();
    grads[rank] = r.w.grad().clone();
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(exchanges[rank], 0);
    // Only accumulated locally: each rank keeps its own gradient.
    EXPECT_TRUE(torch::allclose(grads[rank], torch::full({3}, rank + 1.0f))) << grads[rank];
  }
}

TEST(GradientReducer, TheMeanOverThreeRanksIsTheSumDividedOnTheHost) {
  // The count divides the sums where they are (a tensor, on a GPU without
  // reading it back); on the CPU that is bit for bit the division by the
  // number: 1 + 2 + 3 = 6 over 3 ranks, and 1 + 4 + 9 = 14 (sums exact in
  // any order, the quotient rounded).
  at::Tensor grads[3];
  int contributors[3] = {-1, -1, -1};
  fulgur::test::on_ranks(3, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    Replica r;
    Replica squared;
    auto named = r.named();
    named.emplace_back("squared", squared.w);
    fulgur::GradientReducer reducer(named, group, one_extra());
    reducer.prepare_for_backward();
    (r.loss(rank) + squared.loss(rank) * (rank + 1.0)).backward();
    reducer.finalize_backward();
    contributors[rank] = reducer.contributors();
    grads[rank] = torch::cat({r.w.grad(), squared.w.grad()});
  });
  at::Tensor sum = torch::zeros({6});
  for (int rank = 0; rank < 3; ++rank) {
    sum += torch::cat({torch::full({3}, rank + 1.0f), torch::full({3}, (rank + 1.0f) * (rank + 1))});
  }
  const at::Tensor expected = sum.div_(3.0);
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(contributors[rank], 3) << "rank " << rank;
    EXPECT_TRUE(torch::equal(grads[rank], expected)) << grads[rank] << expected;
  }
}

}  // namespace
