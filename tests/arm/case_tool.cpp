// w4a8moe_case_tool: case files for comparing the program across machines (the Arm build under
// qemu against the x86 build).
//
//   w4a8moe_case_tool write DIR        writes DIR/<name>.safetensors for every case below
//   w4a8moe_case_tool compare REF GOT  compares tensor `out` of two `w4a8moe run` outputs
//
// The comparison applies the accuracy rule of docs/operator.md ("Accuracy") to two implementations
// of the same contract: each element within 1e-5 of the output's scale (plus one rounding step of a
// bf16/f16 output), except in rare rows, where a requantized intermediate value may differ by one
// step between the two (then the whole row moves by about recip * s * w, below 1e-2 of the scale).
// Outputs must be of order one, so an all-zero or all-NaN result fails.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "io/safetensors_file.hpp"
#include "io/safetensors_writer.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

using namespace w4a8moe;

struct Spec {
  const char* name;
  int64_t tokens, hidden, inter, experts, top_k;
  int group;
  DType x_dtype, float_dtype;
  Activation activation;
  bool bias, interleaved, nibbles, on_input;
};

// Small shapes (emulation runs about 1e9 MAC/s) with the features the kernels see: groupwise
// and channelwise, padded columns, 16-bit scales, biases, decode and prefill.
const Spec kCases[] = {
    {"decode_g32_f32_silu", 1, 256, 128, 8, 2, 32, DType::f32, DType::f32, Activation::silu, false,
     false, false, false},
    {"prefill_T37_g32_bf16_swigluoai_bias_interleaved", 37, 160, 96, 4, 2, 32, DType::bf16,
     DType::bf16, Activation::swigluoai, true, true, true, false},
    {"channelwise_T19_H200_f16_gelu_on_input", 19, 200, 72, 6, 3, -1, DType::f16, DType::f32,
     Activation::gelu, false, false, false, true},
    {"prefill_T64_g64_f32_gelu_tanh_f16_scales", 64, 256, 192, 8, 2, 64, DType::f32, DType::f16,
     Activation::gelu_tanh, true, false, false, false},
};

void add_floats(io::SafetensorsWriter& w, const char* name, DType dtype, std::vector<int64_t> shape,
                const std::vector<float>& v) {
  if (dtype == DType::f32) return w.add(name, dtype, std::move(shape), v);
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    detail::store_float(bits.data(), dtype, static_cast<int64_t>(i), v[i]);
  w.add(name, dtype, std::move(shape), bits);
}

// x ~ N(0, 1), int4 weights uniform, scales (1.5 to 3.5) / (8 sqrt(K)): outputs of order one.
void write_case(const Spec& s, const std::string& dir, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  io::SafetensorsWriter w;
  const int64_t T = s.tokens, H = s.hidden, I = s.inter, E = s.experts, K = s.top_k;
  std::vector<float> x(static_cast<size_t>(T * H));
  for (float& v : x) v = normal(rng);
  add_floats(w, "x", s.x_dtype, {T, H}, x);
  std::vector<int32_t> ids(static_cast<size_t>(T * K));
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint32_t>(E));
  w.add("topk_ids", DType::i32, {T, K}, ids);
  std::vector<float> tw(static_cast<size_t>(T * K));
  for (float& v : tw) v = 0.2f + 0.8f * uniform(rng);
  add_floats(w, "topk_weights", s.float_dtype, {T, K}, tw);
  const auto weights = [&](const std::string& name, int64_t rows, int64_t cols) {
    std::vector<int8_t> q(static_cast<size_t>(E * rows * cols));
    for (int8_t& v : q) v = static_cast<int8_t>(static_cast<int>(rng() % 16) - 8);
    if (s.nibbles) {
      std::vector<uint8_t> packed(q.size() / 2);
      for (size_t j = 0; j < packed.size(); ++j)
        packed[j] = static_cast<uint8_t>((q[2 * j] + 8) | ((q[2 * j + 1] + 8) << 4));
      w.add(name, DType::u8, {E, rows, cols / 2}, packed);
    } else {
      w.add(name, DType::i8, {E, rows, cols}, q);
    }
    const int64_t groups = s.group < 0 ? 1 : cols / s.group;
    std::vector<float> sc(static_cast<size_t>(E * rows * groups));
    const float base = 1.0f / (8.0f * std::sqrt(static_cast<float>(cols)));
    for (float& v : sc) v = (1.5f + 2.0f * uniform(rng)) * base;
    if (s.group < 0) {
      add_floats(w, (name + "_scale").c_str(), s.float_dtype, {E, rows}, sc);
    } else {
      add_floats(w, (name + "_scale").c_str(), s.float_dtype, {E, rows, groups}, sc);
    }
    if (s.bias) {
      std::vector<float> b(static_cast<size_t>(E * rows));
      for (float& v : b) v = uniform(rng) - 0.5f;
      add_floats(w, (name + "_bias").c_str(), s.float_dtype, {E, rows}, b);
    }
  };
  weights("w13", 2 * I, H);
  weights("w2", H, I);
  w.set_metadata("group_size", std::to_string(s.group));
  w.set_metadata("activation", activation_name(s.activation));
  w.set_metadata("gate_up_layout", s.interleaved ? "interleaved" : "halves");
  w.set_metadata("apply_router_weight_on_input", s.on_input ? "true" : "false");
  w.write(dir + "/" + s.name + ".safetensors");
}

