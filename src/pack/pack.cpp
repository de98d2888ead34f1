// Logical int4 expert weights -> the packed buffer of the layout that the chosen kernel set reads.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "common/argument_checks.hpp"
#include "common/format.hpp"
#include "common/numeric.hpp"
#include "pack/pack_into.hpp"
#include "pack/packed_format.hpp"
#include "registry.hpp"
#include "thread_pool.hpp"

namespace w4a8moe {

static_assert(std::endian::native == std::endian::little,
              "the nibble shuffle of packs_nibbles_directly reads four bytes as one word: a "
              "little-endian CPU");

namespace detail {
namespace {

struct PackJob {
  const TensorView* w;
  const TensorView* scale;
  const TensorView* zero_point;  // int4_zero_point only
  const TensorView* bias;
  const TensorView* input_order;  // w13, when given
  WeightInput in;
  Geometry g;
  bool interleaved;
  std::string_view w_name;
};

// PackOptions::experts, checked against the tensors' experts; returns how many to pack.
int64_t selected_experts(const PackOptions& options, int64_t experts) {
  if (options.experts.empty()) return experts;
  for (const int32_t e : options.experts)
    if (e < 0 || e >= experts)
      throw Error(cat("PackOptions::experts: expected expert indices in [0, ", experts,
                      ") (the tensors' experts), got ", e));
  std::vector<int32_t> sorted = options.experts;  // memory of the list, not of E
  std::sort(sorted.begin(), sorted.end());
  const auto twice = std::adjacent_find(sorted.begin(), sorted.end());
  if (twice != sorted.end())
    throw Error(cat("PackOptions::experts: expected each expert once, got ", *twice, " twice"));
  return static_cast<int64_t>(options.experts.size());
}

int64_t source_row(const PackJob& job, int64_t n) {
  const int64_t half = job.in.rows / 2;
  return !job.interleaved ? n : (n < half ? 2 * n : 2 * (n - half) + 1);
}

// Logical row n (halves order) of expert e, read from the caller's tensor as integer values
// (int4: w; mxfp4: 2 * e2m1), zero-padded to cols_padded; mxfp4 also the codes into `codes`.
void read_row(const PackJob& job, int64_t e, int64_t n, int8_t* dst, uint8_t* codes) {
  const int64_t src_row = source_row(job, n);
  const int64_t cols = job.in.cols;
  if (job.g.int8_planes()) {
    // Two int4 planes of K (Geometry::int8_cols): h = w >> 4 (arithmetic) in [-8, 7], then
    // l - 8 with l = w & 15 in [0, 15]. Every int8 w is 16 h + l (two's complement). With zero
    // points 0 and -8 (read_zero_point) the sums multiply w - z = h and l, with scales 16 s and
    // s (store_int8_scale): 16 s SUM q h + s SUM q l = s SUM q (16 h + l) = s SUM q w, integer
    // sums as exact as int4's (w - z + 15 in [0, 30] where kernels offset them).
    const auto* src = static_cast<const int8_t*>(job.w->data) + (e * job.in.rows + src_row) * cols;
    for (int64_t k = 0; k < cols; ++k) {
      dst[k] = static_cast<int8_t>(src[k] >> 4);
      dst[cols + k] = static_cast<int8_t>((src[k] & 15) - 8);
    }
    return;  // 2K = cols_padded (K is a multiple of 32)
  }
  if (job.g.weight_format == WeightFormat::int8) {  // as bytes: the values themselves
    const auto* src = static_cast<const int8_t*>(job.w->data) + (e * job.in.rows + src_row) * cols;
    std::copy(src, src + cols, dst);
    return;  // K = cols_padded (a multiple of 32)
  }
  if (job.g.weight_format == WeightFormat::mxfp4) {
    const auto* src =
        static_cast<const uint8_t*>(job.w->data) + (e * job.in.rows + src_row) * (cols / 2);
    for (int64_t j = 0; j < cols / 2; ++j) {
      codes[2 * j] = src[j] & 0x0f;
      codes[2 * j + 1] = src[j] >> 4;
    }
    std::fill(codes + cols, codes + job.g.cols_padded, uint8_t{0});  // code 0: the value 0
    for (int64_t k = 0; k < job.g.cols_padded; ++k) dst[k] = kMxfp4Doubled[codes[k]];
    return;
  }
  if (job.in.nibbles) {
    const auto* src =
        static_cast<const uint8_t*>(job.w->data) + (e * job.in.rows + src_row) * (cols / 2);
    for (int64_t j = 0; j < cols / 2; ++j) {
      dst[2 * j] = static_cast<int8_t>((src[j] & 0x0f) - 8);
      dst[2 * j + 1] = static_cast<int8_t>((src[j] >> 4) - 8);
    }
  } else {
    const auto* src = static_cast<const int8_t*>(job.w->data) + (e * job.in.rows + src_row) * cols;
    for (int64_t k = 0; k < cols; ++k) {
      if (src[k] < -8 || src[k] > 7)
        throw Error(cat(job.w_name, ": expected int4 values in [-8, 7], got ", int{src[k]}, " at [",
                        e, ", ", src_row, ", ", k, "]"));
      dst[k] = src[k];
    }
  }
  std::fill(dst + cols, dst + job.g.cols_padded, int8_t{0});
}

// The nibble stored for each element of a row: int4 (either kind), two's complement
// (qs4_b32_rowmajor) or w + 8 (the other layouts); mxfp4, its code in every layout; int8 in a
// layout of bytes, the byte w + 128.
void stored_nibbles(const Geometry& g, const LayoutInfo& info, const int8_t* v,
                    const uint8_t* codes, uint8_t* nib) {
  for (int64_t k = 0; k < g.cols_padded; ++k)
    nib[k] = info.int8_bytes                          ? static_cast<uint8_t>(v[k] + kInt8Offset)
             : g.weight_format == WeightFormat::mxfp4 ? codes[k]
             : info.offset_nibbles                    ? static_cast<uint8_t>(v[k] + 8)
                                                      : static_cast<uint8_t>(v[k] & 0x0f);
}

// Writes stored row pr's nibbles in the layout's order into its panel record.
void write_weights(const Geometry& g, const LayoutInfo& info, int64_t pr, const uint8_t* nib,
                   uint8_t* block) {
  const int64_t P = info.panel, q = pr / P, r = pr % P;
  uint8_t* panel = g.panel_at(block, q);
  auto pair = [&](int64_t lo, int64_t hi) {
    return static_cast<uint8_t>(nib[lo] | (nib[hi] << 4));
  };
  if (g.layout == LayoutId::qs4_b32_rowmajor) {
    // block byte i = element i (low nibble) | element i + 16 (high nibble)
    for (int64_t b = 0; b < g.cols_padded / kBlock; ++b)
      for (int i = 0; i < 16; ++i) panel[b * 16 + i] = pair(b * kBlock + i, b * kBlock + i + 16);
    return;
  }
  if (g.layout == LayoutId::qu8_p16k4) {  // bytes: chunk of 4 columns = 4P bytes
    for (int64_t c = 0; c < g.cols_padded / 4; ++c)
      for (int j = 0; j < 4; ++j) panel[c * 4 * P + 4 * r + j] = nib[4 * c + j];
    return;
  }
  if (g.layout == LayoutId::qu4_p8k16) {  // Arm i8mm: row pairs, 16-column chunks
    uint8_t* dst = panel + (r / 2) * 16 + (r % 2) * 8;
    for (int64_t c = 0; c < g.cols_padded / 16; ++c)
      for (int j = 0; j < 8; ++j) dst[c * 8 * P + j] = pair(16 * c + j, 16 * c + 8 + j);
    return;
  }
  // panel layouts: chunk of 8 columns = 4P bytes; row r owns bytes 4r..4r+3
  for (int64_t c = 0; c < g.cols_padded / 8; ++c)
    for (int j = 0; j < 4; ++j) panel[c * 4 * P + 4 * r + j] = pair(8 * c + j, 8 * c + 4 + j);
}

// int8: the row's one scale s (or its bf16 rounding) for the low plane (group 1), 16 s for the
// high plane (group 0). 16 s is exact in every scale dtype (a power of two times a value the
// dtype holds) unless it overflows, which is refused.
float store_int8_scale(const PackJob& job, int64_t e, int64_t src_row, int64_t b, uint8_t* sdst) {
  const Geometry& g = job.g;
  const float given = load_float(job.scale->data, job.scale->dtype, e * job.in.rows + src_row);
  float s = g.scale_dtype == job.scale->dtype ? given : bf16_to_f32(f32_to_bf16(given));
  if (b == 0) s *= 16.0f;
  if (g.scale_dtype == DType::f32) {
    std::memcpy(sdst, &s, 4);
  } else {
    const uint16_t h = g.scale_dtype == DType::bf16 ? f32_to_bf16(s) : f32_to_f16(s);
    std::memcpy(sdst, &h, 2);
    s = g.scale_dtype == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
  }
  if (std::isfinite(given) && !std::isfinite(s))
    throw Error(cat(job.w_name, "_scale: expected scales s whose 16 s (the high nibbles' scale) ",
                    dtype_name(g.scale_dtype), " holds, got ", given, " at [", src_row, "]"));
  return s;
}

// The scale of group b as stored: the given one (or its bf16 rounding); mxfp4, 2^(e - 128) in
// bf16 from the exponent e (exact: bf16 has f32's exponent range, denormals included).
float store_scale(const PackJob& job, int64_t e, int64_t src_row, int64_t b, uint8_t* sdst) {
  const Geometry& g = job.g;
  if (g.int8_planes()) return store_int8_scale(job, e, src_row, b, sdst);
  const int64_t src_index = (e * job.in.rows + src_row) * g.groups + b;
  const size_t sbytes = dtype_bytes(g.scale_dtype);
  if (g.weight_format == WeightFormat::mxfp4) {
    const uint8_t exponent = static_cast<const uint8_t*>(job.scale->data)[src_index];
    if (exponent == 255)
      throw Error(cat(job.w_name, "_scale: expected e8m0 exponents in [0, 254], got 255 (NaN) at [",
                      e, ", ", src_row, ", ", b, "]"));
    const uint16_t h = f32_to_bf16(std::ldexp(1.0f, int{exponent} - 128));
    std::memcpy(sdst, &h, 2);
    return bf16_to_f32(h);
  }
  const float given = load_float(job.scale->data, job.scale->dtype, src_index);
  if (g.scale_dtype == job.scale->dtype) {
    std::memcpy(sdst, static_cast<const uint8_t*>(job.scale->data) + src_index * sbytes, sbytes);
    return given;
  }
  const uint16_t h = f32_to_bf16(given);  // ScaleStorage::bf16 rounding
  std::memcpy(sdst, &h, 2);
  return bf16_to_f32(h);
}

// The zero point of group b as given, checked: an int4 value in [-8, 7].
int8_t read_zero_point(const PackJob& job, int64_t e, int64_t src_row, int64_t b) {
  if (job.g.int8_planes()) return b == 0 ? int8_t{0} : int8_t{-8};  // the planes of read_row
  const int8_t z = static_cast<const int8_t*>(
      job.zero_point->data)[(e * job.in.rows + src_row) * job.g.groups + b];
  if (z < -8 || z > 7)
    throw Error(cat(job.w_name, "_zero_point: expected int4 zero points in [-8, 7], got ", int{z},
                    " at [", e, ", ", src_row, ", ", b, "]"));
  return z;
}

// Nibbles 0..3 of v at bits 8i (a byte each, high nibbles zero).
constexpr uint32_t spread_nibbles(uint32_t v) noexcept {
  v = (v | (v << 8)) & 0x00ff00ffu;
  return (v | (v << 4)) & 0x0f0f0f0fu;
}

// The panel layouts of 8-column chunks (qu4_p16k8, qu4_p8k8) store int4 as w + 8 and mxfp4 as its
// code, which is what int4 given nibble-packed (w + 8) and mxfp4 codes already hold: a row's
// chunks come straight from its bytes (element 2m low and 2m + 1 high in byte m; a chunk's byte
// j wants elements j and j + 4), and each group's sum of the values from a table of the bytes.
bool packs_nibbles_directly(const PackJob& job, const LayoutInfo& info) {
  const LayoutId id = job.g.layout;
  const bool mxfp4 = job.g.weight_format == WeightFormat::mxfp4;
  return job.in.nibbles && !info.int8_bytes && !job.g.int8_planes() &&
         (mxfp4 || info.offset_nibbles) && (id == LayoutId::qu4_p16k8 || id == LayoutId::qu4_p8k8);
}

// The values a byte of the row holds, summed: int4 (nibble - 8) twice, or mxfp4's kMxfp4Doubled.
std::array<int16_t, 256> byte_sums(bool mxfp4) {
  std::array<int16_t, 256> sums{};
  for (int b = 0; b < 256; ++b)
    sums[static_cast<size_t>(b)] = static_cast<int16_t>(
        mxfp4 ? kMxfp4Doubled[b & 15] + kMxfp4Doubled[b >> 4] : (b & 15) - 8 + (b >> 4) - 8);
  return sums;
}

// `bytes` holds the row padded to cols_padded with the value 0 (0x88 for int4, 0 for mxfp4).
void write_nibble_row(const Geometry& g, const LayoutInfo& info, int64_t pr, const uint8_t* bytes,
                      const std::array<int16_t, 256>& byte_sum, uint8_t* block, int64_t* sums) {
  const int64_t P = info.panel;
  uint8_t* panel = g.panel_at(block, pr / P) + 4 * (pr % P);
  for (int64_t c = 0; c < g.cols_padded / 8; ++c) {
    uint32_t x = 0;
    std::memcpy(&x, bytes + 4 * c, 4);
    const uint32_t out = spread_nibbles(x & 0xffffu) | (spread_nibbles(x >> 16) << 4);
    std::memcpy(panel + c * 4 * P, &out, 4);
  }
  for (int64_t b = 0; b < g.groups; ++b) {
    int64_t sum = 0;
    for (int64_t m = b * g.group_len / 2; m < (b + 1) * g.group_len / 2; ++m)
      sum += byte_sum[bytes[m]];
    sums[b] = sum;
  }
}

// Rows per packing task of one expert: a multiple of kBlockRows (and so of every panel height),
// so that the rows [j0, j1) of every part that a task packs are whole panels of their own.
constexpr int64_t kPackRows = 4 * kBlockRows;

// Rows [j0, j1) of each part of expert e (j0 a multiple of kPackRows) into its block.
void pack_rows(const PackJob& job, int64_t e, uint8_t* block, int64_t j0, int64_t j1) {
  const Geometry& g = job.g;
  const LayoutInfo& info = layout_info(static_cast<uint32_t>(g.layout), job.w_name);
  const auto cols = static_cast<size_t>(g.cols_padded);
  std::vector<int8_t> row(cols);
  std::vector<uint8_t> codes(cols), nib(cols);
  const size_t sbytes = dtype_bytes(g.scale_dtype);
  const bool direct = packs_nibbles_directly(job, info);
  const bool mxfp4 = g.weight_format == WeightFormat::mxfp4;
  const std::array<int16_t, 256> byte_sum = byte_sums(mxfp4);
  std::vector<int64_t> sums(static_cast<size_t>(g.groups));
  std::vector<uint8_t> bytes(direct ? cols / 2 : 0, mxfp4 ? uint8_t{0} : uint8_t{0x88});
  for (int64_t part = 0; part < g.parts; ++part)
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t pr = g.stored_row(part, j);
      if (j >= g.part_rows) {  // padding row: weight 0, scale 0, zero point 0 (stored 8),
                               // correction 0, bias 0
        std::fill(row.begin(), row.end(), int8_t{0});
        std::fill(codes.begin(), codes.end(), uint8_t{0});  // mxfp4 code 0: the value 0
        stored_nibbles(g, info, row.data(), codes.data(), nib.data());
        write_weights(g, info, pr, nib.data(), block);
        if (g.has_zeros())
          for (int64_t b = 0; b < g.groups; ++b)
            g.panel_zeros(block, pr / info.panel)[b * info.panel + pr % info.panel] = 8;
        continue;  // the buffer is zero-filled: scales, correction and bias stay 0
      }
      const int64_t n = part * g.part_rows + j;
      const int64_t src_row = source_row(job, n);
      if (direct) {
        std::memcpy(bytes.data(),
                    static_cast<const uint8_t*>(job.w->data) +
                        (e * job.in.rows + src_row) * (job.in.cols / 2),
                    static_cast<size_t>(job.in.cols / 2));
        write_nibble_row(g, info, pr, bytes.data(), byte_sum, block, sums.data());
      } else {
        read_row(job, e, n, row.data(), codes.data());
        stored_nibbles(g, info, row.data(), codes.data(), nib.data());
        write_weights(g, info, pr, nib.data(), block);
      }
      // scales, in the stored dtype; the correction uses the stored values
      const int64_t P = info.panel, q = pr / P, r = pr % P;
      uint8_t* scales = g.panel_scales(block, q);
      double zsum = 0.0;
      int64_t wsum_row = 0;
      for (int64_t b = 0; b < g.groups; ++b) {
        const float stored =
            store_scale(job, e, src_row, b, scales + (b * P + r) * static_cast<int64_t>(sbytes));
        // the sums are over the values the kernels multiply: w - z (padding columns included:
        // they meet activations quantized to the zero point, like the rest)
        const int8_t z = g.has_zeros() ? read_zero_point(job, e, src_row, b) : int8_t{0};
        if (g.has_zeros()) g.panel_zeros(block, q)[b * P + r] = static_cast<uint8_t>(z + 8);
        int64_t wsum = 0;
        if (direct) {
          wsum = sums[static_cast<size_t>(b)] - g.group_len * z;
        } else {
          for (int64_t k = b * g.group_len; k < (b + 1) * g.group_len; ++k)
            wsum += row[static_cast<size_t>(k)] - z;
        }
        wsum_row += wsum;
        zsum += static_cast<double>(stored) * static_cast<double>(wsum);
      }
      uint8_t* correction = g.row_correction(block, pr);
      if (g.channelwise()) {
        const auto c = static_cast<int32_t>(wsum_row);
        std::memcpy(correction, &c, 4);
      } else {
        const auto c = static_cast<float>(zsum);
        std::memcpy(correction, &c, 4);
      }
      if (g.has_bias) {
        const float b = load_float(job.bias->data, job.bias->dtype, e * job.in.rows + src_row);
        std::memcpy(g.row_bias(block, pr), &b, 4);
      }
    }
  if (g.has_input_order && j0 == 0)
    std::memcpy(g.input_order(block),
                static_cast<const int32_t*>(job.input_order->data) + e * g.cols,
                static_cast<size_t>(g.cols) * 4);
}

}  // namespace

TensorNames names_of(WeightRole role) {
  return role == WeightRole::w13 ? TensorNames{"w13", "w13_scale", "w13_zero_point", "w13_bias"}
                                 : TensorNames{"w2", "w2_scale", "w2_zero_point", "w2_bias"};
}

void pack_into(WeightRole role, const TensorView& w, const TensorView& scale,
               const TensorView& zero_point, const TensorView& bias, const PackOptions& options,
               const TensorNames& names, const BlockDestination& destination) {
  const bool is_w13 = role == WeightRole::w13;
  const std::string_view w_name = names.w;
  PackJob job{&w, &scale, &zero_point, &bias, &options.input_order, {}, {}, false, w_name};
  job.in = check_weight_input(w, scale, zero_point, bias, options.group_size, w_name, names.scale,
                              names.zero_point, names.bias, options.weight_format);
  check_input_order(options.input_order, role, job.in.experts, job.in.cols,
                    "PackOptions::input_order");
  const bool mxfp4 = options.weight_format == WeightFormat::mxfp4;
  if (options.gate_up_layout != GateUpLayout::halves &&
      options.gate_up_layout != GateUpLayout::interleaved)
    throw Error("gate_up_layout: expected halves or interleaved");
  job.interleaved = is_w13 && options.gate_up_layout == GateUpLayout::interleaved;
  if (is_w13 && !is_valid_w13_rows(job.in.rows))
    throw Error(cat("w13: expected an even number of rows (gate and up, 2I), got ", job.in.rows));
  if (options.scale_storage != ScaleStorage::as_given &&
      options.scale_storage != ScaleStorage::bf16)
    throw Error("scale_storage: expected as_given or bf16");
  const DType scale_dtype =
      mxfp4 || options.scale_storage == ScaleStorage::bf16 ? DType::bf16 : scale.dtype;
  const KernelSet& set = options.kernel_set.empty()
                             ? active_set()
                             : set_by_name(options.kernel_set, "PackOptions::kernel_set");
  // int8: check_weight_input took the group size -1 or K (the planes' geometry has K, the header
  // -1)
  job.g = make_geometry(set.layout_for(options.weight_format), role,
                        selected_experts(options, job.in.experts), job.in.rows, job.in.cols,
                        options.group_size, scale_dtype, !bias.empty(), options.weight_format,
                        w_name, !options.input_order.empty());

  PackedHeader h{};
  std::memcpy(h.magic, kPackedMagic, sizeof h.magic);
  h.version = kPackedFormatVersion;
  h.header_bytes = kHeaderBytes;
  h.layout = static_cast<uint32_t>(job.g.layout);
  h.role = static_cast<uint32_t>(role);
  h.experts = static_cast<uint32_t>(job.g.experts);
  h.rows = static_cast<uint32_t>(job.g.rows);
  h.cols = static_cast<uint32_t>(job.g.layer_cols());
  h.group_size = job.g.layer_group_size();
  h.scale_dtype = static_cast<uint32_t>(scale_dtype);
  h.flags = (job.g.has_bias ? kFlagBias : 0u) | (job.g.has_input_order ? kFlagInputOrder : 0u);
  h.expert_bytes = job.g.expert_bytes;
  h.total_bytes = job.g.total_bytes;
  h.weight_format = static_cast<uint32_t>(job.g.layer_format());
  h.block_rows = static_cast<uint32_t>(job.g.block_rows);
  h.panel_bytes = job.g.panel_bytes;
  h.checksum = header_checksum(h);
  uint8_t* blocks = destination(h);

  // Experts, and runs of rows of one expert, are independent: pack them on all hardware threads
  // (a one-time cost; a linear layer is one expert of up to hundreds of thousands of rows).
  const int64_t runs = (job.g.part_rows_padded + kPackRows - 1) / kPackRows;
  parallel_for(job.g.experts * runs, std::thread::hardware_concurrency(), [&](int64_t task) {
    const int64_t e = task / runs, j0 = task % runs * kPackRows;
    pack_rows(job, options.experts.empty() ? e : options.experts[static_cast<size_t>(e)],
              blocks + static_cast<size_t>(e) * job.g.expert_bytes, j0,
              std::min(j0 + kPackRows, job.g.part_rows_padded));
  });
}

PackedWeights pack(WeightRole role, const TensorView& w, const TensorView& scale,
                   const TensorView& zero_point, const TensorView& bias, const PackOptions& options,
                   const TensorNames& names) {
  PackedWeights out;
  pack_into(role, w, scale, zero_point, bias, options, names, [&](const PackedHeader& h) {
    if (h.total_bytes > options.memory_limit)  // refuse before allocating
      throw Error(cat(names.w, ": the packed buffer needs ", h.total_bytes,
                      " bytes, more than the memory limit of ", options.memory_limit,
                      " bytes (PackOptions::memory_limit)"));
    out = PackedWeights::allocate(h.total_bytes);
    std::memcpy(out.data(), &h, sizeof h);
    return out.data() + kHeaderBytes;
  });
  return out;
}

}  // namespace detail

