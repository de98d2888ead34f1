// Writes the seed corpora of the fuzz harnesses (fuzz/corpus/<harness>/seed-*): small valid
// inputs of every kind, which the fuzzers mutate. Run after changing an input format:
//   <build>/fuzz/w4a8moe_fuzz_seeds fuzz/corpus
// Inputs a fuzzer crashed on are added next to them by hand (crash-<sha1>), never regenerated.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "io/safetensors_writer.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

using namespace w4a8moe;
namespace fs = std::filesystem;

void write(const fs::path& file, const std::vector<uint8_t>& bytes) {
  fs::create_directories(file.parent_path());
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  std::printf("%s (%zu bytes)\n", file.string().c_str(), bytes.size());
}

struct Layer {
  int64_t E, H, I;
  int group;
  bool bias;
  std::vector<int8_t> w13, w2;
  std::vector<uint16_t> s13, s2;  // bf16
  std::vector<float> b13, b2;
  std::vector<float> x;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  int64_t T, K;
};

uint16_t bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

Layer make(int64_t E, int64_t H, int64_t I, int group, bool bias, int64_t T, int64_t K) {
  Layer l{E, H, I, group, bias, {}, {}, {}, {}, {}, {}, {}, {}, {}, T, K};
  const int64_t g13 = group < 0 ? 1 : H / group, g2 = group < 0 ? 1 : I / group;
  for (int64_t i = 0; i < E * 2 * I * H; ++i)
    l.w13.push_back(static_cast<int8_t>((i * 7) % 16 - 8));
  for (int64_t i = 0; i < E * H * I; ++i) l.w2.push_back(static_cast<int8_t>((i * 3) % 16 - 8));
  for (int64_t i = 0; i < E * 2 * I * g13; ++i)
    l.s13.push_back(bf16(0.01f * static_cast<float>(1 + i % 5)));
  for (int64_t i = 0; i < E * H * g2; ++i)
    l.s2.push_back(bf16(0.02f * static_cast<float>(1 + i % 3)));
  if (bias) {
    l.b13.assign(static_cast<size_t>(E * 2 * I), 0.1f);
    l.b2.assign(static_cast<size_t>(E * H), -0.05f);
  }
  for (int64_t i = 0; i < T * H; ++i) l.x.push_back(static_cast<float>(i % 13) / 6.0f - 1.0f);
  for (int64_t i = 0; i < T * K; ++i) l.ids.push_back(static_cast<int32_t>((i * 5 + i / K) % E));
  l.weights.assign(static_cast<size_t>(T * K), 0.5f);
  return l;
}

std::vector<int64_t> scale_shape(const Layer& l, int64_t rows, int64_t cols) {
  if (l.group < 0) return {l.E, rows};
  return {l.E, rows, cols / l.group};
}

std::vector<uint8_t> case_file(const Layer& l, const char* activation) {
  io::SafetensorsWriter w;
  w.add("x", DType::f32, {l.T, l.H}, l.x);
  w.add("topk_ids", DType::i32, {l.T, l.K}, l.ids);
  w.add("topk_weights", DType::f32, {l.T, l.K}, l.weights);
  w.add("w13", DType::i8, {l.E, 2 * l.I, l.H}, l.w13);
  w.add("w2", DType::i8, {l.E, l.H, l.I}, l.w2);
  w.add("w13_scale", DType::bf16, scale_shape(l, 2 * l.I, l.H), l.s13);
  w.add("w2_scale", DType::bf16, scale_shape(l, l.H, l.I), l.s2);
  if (l.bias) {
    w.add("w13_bias", DType::f32, {l.E, 2 * l.I}, l.b13);
    w.add("w2_bias", DType::f32, {l.E, l.H}, l.b2);
  }
  w.set_metadata("group_size", std::to_string(l.group));
  w.set_metadata("activation", activation);
  return w.serialize();
}

struct Packed {
  PackedWeights w13, w2;
};

Packed pack(const Layer& l, const std::string& set) {
  PackOptions o;
  o.group_size = l.group;
  o.kernel_set = set;
  const auto s13 = scale_shape(l, 2 * l.I, l.H), s2 = scale_shape(l, l.H, l.I);
  auto view = [](const void* d, DType t, const std::vector<int64_t>& s) {
    TensorView v;
    v.data = d;
    v.dtype = t;
    v.rank = static_cast<int>(s.size());
    for (size_t i = 0; i < s.size(); ++i) v.shape[i] = s[i];
    return v;
  };
  Packed p;
  p.w13 = pack_w13(view(l.w13.data(), DType::i8, {l.E, 2 * l.I, l.H}),
                   view(l.s13.data(), DType::bf16, s13),
                   l.bias ? view(l.b13.data(), DType::f32, {l.E, 2 * l.I}) : TensorView{}, o);
  p.w2 = pack_w2(view(l.w2.data(), DType::i8, {l.E, l.H, l.I}), view(l.s2.data(), DType::bf16, s2),
                 l.bias ? view(l.b2.data(), DType::f32, {l.E, l.H}) : TensorView{}, o);
  return p;
}

