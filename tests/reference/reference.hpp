// The independent reference of the w4a8moe operator (docs/operator.md), for the tests.
//
// It shares no code with src/ and does not include the library header: its inputs are plain
// vectors of floats (already converted from bf16/f16 by the caller) and int4 values held in
// int8. Two references:
//
//   exact_forward: the contract itself. quant_row in f32 exactly as docs/operator.md says, exact
//     integer dot products, group and scale sums in double, the activation in double, the
//     intermediate converted to f32 and requantized likewise, the output accumulated in double.
//   float_forward: dequantized weights (w * s), no activation quantization, double math (like
//     ref_int4_moe of vLLM's dynamic 4-bit int MoE CPU test). The distance to it is what the int8
//     activations cost.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace moe_ref {

// ---- 16-bit floats (round to nearest even, overflow to infinity, NaN stays NaN) --------------

float bf16_to_f32(uint16_t bits);
uint16_t f32_to_bf16(float value);
float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);

// ---- the operator's pieces --------------------------------------------------------------------

// Integer codes of docs/operator.md, "Activations".
enum class Act : int { swiglustep = 0, swigluoai = 1, silu = 2, gelu = 3, gelu_tanh = 4 };

// act(gate, up) in double; throws std::invalid_argument for an unknown code.
double activation(int code, double gate, double up, double alpha, double limit);

// quant_row (docs/operator.md, "Activation quantization") on one f32 row.
struct QuantRow {
  std::vector<int32_t> q;  // in [-128, 127]
  float scale = 1.0f;      // 255 / (max - min)
  float recip = 1.0f;      // 1 / scale: the size of one quantization step
  float zero_point_f = 0;  // zf before rounding
  int32_t zp = 0;
  bool finite = true;  // false: the row holds NaN or Inf (q, scale, recip are then unused)
};
QuantRow quant_row(std::span<const float> a);

// ---- the problem ------------------------------------------------------------------------------

struct Problem {
  int64_t tokens = 0, hidden = 0, inter = 0, experts = 0, top_k = 0;
  int group_size = -1;  // -1: one scale per output row

  // The tensors start empty ({}: a designated initializer may leave them out).
  std::vector<float> x{};             // [T, H]
  std::vector<int64_t> ids{};         // [T, K], each in [0, E)
  std::vector<float> topk_weights{};  // [T, K]

  // Integer weight values: int4 in [-8, 7], or (mxfp4_values) MXFP4's doubled e2m1 values in
  // [-12, 12], whose scales are then the e8m0 scales halved. w13 rows are stored as given:
  // halves (rows [0, I) gate, [I, 2I) up) or interleaved (row 2j gate j, row 2j + 1 up j);
  // scales and biases follow the same rows.
  bool interleaved = false;
  bool mxfp4_values = false;
  bool zero_point_values = false;  // int4 less its zero point: w - z in [-15, 15]
  std::vector<int8_t> w13{};       // [E, 2I, H]
  std::vector<float> w13_scale{};  // [E, 2I, H/g] or [E, 2I]
  std::vector<float> w13_bias{};   // empty or [E, 2I]
  std::vector<int8_t> w2{};        // [E, H, I]
  std::vector<float> w2_scale{};   // [E, H, I/g] or [E, H]
  std::vector<float> w2_bias{};    // empty or [E, H]
  // Empty, or [E, H]: column c of expert e's w13 rows multiplies x[t, w13_input_order[e, c]]
  // (each row a permutation of [0, H)).
  std::vector<int32_t> w13_input_order{};

  int activation = static_cast<int>(Act::silu);
  float alpha = 1.702f;
  float limit = 7.0f;
  bool apply_router_weight_on_input = false;
};

// Throws std::invalid_argument when sizes, ids or the group size do not fit.
void check_problem(const Problem& p);

struct ExactOptions {
  // An intermediate element whose scaled value m * s lies within this distance of a rounding
  // boundary (or whose row's zero point does) may round the other way in an implementation that
  // computes m in f32: it is counted in `near_boundary` and covered by `allowance`. Elements whose
  // value is exact (e.g. L * L from two clamps) in a row whose extremes are exact are computed
  // identically everywhere and never count. An f32 implementation moves m * s by about
  // 255 * (a few ulps) ~ 1e-4; the margin is ten times that.
  double boundary_margin = 2e-3;
  // For negative tests only: swap the gate and up halves (a deliberately wrong reference).
  bool swap_gate_up = false;
};

struct ExactResult {
  std::vector<double> out;  // [T, H], accumulated in double (before rounding to a dtype)
  // Per (token, slot), [T, K]: the step of the requantized intermediate row (its recip) and the
  // number of its elements near a rounding boundary.
  std::vector<float> recip_m;
  std::vector<int64_t> near_boundary;
  // Distinct (m, scale) pairs among the near elements of the whole call: equal values scaled
  // equally (e.g. clamped at a limit) round the same way, one event.
  int64_t near_boundary_events = 0;
  // [T, H]: the largest change one-step flips of the near-boundary intermediate elements can
  // make: SUM over slots and near elements j of |r| * recip_m * |s2[n, j / g]| * |w2[n, j]|
  // (r = 1 when the router weight is applied on the input).
  std::vector<double> allowance;
  int64_t intermediate_elements = 0;  // T * K * I: the denominator for near_boundary counts
  std::vector<uint8_t> token_finite;  // [T]: 0 if the token's row held NaN or Inf (out is NaN)
};

ExactResult exact_forward(const Problem& p, const ExactOptions& options = {});

// [T, H] in double. Tokens with NaN or Inf give NaN rows.
std::vector<double> float_forward(const Problem& p);

// ---- a dense linear layer (docs/operator.md, "Dense linear layers") --------------------------

// out[t, n] = recip_t * SUM_b s[n, b] * SUM_{k in b} (q_t[k] - zp_t) * w[n, k] + bias[n], in
// double, with (q_t, zp_t, recip_t) = quant_row(x[t]). x [T, K]; w [N, K] the integer weight
// values (int4 less its zero point, or MXFP4's doubled e2m1 values); scale [N, K/g], or [N]
// with group_size -1; bias empty or [N]. Rows of x with NaN or Inf give NaN rows.
std::vector<double> exact_linear(std::span<const float> x, int64_t tokens, int64_t cols,
                                 std::span<const int8_t> w, std::span<const float> scale,
                                 int64_t rows, int group_size, std::span<const float> bias);

}  // namespace moe_ref
