// pack_checkpoint_moe / pack_checkpoint_linear (w4a8moe/checkpoint.hpp): a checkpoint's
// tensors checked as stacks, decoded a chunk of experts at a time (checkpoint_rows.hpp, in
// parallel over the chunk's experts) and streamed into the packer (ExpertPacker), so that the
// decoded copy held at once is one chunk's, never the layer's.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "common/argument_checks.hpp"
#include "common/format.hpp"
#include "pack/checkpoint_rows.hpp"
#include "thread_pool.hpp"
#include "w4a8moe/checkpoint.hpp"
#include "w4a8moe/expert_packer.hpp"

namespace w4a8moe {

using detail::cat;

const char* checkpoint_format_name(CheckpointFormat format) noexcept {
  switch (format) {
    case CheckpointFormat::gptq:
      return "gptq";
    case CheckpointFormat::gptq_v2:
      return "gptq_v2";
    case CheckpointFormat::awq:
      return "awq";
    case CheckpointFormat::compressed_tensors:
      return "compressed-tensors";
    case CheckpointFormat::mxfp4:
      return "mxfp4";
  }
  return "unknown";
}

CheckpointFormat parse_checkpoint_format(std::string_view name, std::string_view argument) {
  for (const auto f : {CheckpointFormat::gptq, CheckpointFormat::gptq_v2, CheckpointFormat::awq,
                       CheckpointFormat::compressed_tensors, CheckpointFormat::mxfp4})
    if (name == checkpoint_format_name(f)) return f;
  if (name == "compressed_tensors") return CheckpointFormat::compressed_tensors;
  throw Error(cat(argument, ": expected gptq, gptq_v2, awq, compressed-tensors or mxfp4, got '",
                  name, "'"));
}

namespace {

// Decoded experts held at once: about this many bytes of nibbles (and at least a thread's worth
// of experts), so that the transient stays small against the layer.
constexpr int64_t kChunkBytes = int64_t{32} << 20;

// Expert e of a contiguous view: the leading dimension dropped (empty stays empty).
TensorView expert_of(const TensorView& v, int64_t e) {
  if (v.empty()) return v;
  TensorView s;
  s.dtype = v.dtype;
  s.rank = v.rank - 1;
  int64_t inner = 1;
  for (int i = 1; i < v.rank; ++i) {
    s.shape[static_cast<size_t>(i - 1)] = v.shape[static_cast<size_t>(i)];
    inner *= v.shape[static_cast<size_t>(i)];
  }
  s.data =
      static_cast<const uint8_t*>(v.data) + static_cast<size_t>(e * inner) * dtype_bytes(v.dtype);
  return s;
}

// One projection stack: its names, sizes and the views of one expert.
struct Stack {
  CheckpointFormat format;
  const CheckpointTensors* t;
  std::string role;  // "w13", "w2" or "w"
  int64_t experts = 1, rows = 0, cols = 0;
  int group_size = -1;
  bool stacked = true;  // rank 3 (MoE) or rank 2 (a dense layer)

  std::string name(const char* field) const { return cat(role, ".", field); }

  // Expert e's slice of a stacked tensor; the view itself for a dense layer.
  TensorView slice(const TensorView& v, int64_t e) const { return stacked ? expert_of(v, e) : v; }

  detail::CheckpointProjection projection(int64_t e) const {
    detail::CheckpointProjection p;
    p.format = format;
    p.rows = rows;
    p.cols = cols;
    p.group_size = group_size;
    p.weight = slice(t->weight, e);
    p.scale = slice(t->scale, e);
    p.zero_point = slice(t->zero_point, e);
    p.g_idx = slice(t->g_idx, e);
    const std::string each = stacked ? " of each expert" : "";
    p.weight_name = name("weight") + each;
    p.scale_name = name("scale") + each;
    p.zero_point_name = name("zero_point") + each;
    p.g_idx_name = name("g_idx") + each;
    p.expert = stacked ? e : -1;
    return p;
  }

