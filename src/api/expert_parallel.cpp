// Expert parallelism without a transport: shards and placements, the local forward, and the
// three steps of the dispatch / combine way (docs/expert-parallel.md).
#include "w4a8moe/expert_parallel.hpp"

#include <algorithm>
#include <cstring>

#include "api/accumulate.hpp"
#include "api/forward_driver.hpp"
#include "api/validate.hpp"
#include "common/checked_math.hpp"
#include "common/format.hpp"
#include "common/numeric.hpp"
#include "thread_pool.hpp"

namespace w4a8moe {

namespace detail {
namespace {

// A dispatched record (docs/expert-parallel.md, "Records"): a 16-byte head, the routing of its
// slots, the row's int8 values; 16-byte aligned.
constexpr size_t kRecToken = 0;  // int32: the token's index at the sender
constexpr size_t kRecSlots = 4;  // int32: slots in this record
constexpr size_t kRecRecip = 8;  // f32: the row's recip (value = (q - zp) * recip)
constexpr size_t kRecZp = 12;    // int32: the row's zero point
constexpr size_t kRecIds = 16;   // int32 [slots]: global expert, -1 for a slot held elsewhere

size_t record_weights(int64_t slots) { return kRecIds + 4 * static_cast<size_t>(slots); }
size_t record_q(int64_t slots) { return kRecIds + 8 * static_cast<size_t>(slots); }
size_t record_size(int64_t slots, int64_t hidden) {
  return (record_q(slots) + static_cast<size_t>(hidden) + 15) / 16 * 16;
}

template <class T>
void put(uint8_t* rec, size_t at, T v) {
  std::memcpy(rec + at, &v, sizeof(T));
}
template <class T>
T get(const uint8_t* rec, size_t at) {
  T v;
  std::memcpy(&v, rec + at, sizeof(T));
  return v;
}

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace
}  // namespace detail

// ---- shards and placements --------------------------------------------------------------------

ExpertShard ExpertShard::all(int64_t experts) { return range(experts, 0, experts); }

ExpertShard ExpertShard::range(int64_t experts, int64_t first, int64_t count) {
  using detail::cat;
  if (experts < 1 || experts > INT32_MAX)
    throw Error(cat("experts: expected a count in [1, ", INT32_MAX, "], got ", experts));
  if (first < 0 || first >= experts)
    throw Error(cat("first: expected a global expert in [0, ", experts, "), got ", first));
  if (count < 1 || count > experts - first)
    throw Error(cat("count: expected 1 to ", experts - first, " experts (from expert ", first,
                    " of ", experts, "), got ", count));
  ExpertShard s;
  s.map_.assign(static_cast<size_t>(experts), -1);
  for (int64_t i = 0; i < count; ++i) {
    s.map_[static_cast<size_t>(first + i)] = static_cast<int32_t>(i);
    s.globals_.push_back(static_cast<int32_t>(first + i));
  }
  return s;
}

ExpertShard ExpertShard::even_split(int64_t experts, int64_t rank, int64_t ranks) {
  using detail::cat;
  if (ranks < 1 || ranks > experts)
    throw Error(cat("ranks: expected 1 to ", experts, " processes (one expert each at least), got ",
                    ranks));
  if (rank < 0 || rank >= ranks)
    throw Error(cat("rank: expected a process in [0, ", ranks, "), got ", rank));
  const int64_t base = experts / ranks, extra = experts % ranks;
  return range(experts, rank * base + std::min(rank, extra), base + (rank < extra ? 1 : 0));
}

ExpertShard ExpertShard::from_map(std::span<const int32_t> map, std::string_view argument) {
  using detail::cat;
  const auto n = static_cast<int64_t>(map.size());
  if (n < 1 || n > INT32_MAX)
    throw Error(cat(argument, ": expected one entry per expert (1 or more), got ", n));
  std::vector<int32_t> globals(map.size(), -1);
  int64_t local = 0;
  for (int64_t e = 0; e < n; ++e) {
    const int32_t l = map[static_cast<size_t>(e)];
    if (l < -1 || l >= n)
      throw Error(cat(argument, ": expected -1 or a local index in [0, ", n, "), got ", l,
                      " for expert ", e));
    if (l < 0) continue;
    if (globals[static_cast<size_t>(l)] >= 0)
      throw Error(cat(argument, ": expected each local index once, got ", l, " for experts ",
                      globals[static_cast<size_t>(l)], " and ", e));
    globals[static_cast<size_t>(l)] = static_cast<int32_t>(e);
    ++local;
  }
  if (local == 0) throw Error(cat(argument, ": expected at least one local expert, got none"));
  for (int64_t l = 0; l < local; ++l)
    if (globals[static_cast<size_t>(l)] < 0)
      throw Error(cat(argument, ": expected the local indices 0 to ", local - 1,
                      " (one per local expert), got no expert for ", l));
  globals.resize(static_cast<size_t>(local));
  ExpertShard s;
  s.map_.assign(map.begin(), map.end());
  s.globals_ = std::move(globals);
  return s;
}

bool ExpertShard::contiguous() const noexcept {
  for (size_t i = 0; i < globals_.size(); ++i)
    if (globals_[i] != globals_[0] + static_cast<int32_t>(i)) return false;
  return true;
}

ExpertPlacement ExpertPlacement::from_shards(std::span<const ExpertShard> shards) {
  using detail::cat;
  if (shards.empty()) throw Error("shards: expected one shard per process, got none");
  const int64_t experts = shards[0].global_experts();
  ExpertPlacement p;
  p.ranks_ = static_cast<int64_t>(shards.size());
  p.owner_.assign(static_cast<size_t>(experts), -1);
  for (size_t r = 0; r < shards.size(); ++r) {
    if (shards[r].global_experts() != experts)
      throw Error(cat("shards: expected every process's shard to map ", experts,
                      " experts (as process 0's does), got ", shards[r].global_experts(),
                      " at process ", r));
    for (const int32_t e : shards[r].globals()) {
      int32_t& owner = p.owner_[static_cast<size_t>(e)];
      if (owner >= 0)
        throw Error(cat("shards: expected each expert held by one process, got expert ", e,
                        " held by processes ", owner, " and ", r));
      owner = static_cast<int32_t>(r);
    }
  }
  for (int64_t e = 0; e < experts; ++e)
    if (p.owner_[static_cast<size_t>(e)] < 0)
      throw Error(
          cat("shards: expected each expert held by one process, got expert ", e, " held by none"));
  return p;
}

ExpertPlacement ExpertPlacement::even_split(int64_t experts, int64_t ranks) {
  std::vector<ExpertShard> shards;
  for (int64_t r = 0; r < std::max<int64_t>(ranks, 1); ++r)
    shards.push_back(ExpertShard::even_split(experts, r, ranks));
  return from_shards(shards);
}

// ---- the local forward ----------------------------------------------------------------------

void forward_local(Context& context, const TensorView& x, const TensorView& topk_ids,
                   const TensorView& topk_weights, std::span<const uint8_t> w13_packed,
                   std::span<const uint8_t> w2_packed, const MoeParams& params,
                   const ExpertShard& shard, const MutableTensorView& out) {
  using namespace detail;
  if (shard.global_experts() == 0)
    throw Error("shard: expected a shard of the layer's experts, got an empty one");
  ForwardRules rules;
  rules.id_experts = shard.global_experts();
  rules.f32_out = true;
  forward_tokens(context, x, topk_ids, topk_weights, w13_packed, w2_packed, params, out, rules,
                 shard.map().data(), shard.local_experts());
}

void write_output(std::span<const float> sums, const MutableTensorView& out) {
  using namespace detail;
  if (out.rank != 2 || out.shape[0] < 0 || out.shape[1] < 1)
    throw Error(cat("out: expected shape [T, H], got ", shape_string(out.rank, out.shape)));
  require_float(out.dtype, "out");
  const int64_t T = out.shape[0], H = out.shape[1];
  if (static_cast<int64_t>(sums.size()) != T * H)
    throw Error(
        cat("sums: expected ", T * H, " values (out's ", T, " x ", H, "), got ", sums.size()));
  if (T == 0) return;
  require_data(out.data, "out");
  if (out.row_stride != 0 && out.row_stride < H)
    throw Error(cat("out: expected a row stride >= ", H, ", got ", out.row_stride));
  require_addressable(out.data, out.dtype, out.rank, out.shape, out.stride(), "out");
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      store_float(out.data, out.dtype, t * out.stride() + h, sums[static_cast<size_t>(t * H + h)]);
}

// ---- dispatch / combine ---------------------------------------------------------------------

Dispatch::Dispatch(ExpertPlacement placement, int64_t rank, const DispatchConfig& config)
    : placement_(std::move(placement)), rank_(rank), config_(config) {
  using namespace detail;
  if (placement_.ranks() < 1)
    throw Error("placement: expected the placement of a layer's experts, got an empty one");
  if (rank < 0 || rank >= placement_.ranks())
    throw Error(cat("rank: expected a process in [0, ", placement_.ranks(), "), got ", rank));
  if (config.hidden < 1 || config.hidden > kMaxCols)
    throw Error(cat("hidden: expected 1 to ", kMaxCols, ", got ", config.hidden));
  if (config.top_k < 1 || config.top_k > 4096)
    throw Error(cat("top_k: expected 1 to 4096 slots, got ", config.top_k));
  if (config.result_dtype != ResultDType::f32 && config.result_dtype != ResultDType::bf16)
    throw Error(cat("result_dtype: expected f32 (0) or bf16 (1), got ",
                    static_cast<int>(config.result_dtype)));
  check_moe_params(config.params);
  if (config.exact && config.result_dtype != ResultDType::f32)
    throw Error("result_dtype: expected f32 with exact results (a row per slot), got bf16");
  slots_per_record_ = config.params.apply_router_weight_on_input ? 1 : config.top_k;
  record_bytes_ = record_size(slots_per_record_, config.hidden);
  send_counts_.assign(static_cast<size_t>(placement_.ranks()), 0);
}

size_t Dispatch::result_row_bytes() const noexcept {
  return static_cast<size_t>(config_.hidden) * (config_.result_dtype == ResultDType::f32 ? 4 : 2);
}

void Dispatch::pack(Context& context, const TensorView& x, const TensorView& topk_ids,
                    const TensorView& topk_weights) {
  using namespace detail;
  const int64_t H = config_.hidden, K = config_.top_k, N = placement_.ranks();
  const ForwardShape s = check_tokens(x, topk_ids, topk_weights, H, placement_.experts());
  if (s.top_k != K)
    throw Error(
        cat("topk_ids: expected ", K, " slots per token (the dispatch's top_k), got ", s.top_k));
  const bool on_input = config_.params.apply_router_weight_on_input;
  const int64_t T = s.tokens;
  tokens_ = T;
  x_dtype_ = x.dtype;
  auto owner_of = [&](int64_t t, int64_t k) {
    return placement_.owner(load_index(topk_ids.data, topk_ids.dtype, t * K + k));
  };

  // Which records each token makes, in process order: per process holding any of its slots
  // (one record), or per slot (weight on the input: the slot's row differs).
  std::fill(send_counts_.begin(), send_counts_.end(), 0);
  token_records_begin_.assign(static_cast<size_t>(T + 1), 0);
  token_records_.clear();
  std::vector<int64_t>& dest = record_dest_;  // d * K + k: process d; weight on input: slot k
  dest.clear();
  // Weight on the input: a process's records of a token in ascending (expert, slot) order, the
  // order forward() adds the slots in, so that one process gives forward()'s bits.
  std::vector<int64_t>& slot_order = record_slot_order_;
  slot_order.resize(static_cast<size_t>(K));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) slot_order[static_cast<size_t>(k)] = k;
    if (on_input)
      std::stable_sort(slot_order.begin(), slot_order.end(), [&](int64_t a, int64_t b) {
        return load_index(topk_ids.data, topk_ids.dtype, t * K + a) <
               load_index(topk_ids.data, topk_ids.dtype, t * K + b);
      });
    for (int64_t d = 0; d < N; ++d) {
      for (const int64_t k : slot_order) {
        if (owner_of(t, k) != d) continue;
        dest.push_back(d * K + k);
        ++send_counts_[static_cast<size_t>(d)];
        if (!on_input) break;
      }
    }
    token_records_begin_[static_cast<size_t>(t + 1)] = static_cast<int64_t>(dest.size());
  }
  // Record positions: process d's records start after those of processes 0 .. d - 1, in token
  // order within.
  std::vector<int64_t> cursor(static_cast<size_t>(N), 0);
  for (int64_t d = 1; d < N; ++d)
    cursor[static_cast<size_t>(d)] =
        cursor[static_cast<size_t>(d - 1)] + send_counts_[static_cast<size_t>(d - 1)];
  token_records_.resize(dest.size());
  for (size_t i = 0; i < dest.size(); ++i)
    token_records_[i] = cursor[static_cast<size_t>(dest[i] / K)]++;
  send_.resize(checked_mul(dest.size(), record_bytes_));

