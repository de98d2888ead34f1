// What the commands that call forward() (bench, run, layer) share: the Context made from the
// execution options, the packed experts (packed here, as `pack` does too, or mapped from a W.w4a8
// file), the output tensor's storage, and the clock.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "io/safetensors_writer.hpp"
#include "w4a8moe/commands.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::cli {

// The Context the forward calls of a command run on.
// The Context of a command's forward calls, as its options say (Context is not movable: the
// caller owns it, this sets it up).
inline void configure_context(Context& context, const ExecutionOptions& options) {
  if (options.spin_us == -1) return;  // the library's default
  const std::chrono::microseconds wait(options.spin_us);
  if (wait.count() < 0 || wait > Context::kMaxSpinWait)
    throw Error("--spin-us: expected 0 to " + std::to_string(Context::kMaxSpinWait.count()) +
                " microseconds, got " + std::to_string(options.spin_us));
  context.set_spin_wait(wait);
}

// The two packed buffers forward() takes, packed here or mapped from a W.w4a8 file, with what
// owns their bytes.
struct PackedExperts {
  PackedFile file;                      // from_file()
  PackedWeights w13_packed, w2_packed;  // pack()
  std::span<const uint8_t> w13, w2;

  // Maps (and unless skip_checksum hashes) a file written by `w4a8moe pack`.
  static PackedExperts open(const std::string& path, bool skip_checksum) {
    PackedFileOptions file_options;
    file_options.verify_checksum = !skip_checksum;
    PackedExperts e;
    e.file = PackedFile::open(path, file_options);
    e.w13 = e.file.w13();
    e.w2 = e.file.w2();
    return e;
  }

  // Packs the logical weights for the kernel set in `options` (w13 with its input order).
  static PackedExperts pack(const LogicalWeights& w, PackOptions options) {
    PackedExperts e;
    options.input_order = w.w13_input_order;
    e.w13_packed = pack_w13(w.w13, w.w13_scale, w.w13_zero_point, w.w13_bias, options);
    options.input_order = {};
    e.w2_packed = pack_w2(w.w2, w.w2_scale, w.w2_zero_point, w.w2_bias, options);
    e.w13 = e.w13_packed.bytes();
    e.w2 = e.w2_packed.bytes();
    return e;
  }
};

// A [rows, cols] output tensor of `dtype` in 8-byte aligned storage. The shape is that of a
// checked input, so rows * cols * the element size is the size of bytes that exist in memory.
struct OutputTensor {
  OutputTensor(DType dtype, int64_t rows, int64_t cols)
      : bytes(static_cast<size_t>(rows) * static_cast<size_t>(cols) * dtype_bytes(dtype)),
        storage(bytes / sizeof(uint64_t) + 1),
        view(MutableTensorView::of(storage.data(), dtype, {rows, cols})) {}
  OutputTensor(const OutputTensor&) = delete;  // `view` points into `storage`
  OutputTensor& operator=(const OutputTensor&) = delete;

  // Adds the tensor, as `name`, to a file being written.
  void add_to(io::SafetensorsWriter& writer, const std::string& name) const {
    writer.add(name, view.dtype, {view.shape[0], view.shape[1]}, storage.data(), bytes);
  }

  size_t bytes;
  std::vector<uint64_t> storage;
  MutableTensorView view;
};

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace w4a8moe::cli
