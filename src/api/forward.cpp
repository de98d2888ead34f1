// The forward driver: routing, scheduling and threads around the micro-kernels.
//
// Per chunk of tokens (chunks bound the scratch memory), three phases:
//   0. quantize each token's activations once (once per (token, slot) when the router weight is
//      applied on the input), and counting-sort the (token, slot) pairs by expert;
//   1. tasks = (expert x slice of I): gate and up rows of the slice for all of the expert's pairs,
//      in tiles of tile_m rows sharing each unpacked weight block, then the activation; the
//      thread that completes an expert's last slice requantizes its pairs' intermediate rows
//      (each row spans every slice, and its int8 scale depends on the whole row);
//   2. tasks = slices of H: for every expert in ascending order and its pairs, the down rows of
//      the slice, weighted and summed into the token's f32 accumulator, then converted to out.
// Tasks are claimed dynamically (task_claims.hpp). Every output element is summed in one fixed
// order (experts ascending, then slots ascending), so the result is bit-identical for any thread
// count.
//
// No barrier inside a chunk: a thread enters phase 1 once every input row is quantized, and
// starts the down rows of an expert once that expert is requantized. A thread woken late (a
// futex wake-up takes tens of microseconds, a good part of a decode step) thus joins work
// already under way instead of holding the others at a barrier, and down's first weights stream
// while phase 1's last tasks finish. Waits are only on work that a thread already running has
// claimed, which never waits back: a thread that never starts, or starts after the others
// finished, holds nobody up, so the driver runs unchanged on a caller's executor that runs its
// tasks on fewer threads, or one after another. Each chunk is one run of the threads, after the
// caller sorted its pairs (the next chunk rewrites the scratch).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <system_error>
#include <thread>

#include "api/accumulate.hpp"
#include "api/context_impl.hpp"
#include "api/forward_driver.hpp"
#include "api/task_claims.hpp"
#include "api/validate.hpp"
#include "common/checked_math.hpp"
#include "common/format.hpp"
#include "common/large_alloc.hpp"
#include "common/numeric.hpp"
#include "registry.hpp"
#include "thread_pool.hpp"