  // The result rows each record brings back (exact: one per slot it carries), in the order the
  // processes return them: process by process, each in its records' order.
  std::vector<int64_t>& rows_at = record_rows_begin_;
  rows_at.assign(dest.size() + 1, 0);
  returned_counts_.assign(static_cast<size_t>(N), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t r = token_records_begin_[static_cast<size_t>(t)];
         r < token_records_begin_[static_cast<size_t>(t + 1)]; ++r) {
      const int64_t d = dest[static_cast<size_t>(r)] / K;
      int64_t rows = 1;
      if (config_.exact && !on_input) {
        rows = 0;
        for (int64_t k = 0; k < K; ++k) rows += owner_of(t, k) == d ? 1 : 0;
      }
      rows_at[static_cast<size_t>(token_records_[static_cast<size_t>(r)]) + 1] = rows;
      returned_counts_[static_cast<size_t>(d)] += rows;
    }
  }
  for (size_t i = 1; i < rows_at.size(); ++i) rows_at[i] += rows_at[i - 1];
  if (config_.exact) {  // combine() weights the rows itself
    topk_ids_.resize(static_cast<size_t>(T * K));
    topk_weights_.resize(static_cast<size_t>(T * K));
    for (int64_t i = 0; i < T * K; ++i) {
      topk_ids_[static_cast<size_t>(i)] = load_index(topk_ids.data, topk_ids.dtype, i);
      topk_weights_[static_cast<size_t>(i)] = load_float(topk_weights.data, topk_weights.dtype, i);
    }
  }

  // Quantize each row once, as forward() does, and write it into its records.
  const KernelSet& set = active_set();
  const int64_t padded = round_up(H, kBlock);
  ThreadPool& pool = context_threads(context);
  const size_t row_floats = static_cast<size_t>(round_up(H, 16));
  const size_t q_bytes = static_cast<size_t>(padded) + static_cast<size_t>(padded / kBlock) * 4;
  const size_t per_thread = row_floats * 4 + (q_bytes + 63) / 64 * 64;
  std::vector<float>& scratch = sums_;
  scratch.resize(static_cast<size_t>(pool.size()) * per_thread / 4);
  const int64_t slots = slots_per_record_;
  auto body = [&](int tid) {
    auto* row = scratch.data() + static_cast<size_t>(tid) * per_thread / 4;
    auto* q = reinterpret_cast<uint8_t*>(row + row_floats);
    QuantRow qr;
    auto quantize = [&](int64_t t, float w) {
      // one group: the receiver stages the rows and writes their group terms (stage_row)
      quantize_input_row(set, x, t, on_input, w, row, padded, padded, 8, q, &qr);
    };
    for (int64_t t = tid; t < T; t += pool.size()) {
      const int64_t r0 = token_records_begin_[static_cast<size_t>(t)];
      const int64_t r1 = token_records_begin_[static_cast<size_t>(t + 1)];
      if (!on_input) quantize(t, 1.0f);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t d = dest[static_cast<size_t>(r)] / K;
        uint8_t* rec = send_.data() +
                       static_cast<size_t>(token_records_[static_cast<size_t>(r)]) * record_bytes_;
        std::memset(rec, 0, record_bytes_);
        put<int32_t>(rec, kRecToken, static_cast<int32_t>(t));
        put<int32_t>(rec, kRecSlots, static_cast<int32_t>(slots));
        if (on_input) {
          const int64_t k = dest[static_cast<size_t>(r)] % K;
          const float w = load_float(topk_weights.data, topk_weights.dtype, t * K + k);
          quantize(t, w);
          put<int32_t>(rec, kRecIds,
                       static_cast<int32_t>(load_index(topk_ids.data, topk_ids.dtype, t * K + k)));
          put<float>(rec, record_weights(1), w);
        } else {
          for (int64_t k = 0; k < K; ++k) {
            const bool here = owner_of(t, k) == d;
            put<int32_t>(
                rec, kRecIds + 4 * static_cast<size_t>(k),
                here ? static_cast<int32_t>(load_index(topk_ids.data, topk_ids.dtype, t * K + k))
                     : -1);
            put<float>(rec, record_weights(K) + 4 * static_cast<size_t>(k),
                       here ? load_float(topk_weights.data, topk_weights.dtype, t * K + k) : 0.0f);
          }
        }
        put<float>(rec, kRecRecip, qr.recip);
        put<int32_t>(rec, kRecZp, qr.zp);
        std::memcpy(rec + record_q(slots), q, static_cast<size_t>(H));
      }
    }
  };
  if (T > 0) pool.run(body);
}

