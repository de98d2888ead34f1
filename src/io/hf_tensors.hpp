// The tensors of a Hugging Face checkpoint folder: one model.safetensors, or shards listed by
// model.safetensors.index.json ("weight_map": tensor -> file of the folder). Shards are mapped
// on first use (MappedSafetensors), from any thread.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "io/mapped_safetensors.hpp"

namespace w4a8moe::io {

class HfTensors {
 public:
  // Reads the index (or finds model.safetensors); throws Error naming the folder.
  explicit HfTensors(std::string folder);

  bool has(const std::string& name) const;
  // The shard holding a tensor; throws Error when the index does not list it or its shard does
  // not hold it.
  const MappedSafetensors& shard_of(const std::string& name) const;
  const TensorEntry& entry(const std::string& name) const { return shard_of(name).entry(name); }
  std::span<const uint8_t> bytes(const std::string& name) const {
    return shard_of(name).bytes(name);
  }
  // The tensor's file pages are no longer needed (MappedSafetensors::release).
  void release(const std::string& name) const { shard_of(name).release(name); }
  // A float tensor (F32, BF16, F16) converted to f32; Error when missing or of another dtype.
  std::vector<float> read_floats(const std::string& name) const;

 private:
  std::string folder_;
  std::map<std::string, std::string> weight_map_;  // tensor -> shard file (sharded checkpoints)
  std::string single_file_;                        // the file of unsharded checkpoints
  mutable std::mutex mutex_;
  mutable std::map<std::string, std::unique_ptr<MappedSafetensors>> shards_;
};

}  // namespace w4a8moe::io