namespace w4a8moe {

namespace detail {
namespace {

// Slices are multiples of every layout's panel height (16 at most). A phase-1 task is one block
// of the packed w13's stored order: its gate and up rows, which are one run of memory.
constexpr int64_t kSliceI = kBlockRows;             // rows of gate (and of up) per phase-1 task
constexpr int64_t kSliceHMax = 256;                 // rows of down per phase-2 task, at most
constexpr int64_t kQuantBatch = 8;                  // rows per claim in phase 0
constexpr size_t kChunkScratch = size_t{64} << 20;  // target scratch bytes per chunk

}  // namespace

// Scratch of one chunk, carved from the context's arena.
struct Scratch {
  uint8_t* qx = nullptr;  // quantized activation rows, qx_stride bytes each
  QuantRow* qx_rows = nullptr;
  int32_t* order = nullptr;   // pair indices sorted by expert
  int32_t* begin = nullptr;   // [E + 1] start of each expert in order
  int32_t* active = nullptr;  // experts with pairs, ascending
  // per active expert (atomic_ref): slices of phase 1 finished, plus 1 once it is requantized
  int64_t* done = nullptr;
  float* m = nullptr;     // intermediate rows, m_stride floats each
  uint8_t* qm = nullptr;  // requantized intermediate rows, qm_stride bytes each
  QuantRow* qm_rows = nullptr;
  float* acc = nullptr;         // [chunk tokens, H] f32 output accumulator
  float* thread_buf = nullptr;  // per thread: tile_m x 256 (gemm results) + H (f32 row conversion)
  size_t qx_stride = 0, m_stride = 0, qm_stride = 0, thread_floats = 0;
};

namespace {

struct Problem : ForwardJob {
  int64_t chunk_tokens = 0;
};

// Rows of down per phase-2 task: every task passes over all of the chunk's requantized rows
// (at long prompts more than the L2 holds), so wide slices save those passes (a 512-token
// layer ran 5% faster with 256 than with 64 rows); narrower ones keep at least 4 tasks per
// thread. A multiple of 64 between 64 and kSliceHMax. The result does not depend on it.
int64_t down_slice(int64_t hidden, int threads) {
  return std::clamp<int64_t>(hidden / (4 * int64_t{threads}) / 64 * 64, 64, kSliceHMax);
}

// Input rows are quantized once per (token, slot) pair, not once per token, when the router
// weight multiplies the input or w13 has an input order (each expert's own gather of x).
bool per_pair_rows(const ForwardJob& p) {
  return p.params->apply_router_weight_on_input || p.w13->has_input_order;
}

struct Layout {
  size_t qx, qx_rows, order, begin, active, done, m, qm, qm_rows, acc, thread_buf, total;
  Scratch scratch;
};

Layout plan(const Problem& p, int64_t chunk, int threads) {
  const size_t pairs = static_cast<size_t>(chunk * p.s.top_k);
  const size_t x_rows = per_pair_rows(p) ? pairs : static_cast<size_t>(chunk);
  Layout l{};
  Scratch& s = l.scratch;
  // A quantized row: cols_padded bytes, then the group terms if the kernel set wants them.
  auto qrow_bytes = [&](const Geometry& g) {
    return align64(static_cast<size_t>(g.cols_padded) +
                   (p.set->group_terms ? static_cast<size_t>(g.groups) * 4 : 0));
  };
  s.qx_stride = qrow_bytes(*p.w13);
  s.m_stride = align64(static_cast<size_t>(p.w2->cols_padded) * 4) / 4;
  s.qm_stride = qrow_bytes(*p.w2);
  // c of gate and up (2 x kSliceI columns) in phase 1, c of down (at most kSliceHMax) in phase 2
  const size_t slice = static_cast<size_t>(std::max(2 * kSliceI, kSliceHMax));
  s.thread_floats = align64(static_cast<size_t>(p.set->tile_m) * slice * 4 +
                            static_cast<size_t>(p.s.hidden) * 4) /
                    4;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = checked_add(off, align64(bytes));
    return at;
  };
  l.qx = take(checked_mul(x_rows, s.qx_stride));
  l.qx_rows = take(x_rows * sizeof(QuantRow));
  l.order = take(pairs * 4);
  l.begin = take(static_cast<size_t>(p.s.experts + 1) * 4);
  l.active = take(static_cast<size_t>(p.s.experts) * 4);
  l.done = take(static_cast<size_t>(p.s.experts) * 8);
  l.m = take(checked_mul(pairs, s.m_stride * 4));
  l.qm = take(checked_mul(pairs, s.qm_stride));
  l.qm_rows = take(pairs * sizeof(QuantRow));
  l.acc = take(checked_mul(static_cast<size_t>(chunk), static_cast<size_t>(p.s.hidden) * 4));
  l.thread_buf = take(static_cast<size_t>(threads) * s.thread_floats * 4);
  l.total = off;
  return l;
}

void bind(Layout& l, uint8_t* base) {
  Scratch& s = l.scratch;
  s.qx = base + l.qx;
  s.qx_rows = reinterpret_cast<QuantRow*>(base + l.qx_rows);
  s.order = reinterpret_cast<int32_t*>(base + l.order);
  s.begin = reinterpret_cast<int32_t*>(base + l.begin);
  s.active = reinterpret_cast<int32_t*>(base + l.active);
  s.done = reinterpret_cast<int64_t*>(base + l.done);
  s.m = reinterpret_cast<float*>(base + l.m);
  s.qm = base + l.qm;
  s.qm_rows = reinterpret_cast<QuantRow*>(base + l.qm_rows);
  s.acc = reinterpret_cast<float*>(base + l.acc);
  s.thread_buf = reinterpret_cast<float*>(base + l.thread_buf);
}

// The counters of one chunk's phase 0: what its threads claim and what they wait for.
struct ChunkSync {
  std::atomic<int64_t> claim;  // the next batch of input rows
  std::atomic<int64_t> ready;  // input rows quantized: phase 1 starts when all are
  void clear() noexcept {
    claim.store(0, std::memory_order_relaxed);
    ready.store(0, std::memory_order_relaxed);
  }
};

// One chunk of tokens: the caller's begin_chunk(), then operator() on every thread of the pool.
class Worker {
 public:
  Worker(const Problem& p, const Scratch& s, int threads, TaskClaims& gate_up_tasks,
         TaskClaims& down_tasks)
      : p_(p), s_(s), threads_(threads), gate_up_tasks_(gate_up_tasks), down_tasks_(down_tasks) {}

