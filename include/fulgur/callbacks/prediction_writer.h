// File: fulgur/callbacks/prediction_writer.h
//
// Predictions written where they are made. Under strategy "ddp" every rank
// predicts its own part of the data and Trainer::predict returns only that
// part; a PredictionWriter gets each rank's predictions with the dataset
// indices of their samples, so nothing is gathered and the parts can be put
// back in the dataset's order.
//
//   class CsvWriter : public fulgur::PredictionWriter {      // your own format
//     void write_on_batch_end(fulgur::Trainer&, fulgur::Module&,
//                             const fulgur::Batch& prediction, const at::Tensor& indices,
//                             const fulgur::Batch&, int64_t) override { ... }
//   };
//
// PredictionFileWriter writes each rank's predictions to one verified file
// and reads them all back, in the dataset's order:
//
//   trainer.predict(model, data);                 // every rank writes its file
//   fulgur::Batch all = fulgur::PredictionFileWriter::read("predictions");
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fulgur/callbacks/callback.h"
#include "fulgur/data/batch.h"

namespace fulgur {

/// When a PredictionWriter writes: after each batch, once at the end of
/// predict with all of the rank's predictions, or both.
enum class WriteInterval { kBatch, kEpoch, kBatchAndEpoch };

class PredictionWriter : public Callback {
 public:
  explicit PredictionWriter(WriteInterval interval = WriteInterval::kBatch);
  std::string state_key() const override { return "PredictionWriter"; }

  /// kBatch and kBatchAndEpoch: after each predict batch, on every rank.
  /// `sample_indices`: the dataset indices of the batch's samples (int64,
  /// CPU), undefined where the loader cannot tell (an IterableLoader).
  virtual void write_on_batch_end(Trainer& trainer, Module& module, const Batch& prediction,
                                  const at::Tensor& sample_indices, const Batch& batch,
                                  int64_t batch_idx);
  /// kEpoch and kBatchAndEpoch: at the end of predict, on every rank, this
  /// rank's predictions and their samples' indices, one per batch.
  virtual void write_on_epoch_end(Trainer& trainer, Module& module,
                                  const std::vector<Batch>& predictions,
                                  const std::vector<at::Tensor>& sample_indices);

  WriteInterval write_interval() const { return interval_; }

  void on_predict_start(Trainer& trainer, Module& module) override;
  void on_predict_batch_end(Trainer& trainer, Module& module, const Batch& prediction,
                            const Batch& batch, int64_t batch_idx) override;
  void on_predict_end(Trainer& trainer, Module& module) override;

 private:
  WriteInterval interval_;
  std::vector<Batch> predictions_;
  std::vector<at::Tensor> indices_;
};

/// Writes each rank's predictions, at the end of predict, to
/// `<dirpath>/predictions-rank<R>.pt` (fulgur's checkpoint format: CRC32C
/// verified, written to a temporary file and renamed into place): every
/// tensor of the predictions concatenated along dimension 0, with the
/// samples' dataset indices and an id of the predict run that rank 0 draws
/// and every rank shares. predict returns on any rank only once every rank's
/// file is written.
class PredictionFileWriter : public PredictionWriter {
 public:
  /// Throws ConfigError on an empty `dirpath`.
  explicit PredictionFileWriter(std::string dirpath);
  std::string state_key() const override { return "PredictionFileWriter"; }
  const std::string& dirpath() const { return dirpath_; }

  void on_predict_start(Trainer& trainer, Module& module) override;
  void write_on_epoch_end(Trainer& trainer, Module& module, const std::vector<Batch>& predictions,
                          const std::vector<at::Tensor>& sample_indices) override;

  /// The file rank `rank` writes under `dirpath`.
  static std::string file_of_rank(const std::string& dirpath, int rank);
  /// Every rank's predictions of the newest run written under `dirpath`,
  /// as one Batch of the kind predict_step returned, each tensor in the
  /// dataset's order (sorted by sample index, each sample once: a padded
  /// shard's repeats and the copies of use_distributed_sampler=false are
  /// dropped; where the loader gave no indices, in rank order). Throws CheckpointError naming the
  /// file when a rank's file is missing, does not verify, or is from another run, and when the
  /// ranks' predictions differ in kind or shape.
  static Batch read(const std::string& dirpath);

 private:
  std::string dirpath_;
  std::string run_id_;
};

}  // namespace fulgur
