// ggml tensor types as stored in GGUF files: block sizes for validating sizes, and the
// dequantizers of the types the checkpoint loader converts.
//
// A quantized ggml row of ne[0] elements is ne[0] / block_elems blocks of block_bytes each.
// Layouts (little-endian; "half" is IEEE f16; q is element j's stored code):
//   Q4_0   {half d; u8 qs[16]}  x[j] = ((qs[j] & 15) - 8) d, x[j + 16] = ((qs[j] >> 4) - 8) d
//   Q4_1   {half d, m; u8 qs[16]}       x = q d + m
//   Q5_0   {half d; u8 qh[4]; u8 qs[16]}  5th bit of x[j] in bit j of qh; x = (q - 16) d
//   Q5_1   {half d, m; u8 qh[4]; u8 qs[16]}  x = q d + m
//   Q8_0   {half d; i8 qs[32]}          x = q d
//   Q4_K   {half d, dmin; u8 scales[12]; u8 qs[128]}  8 sub-blocks of 32: 6-bit scale and min
//   Q5_K   {half d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}
//   Q6_K   {u8 ql[128]; u8 qh[64]; i8 scales[16]; half d}
//   MXFP4  {u8 e; u8 qs[16]}            x = kvalues[q] * 2^(e - 128) (e2m1 values doubled)
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace w4a8moe::io {

enum class GgmlType : uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q8_1 = 9,
  q2_k = 10,
  q3_k = 11,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  q8_k = 15,
  iq2_xxs = 16,
  iq2_xs = 17,
  iq3_xxs = 18,
  iq1_s = 19,
  iq4_nl = 20,
  iq3_s = 21,
  iq2_s = 22,
  iq4_xs = 23,
  i8 = 24,
  i16 = 25,
  i32 = 26,
  i64 = 27,
  f64 = 28,
  iq1_m = 29,
  bf16 = 30,
  tq1_0 = 34,
  tq2_0 = 35,
  mxfp4 = 39,
};

struct GgmlTypeInfo {
  GgmlType type;
  const char* name;  // as ggml prints it: "Q4_0", "F16", ...
  int64_t block_elems;
  int64_t block_bytes;
  bool dequantizable;  // this build can turn it into floats
};

// The type's description, or nullopt for an id ggml does not define (or has removed).
std::optional<GgmlTypeInfo> ggml_type_info(uint32_t id) noexcept;
// "Q4_0", ..., or "unknown type 99" / "Q4_0_4_4 (removed from ggml)" for ids without a layout.
std::string ggml_type_label(uint32_t id);
// The names of the types dequantize_row takes, for messages.
const char* ggml_dequantizable_names() noexcept;

// n elements (a multiple of the block size) of a dequantizable type -> f32. The caller checked
// the type with ggml_type_info(...).dequantizable and the byte count.
void ggml_dequantize_row(GgmlType type, const uint8_t* src, int64_t n, float* dst);

}  // namespace w4a8moe::io