  int64_t groups() const { return group_size == -1 ? 1 : cols / group_size; }
};

// The stack's sizes from its weight, and every tensor's leading dimension and contiguity.
Stack stack_of(CheckpointFormat format, const CheckpointTensors& t, std::string role, int rank,
               int group_size) {
  Stack s{format, &t, std::move(role)};
  s.stacked = rank == 3;
  s.group_size = group_size;
  const TensorView& w = t.weight;
  detail::require_data(w.data, s.name("weight"));
  if (w.rank != rank)
    throw Error(cat(s.name("weight"), ": expected ", rank, " dimensions, got ", w.rank, " (shape ",
                    detail::shape_of(w), ")"));
  detail::require_positive_dims(w, s.name("weight"));
  detail::require_contiguous(w, s.name("weight"));
  const int64_t a = w.shape[static_cast<size_t>(rank - 2)],
                b = w.shape[static_cast<size_t>(rank - 1)];
  s.experts = s.stacked ? w.shape[0] : 1;
  switch (format) {
    case CheckpointFormat::gptq:
    case CheckpointFormat::gptq_v2:
      s.cols = 8 * a, s.rows = b;
      break;
    case CheckpointFormat::awq:
      s.cols = a, s.rows = 8 * b;
      break;
    case CheckpointFormat::compressed_tensors:
      s.rows = a, s.cols = 8 * b;
      break;
    case CheckpointFormat::mxfp4:
      s.rows = a, s.cols = 2 * b;
      break;
  }
  const auto lead = [&](const TensorView& v, const char* field, int want_rank) {
    if (v.empty()) return;
    detail::require_addressable(v, s.name(field));
    detail::require_contiguous(v, s.name(field));
    // channel-wise scales and zero points may come without their trailing 1 ([E, N])
    const bool per_row = want_rank == rank && v.rank == rank - 1 && s.group_size == -1;
    if (v.rank != want_rank && !per_row)
      throw Error(cat(s.name(field), ": expected ", want_rank, " dimensions, got ", v.rank,
                      " (shape ", detail::shape_of(v), ")"));
    if (s.stacked && v.shape[0] != s.experts)
      throw Error(cat(s.name(field), ": expected ", s.experts, " experts (the weight's), got ",
                      v.shape[0], " (shape ", detail::shape_of(v), ")"));
  };
  detail::require_addressable(w, s.name("weight"));
  lead(t.scale, "scale", rank);
  lead(t.zero_point, "zero_point", rank);
  lead(t.g_idx, "g_idx", rank - 1);
  lead(t.bias, "bias", rank - 1);
  if (!t.bias.empty()) {
    detail::require_float(t.bias.dtype, s.name("bias"));
    if (t.bias.shape[static_cast<size_t>(t.bias.rank - 1)] != s.rows)
      throw Error(cat(s.name("bias"), ": expected ", s.rows, " outputs, got shape ",
                      detail::shape_of(t.bias)));
  }
  if (format == CheckpointFormat::mxfp4) {
    if (!t.zero_point.empty() || !t.g_idx.empty())
      throw Error(
          cat(s.name(t.zero_point.empty() ? "g_idx" : "zero_point"), ": mxfp4 has none, got one"));
    return s;
  }
  if (!group_size_fits(group_size, s.cols))
    throw Error(cat("PackOptions::group_size: expected -1 or a multiple of 32 dividing ", s.role,
                    "'s ", s.cols, " inputs, got ", group_size));
  detail::check_checkpoint_projection(s.projection(0));
  return s;
}

void require_defaults(const PackOptions& options) {
  if (options.weight_format != WeightFormat::int4_symmetric)
    throw Error(
        cat("PackOptions::weight_format: follows from the checkpoint format, expected the "
            "default, got ",
            weight_format_name(options.weight_format)));
  if (!options.input_order.empty())
    throw Error("PackOptions::input_order: follows from g_idx, expected none");
}

std::vector<int64_t> selected(const PackOptions& options, int64_t experts) {
  std::vector<int64_t> list;
  if (options.experts.empty()) {
    list.resize(static_cast<size_t>(experts));
    std::iota(list.begin(), list.end(), int64_t{0});
    return list;
  }
  std::vector<bool> seen(static_cast<size_t>(experts), false);
  for (const int32_t e : options.experts) {
    if (e < 0 || e >= experts)
      throw Error(cat("PackOptions::experts: expected indices in [0, ", experts, "), got ", e));
    if (seen[static_cast<size_t>(e)])
      throw Error(cat("PackOptions::experts: expected each expert once, got ", e, " twice"));
    seen[static_cast<size_t>(e)] = true;
    list.push_back(e);
  }
  return list;
}

// One chunk's decoded experts of a stack, in the packer's views.
struct Decoded {
  int64_t count = 0, rows = 0, cols = 0, groups = 1;
  bool channel = false;  // group_size -1: scales and zero points [E, N]
  DType scale_dtype = DType::f32, bias_dtype = DType::f32;
  std::vector<uint8_t> nibbles, scales, bias;
  std::vector<int8_t> zeros;
  std::vector<int32_t> order;

