// The MPI adapter: expert parallelism's steps around MPI collectives (docs/expert-parallel.md).
#include <chrono>
#include <climits>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "common/format.hpp"
#include "common/numeric.hpp"
#include "common/xxhash64.hpp"
#include "w4a8moe/mpi.hpp"

namespace w4a8moe::mpi {

namespace {

using detail::cat;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs `step` here; then every process learns whether any process's step threw, and all throw
// the message of the lowest such process. Collective.
template <class Step>
void agreed(MPI_Comm comm, int rank, double& comm_seconds, const Step& step) {
  std::string message;
  bool failed = false;
  try {
    step();
  } catch (const std::exception& e) {
    message = e.what();
    failed = true;
  }
  const double t0 = now();
  const int mine = failed ? rank : INT_MAX;
  int lowest = INT_MAX;
  MPI_Allreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, comm);
  if (lowest != INT_MAX) {
    int length = rank == lowest ? static_cast<int>(message.size()) : 0;
    MPI_Bcast(&length, 1, MPI_INT, lowest, comm);
    message.resize(static_cast<size_t>(length));
    MPI_Bcast(message.data(), length, MPI_CHAR, lowest, comm);
  }
  comm_seconds += now() - t0;
  if (lowest != INT_MAX) throw Error(cat("rank ", lowest, ": ", message));
}

// Every process's `values`, process after process.
std::vector<int64_t> all_gather(MPI_Comm comm, const std::vector<int64_t>& values, int ranks) {
  std::vector<int64_t> all(values.size() * static_cast<size_t>(ranks));
  MPI_Allgather(values.data(), static_cast<int>(values.size()), MPI_INT64_T, all.data(),
                static_cast<int>(values.size()), MPI_INT64_T, comm);
  return all;
}

// A contiguous MPI type of `bytes` bytes, freed with the object.
class ByteBlock {
 public:
  explicit ByteBlock(size_t bytes) {
    MPI_Type_contiguous(static_cast<int>(bytes), MPI_BYTE, &type_);
    MPI_Type_commit(&type_);
  }
  ~ByteBlock() { MPI_Type_free(&type_); }
  ByteBlock(const ByteBlock&) = delete;
  ByteBlock& operator=(const ByteBlock&) = delete;
  MPI_Datatype type() const { return type_; }

 private:
  MPI_Datatype type_{};
};

// counts (in blocks) -> int counts and displacements for MPI_Alltoallv; throws past INT_MAX.
void to_mpi_counts(std::span<const int64_t> counts, std::vector<int>& c, std::vector<int>& displ,
                   std::string_view what) {
  c.assign(counts.size(), 0);
  displ.assign(counts.size(), 0);
  int64_t at = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (at + counts[i] > INT_MAX)
      throw Error(cat(what, ": expected at most ", INT_MAX,
                      " records in one exchange (MPI counts are int), got ", at + counts[i]));
    c[i] = static_cast<int>(counts[i]);
    displ[i] = static_cast<int>(at);
    at += counts[i];
  }
}

}  // namespace

const char* way_name(Way way) noexcept { return way == Way::dispatch ? "dispatch" : "all-reduce"; }

Way parse_way(std::string_view name, std::string_view argument) {
  if (name == "all-reduce") return Way::all_reduce;
  if (name == "dispatch") return Way::dispatch;
  throw Error(cat(argument, ": expected all-reduce or dispatch, got '", name, "'"));
}