std::vector<float> read_out(const io::SafetensorsFile& f, DType* dtype, int64_t* rows) {
  const io::TensorEntry& e = f.entry("out");
  if (e.shape.size() != 2) throw Error(f.path() + ": tensor out is not [T, H]");
  *dtype = e.dtype;
  *rows = e.shape[0];
  const auto bytes = f.bytes("out");
  std::vector<float> v(static_cast<size_t>(e.shape[0] * e.shape[1]));
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = detail::load_float(bytes.data(), e.dtype, static_cast<int64_t>(i));
  return v;
}

int compare(const std::string& ref_path, const std::string& got_path) {
  const io::SafetensorsFile ref_file = io::SafetensorsFile::read(ref_path);
  const io::SafetensorsFile got_file = io::SafetensorsFile::read(got_path);
  DType dtype, got_dtype;
  int64_t rows, got_rows;
  const std::vector<float> ref = read_out(ref_file, &dtype, &rows);
  const std::vector<float> got = read_out(got_file, &got_dtype, &got_rows);
  if (dtype != got_dtype || ref.size() != got.size() || rows != got_rows) {
    std::fprintf(stderr, "compare: out differs in dtype or shape\n");
    return 1;
  }
  const double u = dtype == DType::bf16 ? 0x1p-8 : (dtype == DType::f16 ? 0x1p-11 : 0.0);
  double scale = 0.0;
  for (float v : ref) scale = std::max(scale, std::fabs(static_cast<double>(v)));
  const int64_t cols = static_cast<int64_t>(ref.size()) / rows;
  int64_t step_rows = 0;
  double worst = 0.0, worst_row_excess = 0.0;
  bool ok = scale >= 0.1 && scale <= 1000.0;  // order one (NaN fails too)
  for (int64_t t = 0; t < rows; ++t) {
    double row_excess = 0.0;  // max over the row of |got - ref| / scale beyond the output step
    for (int64_t h = 0; h < cols; ++h) {
      const double r = static_cast<double>(ref[static_cast<size_t>(t * cols + h)]);
      const double g = static_cast<double>(got[static_cast<size_t>(t * cols + h)]);
      const double d = std::fabs(g - r);
      if (!(d == d)) ok = false;  // NaN
      worst = std::max(worst, d / scale);
      row_excess = std::max(row_excess, (d - u * std::fabs(r)) / scale);
    }
    if (row_excess > 1e-5) ++step_rows;
    worst_row_excess = std::max(worst_row_excess, row_excess);
  }
  const int64_t allowed_rows = std::max<int64_t>(1, rows / 16);
  ok = ok && step_rows <= allowed_rows && worst_row_excess <= 1e-2;
  std::printf(
      "%s: max |out| %.4g, max |diff| / max |out| %.3g, rows beyond 1e-5: %lld of %lld "
      "(allowed %lld, each below 1e-2: worst %.3g) -> %s\n",
      got_path.c_str(), scale, worst, static_cast<long long>(step_rows),
      static_cast<long long>(rows), static_cast<long long>(allowed_rows), worst_row_excess,
      ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "write" && argc == 3) {
      unsigned seed = 4000;
      for (const Spec& s : kCases) write_case(s, argv[2], ++seed);
      for (const Spec& s : kCases) std::printf("%s\n", s.name);
      return 0;
    }
    if (cmd == "compare" && argc == 4) return compare(argv[2], argv[3]);
    std::fprintf(stderr, "usage: %s write DIR | compare REF.safetensors GOT.safetensors\n",
                 argv[0]);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return 1;
  }
}