size_t packed_size(WeightRole role, int64_t experts, int64_t rows, int64_t cols, DType scale_dtype,
                   bool has_bias, const PackOptions& options, std::string_view argument) {
  const bool mxfp4 = options.weight_format == WeightFormat::mxfp4;
  if (mxfp4 && options.group_size != 32)
    throw Error(detail::cat(argument, ": expected group_size 32 for mxfp4 weights, got ",
                            options.group_size));
  const DType stored =
      mxfp4 || options.scale_storage == ScaleStorage::bf16 ? DType::bf16 : scale_dtype;
  const detail::KernelSet& set = options.kernel_set.empty()
                                     ? detail::active_set()
                                     : detail::set_by_name(options.kernel_set, "kernel_set");
  experts = detail::selected_experts(options, experts);  // with the packer's checks
  return detail::make_geometry(set.layout_for(options.weight_format), role, experts, rows, cols,
                               options.group_size, stored, has_bias, options.weight_format,
                               argument, !options.input_order.empty())
      .total_bytes;
}

PackedWeights pack_w13(const TensorView& w13, const TensorView& scale, const TensorView& bias,
                       const PackOptions& options) {
  detail::require_expert_format(options.weight_format, "PackOptions::weight_format");
  return detail::pack(WeightRole::w13, w13, scale, TensorView{}, bias, options,
                      detail::names_of(WeightRole::w13));
}