  Decoded(const Stack& s, int64_t chunk, bool has_order)
      : count(chunk),
        rows(s.rows),
        cols(s.cols),
        groups(s.groups()),
        channel(s.group_size == -1),
        scale_dtype(s.t->scale.dtype),
        bias_dtype(s.t->bias.dtype) {
    nibbles.resize(static_cast<size_t>(chunk * rows * cols / 2));
    scales.resize(static_cast<size_t>(chunk * rows * groups) * dtype_bytes(scale_dtype));
    if (!s.t->zero_point.empty()) zeros.resize(static_cast<size_t>(chunk * rows * groups));
    if (!s.t->bias.empty())
      bias.resize(static_cast<size_t>(chunk * rows) * dtype_bytes(bias_dtype));
    if (has_order) order.resize(static_cast<size_t>(chunk * cols));
  }

  // Expert i of the chunk from stack expert e: rows through row_map, columns in `columns`.
  void decode(const Stack& s, int64_t i, int64_t e, const std::vector<int32_t>& columns,
              const int32_t* row_map) {
    detail::decode_checkpoint_projection(
        s.projection(e), columns, row_map, nibbles.data() + i * rows * cols / 2,
        scales.data() + static_cast<size_t>(i * rows * groups) * dtype_bytes(scale_dtype),
        scale_dtype, zeros.empty() ? nullptr : zeros.data() + i * rows * groups);
    if (!bias.empty()) {
      const size_t b = dtype_bytes(bias_dtype);
      const auto* src = static_cast<const uint8_t*>(s.slice(s.t->bias, e).data);
      for (int64_t n = 0; n < rows; ++n)
        std::memcpy(bias.data() + static_cast<size_t>(i * rows + n) * b,
                    src + static_cast<size_t>(row_map == nullptr ? n : row_map[n]) * b, b);
    }
    if (!order.empty()) {
      int32_t* dst = order.data() + i * cols;
      if (columns.empty())
        std::iota(dst, dst + cols, 0);
      else
        std::copy(columns.begin(), columns.end(), dst);
    }
  }

