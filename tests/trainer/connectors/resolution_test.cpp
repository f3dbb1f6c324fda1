// The connector's report as JSON: exactly the documented keys, in order,
// and errors with every problem.
#include "fulgur/trainer/connectors/resolution.h"

#include <gtest/gtest.h>

#include "fulgur/core/errors.h"

namespace {

// ---- JSON.

TEST(ResolutionJson, HasExactlyTheDocumentedKeysInOrder) {
  fulgur::Resolution r;
  r.accelerator = "cpu";
  r.strategy = "ddp";
  r.launcher = "subprocess_script";
  r.precision = "bf16-mixed";
  r.cluster_environment = "lightning";
  r.num_devices = 2;
  r.world_size = 2;
  r.parallel_devices = {"cpu", "cpu"};
  r.deterministic = fulgur::Determinism::kWarn;
  r.notes = {"a \"quoted\" note\twith a tab"};
  EXPECT_EQ(r.to_json(),
            "{\n"
            "  \"accelerator\": \"cpu\",\n"
            "  \"strategy\": \"ddp\",\n"
            "  \"launcher\": \"subprocess_script\",\n"
            "  \"precision\": \"bf16-mixed\",\n"
            "  \"cluster_environment\": \"lightning\",\n"
            "  \"num_nodes\": 1,\n"
            "  \"num_devices\": 2,\n"
            "  \"world_size\": 2,\n"
            "  \"global_rank\": 0,\n"
            "  \"local_rank\": 0,\n"
            "  \"node_rank\": 0,\n"
            "  \"parallel_devices\": [\n    \"cpu\",\n    \"cpu\"\n  ],\n"
            "  \"deterministic\": \"warn\",\n"
            "  \"sync_batchnorm\": false,\n"
            "  \"notes\": [\n    \"a \\\"quoted\\\" note\\twith a tab\"\n  ]\n"
            "}\n");
  r.launcher.clear();
  r.deterministic = fulgur::Determinism::kOn;
  r.notes.clear();
  const auto json = r.to_json();
  EXPECT_NE(json.find("\"launcher\": null,"), std::string::npos) << json;
  EXPECT_NE(json.find("\"deterministic\": true,"), std::string::npos) << json;
  EXPECT_NE(json.find("\"notes\": []\n"), std::string::npos) << json;
}

TEST(ResolutionJson, ErrorsListEveryProblemAndTheMessage) {
  fulgur::FlagError error("invalid_flags", {"devices=0: selects no device.", "num_nodes=0: bad"});
  EXPECT_EQ(
      fulgur::to_json(error),
      "{\n"
      "  \"error\": \"invalid_flags\",\n"
      "  \"problems\": [\n    \"devices=0: selects no device.\",\n    \"num_nodes=0: bad\"\n  ],\n"
      "  \"message\": \"Trainer: 2 problems with the flags:\\n  - devices=0: selects no "
      "device.\\n  - num_nodes=0: bad\"\n"
      "}\n");
}

}  // namespace