PackedWeights pack_w2(const TensorView& w2, const TensorView& scale, const TensorView& bias,
                      const PackOptions& options) {
  detail::require_expert_format(options.weight_format, "PackOptions::weight_format");
  return detail::pack(WeightRole::w2, w2, scale, TensorView{}, bias, options,
                      detail::names_of(WeightRole::w2));
}

PackedWeights pack_w13(const TensorView& w13, const TensorView& scale, const TensorView& zero_point,
                       const TensorView& bias, const PackOptions& options) {
  detail::require_expert_format(options.weight_format, "PackOptions::weight_format");
  return detail::pack(WeightRole::w13, w13, scale, zero_point, bias, options,
                      detail::names_of(WeightRole::w13));
}

PackedWeights pack_w2(const TensorView& w2, const TensorView& scale, const TensorView& zero_point,
                      const TensorView& bias, const PackOptions& options) {
  detail::require_expert_format(options.weight_format, "PackOptions::weight_format");
  return detail::pack(WeightRole::w2, w2, scale, zero_point, bias, options,
                      detail::names_of(WeightRole::w2));
}

namespace {

// A rank-2 (or, with `rank1`, rank-1) tensor of a linear layer as one expert: [1, ...].
TensorView as_one_expert(const TensorView& t, std::string_view name, bool rank1_allowed) {
  if (t.empty()) return t;
  const bool ok = t.rank == 2 || (rank1_allowed && t.rank == 1);
  if (!ok)
    throw Error(detail::cat(name, ": expected rank 2", rank1_allowed ? " (or 1)" : "",
                            ", got shape ", detail::shape_of(t)));
  if (t.rank == 2 && t.row_stride != 0 && t.row_stride != t.shape[1])
    throw Error(detail::cat(name, ": expected contiguous rows (row stride ", t.shape[1],
                            "), got row stride ", t.row_stride));
  TensorView v = t;
  v.rank = t.rank + 1;
  v.shape = {1, t.shape[0], t.rank == 2 ? t.shape[1] : 0};
  v.row_stride = 0;
  return v;
}

}  // namespace

