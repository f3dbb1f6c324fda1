// seed_everything and the RNG states a checkpoint carries: the same seed
// draws the same numbers, and restored states continue the sequence.
#include "fulgur/utilities/seed.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <sstream>

namespace {

TEST(Seed, TheSameSeedDrawsTheSameNumbersFromTorchAndTheCLibrary) {
  fulgur::seed_everything(123);
  const at::Tensor a = torch::rand({8});
  const int ra = std::rand();
  fulgur::seed_everything(123);
  EXPECT_TRUE(torch::equal(torch::rand({8}), a));
  EXPECT_EQ(std::rand(), ra);
  fulgur::seed_everything(124);
  EXPECT_FALSE(torch::equal(torch::rand({8}), a));
}

TEST(Seed, RestoredStatesContinueTheSequence) {
  fulgur::seed_everything(5);
  (void)torch::rand({3});
  std::stringstream bytes;
  {
    torch::serialize::OutputArchive archive;
    fulgur::save_rng_states(archive);
    archive.save_to(bytes);
  }
  const at::Tensor next = torch::rand({4});
  const at::Tensor next_normal = torch::randn({4});
  fulgur::seed_everything(99);  // draw elsewhere in between
  (void)torch::rand({100});
  torch::serialize::InputArchive archive;
  archive.load_from(bytes);
  fulgur::load_rng_states(archive);
  EXPECT_TRUE(torch::equal(torch::rand({4}), next));
  EXPECT_TRUE(torch::equal(torch::randn({4}), next_normal));
}

}  // namespace
