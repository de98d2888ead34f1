// w4a8moe_gguf_dequant FILE.gguf OUT.safetensors: every tensor of FILE that the checkpoint loader
// can dequantize, read by the library's GGUF reader and dequantizer (src/io), written as F32 with
// its GGUF dimensions reversed (row-major, ne[0] innermost). The Python tests compare the result
// with the dequantization of the gguf package (llama.cpp's own Python code) on files that package
// wrote and quantized. Tensors of other types are listed in metadata "skipped".
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "io/ggml_types.hpp"
#include "io/gguf.hpp"
#include "io/safetensors_writer.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s FILE.gguf OUT.safetensors\n", argv[0]);
    return 2;
  }
  try {
    using namespace w4a8moe::io;
    const GgufFile file = GgufFile::open(argv[1]);
    SafetensorsWriter out;
    std::string skipped;
    for (const GgufTensor& t : file.tensors()) {
      const auto info = ggml_type_info(t.type);
      if (!info || !info->dequantizable) {
        skipped += (skipped.empty() ? "" : ",") + t.name + ":" + ggml_type_label(t.type);
        continue;
      }
      const int64_t cols = t.ne[0];
      const int64_t rows = t.rows();
      std::vector<float> values(static_cast<size_t>(cols * rows));
      const auto bytes = file.bytes(t);
      for (int64_t r = 0; r < rows; ++r)
        ggml_dequantize_row(info->type, bytes.data() + static_cast<size_t>(r) * t.row_bytes(), cols,
                            values.data() + static_cast<size_t>(r * cols));
      std::vector<int64_t> shape;
      for (int d = t.n_dims - 1; d >= 0; --d) shape.push_back(t.ne[static_cast<size_t>(d)]);
      out.add(t.name, w4a8moe::DType::f32, shape, values);
    }
    out.set_metadata("skipped", skipped);
    out.write(argv[2]);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
