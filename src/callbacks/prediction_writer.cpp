#include "fulgur/callbacks/prediction_writer.h"

#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <random>

#include "fulgur/core/errors.h"
#include "fulgur/core/state_dict.h"
#include "fulgur/data/data_loader.h"
#include "fulgur/plugins/io/torch_checkpoint_io.h"
#include "fulgur/strategies/strategy.h"
#include "fulgur/trainer/trainer.h"
#include "strategies/every_rank.h"

namespace fs = std::filesystem;

namespace fulgur {

// ---- PredictionWriter.

PredictionWriter::PredictionWriter(WriteInterval interval) : interval_(interval) {}

void PredictionWriter::write_on_batch_end(Trainer&, Module&, const Batch&, const at::Tensor&,
                                          const Batch&, int64_t) {}

void PredictionWriter::write_on_epoch_end(Trainer&, Module&, const std::vector<Batch>&,
                                          const std::vector<at::Tensor>&) {}

void PredictionWriter::on_predict_start(Trainer&, Module&) {
  predictions_.clear();
  indices_.clear();
}

void PredictionWriter::on_predict_batch_end(Trainer& trainer, Module& module,
                                            const Batch& prediction, const Batch& batch,
                                            int64_t batch_idx) {
  at::Tensor indices;
  if (const DataLoader* loader = trainer.predict_dataloader()) {
    if (auto known = loader->sample_indices(batch_idx)) indices = *known;
  }
  if (interval_ != WriteInterval::kEpoch) {
    write_on_batch_end(trainer, module, prediction, indices, batch, batch_idx);
  }
  if (interval_ != WriteInterval::kBatch) {
    predictions_.push_back(prediction);
    indices_.push_back(indices);
  }
}

void PredictionWriter::on_predict_end(Trainer& trainer, Module& module) {
  if (interval_ != WriteInterval::kBatch) {
    write_on_epoch_end(trainer, module, predictions_, indices_);
  }
  predictions_.clear();
  indices_.clear();
}

// ---- PredictionFileWriter.
//
// A rank's file: "run" (the run's id), "rank", "world_size", "batches" (how
// many predict batches it holds); when batches > 0 also "kind" (a Batch's
// kind), "keys" (a map's keys, in order), the section "tensors" ("0",
// "1", ...: each tensor of the predictions, concatenated along dimension 0)
// and, when the loader knew them, "sample_indices".

namespace {

// The tensors of a Batch, in the order Batch::for_each visits them.
std::vector<at::Tensor> tensors_of(const Batch& b) {
  std::vector<at::Tensor> out;
  b.for_each([&](const at::Tensor& t) { out.push_back(t); });
  return out;
}

std::vector<std::string> keys_of(const Batch& b) {
  std::vector<std::string> keys;
  if (b.is_map()) {
    for (const auto& [key, tensor] : b.map()) keys.push_back(key);
  }
  return keys;
}

// A Batch of `kind` holding `tensors` (a map under `keys`).
Batch batch_of(const std::string& kind, const std::vector<std::string>& keys,
               std::vector<at::Tensor> tensors) {
  if (kind == "tensor") return Batch(tensors.at(0));
  if (kind == "pair") return Batch(tensors.at(0), tensors.at(1));
  if (kind == "list") return Batch(std::move(tensors));
  Batch::Map map;
  for (size_t i = 0; i < keys.size(); ++i) map[keys[i]] = tensors.at(i);
  return Batch(std::move(map));
}

std::string file_name(const std::string& path) { return fs::path(path).filename().string(); }

}  // namespace

PredictionFileWriter::PredictionFileWriter(std::string dirpath)
    : PredictionWriter(WriteInterval::kEpoch), dirpath_(std::move(dirpath)) {
  if (dirpath_.empty()) {
    throw ConfigError(
        "PredictionFileWriter(dirpath=\"\"): pass the directory the ranks write their "
        "predictions to.");
  }
}

std::string PredictionFileWriter::file_of_rank(const std::string& dirpath, int rank) {
  return (fs::path(dirpath) / str("predictions-rank", rank, ".pt")).string();
}

void PredictionFileWriter::on_predict_start(Trainer& trainer, Module& module) {
  PredictionWriter::on_predict_start(trainer, module);
  // One id for the run, drawn by rank 0: read() tells a file of this run
  // from one an earlier run left.
  std::string id;
  if (trainer.strategy().is_global_zero()) {
    std::random_device device;
    id = str(std::hex, device(), device(), "-",
             std::chrono::system_clock::now().time_since_epoch().count());
  }
  run_id_ = trainer.strategy().world_size() > 1 ? trainer.strategy().broadcast_bytes(id) : id;
}

void PredictionFileWriter::write_on_epoch_end(Trainer& trainer, Module&,
                                              const std::vector<Batch>& predictions,
                                              const std::vector<at::Tensor>& sample_indices) {
  Strategy& strategy = trainer.strategy();
  const int rank = strategy.global_rank();
  detail::on_every_rank(strategy, "cannot write its predictions, so none are complete", [&] {
    StateDict state;
    state.set("run", run_id_);
    state.set("rank", static_cast<int64_t>(rank));
    state.set("world_size", static_cast<int64_t>(strategy.world_size()));
    state.set("batches", static_cast<int64_t>(predictions.size()));
    if (!predictions.empty()) {
      const Batch& first = predictions.front();
      const std::vector<std::string> keys = keys_of(first);
      std::vector<std::vector<at::Tensor>> columns(first.num_tensors());
      bool indexed = true;
      for (size_t b = 0; b < predictions.size(); ++b) {
        const Batch& p = predictions[b];
        if (std::string(p.kind()) != first.kind() || p.num_tensors() != first.num_tensors() ||
            keys_of(p) != keys) {
          throw ConfigError(str("PredictionFileWriter: predict_step returned a ", p.kind(), " of ",
                                p.num_tensors(), " tensor(s) for batch ", b, " and a ",
                                first.kind(), " of ", first.num_tensors(),
                                " for batch 0. Return the same kind of Batch for every batch."));
        }
        const auto tensors = tensors_of(p);
        if (tensors.empty()) {
          throw ConfigError(str("PredictionFileWriter: batch ", b,
                                "'s prediction holds no tensor. Return the batch's predictions "
                                "from predict_step."));
        }
        const at::Tensor& idx = sample_indices.at(b);
        const int64_t rows = idx.defined() ? idx.size(0) : -1;
        for (size_t i = 0; i < tensors.size(); ++i) {
          if (!tensors[i].defined()) {
            throw ConfigError(str("PredictionFileWriter: tensor ", i, " of batch ", b,
                                  "'s prediction is undefined (an empty at::Tensor). Return the "
                                  "batch's predictions from predict_step."));
          }
          if (tensors[i].dim() == 0) {
            throw ConfigError(str("PredictionFileWriter: tensor ", i, " of batch ", b,
                                  "'s prediction has no dimensions, so the batches cannot be "
                                  "joined. Return tensors whose dimension 0 is the batch's "
                                  "samples."));
          }
          // One row per sample in every tensor: the rows are put back in
          // the dataset's order together.
          const int64_t expected = rows >= 0 ? rows : tensors.front().size(0);
          if (tensors[i].size(0) != expected) {
            throw ConfigError(str("PredictionFileWriter: tensor ", i, " of batch ", b,
                                  "'s prediction has ", tensors[i].size(0),
                                  " row(s), but the batch has ", expected,
                                  rows >= 0 ? " sample(s)" : " in its tensor 0",
                                  ". Return one row per sample in every tensor, so that each "
                                  "row can be put back in the dataset's order."));
          }
          columns[i].push_back(tensors[i].to(torch::kCPU));
        }
        indexed = indexed && idx.defined();
      }
      state.set("kind", std::string(first.kind()));
      state.set("keys", c10::List<std::string>(keys));
      StateDict& joined = state.section("tensors");
      for (size_t i = 0; i < columns.size(); ++i) {
        joined.set_plain(std::to_string(i), torch::cat(columns[i]));
      }
      if (indexed) state.set_plain("sample_indices", torch::cat(sample_indices));
    }
    std::error_code ec;
    fs::create_directories(dirpath_, ec);
    if (ec) {
      throw ConfigError(str("PredictionFileWriter: cannot create \"", dirpath_,
                            "\": ", ec.message(), ". Pass a directory every rank can write."));
    }
    TorchCheckpointIO io;
    io.save_checkpoint(state, file_of_rank(dirpath_, rank));
  });
}

Batch PredictionFileWriter::read(const std::string& dirpath) {
  TorchCheckpointIO io;
  const std::string where = str("PredictionFileWriter::read(\"", dirpath, "\"): ");
  std::error_code ec;
  if (const fs::file_status st = fs::status(dirpath, ec); fs::exists(st) && !fs::is_directory(st)) {
    throw CheckpointError(str(where, "it is ",
                              fs::is_regular_file(st) ? "a file" : "not a directory",
                              ", not the directory a PredictionFileWriter wrote to. Pass that "
                              "directory."));
  }
  // A file that is not what PredictionFileWriter writes (damaged, another
  // program's, a training checkpoint): said as such, not as a checkpoint
  // to resume from.
  auto damaged = [&](const std::string& path, const std::string& why) {
    return CheckpointError(str(where, file_name(path),
                               " is not a predictions file of a PredictionFileWriter, or is "
                               "damaged (",
                               why, "). Predict again into this directory to write it anew."));
  };
  auto load = [&](int rank) {
    const std::string path = file_of_rank(dirpath, rank);
    std::error_code ec;
    const fs::file_status st = fs::status(path, ec);
    if (fs::exists(st) && !fs::is_regular_file(st)) {
      throw CheckpointError(str(where, file_name(path), " is ",
                                fs::is_directory(st) ? "a directory" : "not a regular file",
                                ", not a predictions file. Predict again into an empty "
                                "directory."));
    }
    if (!fs::is_regular_file(st)) {
      throw CheckpointError(
          str(where, file_name(path), " is missing",
              rank == 0
                  ? ""
                  : str(" (", file_name(file_of_rank(dirpath, 0)), " is from a run of more ranks)"),
              ". Read once Trainer::predict with a PredictionFileWriter writing to this "
              "directory has returned on every rank."));
    }
    try {
      StateDict state = io.load_checkpoint(path);
      (void)state.string("run");
      (void)state.integer("world_size");
      (void)state.integer("batches");
      return state;
    } catch (const std::exception& e) {
      throw damaged(path, e.what());
    }
  };
  const StateDict first = load(0);
  const std::string run = first.string("run");
  const int64_t world = first.integer("world_size");
  std::string kind;
  std::vector<std::string> keys;
  std::vector<std::vector<at::Tensor>> columns;
  std::vector<at::Tensor> indices;
  bool indexed = true;
  for (int64_t r = 0; r < world; ++r) {
    const StateDict state = r == 0 ? first : load(static_cast<int>(r));
    const std::string name = file_name(file_of_rank(dirpath, static_cast<int>(r)));
    if (state.string("run") != run || state.integer("world_size") != world) {
      throw CheckpointError(str(where, name, " is from another predict run than ",
                                file_name(file_of_rank(dirpath, 0)),
                                " (an earlier run's file, left behind). Predict again into an "
                                "empty directory."));
    }
    if (state.integer("batches") == 0) continue;
    std::string its_kind;
    std::vector<std::string> its_keys;
    std::vector<at::Tensor> its_tensors;
    std::optional<at::Tensor> its_indices;
    try {
      its_kind = state.string("kind");
      const c10::List<c10::IValue> listed = state.at("keys").toList();
      for (size_t k = 0; k < listed.size(); ++k) its_keys.push_back(listed.get(k).toStringRef());
      const StateDict& tensors = state.section_at("tensors");
      for (size_t i = 0; i < tensors.size(); ++i) {
        its_tensors.push_back(tensors.tensor(std::to_string(i)));
      }
      if (const c10::IValue* idx = state.find("sample_indices")) its_indices = idx->toTensor();
    } catch (const std::exception& e) {
      throw damaged(file_of_rank(dirpath, static_cast<int>(r)), e.what());
    }
    if (kind.empty()) {
      kind = its_kind;
      keys = its_keys;
      columns.resize(its_tensors.size());
    } else if (its_kind != kind || its_keys != keys || its_tensors.size() != columns.size()) {
      throw CheckpointError(str(where, name, " holds a ", its_kind, " of ", its_tensors.size(),
                                " tensor(s), the ranks before it a ", kind, " of ", columns.size(),
                                ": the ranks' predict_step returned different "
                                "kinds of Batch."));
    }
    for (size_t i = 0; i < columns.size(); ++i) columns[i].push_back(its_tensors[i]);
    if (its_indices) {
      indices.push_back(*its_indices);
    } else {
      indexed = false;
    }
  }
  if (kind.empty()) {
    throw CheckpointError(str(where, "no rank predicted any batch."));
  }
  std::vector<at::Tensor> merged;
  for (auto& column : columns) {
    try {
      merged.push_back(torch::cat(column));
    } catch (const c10::Error& e) {
      throw CheckpointError(str(where,
                                "the ranks' predictions differ in shape beyond dimension 0, "
                                "so they cannot be joined: ",
                                error_message(e)));
    }
  }
  if (indexed) {
    // The dataset's order, each sample once: a sample predicted on several
    // ranks (a shard padded to the others' length, or every rank predicting
    // everything with use_distributed_sampler=false) is kept once.
    const at::Tensor all = torch::cat(indices);
    const at::Tensor order = torch::argsort(all, /*dim=*/int64_t{0});
    const at::Tensor sorted = all.index_select(0, order);
    at::Tensor first = torch::ones({sorted.size(0)}, torch::kBool);
    if (sorted.size(0) > 1) {
      first.slice(0, 1).copy_(sorted.slice(0, 1).ne(sorted.slice(0, 0, sorted.size(0) - 1)));
    }
    const at::Tensor keep = order.masked_select(first);
    for (auto& t : merged) t = t.index_select(0, keep);
  }
  return batch_of(kind, keys, std::move(merged));
}

}  // namespace fulgur
