// Safetensors files: a checked reader, a writer, and the loader of w4a8moe case files.
//
// The format: an 8-byte little-endian header length N, N bytes of JSON, then the data region.
// The JSON maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative
// to the data region) and may hold "__metadata__", a string -> string map.
//
// The reader checks every field against the file before it touches the data, and copies each
// tensor into its own 64-byte aligned buffer, so a view never depends on the alignment of the
// bytes in the file and a hostile file can only produce an Error naming the file and the problem.
//
// The writer follows the reference implementation's layout so that any safetensors reader takes
// its files: tensors sorted by element size (largest first) then by name, packed without holes
// (each offset is thus a multiple of its element size), header padded with spaces to 8 bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "io/mapped_file.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {

// Limits of the reader: a header this long is no tensor index, and ranks stay small.
inline constexpr uint64_t kMaxHeaderBytes = 100u * 1000u * 1000u;
inline constexpr size_t kMaxRank = 8;

// "F32", "BF16", "F16", "I8", "U8", "I32", "I64" <-> DType.
const char* safetensors_dtype_name(DType dtype) noexcept;
std::optional<DType> parse_safetensors_dtype(std::string_view name) noexcept;

using Metadata = std::map<std::string, std::string, std::less<>>;

struct TensorEntry {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;  // rank 0 to kMaxRank
  size_t size_bytes = 0;       // product(shape) * dtype_bytes(dtype)
};

// A safetensors file read into memory and checked.
class SafetensorsFile {
 public:
  // Reads and checks the whole file; throws Error naming the file and the first problem.
  static SafetensorsFile read(const std::string& path);

  const std::string& path() const noexcept { return path_; }
  bool contains(std::string_view name) const;
  std::vector<std::string> names() const;  // sorted
  // The entry / bytes / view of a tensor; throw Error if the file has no tensor of that name.
  const TensorEntry& entry(std::string_view name) const;
  std::span<const uint8_t> bytes(std::string_view name) const;  // 64-byte aligned
  // A contiguous view; throws Error unless the rank is 1 to 3.
  TensorView view(std::string_view name) const;
  const Metadata& metadata() const noexcept { return metadata_; }

 private:
  struct AlignedFree {
    void operator()(uint8_t* p) const noexcept;
  };
  struct Tensor {
    TensorEntry entry;
    std::unique_ptr<uint8_t, AlignedFree> data;
  };
  const Tensor& find(std::string_view name) const;

  std::string path_;
  std::map<std::string, Tensor, std::less<>> tensors_;
  Metadata metadata_;
};

// Collects tensors (copying their bytes) and string metadata, then writes one file.
class SafetensorsWriter {
 public:
  // Throws Error if the name is empty, reserved ("__metadata__") or taken, if a dimension is
  // negative, or if size_bytes differs from product(shape) * dtype_bytes(dtype).
  void add(std::string name, DType dtype, std::vector<int64_t> shape, const void* data,
           size_t size_bytes);
  template <class T>
  void add(std::string name, DType dtype, std::vector<int64_t> shape,
           const std::vector<T>& values) {
    add(std::move(name), dtype, std::move(shape), values.data(), values.size() * sizeof(T));
  }
  void set_metadata(std::string key, std::string value);

  // The whole file as bytes.
  std::vector<uint8_t> serialize() const;
  // Writes to a temporary file next to `path`, then renames it to `path`. Throws Error on
  // failure (and leaves no temporary file behind).
  void write(const std::string& path) const;

 private:
  struct Pending {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::vector<Pending> tensors_;
  Metadata metadata_;
};

// ---- memory-mapped reader (checkpoints) ------------------------------------------------------
// The same checks as SafetensorsFile::read, but the data stays in the file: bytes() points into a
// read-only mapping (aligned only as the file's offsets are), and release() drops a tensor's pages
// from the resident set once it was consumed, so a loader streams a large checkpoint.
class MappedSafetensors {
 public:
  // Maps and checks the file; throws Error naming the file and the first problem.
  static MappedSafetensors open(const std::string& path);

  const std::string& path() const noexcept { return file_.path(); }
  bool contains(std::string_view name) const;
  std::vector<std::string> names() const;  // sorted
  // Throw Error if the file has no tensor of that name.
  const TensorEntry& entry(std::string_view name) const;
  std::span<const uint8_t> bytes(std::string_view name) const;
  void release(std::string_view name) const;
  const Metadata& metadata() const noexcept { return metadata_; }

 private:
  struct Tensor {
    TensorEntry entry;
    uint64_t offset = 0;  // in the file
  };
  const Tensor& find(std::string_view name) const;

  MappedFile file_;
  std::map<std::string, Tensor, std::less<>> tensors_;
  Metadata metadata_;
};

// ---------------------------------------------------------------------------------------------
// Case files: the inputs of one forward call.
//
// Tensors: x [T, H] (F32/BF16/F16); topk_ids [T, K] (I32/I64); topk_weights [T, K];
// w13 (I8 [E, 2I, H] or U8 [E, 2I, H/2] nibble-packed), w13_scale, optional w13_bias [E, 2I];
// w2 (I8 [E, H, I] or U8 [E, H, I/2]), w2_scale, optional w2_bias [E, H].
// Metadata: group_size (required: "-1" or an integer), activation (required: silu, swigluoai,
// swiglustep, gelu, gelu_tanh), alpha and limit (optional numbers),
// apply_router_weight_on_input (optional: "true"/"false"), gate_up_layout (optional: "halves" or
// "interleaved"). Other metadata keys are ignored. Cross-tensor shapes are checked by the
// library's pack and forward calls, not here.

struct LoadedCase {
  LoadedCase() = default;
  LoadedCase(const LoadedCase&) = delete;  // the views point into `file`
  LoadedCase& operator=(const LoadedCase&) = delete;
  LoadedCase(LoadedCase&&) = default;  // moving keeps the tensor buffers in place
  LoadedCase& operator=(LoadedCase&&) = default;

  SafetensorsFile file;  // owns the bytes of every view below
  TensorView x, topk_ids, topk_weights;
  LogicalWeights weights;  // includes group_size and gate_up_layout
  MoeParams params;

  PackOptions pack_options() const {
    PackOptions options;
    options.group_size = weights.group_size;
    options.gate_up_layout = weights.gate_up_layout;
    return options;
  }
};

// Reads and checks a case file; throws Error naming the file and the tensor or metadata key.
LoadedCase load_case(const std::string& path);

}  // namespace w4a8moe::io