void put24(std::vector<uint8_t>& v, size_t n) {
  v.push_back(static_cast<uint8_t>(n >> 16));
  v.push_back(static_cast<uint8_t>(n >> 8));
  v.push_back(static_cast<uint8_t>(n));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const fs::path root = argv[1];
  const Layer layers[] = {make(2, 32, 32, 32, false, 2, 2), make(3, 40, 24, -1, true, 3, 2),
                          make(2, 64, 32, 32, true, 1, 1)};
  const char* activations[] = {"silu", "swigluoai", "gelu_tanh"};

  // safetensors: case files, and two broken ones
  for (int i = 0; i < 3; ++i)
    write(root / "safetensors" / ("seed-case-" + std::to_string(i)),
          case_file(layers[i], activations[i]));
  std::vector<uint8_t> broken = case_file(layers[0], "silu");
  broken.resize(broken.size() / 2);
  write(root / "safetensors" / "seed-truncated", broken);
  const std::string json = "{\"x\":{\"dtype\":\"F32\",\"shape\":[1,2],\"data_offsets\":[0,8]}}";
  std::vector<uint8_t> tiny(8, 0);
  tiny[0] = static_cast<uint8_t>(json.size());
  tiny.insert(tiny.end(), json.begin(), json.end());
  tiny.resize(tiny.size() + 8, 0);
  write(root / "safetensors" / "seed-tiny", tiny);

  // packed: buffers of every layout this machine packs, checksums resealed by the harness
  int n = 0;
  std::vector<std::string> layouts;
  for (const std::string& set : available_kernel_sets()) {
    const std::string layout = pack(layers[0], set).w13.info().layout;
    if (std::find(layouts.begin(), layouts.end(), layout) != layouts.end()) continue;
    layouts.push_back(layout);
    for (const Layer& l : layers) {
      const Packed p = pack(l, set);
      std::vector<uint8_t> in = {static_cast<uint8_t>(n % 2 == 0 ? 0 : 3)};
      put24(in, p.w13.size());
      put24(in, p.w2.size());
      in.insert(in.end(), p.w13.bytes().begin(), p.w13.bytes().end());
      in.insert(in.end(), p.w2.bytes().begin(), p.w2.bytes().end());
      for (int i = 0; i < 32; ++i) in.push_back(static_cast<uint8_t>(i * 11));
      write(root / "packed" / ("seed-" + layout + "-" + std::to_string(n++)), in);
    }
  }

  // packed_file: files of two layouts, flags 0 (as written) and 3 (checksums resealed)
  const fs::path temp = fs::temp_directory_path() / "w4a8moe_seed.w4a8";
  n = 0;
  for (const std::string& set : {std::string("scalar"), active_kernel_set()})
    for (int i = 0; i < 2; ++i) {
      const Packed p = pack(layers[i + 1], set);
      PackedFileMeta meta;
      meta.has_params = i == 0;
      meta.top_k = layers[i + 1].K;
      save_packed(temp.string(), p.w13.bytes(), p.w2.bytes(), meta);
      std::ifstream f(temp, std::ios::binary);
      std::vector<uint8_t> in = {static_cast<uint8_t>(i == 0 ? 0 : 3)};
      in.insert(in.end(), std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
      write(root / "packed_file" / ("seed-" + set + "-" + std::to_string(n++)), in);
    }
  fs::remove(temp);

  // api: each operation once with all-zero choices (the valid defaults), and with a pattern
  for (int op = 0; op < 8; ++op) {
    std::vector<uint8_t> zeros(96, 0), mixed(96);
    zeros[0] = static_cast<uint8_t>(op);
    for (size_t i = 0; i < mixed.size(); ++i) mixed[i] = static_cast<uint8_t>((i * 37 + op) % 160);
    mixed[0] = static_cast<uint8_t>(op);
    write(root / "api" / ("seed-op" + std::to_string(op) + "-zeros"), zeros);
    write(root / "api" / ("seed-op" + std::to_string(op) + "-mixed"), mixed);
  }
  return 0;
}
