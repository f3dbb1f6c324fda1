#include "fulgur/plugins/environments/lightning.h"

#include <gtest/gtest.h>

#include "fulgur/core/errors.h"
#include "support/test_support.h"

namespace {

TEST(LightningEnvironment, EmptyEnvironmentIsOneLocalProcess) {
  fulgur::LightningEnvironment env{fulgur::EnvView(std::map<std::string, std::string>{})};
  EXPECT_EQ(env.name(), "lightning");
  EXPECT_FALSE(env.creates_processes_externally());
  EXPECT_EQ(env.main_address(), "127.0.0.1");
  EXPECT_EQ(env.main_port(), 0);
  EXPECT_EQ(env.world_size(), 1);
  EXPECT_EQ(env.global_rank(), 0);
  EXPECT_EQ(env.local_rank(), 0);
  EXPECT_EQ(env.node_rank(), 0);
}

TEST(LightningEnvironment, ReadsTorchrunStyleVariables) {
  fulgur::LightningEnvironment env{
      fulgur::EnvView(std::map<std::string, std::string>{{"MASTER_ADDR", "10.0.0.1"},
                                                         {"MASTER_PORT", "29500"},
                                                         {"WORLD_SIZE", "8"},
                                                         {"RANK", "5"},
                                                         {"LOCAL_RANK", "1"},
                                                         {"NODE_RANK", "2"}})};
  EXPECT_TRUE(env.creates_processes_externally());
  EXPECT_EQ(env.main_address(), "10.0.0.1");
  EXPECT_EQ(env.main_port(), 29500);
  EXPECT_EQ(env.world_size(), 8);
  EXPECT_EQ(env.global_rank(), 5);
  EXPECT_EQ(env.local_rank(), 1);
  EXPECT_EQ(env.node_rank(), 2);
}

TEST(LightningEnvironment, GroupRankIsTheNodeRankWhenNodeRankIsUnset) {
  fulgur::LightningEnvironment env{
      fulgur::EnvView(std::map<std::string, std::string>{{"GROUP_RANK", "3"}})};
  EXPECT_EQ(env.node_rank(), 3);
}

TEST(LightningEnvironment, BadPortIsAConfigError) {
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::LightningEnvironment{fulgur::EnvView(
                         std::map<std::string, std::string>{{"MASTER_PORT", "70000"}})},
                     {"MASTER_PORT=70000", "1..65535"});
  EXPECT_THROWS_WITH(fulgur::ConfigError,
                     fulgur::LightningEnvironment{
                         fulgur::EnvView(std::map<std::string, std::string>{{"RANK", "zero"}})},
                     {"RANK", "zero"});
}

TEST(LightningEnvironment, RegisteredAsLightning) {
  fulgur::EnvView env(std::map<std::string, std::string>{{"RANK", "2"}});
  auto created = fulgur::cluster_environment_registry().create("lightning", env);
  EXPECT_EQ(created->name(), "lightning");
  EXPECT_EQ(created->global_rank(), 2);
}

}  // namespace