ExpertParallel::ExpertParallel(MPI_Comm comm, const ExpertShard& shard,
                               std::span<const uint8_t> w13_packed,
                               std::span<const uint8_t> w2_packed, int64_t top_k,
                               const Config& config)
    : comm_(comm), shard_(shard), w13_(w13_packed), w2_(w2_packed), top_k_(top_k), config_(config) {
  MPI_Comm_rank(comm, &rank_);
  MPI_Comm_size(comm, &ranks_);
  double ignored = 0;
  // This process's own arguments.
  std::vector<int64_t> signature;
  agreed(comm_, rank_, ignored, [&] {
    if (shard_.global_experts() == 0)
      throw Error("shard: expected a shard of the layer's experts, got an empty one");
    const PackedInfo w13 = inspect_packed(w13_, "w13_packed");
    const PackedInfo w2 = inspect_packed(w2_, "w2_packed");
    if (w13.experts != shard_.local_experts())
      throw Error(cat("w13_packed: expected the shard's ", shard_.local_experts(),
                      " local experts, got ", w13.experts));
    if (w2.experts != w13.experts)
      throw Error(
          cat("w2_packed: expected ", w13.experts, " experts (as w13_packed), got ", w2.experts));
    if (top_k < 1) throw Error(cat("top_k: expected 1 or more slots, got ", top_k));
    check_moe_params(config.params);
    hidden_ = w13.cols;
    uint32_t alpha = 0, limit = 0;
    std::memcpy(&alpha, &config.params.alpha, 4);
    std::memcpy(&limit, &config.params.limit, 4);
    signature = {hidden_,
                 w2.cols,
                 w13.group_size,
                 shard_.global_experts(),
                 top_k,
                 static_cast<int64_t>(config.way),
                 static_cast<int64_t>(config.result_dtype) + (config.exact ? 2 : 0),
                 static_cast<int64_t>(config.params.activation),
                 config.params.apply_router_weight_on_input ? 1 : 0,
                 alpha,
                 limit};
  });
  // The same layer and settings everywhere: each process compares every process's with
  // process 0's, so all find the same first difference.
  static constexpr const char* kFields[] = {"hidden size",
                                            "intermediate size",
                                            "group size",
                                            "number of experts",
                                            "top_k",
                                            "expert-parallel way",
                                            "result dtype (and exactness)",
                                            "activation",
                                            "apply_router_weight_on_input",
                                            "alpha",
                                            "limit"};
  const std::vector<int64_t> all = all_gather(comm_, signature, ranks_);
  const size_t n = signature.size();
  for (int r = 1; r < ranks_; ++r)
    for (size_t f = 0; f < n; ++f)
      if (all[static_cast<size_t>(r) * n + f] != all[f])
        throw Error(cat("rank ", r, ": expected the ", kFields[f], " of rank 0 (", all[f],
                        "), got ", all[static_cast<size_t>(r) * n + f]));
  // The shards together hold each expert once.
  std::vector<int64_t> map(shard_.map().begin(), shard_.map().end());
  const std::vector<int64_t> maps = all_gather(comm_, map, ranks_);
  std::vector<ExpertShard> shards;
  const size_t E = map.size();
  for (int r = 0; r < ranks_; ++r) {
    std::vector<int32_t> m(E);
    for (size_t e = 0; e < E; ++e)
      m[e] = static_cast<int32_t>(maps[static_cast<size_t>(r) * E + e]);
    shards.push_back(ExpertShard::from_map(m));
  }
  placement_ = ExpertPlacement::from_shards(shards);
  if (config_.way == Way::dispatch) {
    DispatchConfig dc;
    dc.hidden = hidden_;
    dc.top_k = top_k_;
    dc.params = config_.params;
    dc.result_dtype = config_.result_dtype;
    dc.exact = config_.exact;
    dispatch_ = std::make_unique<Dispatch>(placement_, rank_, dc);
  }
}

void ExpertParallel::forward(Context& context, const TensorView& x, const TensorView& topk_ids,
                             const TensorView& topk_weights, const MutableTensorView& out) {
  stats_ = {};
  const double t0 = now();
  if (config_.way == Way::dispatch)
    forward_dispatch(context, x, topk_ids, topk_weights, out);
  else
    forward_all_reduce(context, x, topk_ids, topk_weights, out);
  stats_.seconds = now() - t0;
}

void ExpertParallel::forward_all_reduce(Context& context, const TensorView& x,
                                        const TensorView& topk_ids, const TensorView& topk_weights,
                                        const MutableTensorView& out) {
  int64_t T = 0;
  uint64_t ids_hash = 0;
  agreed(comm_, rank_, stats_.comm_seconds, [&] {
    if (x.rank != 2) throw Error(cat("x: expected rank 2 [T, H], got rank ", x.rank));
    T = x.shape[0];
    partial_.resize(static_cast<size_t>(T * hidden_));
    forward_local(context, x, topk_ids, topk_weights, w13_, w2_, config_.params, shard_,
                  MutableTensorView::of(partial_.data(), DType::f32, {T, hidden_}));
    detail::Xxh64 h;
    for (int64_t i = 0; i < T * topk_ids.shape[1]; ++i) {
      const int64_t id = detail::load_index(topk_ids.data, topk_ids.dtype, i);
      h.update(&id, sizeof id);
    }
    ids_hash = h.digest();
  });
  // every process has the same tokens: T and the routing agree
  double c0 = now();
  const std::vector<int64_t> all = all_gather(comm_, {T, static_cast<int64_t>(ids_hash)}, ranks_);
  stats_.comm_seconds += now() - c0;
  for (int r = 1; r < ranks_; ++r) {
    if (all[2 * static_cast<size_t>(r)] != all[0])
      throw Error(cat("rank ", r, ": expected the ", all[0],
                      " tokens of rank 0 (all-reduce: every process has all tokens), got ",
                      all[2 * static_cast<size_t>(r)]));
    if (all[2 * static_cast<size_t>(r) + 1] != all[1])
      throw Error(cat("rank ", r,
                      ": expected the topk_ids of rank 0 (all-reduce: every process has all "
                      "tokens), got other ids"));
  }
  c0 = now();
  // in pieces of at most 2^30 values (MPI counts are int)
  for (size_t at = 0; at < partial_.size(); at += size_t{1} << 30) {
    const size_t count = std::min(partial_.size() - at, size_t{1} << 30);
    MPI_Allreduce(MPI_IN_PLACE, partial_.data() + at, static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                  comm_);
  }
  stats_.comm_seconds += now() - c0;
  const auto ring = static_cast<uint64_t>(2.0 * (ranks_ - 1) / ranks_ *
                                          static_cast<double>(partial_.size()) * 4.0);
  stats_.bytes_sent = stats_.bytes_received = ring;
  write_output(partial_, out);
}

