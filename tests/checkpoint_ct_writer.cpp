// The compressed-tensors side of the checkpoint writers (checkpoint_writers.hpp): the folder
// writer (config.json, safetensors shards and their index), compressed-tensors' pack_to_int32,
// and GPTQ's and AWQ's module tensors as AutoGPTQ's and AutoAWQ's pack() lay them out.
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "checkpoint_writers.hpp"
#include "io/safetensors_writer.hpp"

using w4a8moe::DType;

namespace ckpt_test {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// compressed-tensors

std::vector<int32_t> pack_int4_words(const std::vector<int8_t>& values, int64_t rows,
                                     int64_t cols) {
  const int64_t words = (cols + 7) / 8;
  std::vector<int32_t> out(static_cast<size_t>(rows * words), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t u = static_cast<uint32_t>(values[static_cast<size_t>(r * cols + c)] + 8);
      uint32_t& w = reinterpret_cast<uint32_t&>(out[static_cast<size_t>(r * words + c / 8)]);
      w |= u << (4 * (c % 8));
    }
  return out;
}

void CtWriter::write(const std::string& folder) const {
  fs::create_directories(folder);
  {
    std::ofstream out(fs::path(folder) / "config.json");
    out << config.dump(2);
  }
  std::vector<w4a8moe::io::SafetensorsWriter> writers(static_cast<size_t>(shards));
  nlohmann::json map = nlohmann::json::object();
  size_t i = 0;
  const auto file_name = [&](int k) {
    if (shards == 1) return std::string("model.safetensors");
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", k + 1, shards);
    return std::string(buf);
  };
  for (const auto& [name, t] : tensors) {
    const int k = static_cast<int>(i++ % static_cast<size_t>(shards));
    writers[static_cast<size_t>(k)].add(name, t.dtype, t.shape, t.bytes.data(), t.bytes.size());
    map[name] = file_name(k);
  }
  for (int k = 0; k < shards; ++k)
    writers[static_cast<size_t>(k)].write((fs::path(folder) / file_name(k)).string());
  if (shards > 1) {
    std::ofstream out(fs::path(folder) / "model.safetensors.index.json");
    out << nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", map}}.dump(2);
  }
}

std::vector<uint16_t> bf16_of(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_bits(v[i]);
  return out;
}

// One module's GPTQ or AWQ tensors from int4 values v [rows, cols] in [-8, 7], scales and zero
// points (in [-8, 7]; symmetric: all 0) [rows, groups], packed as AutoGPTQ's and AutoAWQ's
// pack() write them: GPTQ qweight [cols/8, rows] eight inputs a word (input 8i + j in bits 4j),
// AWQ qweight [cols, rows/8] eight outputs a word in the order 0 2 4 6 1 3 5 7 (bits 4i hold
// output 8w + order[i]); qzeros [groups, rows/8] packed like the outputs, GPTQ's "gptq" format
// storing zero - 1; scales F16 [groups, rows]; GPTQ's g_idx [cols] as given (act-order), else
// k / group size.
void add_gptq_module(CtWriter& w, const std::string& p, bool awq, bool zeros_minus_one,
                     const std::vector<int8_t>& v, const std::vector<float>& sc,
                     const std::vector<int8_t>& z, int64_t rows, int64_t cols, int64_t groups,
                     const std::vector<int32_t>& g_idx_given) {
  constexpr int kAwqOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  const auto u = [](int8_t x) { return static_cast<uint32_t>(x + 8); };
  std::vector<uint32_t> qweight(static_cast<size_t>(rows * cols / 8), 0);
  if (!awq) {
    for (int64_t i = 0; i < cols / 8; ++i)
      for (int64_t n = 0; n < rows; ++n)
        for (int j = 0; j < 8; ++j)
          qweight[static_cast<size_t>(i * rows + n)] |=
              u(v[static_cast<size_t>(n * cols + 8 * i + j)]) << (4 * j);
  } else {
    for (int64_t k = 0; k < cols; ++k)
      for (int64_t c = 0; c < rows / 8; ++c)
        for (int i = 0; i < 8; ++i)
          qweight[static_cast<size_t>(k * (rows / 8) + c)] |=
              u(v[static_cast<size_t>((8 * c + kAwqOrder[i]) * cols + k)]) << (4 * i);
  }
  std::vector<uint32_t> qzeros(static_cast<size_t>(groups * rows / 8), 0);
  for (int64_t b = 0; b < groups; ++b)
    for (int64_t c = 0; c < rows / 8; ++c)
      for (int i = 0; i < 8; ++i) {
        const int64_t n = 8 * c + (awq ? kAwqOrder[i] : i);
        const uint32_t stored =
            u(z[static_cast<size_t>(n * groups + b)]) - (zeros_minus_one ? 1 : 0);
        qzeros[static_cast<size_t>(b * (rows / 8) + c)] |= (stored & 15u) << (4 * i);
      }
  std::vector<uint16_t> scales(static_cast<size_t>(groups * rows));
  for (int64_t b = 0; b < groups; ++b)
    for (int64_t n = 0; n < rows; ++n)
      scales[static_cast<size_t>(b * rows + n)] = f16_bits(sc[static_cast<size_t>(n * groups + b)]);
  w.add(p + "qweight", DType::i32,
        awq ? std::vector<int64_t>{cols, rows / 8} : std::vector<int64_t>{cols / 8, rows}, qweight);
  w.add(p + "qzeros", DType::i32, {groups, rows / 8}, qzeros);
  w.add(p + "scales", DType::f16, {groups, rows}, scales);
  if (!awq) {
    std::vector<int32_t> g_idx = g_idx_given;
    if (g_idx.empty())
      for (int64_t k = 0; k < cols; ++k) g_idx.push_back(static_cast<int32_t>(k / (cols / groups)));
    w.add(p + "g_idx", DType::i32, {cols}, g_idx);
  }
}

}  // namespace ckpt_test
