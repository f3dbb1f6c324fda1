// File: fulgur/plugins/io/torch_checkpoint_io.h
#pragma once

#include "fulgur/plugins/io/checkpoint_io.h"

namespace fulgur {

/// LibTorch's archive format (the zip container torch::save writes), written
/// to `<path>.tmp.<pid>`, flushed to disk, then renamed over `path`.
class TorchCheckpointIO : public CheckpointIO {
 public:
  std::string_view name() const override { return "torch"; }
  void save_checkpoint(torch::serialize::OutputArchive& checkpoint,
                       const std::string& path) override;
  void load_checkpoint(const std::string& path,
                       torch::serialize::InputArchive& checkpoint) override;
  void remove_checkpoint(const std::string& path) override;
};

}  // namespace fulgur