  // The views of the first n experts (n = count, or fewer in the last chunk).
  TensorView w(int64_t n) const {
    return TensorView::of(nibbles.data(), DType::u8, {n, rows, cols / 2});
  }
  TensorView scale(int64_t n) const { return per_group(scales.data(), scale_dtype, n); }
  TensorView zero(int64_t n) const {
    return zeros.empty() ? TensorView{} : per_group(zeros.data(), DType::i8, n);
  }
  TensorView bias_view(int64_t n) const {
    return bias.empty() ? TensorView{} : TensorView::of(bias.data(), bias_dtype, {n, rows});
  }
  TensorView order_view(int64_t n) const {
    return order.empty() ? TensorView{} : TensorView::of(order.data(), DType::i32, {n, cols});
  }
  TensorView per_group(const void* data, DType dtype, int64_t n) const {
    return channel ? TensorView::of(data, dtype, {n, rows})
                   : TensorView::of(data, dtype, {n, rows, groups});
  }
};

PackOptions options_for(const PackOptions& options, const Stack& s) {
  PackOptions o = options;
  o.experts.clear();
  o.input_order = {};
  o.weight_format =
      s.t->zero_point.empty() ? WeightFormat::int4_symmetric : WeightFormat::int4_zero_point;
  return o;
}

}  // namespace

PackedLayer pack_checkpoint_moe(CheckpointFormat format, const CheckpointTensors& w13,
                                const CheckpointTensors& w2, const PackOptions& options) {
  require_defaults(options);
  const Stack s13 = stack_of(format, w13, "w13", 3, options.group_size);
  const Stack s2 = stack_of(format, w2, "w2", 3, options.group_size);
  if (s2.experts != s13.experts)
    throw Error(cat("w2.weight: expected ", s13.experts, " experts (w13's), got ", s2.experts));
  if (s2.rows != s13.cols)
    throw Error(cat("w2.weight: expected ", s13.cols, " outputs (w13's inputs, H), got ", s2.rows));
  if (s13.rows != 2 * s2.cols)
    throw Error(cat("w13.weight: expected ", 2 * s2.cols,
                    " outputs (gate and up, twice w2's inputs), got ", s13.rows));
  if (format == CheckpointFormat::mxfp4) {
    PackOptions o = options;
    o.weight_format = WeightFormat::mxfp4;
    return {pack_w13(w13.weight, w13.scale, w13.bias, o), pack_w2(w2.weight, w2.scale, w2.bias, o)};
  }

  // act-order, checked for every expert before anything is packed
  const std::vector<int64_t> experts = selected(options, s13.experts);
  const auto count = static_cast<int64_t>(experts.size());
  std::vector<std::vector<int32_t>> order13(experts.size()), order2(experts.size());
  bool has13 = false, has2 = false;
  for (size_t i = 0; i < experts.size(); ++i) {
    order13[i] = detail::checkpoint_group_order(s13.projection(experts[i]));
    order2[i] = detail::checkpoint_group_order(s2.projection(experts[i]));
    has13 |= !order13[i].empty();
    has2 |= !order2[i].empty();
  }
  if (has2 && options.gate_up_layout != GateUpLayout::halves)
    throw Error(
        "w2.g_idx: act-order of down's inputs moves w13's gate and up rows with them, "
        "which needs gate_up_layout halves, got interleaved");

  ExpertPacker p13(WeightRole::w13, count, options_for(options, s13));
  ExpertPacker p2(WeightRole::w2, count, options_for(options, s2));
  const int64_t per_expert = (s13.rows * s13.cols + s2.rows * s2.cols) / 2;
  const auto threads = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  const int64_t chunk = std::min(count, std::max(threads, kChunkBytes / per_expert));
  Decoded d13(s13, chunk, has13), d2(s2, chunk, false);
  const int64_t inter = s2.cols;
  for (int64_t first = 0; first < count; first += chunk) {
    const int64_t n = std::min(chunk, count - first);
    // an error names the chunk's first bad expert (w13 before w2), whichever thread meets it
    std::vector<std::string> errors(static_cast<size_t>(n));
    detail::parallel_for(n, threads, [&](int64_t i) {
      const auto at = static_cast<size_t>(first + i);
      const int64_t e = experts[at];
      std::vector<int32_t> rows;  // down's inputs sorted: w13's gate and up rows with them
      if (!order2[at].empty()) {
        rows.resize(static_cast<size_t>(2 * inter));
        for (int64_t j = 0; j < inter; ++j) {
          rows[static_cast<size_t>(j)] = order2[at][static_cast<size_t>(j)];
          rows[static_cast<size_t>(inter + j)] =
              static_cast<int32_t>(inter) + order2[at][static_cast<size_t>(j)];
        }
      }
      try {
        d13.decode(s13, i, e, order13[at], rows.empty() ? nullptr : rows.data());
        d2.decode(s2, i, e, order2[at], nullptr);
      } catch (const Error& error) {
        errors[static_cast<size_t>(i)] = error.what();
      }
    });
    for (const std::string& error : errors)
      if (!error.empty()) throw Error(error);
    p13.append(d13.w(n), d13.scale(n), d13.zero(n), d13.bias_view(n), d13.order_view(n));
    p2.append(d2.w(n), d2.scale(n), d2.zero(n), d2.bias_view(n), TensorView{});
  }
  return {std::move(p13).finish(), std::move(p2).finish()};
}

PackedWeights pack_checkpoint_linear(CheckpointFormat format, const CheckpointTensors& w,
                                     const PackOptions& options) {
  require_defaults(options);
  const Stack s = stack_of(format, w, "w", 2, options.group_size);
  if (format == CheckpointFormat::mxfp4) {
    PackOptions o = options;
    o.weight_format = WeightFormat::mxfp4;
    return pack_linear(w.weight, w.scale, TensorView{}, w.bias, o);
  }
  if (!detail::checkpoint_group_order(s.projection(0)).empty())
    throw Error(
        "w.g_idx: expected the inputs in order (g_idx k / group_size): a dense layer "
        "packs no input order, got act-order");
  Decoded d(s, 1, false);
  d.decode(s, 0, 0, {}, nullptr);
  return pack_linear(expert_of(d.w(1), 0), expert_of(d.scale(1), 0), expert_of(d.zero(1), 0),
                     expert_of(d.bias_view(1), 0), options_for(options, s));
}

}  // namespace w4a8moe