void Dispatch::compute(Context& context, std::span<const uint8_t> received,
                       std::span<const int64_t> recv_counts, std::span<const uint8_t> w13_packed,
                       std::span<const uint8_t> w2_packed, const ExpertShard& shard) {
  using namespace detail;
  const int64_t H = config_.hidden, N = placement_.ranks(), slots = slots_per_record_;
  // The shard must be this process's share of the placement.
  if (shard.global_experts() != placement_.experts())
    throw Error(cat("shard: expected a map of the placement's ", placement_.experts(),
                    " experts, got ", shard.global_experts()));
  for (int64_t e = 0; e < placement_.experts(); ++e) {
    const bool held = shard.map()[static_cast<size_t>(e)] >= 0;
    if (held != (placement_.owner(e) == rank_))
      throw Error(cat("shard: expected the experts the placement gives process ", rank_,
                      ", got expert ", e, held ? " held here" : " missing",
                      " (the placement gives it to process ", placement_.owner(e), ")"));
  }
  if (static_cast<int64_t>(recv_counts.size()) != N)
    throw Error(
        cat("recv_counts: expected one count per process (", N, "), got ", recv_counts.size()));
  int64_t R = 0;
  for (int64_t r = 0; r < N; ++r) {
    const int64_t c = recv_counts[static_cast<size_t>(r)];
    if (c < 0 || c > INT32_MAX - R)
      throw Error(cat("recv_counts: expected a record count in [0, ", INT32_MAX - R, "], got ", c,
                      " from process ", r));
    R += c;
  }
  if (received.size() != static_cast<size_t>(R) * record_bytes_)
    throw Error(cat("received: expected ", R, " records of ", record_bytes_, " bytes (",
                    static_cast<size_t>(R) * record_bytes_, " bytes), got ", received.size(),
                    " bytes"));

  // The routing of the records, checked.
  ids_.resize(static_cast<size_t>(R * slots));
  weights_.resize(static_cast<size_t>(R * slots));
  int64_t from = 0, from_end = recv_counts.empty() ? 0 : recv_counts[0];
  for (int64_t i = 0; i < R; ++i) {
    while (i >= from_end) from_end += recv_counts[static_cast<size_t>(++from)];
    const uint8_t* rec = received.data() + static_cast<size_t>(i) * record_bytes_;
    const int64_t first = i - (from_end - recv_counts[static_cast<size_t>(from)]);
    auto bad = [&](auto... what) {
      return Error(cat("received: record ", first, " from process ", from, ": expected ", what...));
    };
    if (get<int32_t>(rec, kRecSlots) != slots)
      throw bad(slots, " slots, got ", get<int32_t>(rec, kRecSlots));
    const auto zp = get<int32_t>(rec, kRecZp);
    if (zp < -128 || zp > 127) throw bad("a zero point in [-128, 127], got ", zp);
    bool any = false;
    for (int64_t k = 0; k < slots; ++k) {
      const auto e = get<int32_t>(rec, kRecIds + 4 * static_cast<size_t>(k));
      if (e < -1 || e >= placement_.experts())
        throw bad("expert ids in [-1, ", placement_.experts(), "), got ", e, " in slot ", k);
      if (e >= 0 && shard.map()[static_cast<size_t>(e)] < 0)
        throw bad("experts of process ", rank_, ", got expert ", e, " (of process ",
                  placement_.owner(e), ") in slot ", k);
      any |= e >= 0;
      ids_[static_cast<size_t>(i * slots + k)] = e;
      weights_[static_cast<size_t>(i * slots + k)] =
          get<float>(rec, record_weights(slots) + 4 * static_cast<size_t>(k));
    }
    if (!any) throw bad("a slot of an expert of process ", rank_, ", got none");
  }

  const Geometry w13 = read_geometry(w13_packed, "w13_packed");
  const Geometry w2 = read_geometry(w2_packed, "w2_packed");
  ForwardJob job;
  job.s = check_packed_pair(w13, w2, "w13_packed", "w2_packed");
  if (job.s.experts != shard.local_experts())
    throw Error(cat("w13_packed: expected the shard's ", shard.local_experts(),
                    " local experts, got ", job.s.experts));
  if (job.s.hidden != H)
    throw Error(
        cat("w13_packed: expected hidden size ", H, " (the dispatch's), got ", job.s.hidden));
  job.s.tokens = R;
  job.s.top_k = slots;
  const TensorView ids = TensorView::of(ids_.data(), DType::i32, {R, slots});
  const TensorView weights = TensorView::of(weights_.data(), DType::f32, {R, slots});
  StagedRows staged;
  staged.base = received.data();
  staged.stride = record_bytes_;
  staged.q_offset = record_q(slots);
  staged.recip_offset = kRecRecip;
  staged.zp_offset = kRecZp;
  const bool f32 = config_.result_dtype == ResultDType::f32;
  // f32 results of whole records are the sums themselves: written in place
  const bool in_place = f32 && !config_.exact;
  if (in_place)
    results_.resize(static_cast<size_t>(R * H) * 4);
  else
    sums_.resize(static_cast<size_t>(R * (config_.exact ? slots : 1) * H));
  void* sums = in_place ? static_cast<void*>(results_.data()) : static_cast<void*>(sums_.data());
  const MutableTensorView out = MutableTensorView::of(sums, DType::f32, {R, H});
  set_weights(job, w13, w2, w13_packed, w2_packed);
  job.staged = &staged;
  job.ids = &ids;
  job.weights = &weights;
  job.out = &out;
  job.params = &config_.params;
  job.local_of = shard.map().data();
  if (config_.exact) job.slot_rows = sums_.data();
  run_forward(context, job);

  // The result rows in record order (exact: each record's local slots in slot order).
  result_counts_.assign(recv_counts.begin(), recv_counts.end());
  if (config_.exact) {
    const auto local = std::count_if(ids_.begin(), ids_.end(), [](int32_t e) { return e >= 0; });
    results_.resize(static_cast<size_t>(local * H) * 4);
    const size_t row_bytes = static_cast<size_t>(H) * 4;
    int64_t kept = 0, process = 0, process_end = recv_counts.empty() ? 0 : recv_counts[0];
    std::fill(result_counts_.begin(), result_counts_.end(), 0);
    for (int64_t i = 0; i < R; ++i) {
      while (i >= process_end) process_end += recv_counts[static_cast<size_t>(++process)];
      for (int64_t k = 0; k < slots; ++k) {
        if (ids_[static_cast<size_t>(i * slots + k)] < 0) continue;
        std::memcpy(results_.data() + static_cast<size_t>(kept++) * row_bytes,
                    sums_.data() + (i * slots + k) * H, row_bytes);
        ++result_counts_[static_cast<size_t>(process)];
      }
    }
  } else if (!in_place) {  // bf16
    results_.resize(static_cast<size_t>(R * H) * 2);
    auto* dst = reinterpret_cast<uint16_t*>(results_.data());
    for (size_t i = 0; i < static_cast<size_t>(R * H); ++i) dst[i] = f32_to_bf16(sums_[i]);
  }
}