PackedWeights pack_linear(const TensorView& w, const TensorView& scale,
                          const TensorView& zero_point, const TensorView& bias,
                          const PackOptions& options) {
  if (!options.experts.empty())
    throw Error("PackOptions::experts: expected none for a linear layer's weights, got a list");
  if (!options.input_order.empty())
    throw Error("PackOptions::input_order: expected none for a linear layer's weights, got one");
  if (options.gate_up_layout != GateUpLayout::halves)
    throw Error(
        "PackOptions::gate_up_layout: expected halves (the default) for a linear layer's "
        "weights, got interleaved");
  detail::require_data(w.data, "w");
  if (w.rank != 2)
    throw Error(detail::cat("w: expected rank 2 [N, K] (or [N, K/2] nibble-packed), got shape ",
                            detail::shape_of(w)));
  const TensorView w3 = as_one_expert(w, "w", false);
  const TensorView s3 = as_one_expert(scale, "w_scale", true);
  const TensorView z3 = as_one_expert(zero_point, "w_zero_point", true);
  TensorView b2 = bias;
  if (!bias.empty()) {
    if (bias.rank != 1)
      throw Error(detail::cat("w_bias: expected rank 1 [N], got shape ", detail::shape_of(bias)));
    b2.rank = 2;
    b2.shape = {1, bias.shape[0], 0};
    b2.row_stride = 0;
  }
  return detail::pack(WeightRole::w2, w3, s3, z3, b2, options,
                      {"w", "w_scale", "w_zero_point", "w_bias"});
}

}  // namespace w4a8moe
