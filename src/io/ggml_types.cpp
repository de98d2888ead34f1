#include "io/ggml_types.hpp"

#include <bit>
#include <cstring>

#include "common/format.hpp"
#include "common/numeric.hpp"

namespace w4a8moe::io {

namespace {

constexpr GgmlTypeInfo kTypes[] = {
    {GgmlType::f32, "F32", 1, 4, true},
    {GgmlType::f16, "F16", 1, 2, true},
    {GgmlType::q4_0, "Q4_0", 32, 18, true},
    {GgmlType::q4_1, "Q4_1", 32, 20, true},
    {GgmlType::q5_0, "Q5_0", 32, 22, true},
    {GgmlType::q5_1, "Q5_1", 32, 24, true},
    {GgmlType::q8_0, "Q8_0", 32, 34, true},
    {GgmlType::q8_1, "Q8_1", 32, 36, false},
    {GgmlType::q2_k, "Q2_K", 256, 84, false},
    {GgmlType::q3_k, "Q3_K", 256, 110, false},
    {GgmlType::q4_k, "Q4_K", 256, 144, true},
    {GgmlType::q5_k, "Q5_K", 256, 176, true},
    {GgmlType::q6_k, "Q6_K", 256, 210, true},
    {GgmlType::q8_k, "Q8_K", 256, 292, false},
    {GgmlType::iq2_xxs, "IQ2_XXS", 256, 66, false},
    {GgmlType::iq2_xs, "IQ2_XS", 256, 74, false},
    {GgmlType::iq3_xxs, "IQ3_XXS", 256, 98, false},
    {GgmlType::iq1_s, "IQ1_S", 256, 50, false},
    {GgmlType::iq4_nl, "IQ4_NL", 32, 18, false},
    {GgmlType::iq3_s, "IQ3_S", 256, 110, false},
    {GgmlType::iq2_s, "IQ2_S", 256, 82, false},
    {GgmlType::iq4_xs, "IQ4_XS", 256, 136, false},
    {GgmlType::i8, "I8", 1, 1, false},
    {GgmlType::i16, "I16", 1, 2, false},
    {GgmlType::i32, "I32", 1, 4, false},
    {GgmlType::i64, "I64", 1, 8, false},
    {GgmlType::f64, "F64", 1, 8, false},
    {GgmlType::iq1_m, "IQ1_M", 256, 56, false},
    {GgmlType::bf16, "BF16", 1, 2, true},
    {GgmlType::tq1_0, "TQ1_0", 256, 54, false},
    {GgmlType::tq2_0, "TQ2_0", 256, 66, false},
    {GgmlType::mxfp4, "MXFP4", 32, 17, true},
};

struct Removed {
  uint32_t id;
  const char* name;
};
constexpr Removed kRemoved[] = {{4, "Q4_2"},        {5, "Q4_3"},       {31, "Q4_0_4_4"},
                                {32, "Q4_0_4_8"},   {33, "Q4_0_8_8"},  {36, "IQ4_NL_4_4"},
                                {37, "IQ4_NL_4_8"}, {38, "IQ4_NL_8_8"}};

float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return detail::f16_to_f32(h);
}

constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128): half of the E8M0 scale 2^(e - 127), since the table holds doubled values.
float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
  return std::bit_cast<float>(bits);
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block.
void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void dequant_block(GgmlType type, const uint8_t* b, float* y) {
  switch (type) {
    case GgmlType::q4_0: {
      const float d = half(b);
      for (int j = 0; j < 16; ++j) {
        y[j] = static_cast<float>((b[2 + j] & 0x0f) - 8) * d;
        y[j + 16] = static_cast<float>((b[2 + j] >> 4) - 8) * d;
      }
      return;
    }
    case GgmlType::q4_1: {
      const float d = half(b), m = half(b + 2);
      for (int j = 0; j < 16; ++j) {
        y[j] = static_cast<float>(b[4 + j] & 0x0f) * d + m;
        y[j + 16] = static_cast<float>(b[4 + j] >> 4) * d + m;
      }
      return;
    }
    case GgmlType::q5_0:
    case GgmlType::q5_1: {
      const bool one = type == GgmlType::q5_1;
      // Q5_0 has no m: adding -0.0 changes no value and keeps the sign of a zero (q = 16 with a
      // negative d is -0.0 in ggml, as in the gguf package; + 0.0 would make it +0.0).
      const float d = half(b), m = one ? half(b + 2) : -0.0f;
      uint32_t qh;
      std::memcpy(&qh, b + (one ? 4 : 2), 4);
      const uint8_t* qs = b + (one ? 8 : 6);
      const int offset = one ? 0 : 16;
      for (int j = 0; j < 16; ++j) {
        const int h0 = static_cast<int>(((qh >> j) << 4) & 0x10);
        const int h1 = static_cast<int>((qh >> (j + 12)) & 0x10);
        y[j] = static_cast<float>(((qs[j] & 0x0f) | h0) - offset) * d + m;
        y[j + 16] = static_cast<float>(((qs[j] >> 4) | h1) - offset) * d + m;
      }
      return;
    }
    case GgmlType::q8_0: {
      const float d = half(b);
      for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
      return;
    }
    case GgmlType::q4_k:
    case GgmlType::q5_k: {
      const bool five = type == GgmlType::q5_k;
      const float d = half(b), dmin = half(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* ql = b + (five ? 48 : 16);
      int is = 0;
      uint8_t u1 = 1, u2 = 2;
      for (int j = 0; j < 256; j += 64) {
        int sc, m;
        scale_min_k4(is, scales, sc, m);
        const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
        scale_min_k4(is + 1, scales, sc, m);
        const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(m);
        for (int l = 0; l < 32; ++l) {
          const int h = five && (qh[l] & u1) ? 16 : 0;
          y[j + l] = d1 * static_cast<float>((ql[l] & 0x0f) + h) - m1;
        }
        for (int l = 0; l < 32; ++l) {
          const int h = five && (qh[l] & u2) ? 16 : 0;
          y[j + 32 + l] = d2 * static_cast<float>((ql[l] >> 4) + h) - m2;
        }
        ql += 32;
        is += 2;
        u1 = static_cast<uint8_t>(u1 << 2);
        u2 = static_cast<uint8_t>(u2 << 2);
      }
      return;
    }
    case GgmlType::q6_k: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half(b + 208);
      for (int n = 0; n < 256; n += 128) {
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          y[n + l] = d * static_cast<float>(sc[is + 0]) * static_cast<float>(q1);
          y[n + l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
          y[n + l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
          y[n + l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
        }
        ql += 64;
        qh += 32;
        sc += 8;
      }
      return;
    }
    case GgmlType::mxfp4: {
      const float d = e8m0_half(b[0]);
      for (int j = 0; j < 16; ++j) {
        y[j] = static_cast<float>(kMxfp4Values[b[1 + j] & 0x0f]) * d;
        y[j + 16] = static_cast<float>(kMxfp4Values[b[1 + j] >> 4]) * d;
      }
      return;
    }
    default:
      return;  // unreachable: callers check dequantizable
  }
}

}  // namespace

std::optional<GgmlTypeInfo> ggml_type_info(uint32_t id) noexcept {
  for (const GgmlTypeInfo& t : kTypes)
    if (static_cast<uint32_t>(t.type) == id) return t;
  return std::nullopt;
}

std::string ggml_type_label(uint32_t id) {
  if (const auto info = ggml_type_info(id)) return info->name;
  for (const Removed& r : kRemoved)
    if (r.id == id) return detail::cat(r.name, " (type ", id, ", removed from ggml)");
  return detail::cat("unknown type ", id);
}

const char* ggml_dequantizable_names() noexcept {
  return "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and MXFP4";
}

void ggml_dequantize_row(GgmlType type, const uint8_t* src, int64_t n, float* dst) {
  switch (type) {
    case GgmlType::f32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case GgmlType::f16:
    case GgmlType::bf16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = type == GgmlType::f16 ? detail::f16_to_f32(h) : detail::bf16_to_f32(h);
      }
      return;
    default: {
      const GgmlTypeInfo info = *ggml_type_info(static_cast<uint32_t>(type));
      for (int64_t blk = 0; blk < n / info.block_elems; ++blk)
        dequant_block(type, src + blk * info.block_bytes, dst + blk * info.block_elems);
    }
  }
}

}  // namespace w4a8moe::io
