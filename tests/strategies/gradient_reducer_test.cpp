// The bucketed gradient reducer between two ranks of one process (a thread
// each, real Gloo over 127.0.0.1): the averages it writes, the ranks that
// join without a backward, and the stop votes its first bucket carries.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fulgur/strategies/gradient_reducer.h"
#include "fulgur/strategies/process_group.h"
#include "support/test_support.h"

namespace {

// y = w . x with w = 0 and x = (rank + 1) * ones: dL/dw = (rank + 1).
struct Replica {
  at::Tensor w = torch::zeros({3}, torch::requires_grad());
  at::Tensor loss(int rank) { return (w * torch::full({3}, rank + 1.0)).sum(); }
  std::vector<std::pair<std::string, at::Tensor>> named() { return {{"w", w}}; }
};

TEST(GradientReducer, AveragesGradientsAndCountsTheStopVotes) {
  at::Tensor grads[2];
  int votes[2] = {-1, -1};
  int64_t exchanges[2] = {-1, -1};
  fulgur::test::on_ranks(2, [&](int rank, std::shared_ptr<fulgur::ProcessGroup> group) {
    Replica r;
    fulgur::GradientReducer reducer(r.named(), group);
    EXPECT_EQ(reducer.exchanges(), 0);
    reducer.set_stop_vote(rank == 1);
    reducer.prepare_for_backward();
    r.loss(rank).backward();
    EXPECT_EQ(reducer.finalize_backward(), 2);
    grads[rank] = r.w.grad().clone();
    votes[rank] = reducer.stop_votes();
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
    fulgur::GradientReducer reducer(r.named(), group);
    // Two exchanges, gradients not zeroed between them; the votes are per
    // exchange, not accumulated.
    for (int step = 0; step < 2; ++step) {
      reducer.set_stop_vote(step == 1);  // both ranks vote to stop in the second
      if (rank == 0) {
        reducer.prepare_for_backward();
        r.loss(rank).backward();
        contributors[rank] = reducer.finalize_backward();
      } else {
        contributors[rank] = reducer.join_without_backward();
      }
      if (step == 0) {
        EXPECT_EQ(reducer.stop_votes(), 0) << "rank " << rank;
      }
    }
    grads[rank] = r.w.grad().clone();
    votes[rank] = reducer.stop_votes();
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
    fulgur::GradientReducer reducer(r.named(), group);
    reducer.set_require_sync(false);
    reducer.set_stop_vote(true);
    reducer.prepare_for_backward();
    r.loss(rank).backward();
    EXPECT_EQ(reducer.finalize_backward(), 0);
    EXPECT_EQ(reducer.stop_votes(), 0);
    exchanges[rank] = reducer.exchanges();
    grads[rank] = r.w.grad().clone();
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(exchanges[rank], 0);
    // Only accumulated locally: each rank keeps its own gradient.
    EXPECT_TRUE(torch::allclose(grads[rank], torch::full({3}, rank + 1.0f))) << grads[rank];
  }
}

}  // namespace
