// The checkpoint layer pipeline shared by both loaders: row conversion, chunk buffers, streamed
// packing and the float reference.
#include "io/checkpoint.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/activation.hpp"
#include "common/format.hpp"
#include "common/numeric.hpp"
#include "io/convert.hpp"
#include "thread_pool.hpp"
#include "w4a8moe/expert_packer.hpp"

namespace w4a8moe::io {

using detail::cat;

// ---------------------------------------------------------------------------------------------
// Row conversion

void pack_nibbles(const int8_t* values, int64_t n, uint8_t* dst) {
  for (int64_t j = 0; j < n / 2; ++j)
    dst[j] = static_cast<uint8_t>((values[2 * j] + 8) | ((values[2 * j + 1] + 8) << 4));
}

void store_scale(uint8_t* dst, DType dtype, int64_t i, float value) {
  detail::store_float(dst, dtype, i, value);
}

void convert_row(const float* row, int64_t n, int group_size, QuantRule rule, uint8_t* nibbles,
                 float* scales, Conversion& stats, const std::string& what) {
  QuantizedWeights q;
  try {
    q = quantize_weights(TensorView::of(row, DType::f32, {1, 1, n}), group_size, rule);
  } catch (const Error& e) {
    throw Error(cat(what, ": ", e.what()));
  }
  pack_nibbles(q.values.data(), n, nibbles);
  const int64_t g = group_size == -1 ? n : group_size;
  std::copy(q.scales.begin(), q.scales.end(), scales);
  for (int64_t k = 0; k < n; ++k) {
    const double ref = static_cast<double>(row[k]);
    const double got = static_cast<double>(q.values[static_cast<size_t>(k)]) *
                       static_cast<double>(q.scales[static_cast<size_t>(k / g)]);
    const double err = got - ref;
    stats.err_sq += err * err;
    stats.ref_sq += ref * ref;
    stats.max_abs_err = std::max(stats.max_abs_err, std::fabs(err));
  }
  stats.elements += n;
}

void gather_columns(const uint8_t* matrix, DType dtype, int64_t in, int64_t out, int64_t first,
                    int64_t step, int64_t count, float* dst) {
  for (int64_t k = 0; k < in; ++k) {
    const int64_t at = k * out + first;
    for (int64_t r = 0; r < count; ++r)
      dst[r * in + k] = detail::load_float(matrix, dtype, at + r * step);
  }
}

void decode_mxfp4_row(const uint8_t* blocks, const uint8_t* scales, int64_t n, float* dst) {
  static constexpr float kE2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int64_t g = 0; g < n / 32; ++g) {
    const float s = std::ldexp(1.0f, static_cast<int>(scales[g]) - 127);
    for (int64_t b = 0; b < 16; ++b) {
      const uint8_t v = blocks[g * 16 + b];
      dst[g * 32 + 2 * b] = kE2m1[v & 15] * s;
      dst[g * 32 + 2 * b + 1] = kE2m1[v >> 4] * s;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// LayerSource

std::vector<Conversion> LayerSource::conversions() const {
  std::lock_guard lock(mutex_);
  return conversions_;
}

void LayerSource::add_conversion(int index, const Conversion& delta) const {
  std::lock_guard lock(mutex_);
  Conversion& c = conversions_.at(static_cast<size_t>(index));
  c.err_sq += delta.err_sq;
  c.ref_sq += delta.ref_sq;
  c.max_abs_err = std::max(c.max_abs_err, delta.max_abs_err);
  c.elements += delta.elements;
}

std::unique_ptr<LayerSource> open_layer(const std::string& path, int layer,
                                        const LoadOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) throw Error(cat("model '", path, "': no such file or folder"));
  if (layer < 0) throw Error(cat("--layer: expected a layer index >= 0, got ", layer));
  if (fs::is_directory(status)) return open_compressed_tensors_layer(path, layer, options);
  char magic[4] = {};
  std::ifstream in(path, std::ios::binary);
  in.read(magic, 4);
  if (in.gcount() == 4 && std::memcmp(magic, "GGUF", 4) == 0)
    return open_gguf_layer(path, layer, options);
  if (path.size() >= 5 && path.substr(path.size() - 5) == ".gguf")
    return open_gguf_layer(path, layer, options);  // reports the bad magic
  throw Error(cat("model '", path,
                  "': expected a .gguf file or a folder with config.json and safetensors files"));
}

void route_tokens(const LayerSource& source, const Router& router, const TensorView& x,
                  std::vector<int32_t>& ids, std::vector<float>& weights) {
  const LayerInfo& info = source.info();
  const int64_t T = x.shape[0], E = info.experts, K = info.top_k, H = info.hidden;
  ids.assign(static_cast<size_t>(T * K), 0);
  weights.assign(static_cast<size_t>(T * K), 1.0f);
  if (router.weight.empty()) {
    if (E != 1 || K != 1) throw Error(cat("layer ", info.layer, ": the router is missing"));
    return;  // a shared expert without a gate: every token, weight 1
  }
  std::vector<float> logits(static_cast<size_t>(T * E));
  router_logits(
      x, TensorView::of(router.weight.data(), DType::f32, {E, H}),
      router.bias.empty() ? TensorView{} : TensorView::of(router.bias.data(), DType::f32, {E}),
      MutableTensorView::of(logits.data(), DType::f32, {T, E}));
  route(TensorView::of(logits.data(), DType::f32, {T, E}),
        router.selection_bias.empty()
            ? TensorView{}
            : TensorView::of(router.selection_bias.data(), DType::f32, {E}),
        info.routing, MutableTensorView::of(ids.data(), DType::i32, {T, K}),
        MutableTensorView::of(weights.data(), DType::f32, {T, K}));
}

// ---------------------------------------------------------------------------------------------
// Chunks of expert slots

SlotSizes slot_sizes(const LayerInfo& info) {
  const auto H = static_cast<size_t>(info.hidden), I = static_cast<size_t>(info.inter);
  const size_t g13 = info.group_size == -1 ? 1 : H / static_cast<size_t>(info.group_size);
  const size_t g2 = info.group_size == -1 ? 1 : I / static_cast<size_t>(info.group_size);
  SlotSizes s;
  s.w13 = 2 * I * H / 2;
  s.w13_scale = 2 * I * g13 * dtype_bytes(info.w13_scale_dtype);
  s.w2 = H * I / 2;
  s.w2_scale = H * g2 * dtype_bytes(info.w2_scale_dtype);
  if (info.expert_bias) {
    s.w13_bias = 2 * I * sizeof(float);
    s.w2_bias = H * sizeof(float);
  }
  return s;
}

ExpertChunk::ExpertChunk(const LayerInfo& info, int64_t count)
    : info_(info), sizes_(slot_sizes(info)), count_(count) {
  const auto n = static_cast<size_t>(count);
  w13_.resize(n * sizes_.w13);
  w13_scale_.resize(n * sizes_.w13_scale);
  w2_.resize(n * sizes_.w2);
  w2_scale_.resize(n * sizes_.w2_scale);
  w13_bias_.resize(n * sizes_.w13_bias / sizeof(float));
  w2_bias_.resize(n * sizes_.w2_bias / sizeof(float));
}

ExpertSlot ExpertChunk::slot(int64_t i) {
  const auto k = static_cast<size_t>(i);
  ExpertSlot s;
  s.w13 = w13_.data() + k * sizes_.w13;
  s.w13_scale = w13_scale_.data() + k * sizes_.w13_scale;
  s.w2 = w2_.data() + k * sizes_.w2;
  s.w2_scale = w2_scale_.data() + k * sizes_.w2_scale;
  if (info_.expert_bias) {
    s.w13_bias = w13_bias_.data() + k * (sizes_.w13_bias / sizeof(float));
    s.w2_bias = w2_bias_.data() + k * (sizes_.w2_bias / sizeof(float));
  }
  return s;
}

TensorView ExpertChunk::w13(int64_t n) const {
  return TensorView::of(w13_.data(), DType::u8, {n, 2 * info_.inter, info_.hidden / 2});
}
TensorView ExpertChunk::w13_scale(int64_t n) const {
  if (info_.group_size == -1)
    return TensorView::of(w13_scale_.data(), info_.w13_scale_dtype, {n, 2 * info_.inter});
  return TensorView::of(w13_scale_.data(), info_.w13_scale_dtype,
                        {n, 2 * info_.inter, info_.hidden / info_.group_size});
}
TensorView ExpertChunk::w13_bias(int64_t n) const {
  if (!info_.expert_bias) return {};
  return TensorView::of(w13_bias_.data(), DType::f32, {n, 2 * info_.inter});
}
TensorView ExpertChunk::w2(int64_t n) const {
  return TensorView::of(w2_.data(), DType::u8, {n, info_.hidden, info_.inter / 2});
}
TensorView ExpertChunk::w2_scale(int64_t n) const {
  if (info_.group_size == -1)
    return TensorView::of(w2_scale_.data(), info_.w2_scale_dtype, {n, info_.hidden});
  return TensorView::of(w2_scale_.data(), info_.w2_scale_dtype,
                        {n, info_.hidden, info_.inter / info_.group_size});
}
TensorView ExpertChunk::w2_bias(int64_t n) const {
  if (!info_.expert_bias) return {};
  return TensorView::of(w2_bias_.data(), DType::f32, {n, info_.hidden});
}

namespace {

int resolve_threads(int threads) {
  if (threads > 0) return threads;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

}  // namespace

PackedLayer pack_layer(const LayerSource& source, int threads,
                       const std::function<void(double)>& progress) {
  const LayerInfo& info = source.info();
  threads = resolve_threads(threads);
  const int64_t chunk = std::min<int64_t>(threads, info.experts);
  ExpertChunk buffers(info, chunk);
  PackOptions options;
  options.group_size = info.group_size;
  ExpertPacker p13(WeightRole::w13, info.experts, options);
  ExpertPacker p2(WeightRole::w2, info.experts, options);
  for (int64_t e0 = 0; e0 < info.experts; e0 += chunk) {
    const int64_t n = std::min(chunk, info.experts - e0);
    detail::parallel_for(n, threads, [&](int64_t i) {
      source.load_expert(e0 + i, buffers.slot(i));
      source.release_expert(e0 + i);
    });
    p13.append(buffers.w13(n), buffers.w13_scale(n), buffers.w13_bias(n));
    p2.append(buffers.w2(n), buffers.w2_scale(n), buffers.w2_bias(n));
    if (progress) progress(static_cast<double>(e0 + n) / static_cast<double>(info.experts));
  }
  return {std::move(p13).finish(), std::move(p2).finish()};
}

// ---------------------------------------------------------------------------------------------
// Float reference

namespace {

// Row n of a nibble-packed [rows, cols] matrix with its scales, dequantized to double.
void dequant_row(const uint8_t* w, const uint8_t* scales, DType scale_dtype, int group_size,
                 int64_t cols, int64_t n, std::vector<double>& out) {
  const int64_t groups = group_size == -1 ? 1 : cols / group_size;
  const int64_t g = group_size == -1 ? cols : group_size;
  out.resize(static_cast<size_t>(cols));
  const uint8_t* row = w + n * (cols / 2);
  for (int64_t k = 0; k < cols; ++k) {
    const int q = ((row[k / 2] >> (4 * (k % 2))) & 0x0f) - 8;
    const double s =
        static_cast<double>(detail::load_float(scales, scale_dtype, n * groups + k / g));
    out[static_cast<size_t>(k)] = q * s;
  }
}

}  // namespace

std::vector<double> float_reference(const LayerSource& source, const std::vector<float>& x,
                                    const std::vector<int32_t>& ids,
                                    const std::vector<float>& weights, int threads) {
  const LayerInfo& info = source.info();
  const int64_t H = info.hidden, I = info.inter, E = info.experts;
  const int64_t T = static_cast<int64_t>(x.size()) / H;
  const int64_t K = T == 0 ? 0 : static_cast<int64_t>(ids.size()) / T;
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(E));  // (t * K + k) per expert
  for (int64_t i = 0; i < T * K; ++i) {
    const int32_t e = ids[static_cast<size_t>(i)];
    if (e < 0 || e >= E) throw Error(cat("topk_ids: expected ids in [0, ", E, "), got ", e));
    slots[static_cast<size_t>(e)].push_back(i);
  }
  std::vector<int64_t> used;
  for (int64_t e = 0; e < E; ++e)
    if (!slots[static_cast<size_t>(e)].empty()) used.push_back(e);

  threads = resolve_threads(threads);
  const int64_t workers =
      std::clamp<int64_t>(threads, 1, std::max<int64_t>(1, static_cast<int64_t>(used.size())));
  std::vector<std::vector<double>> partial(static_cast<size_t>(workers),
                                           std::vector<double>(static_cast<size_t>(T * H), 0.0));
  std::vector<ExpertChunk> buffers;
  for (int64_t w = 0; w < workers; ++w) buffers.emplace_back(info, 1);
  detail::parallel_for(workers, static_cast<int>(workers), [&](int64_t w) {
    std::vector<double>& out = partial[static_cast<size_t>(w)];
    ExpertChunk& buf = buffers[static_cast<size_t>(w)];
    const ExpertSlot slot = buf.slot(0);
    std::vector<double> row, a;
    for (size_t u = static_cast<size_t>(w); u < used.size(); u += static_cast<size_t>(workers)) {
      const int64_t e = used[u];
      source.load_expert(e, slot);
      source.release_expert(e);
      const std::vector<int64_t>& list = slots[static_cast<size_t>(e)];
      const auto n_tok = static_cast<int64_t>(list.size());
      // inputs of the chosen slots
      std::vector<double> in(static_cast<size_t>(n_tok * H));
      for (int64_t s = 0; s < n_tok; ++s) {
        const int64_t i = list[static_cast<size_t>(s)], t = i / K;
        const double r = info.params.apply_router_weight_on_input
                             ? static_cast<double>(weights[static_cast<size_t>(i)])
                             : 1.0;
        for (int64_t k = 0; k < H; ++k)
          in[static_cast<size_t>(s * H + k)] =
              static_cast<double>(x[static_cast<size_t>(t * H + k)]) * r;
      }
      std::vector<double> h(static_cast<size_t>(n_tok * 2 * I));
      for (int64_t n = 0; n < 2 * I; ++n) {
        dequant_row(slot.w13, slot.w13_scale, info.w13_scale_dtype, info.group_size, H, n, row);
        const double b = info.expert_bias ? static_cast<double>(slot.w13_bias[n]) : 0.0;
        for (int64_t s = 0; s < n_tok; ++s) {
          double acc = 0.0;
          const double* xs = in.data() + s * H;
          for (int64_t k = 0; k < H; ++k) acc += row[static_cast<size_t>(k)] * xs[k];
          h[static_cast<size_t>(s * 2 * I + n)] = acc + b;
        }
      }
      std::vector<double> m(static_cast<size_t>(n_tok * I));
      for (int64_t s = 0; s < n_tok; ++s)
        for (int64_t j = 0; j < I; ++j)
          m[static_cast<size_t>(s * I + j)] =
              detail::activation_f64(info.params, h[static_cast<size_t>(s * 2 * I + j)],
                                     h[static_cast<size_t>(s * 2 * I + I + j)]);
      for (int64_t n = 0; n < H; ++n) {
        dequant_row(slot.w2, slot.w2_scale, info.w2_scale_dtype, info.group_size, I, n, row);
        const double b = info.expert_bias ? static_cast<double>(slot.w2_bias[n]) : 0.0;
        for (int64_t s = 0; s < n_tok; ++s) {
          double acc = 0.0;
          const double* ms = m.data() + s * I;
          for (int64_t j = 0; j < I; ++j) acc += row[static_cast<size_t>(j)] * ms[j];
          const int64_t i = list[static_cast<size_t>(s)], t = i / K;
          const double r = info.params.apply_router_weight_on_input
                               ? 1.0
                               : static_cast<double>(weights[static_cast<size_t>(i)]);
          out[static_cast<size_t>(t * H + n)] += r * (acc + b);
        }
      }
    }
  });
  std::vector<double> out(static_cast<size_t>(T * H), 0.0);
  for (const std::vector<double>& p : partial)
    for (size_t i = 0; i < out.size(); ++i) out[i] += p[i];
  return out;
}

}  // namespace w4a8moe::io