void Dispatch::combine(Context& context, std::span<const uint8_t> returned,
                       const MutableTensorView& out) {
  using namespace detail;
  const int64_t H = config_.hidden, T = tokens_, K = config_.top_k;
  const size_t rows =
      static_cast<size_t>(record_rows_begin_.empty() ? 0 : record_rows_begin_.back());
  const size_t row_bytes = result_row_bytes();
  if (returned.size() != rows * row_bytes)
    throw Error(cat("returned: expected ", rows, " result rows of ", row_bytes, " bytes (",
                    rows * row_bytes, " bytes: the results of the records pack() sent), got ",
                    returned.size(), " bytes"));
  if (out.dtype != x_dtype_)
    throw Error(cat("out: expected dtype ", dtype_name(x_dtype_), " (the dtype of x), got ",
                    dtype_name(out.dtype)));
  if (out.rank != 2 || out.shape[0] != T || out.shape[1] != H)
    throw Error(
        cat("out: expected shape [", T, ", ", H, "], got ", shape_string(out.rank, out.shape)));
  if (out.row_stride != 0 && out.row_stride < H)
    throw Error(cat("out: expected a row stride >= ", H, ", got ", out.row_stride));
  if (T == 0) return;
  require_data(out.data, "out");
  require_addressable(out.data, out.dtype, out.rank, out.shape, out.stride(), "out");
  ThreadPool& pool = context_threads(context);
  const auto per_thread = static_cast<size_t>(2 * H);  // the sum, and a row to add
  acc_.resize(static_cast<size_t>(pool.size()) * per_thread);
  const bool f32 = config_.result_dtype == ResultDType::f32;
  const bool on_input = config_.params.apply_router_weight_on_input;
  token_slots_.resize(static_cast<size_t>(pool.size()));
  auto body = [&](int tid) {
    float* acc = acc_.data() + static_cast<size_t>(tid) * per_thread;
    float* y = acc + H;
    std::vector<ReturnedSlot>& mine = token_slots_[static_cast<size_t>(tid)];
    auto add_row = [&](int64_t row, float weight) {
      const uint8_t* src = returned.data() + static_cast<size_t>(row) * row_bytes;
      if (f32)
        std::memcpy(y, src, static_cast<size_t>(H) * 4);
      else
        for (int64_t h = 0; h < H; ++h) y[h] = load_float(src, DType::bf16, h);
      add_weighted_row(acc, weight, y, H);
    };
    for (int64_t t = tid; t < T; t += pool.size()) {
      std::fill(acc, acc + H, 0.0f);
      const int64_t r0 = token_records_begin_[static_cast<size_t>(t)];
      const int64_t r1 = token_records_begin_[static_cast<size_t>(t + 1)];
      if (!config_.exact) {  // a row per record, in process order
        for (int64_t r = r0; r < r1; ++r)
          add_row(record_rows_begin_[static_cast<size_t>(token_records_[static_cast<size_t>(r)])],
                  1.0f);
      } else {  // a row per slot, in forward()'s order: experts ascending, then slots
        mine.clear();
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t d = record_dest_[static_cast<size_t>(r)] / K;
          int64_t row =
              record_rows_begin_[static_cast<size_t>(token_records_[static_cast<size_t>(r)])];
          for (int64_t k = 0; k < K; ++k) {
            const bool carried =
                on_input ? k == record_dest_[static_cast<size_t>(r)] % K
                         : placement_.owner(topk_ids_[static_cast<size_t>(t * K + k)]) == d;
            if (carried) mine.push_back({topk_ids_[static_cast<size_t>(t * K + k)], k, row++});
          }
        }
        std::sort(mine.begin(), mine.end(), [](const ReturnedSlot& a, const ReturnedSlot& b) {
          return a.expert != b.expert ? a.expert < b.expert : a.slot < b.slot;
        });
        for (const ReturnedSlot& sl : mine)
          add_row(sl.row, on_input ? 1.0f : topk_weights_[static_cast<size_t>(t * K + sl.slot)]);
      }
      const int64_t base = t * out.stride();
      if (out.dtype == DType::f32)
        std::memcpy(static_cast<uint8_t*>(out.data) + base * 4, acc, static_cast<size_t>(H) * 4);
      else
        for (int64_t h = 0; h < H; ++h) store_float(out.data, out.dtype, base + h, acc[h]);
    }
  };
  pool.run(body);
}

}  // namespace w4a8moe