void ExpertParallel::forward_dispatch(Context& context, const TensorView& x,
                                      const TensorView& topk_ids, const TensorView& topk_weights,
                                      const MutableTensorView& out) {
  Dispatch& d = *dispatch_;
  agreed(comm_, rank_, stats_.comm_seconds, [&] {
    // out first: combine() runs after the last exchange, where a failure would be this
    // process's alone
    if (out.dtype != x.dtype)
      throw Error(cat("out: expected dtype ", dtype_name(x.dtype), " (the dtype of x), got ",
                      dtype_name(out.dtype)));
    if (out.rank != 2 || out.shape[0] != x.shape[0] || out.shape[1] != hidden_)
      throw Error(cat("out: expected shape [", x.shape[0], ", ", hidden_, "], got [", out.shape[0],
                      ", ", out.shape[1], "]"));
    d.pack(context, x, topk_ids, topk_weights);
  });
  const auto N = static_cast<size_t>(ranks_);
  recv_counts_.assign(N, 0);
  double c0 = now();
  MPI_Alltoall(d.send_counts().data(), 1, MPI_INT64_T, recv_counts_.data(), 1, MPI_INT64_T, comm_);
  stats_.comm_seconds += now() - c0;
  std::vector<int> sc, sd, rc, rd;
  agreed(comm_, rank_, stats_.comm_seconds, [&] {
    to_mpi_counts(d.send_counts(), sc, sd, "send");
    to_mpi_counts(recv_counts_, rc, rd, "receive");
    int64_t total = 0;
    for (int64_t c : recv_counts_) total += c;
    received_.resize(static_cast<size_t>(total) * d.record_bytes());
  });
  {
    const ByteBlock record(d.record_bytes());
    c0 = now();
    MPI_Alltoallv(d.send_buffer().data(), sc.data(), sd.data(), record.type(), received_.data(),
                  rc.data(), rd.data(), record.type(), comm_);
    stats_.comm_seconds += now() - c0;
  }
  // then the results back: rows per process (with exact results, a row per slot)
  std::vector<int> bc, bd, oc, od;
  agreed(comm_, rank_, stats_.comm_seconds, [&] {
    d.compute(context, received_, recv_counts_, w13_, w2_, shard_);
    to_mpi_counts(d.result_counts(), oc, od, "results");
    to_mpi_counts(d.returned_counts(), bc, bd, "returned");
  });
  int64_t back = 0;
  for (int64_t c : d.returned_counts()) back += c;
  returned_.resize(static_cast<size_t>(back) * d.result_row_bytes());
  {
    const ByteBlock row(d.result_row_bytes());
    c0 = now();
    MPI_Alltoallv(d.results().data(), oc.data(), od.data(), row.type(), returned_.data(), bc.data(),
                  bd.data(), row.type(), comm_);
    stats_.comm_seconds += now() - c0;
  }
  d.combine(context, returned_, out);
  for (size_t r = 0; r < N; ++r) {
    if (static_cast<int>(r) == rank_) continue;
    const auto sent = static_cast<uint64_t>(d.send_counts()[r]);
    const auto got = static_cast<uint64_t>(recv_counts_[r]);
    const auto rows_out = static_cast<uint64_t>(d.result_counts()[r]);
    const auto rows_in = static_cast<uint64_t>(d.returned_counts()[r]);
    stats_.records_sent += d.send_counts()[r];
    stats_.bytes_sent += sent * d.record_bytes() + rows_out * d.result_row_bytes();
    stats_.bytes_received += got * d.record_bytes() + rows_in * d.result_row_bytes();
  }
}

}  // namespace w4a8moe::mpi