  // On the caller, before the chunk's run: sorts its pairs by expert and sets the phases' tasks.
  void begin_chunk(int64_t t0, int64_t tokens) {
    t0_ = t0;
    tokens_ = tokens;
    sync_.clear();
    sort_pairs(t0, tokens);
    gate_up_tasks_.reset(int64_t{active_count_} * inter_slices());
    down_tasks_.reset(down_slices());
  }

  void operator()(int tid) {
    if (p_.set->thread_begin != nullptr) p_.set->thread_begin();
    const int64_t rows = quantize_inputs(tid, t0_, tokens_);
    wait_until([&] { return sync_.ready.load(std::memory_order_acquire) >= rows; });
    gate_up(tid);
    down(tid, t0_, tokens_);
    if (p_.set->thread_end != nullptr) p_.set->thread_end();
  }

 private:
  std::atomic_ref<int64_t> done(int32_t active_index) const {
    return std::atomic_ref<int64_t>(s_.done[active_index]);
  }

  float* thread_buf(int tid) const {
    return s_.thread_buf + static_cast<size_t>(tid) * s_.thread_floats;
  }

  float router_weight(int64_t t0, int64_t pair) const {
    return load_float(p_.weights->data, p_.weights->dtype, t0 * p_.s.top_k + pair);
  }

  // The packed expert of a (token, slot) pair, or -1 when the slot adds nothing here.
  int64_t local_expert(int64_t t0, int64_t pair) const {
    const int64_t id = load_index(p_.ids->data, p_.ids->dtype, t0 * p_.s.top_k + pair);
    if (p_.local_of == nullptr) return id;
    return id < 0 ? -1 : p_.local_of[id];
  }

