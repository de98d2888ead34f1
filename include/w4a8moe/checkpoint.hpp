// Packing straight from the quantized layouts checkpoints ship: GPTQ (gptq and gptq_v2), AWQ,
// compressed-tensors pack-quantized and MXFP4 (gpt-oss). The tensors are taken as the file (or
// an engine's loader) holds them and packed exactly, expert by expert, with no unpacked copy of
// the layer: the codes, zero points, scales and act-order are kept, never requantized.
//
//   PackedLayer layer = pack_checkpoint_moe(CheckpointFormat::gptq, w13, w2, options);
//   forward(context, x, ids, weights, layer.w13.bytes(), layer.w2.bytes(), params, out);
//
// The layouts of one projection stack (E experts, N outputs, K inputs, G = K / g groups, or 1
// for group_size -1; docs/checkpoints.md describes each bit):
//
//   format               weight                 scale             zero_point          g_idx
//   gptq, gptq_v2        i32 [E, K/8, N]        [E, G, N] float   i32 [E, G, N/8]     [E, K]
//   awq                  i32 [E, K, N/8]        [E, G, N] float   i32 [E, G, N/8]     -
//   compressed_tensors   i32 [E, N, K/8]        [E, N, G] float   i32 [E, N/8, G]     [E, K]
//   mxfp4                u8  [E, N, K/2] codes  u8 [E, N, K/32]   -                   -
//
// GPTQ packs eight inputs a word along K (input k of output n in bits 4 (k % 8) of word
// [k / 8, n], the unsigned q = w + 8), its zeros eight outputs a word (gptq stores zero - 1,
// gptq_v2 the zero); AWQ packs eight outputs a word along N in its order (output 8w + j in bits
// 4 kAwqNibble[j]), zeros likewise; compressed-tensors packs eight inputs a word along K (value +
// 8) and its zero points eight rows a word (z + 8). A g_idx other than k / g (act-order) becomes
// w13's input order (docs/operator.md, "Input order"), and w2's moves w13's gate and up rows
// with down's inputs. An empty zero_point means symmetric weights (GPTQ sym: every zero 8).
// For the dense layers (pack_checkpoint_linear) the same layouts without the leading E.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe {

enum class CheckpointFormat : uint8_t {
  gptq = 0,                // GPTQ checkpoint_format "gptq": zeros stored less one
  gptq_v2 = 1,             // GPTQ "gptq_v2": zeros as they are
  awq = 2,                 // AutoAWQ gemm
  compressed_tensors = 3,  // compressed-tensors pack-quantized int4
  mxfp4 = 4,               // OCP MX FP4 codes and e8m0 exponents (gpt-oss)
};
const char* checkpoint_format_name(CheckpointFormat format) noexcept;
// "gptq", "gptq_v2", "awq", "compressed-tensors" (or "compressed_tensors"), "mxfp4" -> format;
// anything else throws Error naming `argument`.
CheckpointFormat parse_checkpoint_format(std::string_view name,
                                         std::string_view argument = "format");

// The nibble of AWQ's words holding output 8w + j (the inverse of its packing order).
inline constexpr std::array<int, 8> kAwqNibble = {0, 4, 1, 5, 2, 6, 3, 7};

// One projection stack as the checkpoint holds it (layouts above). Empty views are absent.
struct CheckpointTensors {
  TensorView weight, scale, zero_point, g_idx, bias;  // bias [E, N] (pack_linear: [N])
};

struct PackedLayer {
  PackedWeights w13, w2;
};

// w13 (gate and up stacked as options.gate_up_layout says, N = 2I, K = H) and w2 (N = H, K = I)
// -> the two packed buffers forward() takes. options: group_size (mxfp4: 32), gate_up_layout,
// kernel_set, memory_limit and experts as for pack_w13 / pack_w2; the weight format follows from
// the checkpoint's (int4 with zero points when zero_point is given), scales are stored as given
// (mxfp4: bf16), and input_order comes from g_idx (PackOptions::input_order and weight_format
// must be left at their defaults). Throws Error naming the tensor ("w13.g_idx", "w2.zero_point",
// ...) that does not hold what its format says: a wrong shape or dtype, a g_idx that does not
// put group_size inputs in each group, a GPTQ zero of 16, an e8m0 exponent of 255.
PackedLayer pack_checkpoint_moe(CheckpointFormat format, const CheckpointTensors& w13,
                                const CheckpointTensors& w2, const PackOptions& options);

// A dense layer in the same layouts, rank 2 (no E; bias [N]) -> pack_linear's buffer. Act-order
// is refused (a dense layer's input order is not a packed feature).
PackedWeights pack_checkpoint_linear(CheckpointFormat format, const CheckpointTensors& w,
                                     const PackOptions& options);

}  // namespace w4a8moe
