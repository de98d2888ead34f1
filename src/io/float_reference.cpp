// The float reference of a checkpoint layer (checkpoint.hpp, float_reference).
#include <algorithm>
#include <vector>

#include "common/activation.hpp"
#include "common/format.hpp"
#include "common/numeric.hpp"
#include "io/checkpoint.hpp"
#include "io/convert.hpp"
#include "thread_pool.hpp"

namespace w4a8moe::io {

using detail::cat;

namespace {

// Row n of a nibble-packed [rows, cols] matrix with its scales (and zero points, int4 with zero
// points), dequantized to double: int4 (w - z) * s for the nibble w + 8 (z = 0 without zero
// points), or mxfp4 e2m1(code) * 2^(e - 127).
void dequant_row(const uint8_t* w, const uint8_t* scales, const int8_t* zero_points,
                 DType scale_dtype, int group_size, WeightFormat format, int64_t cols, int64_t n,
                 std::vector<double>& out) {
  const int64_t groups = group_size == -1 ? 1 : cols / group_size;
  const int64_t g = group_size == -1 ? cols : group_size;
  out.resize(static_cast<size_t>(cols));
  const uint8_t* row = w + n * (cols / 2);
  if (format == WeightFormat::mxfp4) {  // the codes in the order of gpt-oss's blocks
    std::vector<float> values(static_cast<size_t>(cols));
    decode_mxfp4_row(row, scales + n * groups, cols, values.data());
    std::copy(values.begin(), values.end(), out.begin());
    return;
  }
  for (int64_t k = 0; k < cols; ++k) {
    const int64_t at = n * groups + k / g;
    const int q = ((row[k / 2] >> (4 * (k % 2))) & 0x0f) - 8;
    const int z = zero_points != nullptr ? zero_points[at] : 0;
    out[static_cast<size_t>(k)] =
        (q - z) * static_cast<double>(detail::load_float(scales, scale_dtype, at));
  }
}

// y [n_tok, rows] = x [n_tok, cols] times the dequantized nibble-packed w [rows, cols]^T, plus
// the bias (when given), in double.
std::vector<double> project(const uint8_t* w, const uint8_t* scales, const int8_t* zero_points,
                            DType scale_dtype, int group_size, WeightFormat format, int64_t rows,
                            int64_t cols, const float* bias, const std::vector<double>& x,
                            int64_t n_tok) {
  std::vector<double> y(static_cast<size_t>(n_tok * rows)), row;
  for (int64_t n = 0; n < rows; ++n) {
    dequant_row(w, scales, zero_points, scale_dtype, group_size, format, cols, n, row);
    const double b = bias != nullptr ? static_cast<double>(bias[n]) : 0.0;
    for (int64_t s = 0; s < n_tok; ++s) {
      double acc = 0.0;
      const double* xs = x.data() + s * cols;
      for (int64_t k = 0; k < cols; ++k) acc += row[static_cast<size_t>(k)] * xs[k];
      y[static_cast<size_t>(s * rows + n)] = acc + b;
    }
  }
  return y;
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

  threads = loader_threads(threads);
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
        for (int64_t k = 0; k < H; ++k) {  // column k of w13 multiplies input order[k]
          const int64_t input = slot.w13_input_order != nullptr ? slot.w13_input_order[k] : k;
          in[static_cast<size_t>(s * H + k)] =
              static_cast<double>(x[static_cast<size_t>(t * H + input)]) * r;
        }
      }
      const std::vector<double> h = project(
          slot.w13, slot.w13_scale, slot.w13_zero_point, info.w13_scale_dtype, info.group_size,
          info.w13_format, 2 * I, H, info.expert_bias ? slot.w13_bias : nullptr, in, n_tok);
      std::vector<double> m(static_cast<size_t>(n_tok * I));
      for (int64_t s = 0; s < n_tok; ++s)
        for (int64_t j = 0; j < I; ++j)
          m[static_cast<size_t>(s * I + j)] =
              detail::activation_f64(info.params, h[static_cast<size_t>(s * 2 * I + j)],
                                     h[static_cast<size_t>(s * 2 * I + I + j)]);
      const std::vector<double> y =
          project(slot.w2, slot.w2_scale, slot.w2_zero_point, info.w2_scale_dtype, info.group_size,
                  info.w2_format, H, I, info.expert_bias ? slot.w2_bias : nullptr, m, n_tok);
      for (int64_t s = 0; s < n_tok; ++s) {
        const int64_t i = list[static_cast<size_t>(s)], t = i / K;
        const double r = info.params.apply_router_weight_on_input
                             ? 1.0
                             : static_cast<double>(weights[static_cast<size_t>(i)]);
        for (int64_t n = 0; n < H; ++n)
          out[static_cast<size_t>(t * H + n)] += r * y[static_cast<size_t>(s * H + n)];
      }
    }
  });
  std::vector<double> out(static_cast<size_t>(T * H), 0.0);
  for (const std::vector<double>& p : partial)
    for (size_t i = 0; i < out.size(); ++i) out[i] += p[i];
  return out;
}

}  // namespace w4a8moe::io
