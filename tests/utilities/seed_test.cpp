// seed_everything and the RNG states a checkpoint carries: the same seed
// draws the same numbers, and restored states continue the sequence.
#include "fulgur/utilities/seed.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "fulgur/core/errors.h"

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
  const fulgur::StateDict state = fulgur::rng_state_dict();
  EXPECT_TRUE(state.is_buffer("cpu"));
  EXPECT_TRUE(state.contains("cuda_count"));
  const std::string bytes = fulgur::to_bytes(state);
  const at::Tensor next = torch::rand({4});
  const at::Tensor next_normal = torch::randn({4});
  // From the state itself, and through the archive codec.
  for (const fulgur::StateDict& saved : {state, fulgur::from_bytes(bytes)}) {
    fulgur::seed_everything(99);  // draw elsewhere in between
    (void)torch::rand({100});
    fulgur::load_rng_state_dict(saved);
    EXPECT_TRUE(torch::equal(torch::rand({4}), next));
    EXPECT_TRUE(torch::equal(torch::randn({4}), next_normal));
  }
}

TEST(Seed, AStateWithoutTheCpuGeneratorIsRefusedByName) {
  fulgur::StateDict state;
  state.set("cuda_count", int64_t{0});
  try {
    fulgur::load_rng_state_dict(state);
    FAIL() << "no error";
  } catch (const fulgur::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("\"cpu\""), std::string::npos) << e.what();
  }
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
      const fulgur::StateDict state =
          fulgur::from_bytes(fulgur::to_bytes(fulgur::rng_state_dict()));
      if (state.integer("cuda_count") != 0) code = 5;
      fulgur::load_rng_state_dict(state);
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
      << "2: cuda_usable() in a forked child; 3: another draw; 4: an exception (above); "
         "5: CUDA generators saved";
}

}  // namespace
