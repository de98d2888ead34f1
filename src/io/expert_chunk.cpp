// Buffers of consecutive expert slots (checkpoint.hpp, ExpertChunk).
#include "common/format.hpp"
#include "common/numeric.hpp"
#include "io/checkpoint.hpp"

namespace w4a8moe::io {

namespace {

// i in [0, end), or an Error naming what: the chunk's callers are internal, so a miss is a bug
// that should say so, not read past the buffers.
void check_slots(const char* what, int64_t i, int64_t end) {
  if (i < 0 || i >= end)
    throw Error(detail::cat("ExpertChunk: ", what, " ", i, " outside [0, ", end, ")"));
}

}  // namespace

SlotSizes slot_sizes(const LayerInfo& info) {
  const auto H = static_cast<size_t>(info.hidden), I = static_cast<size_t>(info.inter);
  const size_t g13 = info.group_size == -1 ? 1 : H / static_cast<size_t>(info.group_size);
  const size_t g2 = info.group_size == -1 ? 1 : I / static_cast<size_t>(info.group_size);
  SlotSizes s;
  s.w13 = 2 * I * H / 2;
  s.w13_scale = 2 * I * g13 * dtype_bytes(info.w13_scale_dtype);
  s.w2 = H * I / 2;
  s.w2_scale = H * g2 * dtype_bytes(info.w2_scale_dtype);
  if (info.w13_format == WeightFormat::int4_zero_point) s.w13_zero_point = 2 * I * g13;
  if (info.w2_format == WeightFormat::int4_zero_point) s.w2_zero_point = H * g2;
  if (info.w13_input_order) s.w13_input_order = H * sizeof(int32_t);
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
  w13_zero_point_.resize(n * sizes_.w13_zero_point);
  w2_zero_point_.resize(n * sizes_.w2_zero_point);
  w13_input_order_.resize(n * sizes_.w13_input_order / sizeof(int32_t));
}

ExpertSlot ExpertChunk::slot(int64_t i) {
  check_slots("slot", i, count_);
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
  if (sizes_.w13_zero_point > 0)
    s.w13_zero_point = w13_zero_point_.data() + k * sizes_.w13_zero_point;
  if (sizes_.w2_zero_point > 0) s.w2_zero_point = w2_zero_point_.data() + k * sizes_.w2_zero_point;
  if (sizes_.w13_input_order > 0)
    s.w13_input_order = w13_input_order_.data() + k * (sizes_.w13_input_order / sizeof(int32_t));
  return s;
}

TensorView ExpertChunk::w13(int64_t n) const {
  check_slots("count", n, count_ + 1);
  return TensorView::of(w13_.data(), DType::u8, {n, 2 * info_.inter, info_.hidden / 2});
}
TensorView ExpertChunk::w13_scale(int64_t n) const {
  check_slots("count", n, count_ + 1);
  if (info_.group_size == -1)
    return TensorView::of(w13_scale_.data(), info_.w13_scale_dtype, {n, 2 * info_.inter});
  return TensorView::of(w13_scale_.data(), info_.w13_scale_dtype,
                        {n, 2 * info_.inter, info_.hidden / info_.group_size});
}
TensorView ExpertChunk::w13_bias(int64_t n) const {
  check_slots("count", n, count_ + 1);
  if (!info_.expert_bias) return {};
  return TensorView::of(w13_bias_.data(), DType::f32, {n, 2 * info_.inter});
}
TensorView ExpertChunk::w2(int64_t n) const {
  check_slots("count", n, count_ + 1);
  return TensorView::of(w2_.data(), DType::u8, {n, info_.hidden, info_.inter / 2});
}
TensorView ExpertChunk::w2_scale(int64_t n) const {
  check_slots("count", n, count_ + 1);
  if (info_.group_size == -1)
    return TensorView::of(w2_scale_.data(), info_.w2_scale_dtype, {n, info_.hidden});
  return TensorView::of(w2_scale_.data(), info_.w2_scale_dtype,
                        {n, info_.hidden, info_.inter / info_.group_size});
}
TensorView ExpertChunk::w2_bias(int64_t n) const {
  check_slots("count", n, count_ + 1);
  if (!info_.expert_bias) return {};
  return TensorView::of(w2_bias_.data(), DType::f32, {n, info_.hidden});
}

TensorView ExpertChunk::w13_zero_point(int64_t n) const {
  check_slots("count", n, count_ + 1);
  if (sizes_.w13_zero_point == 0) return {};
  if (info_.group_size == -1)
    return TensorView::of(w13_zero_point_.data(), DType::i8, {n, 2 * info_.inter});
  return TensorView::of(w13_zero_point_.data(), DType::i8,
                        {n, 2 * info_.inter, info_.hidden / info_.group_size});
}
TensorView ExpertChunk::w2_zero_point(int64_t n) const {
  check_slots("count", n, count_ + 1);
  if (sizes_.w2_zero_point == 0) return {};
  if (info_.group_size == -1)
    return TensorView::of(w2_zero_point_.data(), DType::i8, {n, info_.hidden});
  return TensorView::of(w2_zero_point_.data(), DType::i8,
                        {n, info_.hidden, info_.inter / info_.group_size});
}

TensorView ExpertChunk::w13_input_order(int64_t n) const {
  check_slots("count", n, count_ + 1);
  if (sizes_.w13_input_order == 0) return {};
  return TensorView::of(w13_input_order_.data(), DType::i32, {n, info_.hidden});
}

}  // namespace w4a8moe::io
