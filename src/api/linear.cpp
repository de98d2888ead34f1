// linear(): a dense int4 (or MXFP4) layer on the forward driver's pieces. Per chunk of tokens,
// two runs of the context's threads:
//   1. each row of x quantized once, as forward() quantizes a token (tokens dealt to the threads);
//   2. tasks = (slice of the output rows) x (tile of tokens), slice-major, so that a thread's
//      consecutive tasks reuse one slice of the weights from its cache across the token tiles;
//      each task is one GEMM call of the kernel set, whose result (bias included) is stored to out.
// A row's result does not depend on the rows beside it (the kernel contract), so out is
// bit-identical for any thread count. Two runs rather than a barrier: the same code runs on a
// caller's executor, whose tasks may run one after another.
// int8 weights are packed as bytes where the kernel set has a layout of them (LayoutInfo::
// int8_bytes), each row of x quantized as for any layer; else as two int4 planes of K inputs
// (Geometry::int8_cols), which the GEMM reads as one int4 layer with zero points of 2K inputs:
// each row of x is then quantized as the row [x, x] (quantize_twice).
#include <algorithm>
#include <cstring>

#include "api/context_impl.hpp"
#include "api/forward_driver.hpp"
#include "common/argument_checks.hpp"
#include "common/checked_math.hpp"
#include "common/format.hpp"
#include "common/numeric.hpp"
#include "registry.hpp"

