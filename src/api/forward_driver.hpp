// The forward driver's entry, shared by forward(), forward_local() and the dispatch steps of
// expert parallelism (docs/expert-parallel.md): one job description, one driver.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "api/validate.hpp"
#include "common/argument_checks.hpp"
#include "pack/packed_format.hpp"
#include "registry.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

// Activation rows quantized by another process (dispatched records): row r's int8 values start
// at base + r * stride + q_offset (`hidden` bytes), its recip (f32) and zero point (int32) at
// recip_offset and zp_offset. The driver stages them into its kernel set's row format instead of
// quantizing x.
struct StagedRows {
  const uint8_t* base = nullptr;
  size_t stride = 0, q_offset = 0, recip_offset = 0, zp_offset = 0;
};

struct ForwardJob {
  ForwardShape s;  // s.experts: the experts the packed buffers hold
  const Geometry* w13 = nullptr;
  const Geometry* w2 = nullptr;
  const KernelSet* set = nullptr;
  const uint8_t* w13_base = nullptr;  // first expert block
  const uint8_t* w2_base = nullptr;
  const TensorView* x = nullptr;           // null when `staged` gives the rows
  const StagedRows* staged = nullptr;      // rows: T, or T * K when the weight is on the input
  const TensorView* ids = nullptr;         // [T, K]
  const TensorView* weights = nullptr;     // [T, K]
  const MutableTensorView* out = nullptr;  // [T, H], x's dtype or f32
  const MoeParams* params = nullptr;
  // ids -> packed expert index: local_of[id], -1 for an expert held elsewhere (that slot adds
  // nothing); ids of -1 are skipped too. Null: ids index the packed experts directly.
  const int32_t* local_of = nullptr;
  // Non-null: no sum; the down row y of pair p (token t, slot k: p = t * K + k), unweighted, goes
  // to slot_rows[p * H, (p + 1) * H) for every local pair (the exact combine of dispatch).
  float* slot_rows = nullptr;
};

// The weights' part of a job: the decoded geometries (kept alive by the caller), the kernel set
// of their layout, the first expert blocks of the buffers.
inline void set_weights(ForwardJob& job, const Geometry& w13, const Geometry& w2,
                        std::span<const uint8_t> w13_packed, std::span<const uint8_t> w2_packed) {
  job.w13 = &w13;
  job.w2 = &w2;
  job.set = &set_for_layout(w13.layout, "w13_packed");
  job.w13_base = w13_packed.data() + kHeaderBytes;
  job.w2_base = w2_packed.data() + kHeaderBytes;
}

// Row t of x, times `weight` when `weighted` (the router weight on the input), quantized by
// `set` into dst (cols_padded bytes, then the group terms for weights of offset
// group_term_offset if the set writes them): the one quantization of an input row, whether
// forward() or a dispatching process does it. With `order` (w13's input order of one expert),
// column c of the row is x[t, order[c]].
void quantize_input_row(const KernelSet& set, const TensorView& x, int64_t t, bool weighted,
                        float weight, float* row, int64_t cols_padded, int64_t group_len,
                        int32_t group_term_offset, void* dst, QuantRow* out,
                        const int32_t* order = nullptr);

// Input order[c] of a row of `cols` inputs. The packer wrote permutations; a damaged buffer
// (whose body no checksum covers) is clamped to the row rather than read outside it.
inline int64_t input_index(const int32_t* order, int64_t c, int64_t cols) noexcept {
  return std::min<int64_t>(static_cast<uint32_t>(order[c]), cols - 1);
}

// forward() and forward_local(): the checks (ids name rules.id_experts experts when set), then
// the run. local_of as ForwardJob::local_of; `local_experts` (-1: any) must be the packed count.
void forward_tokens(Context& context, const TensorView& x, const TensorView& topk_ids,
                    const TensorView& topk_weights, std::span<const uint8_t> w13_packed,
                    std::span<const uint8_t> w2_packed, const MoeParams& params,
                    const MutableTensorView& out, const ForwardRules& rules,
                    const int32_t* local_of, int64_t local_experts);

// Runs the job on the context's threads. Arguments are checked by the caller.
void run_forward(Context& context, const ForwardJob& job);

class ThreadPool;
// The context's worker threads, for the other steps of a forward (dispatch, combine).
ThreadPool& context_threads(Context& context);

// Grants the driver the context's threads and scratch.
struct ContextAccess {
  static Context::Impl& impl(Context& context) { return *context.impl_; }
};

}  // namespace w4a8moe::detail