  void sort_pairs(int64_t t0, int64_t tokens) {
    const int64_t E = p_.s.experts, K = p_.s.top_k, pairs = tokens * K;
    std::fill(s_.begin, s_.begin + E + 1, 0);
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t e = local_expert(t0, i);
      if (e >= 0) ++s_.begin[e + 1];
    }
    int32_t n_active = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (s_.begin[e + 1] > 0) s_.active[n_active++] = static_cast<int32_t>(e);
      s_.begin[e + 1] += s_.begin[e];
    }
    active_count_ = n_active;
    std::fill(s_.done, s_.done + n_active, 0);
    // Stable placement: pairs ascending within an expert. begin[e] serves as the cursor of
    // expert e, ending at the start of e + 1; shifting by one restores the starts.
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t e = local_expert(t0, i);
      if (e >= 0) s_.order[s_.begin[e]++] = static_cast<int32_t>(i);
    }
    for (int64_t e = E; e > 0; --e) s_.begin[e] = s_.begin[e - 1];
    s_.begin[0] = 0;
  }

  // Row r of the staged input into the kernel set's row format: the int8 values, the padding
  // as the zero point, and the group terms (-offset * SUM q per group) when the set reads them, as
  // its quantizer writes them.
  // With w13's input order (`order`), the values gathered by it: a quantized value depends only
  // on its input and the row's scale and zero point, which no order changes.
  void stage_row(int64_t r, uint8_t* dst, QuantRow* row, const int32_t* order) const {
    const StagedRows& st = *p_.staged;
    const uint8_t* rec = st.base + static_cast<size_t>(r) * st.stride;
    const int64_t H = p_.s.hidden, padded = p_.w13->cols_padded;
    QuantRow q;
    std::memcpy(&q.recip, rec + st.recip_offset, 4);
    std::memcpy(&q.zp, rec + st.zp_offset, 4);
    if (order != nullptr) {
      for (int64_t c = 0; c < H; ++c) dst[c] = rec[st.q_offset + input_index(order, c, H)];
    } else {
      std::memcpy(dst, rec + st.q_offset, static_cast<size_t>(H));
    }
    std::fill(dst + H, dst + padded, static_cast<uint8_t>(static_cast<int8_t>(q.zp)));
    q.data = dst;
    if (p_.set->group_terms) {
      auto* terms = reinterpret_cast<int32_t*>(dst + padded);
      const auto* v = reinterpret_cast<const int8_t*>(dst);
      const int64_t len = p_.w13->group_len;
      const int32_t offset = p_.set->group_term_offset(*p_.w13);
      for (int64_t b = 0; b < padded / len; ++b) {
        int32_t sum = 0;
        for (int64_t k = b * len; k < (b + 1) * len; ++k) sum += v[k];
        terms[b] = -offset * sum;
      }
      q.group_terms = terms;
    }
    *row = q;
  }

  // Phase 0 (the thread's share of it); returns the chunk's input rows. Adds to sync_.ready as
  // it goes (release: the rows are visible to whoever sees the count).
  int64_t quantize_inputs(int tid, int64_t t0, int64_t tokens) {
    const int64_t K = p_.s.top_k;
    const int64_t rows = per_pair_rows(p_) ? tokens * K : tokens;
    float* row = thread_buf(tid);
    for (;;) {
      const int64_t r0 = sync_.claim.fetch_add(kQuantBatch, std::memory_order_relaxed);
      if (r0 >= rows) break;
      const int64_t r1 = std::min(rows, r0 + kQuantBatch);
      quantize_batch(t0, r0, r1, row);
      sync_.ready.fetch_add(r1 - r0, std::memory_order_release);
    }
    return rows;
  }

  // Input rows [r0, r1) of the chunk, quantized (row: the thread's f32 scratch).
  void quantize_batch(int64_t t0, int64_t r0, int64_t r1, float* row) {
    const bool on_input = p_.params->apply_router_weight_on_input;
    const bool per_pair = per_pair_rows(p_);
    const int64_t K = p_.s.top_k;
    for (int64_t r = r0; r < r1; ++r) {
      // a row of a pair belongs to that pair: none to quantize for a pair held elsewhere
      const int64_t e = per_pair ? local_expert(t0, r) : -1;
      if (per_pair && e < 0) continue;
      // w13's input order: the expert's gather of the row
      const int32_t* order = p_.w13->has_input_order
                                 ? reinterpret_cast<const int32_t*>(p_.w13->input_order(
                                       p_.w13_base + static_cast<size_t>(e) * p_.w13->expert_bytes))
                                 : nullptr;
      uint8_t* dst = s_.qx + static_cast<size_t>(r) * s_.qx_stride;
      const int64_t t = per_pair ? r / K : r;
      if (p_.staged != nullptr) {
        stage_row(on_input ? t0 * K + r : t0 + t, dst, &s_.qx_rows[r], order);
        continue;
      }
      quantize_input_row(*p_.set, *p_.x, t0 + t, on_input, on_input ? router_weight(t0, r) : 1.0f,
                         row, p_.w13->cols_padded, p_.w13->group_len,
                         p_.set->group_term_offset(*p_.w13), dst, &s_.qx_rows[r], order);
    }
  }

  // The panel records of stored rows [n0, n1) of one expert (one run), as a prefetch range.
  static PrefetchRange rows_range(const Geometry& g, const uint8_t* expert, int64_t n0,
                                  int64_t n1) {
    const int64_t P = g.panel, q0 = n0 / P, q1 = (n1 + P - 1) / P;
    return {g.panel_at(expert, q0), (q1 - q0) * static_cast<int64_t>(g.panel_bytes) / 64};
  }

  // Share ti of `count` of a prefetch range: the next task's lines are spread over the current
  // task's tiles, so that its first tile does not ask DRAM for all of them at once.
  static PrefetchRange share(const PrefetchRange& r, int64_t ti, int64_t count) {
    const int64_t a = r.lines * ti / count, b = r.lines * (ti + 1) / count;
    return {r.begin == nullptr ? nullptr : r.begin + 64 * a, b - a};
  }

  // Phase 1's tasks: slices of I per active expert, experts ascending.
  int64_t inter_slices() const { return (p_.s.inter + kSliceI - 1) / kSliceI; }
  // Phase 2's tasks: slices of H.
  int64_t down_slices() const {
    const int64_t slice = down_slice(p_.s.hidden, threads_);
    return (p_.s.hidden + slice - 1) / slice;
  }

  void gate_up(int tid) {
    const bool per_pair = per_pair_rows(p_);
    const int64_t I = p_.s.inter, K = p_.s.top_k, tile = p_.set->tile_m;
    const int64_t slices = inter_slices();
    const Geometry& w13 = *p_.w13;
    float* cg = thread_buf(tid);
    float* cu = cg + tile * kSliceI;
    QuantRow a[kMaxTileM];
    auto expert_of = [&](int64_t task) {
      return p_.w13_base + static_cast<size_t>(s_.active[task / slices]) * p_.w13->expert_bytes;
    };
    // Each thread claims one task ahead and prefetches its weights while computing the current
    // one (spread over its tiles), so that the first tile of a task does not wait for DRAM.
    int64_t task = gate_up_tasks_.claim(tid);
    while (task >= 0) {
      const int64_t following = gate_up_tasks_.claim(tid);
      const int32_t e = s_.active[task / slices];
      const int64_t i0 = (task % slices) * kSliceI, i1 = std::min(I, i0 + kSliceI);
      // the block's stored rows: gate's, then up's
      const int64_t gate0 = w13.stored_row(0, i0), up0 = w13.stored_row(1, i0);
      const uint8_t* expert = expert_of(task);
      PrefetchRange pf_gate[2] = {}, pf_up[2] = {};
      if (following >= 0) {
        const int64_t j0 = (following % slices) * kSliceI, len = w13.block_len(j0);
        const int64_t g0 = w13.stored_row(0, j0);
        pf_gate[0] = rows_range(w13, expert_of(following), g0, g0 + len);
        pf_up[0] = rows_range(w13, expert_of(following), g0 + len, g0 + 2 * len);
      }
      const RowTiles tiles(s_.begin[e + 1] - s_.begin[e], tile);
      for (int64_t ti = 0; ti < tiles.count; ++ti) {
        const int64_t j = s_.begin[e] + tiles.start(ti), m = tiles.size(ti);
        for (int64_t r = 0; r < m; ++r) {
          const int32_t pair = s_.order[j + r];
          a[r] = s_.qx_rows[per_pair ? pair : pair / K];
        }
        const PrefetchRange gate_share[2] = {share(pf_gate[0], ti, tiles.count), {}};
        const PrefetchRange up_share[2] = {share(pf_up[0], ti, tiles.count), {}};
        gemm(m, a, expert, w13, gate0, gate0 + (i1 - i0), cg, kSliceI, gate_share);
        gemm(m, a, expert, w13, up0, up0 + (i1 - i0), cu, kSliceI, up_share);
        for (int64_t r = 0; r < m; ++r) {
          float* dst = s_.m + static_cast<size_t>(s_.order[j + r]) * s_.m_stride + i0;
          p_.set->activate(*p_.params, cg + r * kSliceI, cu + r * kSliceI, dst, i1 - i0);
        }
      }
      // The last slice of this expert to finish (acq_rel: its thread sees every other slice's
      // rows) requantizes the expert's rows, so down needs no separate phase and barrier.
      const auto ai = static_cast<int32_t>(task / slices);
      if (done(ai).fetch_add(1, std::memory_order_acq_rel) + 1 == slices) {
        requantize_expert(e);
        done(ai).fetch_add(1, std::memory_order_release);  // down may read its rows now
      }
      task = following;
    }
  }

  // One GEMM call: rows a[0, m) of the expert's padded output rows [n0, n1) into c; `prefetch`
  // (two ranges, or null) goes with it.
  void gemm(int64_t m, const QuantRow* a, const uint8_t* expert, const Geometry& geometry,
            int64_t n0, int64_t n1, float* c, int64_t c_stride,
            const PrefetchRange* prefetch) const {
    GemmArgs g;
    g.m = m;
    g.a = a;
    g.expert = expert;
    g.geometry = &geometry;
    g.n_begin = n0;
    g.n_end = n1;
    g.c = c;
    g.c_stride = c_stride;
    if (prefetch != nullptr) std::copy(prefetch, prefetch + 2, g.prefetch);
    p_.set->gemm(g);
  }

  // The intermediate rows of expert e's pairs, quantized for down.
  void requantize_expert(int32_t e) {
    for (int32_t j = s_.begin[e]; j < s_.begin[e + 1]; ++j) {
      const size_t r = static_cast<size_t>(s_.order[j]);
      p_.set->quantize({.src = s_.m + r * s_.m_stride,
                        .cols = p_.s.inter,
                        .cols_padded = p_.w2->cols_padded,
                        .group_len = p_.w2->group_len,
                        .group_term_offset = p_.set->group_term_offset(*p_.w2),
                        .dst = s_.qm + r * s_.qm_stride,
                        .row = &s_.qm_rows[r]});
    }
  }

  void down(int tid, int64_t t0, int64_t tokens) {
    const bool on_input = p_.params->apply_router_weight_on_input;
    const int64_t H = p_.s.hidden, K = p_.s.top_k, tile = p_.set->tile_m;
    const int64_t slice = down_slice(H, threads_);
    const int64_t requantized = inter_slices() + 1;  // an expert's done count once requantized
    float* c = thread_buf(tid);
    QuantRow a[kMaxTileM];
    const MutableTensorView& out = *p_.out;
    const int64_t out_stride = out.stride();
    for (;;) {
      const int64_t task = down_tasks_.claim(tid);
      if (task < 0) break;
      const int64_t h0 = task * slice, h1 = std::min(H, h0 + slice), w = h1 - h0;
      for (int64_t t = 0; t < tokens; ++t) std::fill_n(s_.acc + t * H + h0, w, 0.0f);
      for (int32_t ai = 0; ai < active_count_; ++ai) {
        const int32_t e = s_.active[ai];
        wait_until([&] { return done(ai).load(std::memory_order_acquire) >= requantized; });
        const uint8_t* expert = p_.w2_base + static_cast<size_t>(e) * p_.w2->expert_bytes;
        PrefetchRange pf[2] = {};  // the next expert's rows of this slice
        if (ai + 1 < active_count_)
          pf[0] = rows_range(
              *p_.w2, p_.w2_base + static_cast<size_t>(s_.active[ai + 1]) * p_.w2->expert_bytes, h0,
              h1);
        const RowTiles tiles(s_.begin[e + 1] - s_.begin[e], tile);
        for (int64_t ti = 0; ti < tiles.count; ++ti) {
          const int64_t j = s_.begin[e] + tiles.start(ti), m = tiles.size(ti);
          for (int64_t r = 0; r < m; ++r) a[r] = s_.qm_rows[s_.order[j + r]];
          const PrefetchRange pf_share[2] = {share(pf[0], ti, tiles.count), {}};
          gemm(m, a, expert, *p_.w2, h0, h1, c, slice, pf_share);
          for (int64_t r = 0; r < m; ++r) {
            const int32_t pair = s_.order[j + r];
            const float* y = c + r * slice;
            if (p_.slot_rows != nullptr) {  // the pair's row itself, unweighted
              std::copy(y, y + w, p_.slot_rows + (t0 * K + pair) * H + h0);
              continue;
            }
            const float rw = on_input ? 1.0f : router_weight(t0, pair);
            add_weighted_row(s_.acc + (pair / K) * H + h0, rw, y, w);
          }
        }
      }
      for (int64_t t = 0; t < tokens && p_.slot_rows == nullptr; ++t) {
        const float* acc = s_.acc + t * H + h0;
        const int64_t base = (t0 + t) * out_stride + h0;
        if (out.dtype == DType::f32) {
          std::memcpy(static_cast<uint8_t*>(out.data) + base * 4, acc, static_cast<size_t>(w) * 4);
        } else {
          for (int64_t h = 0; h < w; ++h) store_float(out.data, out.dtype, base + h, acc[h]);
        }
      }
    }
  }

  const Problem& p_;
  const Scratch& s_;
  int threads_;
  ChunkSync sync_;
  int64_t t0_ = 0, tokens_ = 0;  // the running chunk's
  TaskClaims& gate_up_tasks_;
  TaskClaims& down_tasks_;
  int32_t active_count_ = 0;  // written by begin_chunk(), before the chunk's run
};

}  // namespace
}  // namespace detail