namespace w4a8moe {

namespace detail {
namespace {

constexpr int64_t kSliceMax = 256;                  // output rows per task, at most
constexpr size_t kChunkScratch = size_t{32} << 20;  // target scratch bytes per chunk

// Output rows per task: a multiple of 64 (of every panel height) in [64, kSliceMax], narrower
// when that leaves fewer than 4 slices per thread.
int64_t slice_rows(int64_t rows, int threads) {
  return std::clamp<int64_t>(rows / (4 * int64_t{threads}) / 64 * 64, 64, kSliceMax);
}

void check_linear(const TensorView& x, const Geometry& g, const MutableTensorView& out) {
  if (g.role != WeightRole::w2 || g.experts != 1)
    throw Error(
        cat("w_packed: expected a linear layer's weights (pack_linear: one expert of "
            "role w2), got ",
            g.experts, " expert(s) of role ", g.role == WeightRole::w13 ? "w13" : "w2"));
  require_float(x.dtype, "x");
  if (x.rank != 2) throw Error(cat("x: expected rank 2 [T, K], got shape ", shape_of(x)));
  const int64_t x_cols = g.layer_cols();
  if (x.shape[0] < 0 || x.shape[1] != x_cols)
    throw Error(
        cat("x: expected shape [T, ", x_cols, "] (K of w_packed), got shape ", shape_of(x)));
  if (x.row_stride != 0 && x.row_stride < x.shape[1])
    throw Error(cat("x: expected a row stride >= ", x.shape[1], ", got ", x.row_stride));
  const int64_t tokens = x.shape[0];
  if (tokens > 0) require_data(x.data, "x");
  require_addressable(x, "x");
  if (out.dtype != x.dtype && out.dtype != DType::f32)
    throw Error(cat("out: expected dtype ", dtype_name(x.dtype), " (the dtype of x) or f32, got ",
                    dtype_name(out.dtype)));
  if (out.rank != 2 || out.shape[0] != tokens || out.shape[1] != g.rows)
    throw Error(cat("out: expected shape [", tokens, ", ", g.rows, "], got ",
                    shape_string(out.rank, out.shape)));
  if (out.row_stride != 0 && out.row_stride < g.rows)
    throw Error(cat("out: expected a row stride >= ", g.rows, ", got ", out.row_stride));
  require_addressable(out.data, out.dtype, out.rank, out.shape, out.stride(), "out");
  if (tokens == 0) return;
  require_data(out.data, "out");
  const auto end = [](const void* p, int64_t rows, int64_t stride, int64_t cols, DType d) {
    return reinterpret_cast<uintptr_t>(p) +
           static_cast<uintptr_t>((rows - 1) * stride + cols) * dtype_bytes(d);
  };
  const auto xb = reinterpret_cast<uintptr_t>(x.data), ob = reinterpret_cast<uintptr_t>(out.data);
  if (xb < end(out.data, tokens, out.stride(), g.rows, out.dtype) &&
      ob < end(x.data, tokens, x.stride(), x_cols, x.dtype))
    throw Error("out: expected a buffer that does not overlap x, got overlapping memory");
}

struct LinearJob {
  const TensorView* x;
  const MutableTensorView* out;
  const Geometry* g;
  const KernelSet* set;
  const uint8_t* expert;  // the one expert block
  int64_t slice, slices;
  size_t qrow_stride, thread_floats;
  // the chunk's scratch
  uint8_t* qx;
  QuantRow* rows;
  float* thread_buf;
  int64_t t0, tokens, tiles;
};

// int8 weights: row t of x, twice ([x, x], 2K values), quantized as one row by the set's
// quantizer into dst. quant_row's scale and zero point depend on the row's minimum and maximum,
// which the copy does not change, and each element's q on its value alone: the integers are
// those of x's row, twice, whatever byte format the set's quantizer writes. The quantizer also
// writes each plane's group terms (a plane is a group of K), as the GEMM wants them.
void quantize_twice(const KernelSet& set, const TensorView& x, int64_t t, float* row,
                    const Geometry& g, void* dst, QuantRow* out) {
  const int64_t K = g.int8_cols, base = t * x.stride();
  if (x.dtype == DType::f32) {
    std::memcpy(row, static_cast<const uint8_t*>(x.data) + base * 4, static_cast<size_t>(K) * 4);
  } else {
    for (int64_t k = 0; k < K; ++k) row[k] = load_float(x.data, x.dtype, base + k);
  }
  std::memcpy(row + K, row, static_cast<size_t>(K) * 4);
  set.quantize({.src = row,
                .cols = 2 * K,
                .cols_padded = g.cols_padded,
                .group_len = g.group_len,
                .group_term_offset = set.group_term_offset(g),
                .dst = dst,
                .row = out});
}

// Run 1: rows t0 + tid, t0 + tid + threads, ... of x quantized.
struct QuantizeRun {
  const LinearJob& j;
  int threads;
  void operator()(int tid) const {
    float* row = j.thread_buf + static_cast<size_t>(tid) * j.thread_floats;
    for (int64_t r = tid; r < j.tokens; r += threads) {
      uint8_t* dst = j.qx + static_cast<size_t>(r) * j.qrow_stride;
      if (j.g->int8_planes())
        quantize_twice(*j.set, *j.x, j.t0 + r, row, *j.g, dst, &j.rows[r]);
      else
        quantize_input_row(*j.set, *j.x, j.t0 + r, false, 1.0f, row, j.g->cols_padded,
                           j.g->group_len, j.set->group_term_offset(*j.g), dst, &j.rows[r]);
    }
  }
};

// Run 2: the GEMM tasks, claimed from `tasks`.
struct GemmRun {
  const LinearJob& j;
  TaskClaims& tasks;
  void operator()(int tid) const {
    if (j.set->thread_begin != nullptr) j.set->thread_begin();
    float* c = j.thread_buf + static_cast<size_t>(tid) * j.thread_floats;
    const RowTiles tiles(j.tokens, j.set->tile_m);
    const MutableTensorView& out = *j.out;
    for (int64_t task = tasks.claim(tid); task >= 0; task = tasks.claim(tid)) {
      const int64_t n0 = task / j.tiles * j.slice, n1 = std::min(j.g->rows, n0 + j.slice);
      const int64_t ti = task % j.tiles, r0 = tiles.start(ti), m = tiles.size(ti);
      GemmArgs a;
      a.m = m;
      a.a = j.rows + r0;
      a.expert = j.expert;
      a.geometry = j.g;
      a.n_begin = n0;
      a.n_end = n1;
      a.c = c;
      a.c_stride = j.slice;
      j.set->gemm(a);
      for (int64_t r = 0; r < m; ++r) {
        const float* y = c + r * j.slice;
        const int64_t base = (j.t0 + r0 + r) * out.stride() + n0;
        if (out.dtype == DType::f32) {
          std::memcpy(static_cast<uint8_t*>(out.data) + base * 4, y,
                      static_cast<size_t>(n1 - n0) * 4);
        } else {
          for (int64_t n = 0; n < n1 - n0; ++n) store_float(out.data, out.dtype, base + n, y[n]);
        }
      }
    }
    if (j.set->thread_end != nullptr) j.set->thread_end();
  }
};

}  // namespace
}  // namespace detail

void linear(Context& context, const TensorView& x, std::span<const uint8_t> w_packed,
            const MutableTensorView& out) {
  using namespace detail;
  Context::Impl& impl = ContextAccess::impl(context);
  impl.pool.prewake();
  const Geometry g = read_geometry(w_packed, "w_packed");
  check_linear(x, g, out);
  const int64_t tokens = x.shape[0];
  if (tokens == 0) return;
  const KernelSet& set = set_for_layout(g.layout, "w_packed");
  const int threads = impl.pool.size();

  LinearJob j{};
  j.x = &x;
  j.out = &out;
  j.g = &g;
  j.set = &set;
  j.expert = w_packed.data() + kHeaderBytes;
  j.slice = slice_rows(g.rows, threads);
  j.slices = (g.rows + j.slice - 1) / j.slice;
  j.qrow_stride = align64(static_cast<size_t>(g.cols_padded) +
                          (set.group_terms ? static_cast<size_t>(g.groups) * 4 : 0));
  // per thread: the GEMM's tile (tile_m rows of a slice), or an f32 row of x to quantize
  j.thread_floats = align64(std::max(static_cast<size_t>(set.tile_m * j.slice),
                                     static_cast<size_t>(g.cols_padded)) *
                            4) /
                    4;
  const size_t per_token = j.qrow_stride + align64(sizeof(QuantRow));
  const size_t fixed = static_cast<size_t>(threads) * j.thread_floats * 4;
  const auto need = [&](int64_t chunk) {
    return checked_add(fixed, checked_mul(per_token, static_cast<size_t>(chunk)));
  };
  int64_t chunk = std::clamp<int64_t>(static_cast<int64_t>(kChunkScratch / per_token), 16, tokens);
  if (need(1) > impl.memory_limit)
    throw Error(cat("context: the call needs ", need(1), " bytes of scratch memory (one token: K ",
                    g.layer_cols(), ", ", threads, " threads), more than the memory limit of ",
                    impl.memory_limit, " bytes; raise it with Context::set_memory_limit"));
  while (need(chunk) > impl.memory_limit) chunk = std::max<int64_t>(1, chunk / 2);
  if (impl.arena_bytes > impl.memory_limit) {  // the limit was lowered since the arena grew
    impl.arena.reset();
    impl.arena_bytes = 0;
  }
  uint8_t* base = impl.reserve(need(chunk));
  j.thread_buf = reinterpret_cast<float*>(base);
  j.qx = base + fixed;
  j.rows = reinterpret_cast<QuantRow*>(j.qx + j.qrow_stride * static_cast<size_t>(chunk));

  for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
    j.t0 = t0;
    j.tokens = std::min(chunk, tokens - t0);
    j.tiles = RowTiles(j.tokens, set.tile_m).count;
    QuantizeRun quantize{j, threads};
    impl.pool.run(quantize);
    impl.down_tasks.reset(j.slices * j.tiles);
    GemmRun gemm{j, impl.down_tasks};
    impl.pool.run(gemm);
  }
}

}  // namespace w4a8moe
