// seed_everything and the RNG states a checkpoint carries: the same seed
// draws the same numbers, and restored states continue the sequence.
#include "fulgur/utilities/seed.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
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

// A rank forked by ddp_fork's launcher from a process that used CUDA cannot
// use CUDA (torch::manual_seed failed there with "CUDA error: initialization
// error" on a GPU machine): seeding, and saving and restoring the RNG states,
// keep to the CPU generator there, and draw as in any process.
TEST(Seed, AForkedChildOfAProcessThatUsedCudaSeedsSavesAndRestores) {
  if (torch::cuda::is_available()) (void)torch::rand({2}, torch::kCUDA);  // CUDA initialised
  fulgur::seed_everything(11);
  const at::Tensor expected = torch::rand({4});
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 0;
    try {
      fulgur::detail::mark_forked_child();
      if (fulgur::cuda_usable()) code = 2;
      fulgur::seed_everything(11);
      if (!torch::equal(torch::rand({4}), expected)) code = 3;
      std::stringstream bytes;
      torch::serialize::OutputArchive out;
      fulgur::save_rng_states(out);
      out.save_to(bytes);
      torch::serialize::InputArchive in;
      in.load_from(bytes);
      fulgur::load_rng_states(in);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "forked child: %s\n", e.what());
      code = 4;
    }
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died by a signal";
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "2: cuda_usable() in a forked child; 3: another draw; 4: an exception (above)";
}

}  // namespace
