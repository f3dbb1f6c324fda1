// The unit tests' main: GoogleTest + GMock, and one intra-op thread so that
// the tiny models of the tests run fast and ctest can run tests in parallel.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleMock(&argc, argv);
  torch::set_num_threads(1);
  return RUN_ALL_TESTS();
}