void forward(Context& context, const TensorView& x, const TensorView& topk_ids,
             const TensorView& topk_weights, std::span<const uint8_t> w13_packed,
             std::span<const uint8_t> w2_packed, const MoeParams& params,
             const MutableTensorView& out) {
  detail::forward_tokens(context, x, topk_ids, topk_weights, w13_packed, w2_packed, params, out, {},
                         nullptr, -1);
}

namespace detail {

void quantize_input_row(const KernelSet& set, const TensorView& x, int64_t t, bool weighted,
                        float weight, float* row, int64_t cols_padded, int64_t group_len,
                        int32_t group_term_offset, void* dst, QuantRow* out, const int32_t* order) {
  const int64_t H = x.shape[1], base = t * x.stride();
  if (order != nullptr) {
    for (int64_t c = 0; c < H; ++c)
      row[c] = load_float(x.data, x.dtype, base + input_index(order, c, H)) * weight;
  } else if (x.dtype == DType::f32 && !weighted) {
    std::memcpy(row, static_cast<const uint8_t*>(x.data) + base * 4, static_cast<size_t>(H) * 4);
  } else {
    for (int64_t h = 0; h < H; ++h) row[h] = load_float(x.data, x.dtype, base + h) * weight;
  }
  set.quantize({.src = row,
                .cols = H,
                .cols_padded = cols_padded,
                .group_len = group_len,
                .group_term_offset = group_term_offset,
                .dst = dst,
                .row = out});
}

void forward_tokens(Context& context, const TensorView& x, const TensorView& topk_ids,
                    const TensorView& topk_weights, std::span<const uint8_t> w13_packed,
                    std::span<const uint8_t> w2_packed, const MoeParams& params,
                    const MutableTensorView& out, const ForwardRules& rules,
                    const int32_t* local_of, int64_t local_experts) {
  // the workers' wake-up (tens of microseconds) overlaps the checks
  ContextAccess::impl(context).pool.prewake();
  const Geometry w13 = read_geometry(w13_packed, "w13_packed");
  const Geometry w2 = read_geometry(w2_packed, "w2_packed");
  ForwardJob job;
  job.s = check_forward(x, topk_ids, topk_weights, w13, w2, params, out, rules);
  if (local_experts >= 0 && job.s.experts != local_experts)
    throw Error(cat("w13_packed: expected the shard's ", local_experts, " local experts, got ",
                    job.s.experts));
  set_weights(job, w13, w2, w13_packed, w2_packed);
  job.x = &x;
  job.ids = &topk_ids;
  job.weights = &topk_weights;
  job.out = &out;
  job.params = &params;
  job.local_of = local_of;
  run_forward(context, job);
}

ThreadPool& context_threads(Context& context) { return ContextAccess::impl(context).pool; }

void run_forward(Context& context, const ForwardJob& job) {
  Problem p;
  static_cast<ForwardJob&>(p) = job;
  if (p.s.tokens == 0) return;  // an empty batch: nothing to compute
  Context::Impl& impl = ContextAccess::impl(context);
  const int threads = impl.pool.size();
  // Tokens per chunk: as many as fit the scratch target, at least 16, at most T.
  const size_t per_token = plan(p, 1, 0).total;
  p.chunk_tokens =
      std::clamp<int64_t>(static_cast<int64_t>(kChunkScratch / per_token), 16, p.s.tokens);
  Layout layout = plan(p, p.chunk_tokens, threads);
  // Resource limits: fewer tokens per chunk when the scratch would exceed the
  // context's limit (the result is the same bits: tokens are independent); refuse when even one
  // token does not fit. plan() is monotonic in the chunk size.
  if (layout.total > impl.memory_limit) {
    const Layout one = plan(p, 1, threads);
    if (one.total > impl.memory_limit)
      throw Error(cat("context: the call needs ", one.total,
                      " bytes of scratch memory (one token: H ", p.s.hidden, ", I ", p.s.inter,
                      ", K ", p.s.top_k, ", ", threads, " threads), more than the memory limit of ",
                      impl.memory_limit, " bytes; raise it with Context::set_memory_limit"));
    int64_t lo = 1, hi = p.chunk_tokens - 1;  // lo fits, hi + 1 does not
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (plan(p, mid, threads).total <= impl.memory_limit)
        lo = mid;
      else
        hi = mid - 1;
    }
    p.chunk_tokens = lo;
    layout = plan(p, p.chunk_tokens, threads);
  }
  if (impl.arena_bytes > impl.memory_limit) {  // the limit was lowered since the arena grew
    impl.arena.reset();
    impl.arena_bytes = 0;
  }
  bind(layout, impl.reserve(layout.total));

  // One Worker object for all threads: they share its chunk state.
  Worker worker(p, layout.scratch, threads, impl.gate_up_tasks, impl.down_tasks);
  for (int64_t t0 = 0; t0 < p.s.tokens; t0 += p.chunk_tokens) {
    worker.begin_chunk(t0, std::min(p.chunk_tokens, p.s.tokens - t0));
    impl.pool.run(worker);
  }
}

}  // namespace detail

}  // namespace w4a8moe
