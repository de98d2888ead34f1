// The MPI adapter of expert parallelism (docs/expert-parallel.md): the steps of
// w4a8moe/expert_parallel.hpp around MPI_Allreduce and MPI_Alltoallv. Built as the library
// w4a8moe_mpi (CMake target w4a8moe::mpi) when CMake finds MPI.
//
// Every call is collective over the communicator. A bad argument on any process makes every
// process throw w4a8moe::Error with the message of the lowest process that found one (prefixed
// by its rank): no process is left waiting in a collective.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "w4a8moe/expert_parallel.hpp"

namespace w4a8moe::mpi {

enum class Way : uint8_t {
  all_reduce = 0,  // every process has all tokens; one MPI_Allreduce of the f32 partial sums
  dispatch = 1,    // each process has its own tokens; records out and results back by all-to-all
};

const char* way_name(Way way) noexcept;
// "all-reduce" or "dispatch"; anything else throws Error naming `argument`.
Way parse_way(std::string_view name, std::string_view argument = "expert-parallel");

struct Config {
  Way way = Way::all_reduce;
  MoeParams params;
  ResultDType result_dtype = ResultDType::f32;  // dispatch: the results' dtype on the way back
  bool exact = false;  // dispatch: a row per slot, forward()'s bits whatever the process count
};

// Per call: wall time, the share spent in MPI calls, and the bytes this process moved to and from
// the others (its own records excluded; all-reduce: the 2 (N - 1) / N * T * H * 4 bytes of a ring
// all-reduce, whatever algorithm MPI picks).
struct Stats {
  double seconds = 0, comm_seconds = 0;
  uint64_t bytes_sent = 0, bytes_received = 0;
  int64_t records_sent = 0;  // dispatch: records for other processes
};

class ExpertParallel {
 public:
  // Collective. Each process gives its shard and the packed weights of its experts (kept by
  // the caller while this object lives). Checks, across processes: the same layer shape (H, I,
  // group size, experts, top_k), config and params everywhere; the shards hold each expert
  // exactly once; each process's packed weights hold its shard's experts.
  ExpertParallel(MPI_Comm comm, const ExpertShard& shard, std::span<const uint8_t> w13_packed,
                 std::span<const uint8_t> w2_packed, int64_t top_k, const Config& config);

  // Collective. all_reduce: x [T, H], topk_ids, topk_weights the same on every process (T and the
  // ids are checked to agree); dispatch: this process's own tokens (T may differ, 0 included).
  // out [T, H] of x's dtype. Deterministic: the same bits from run to run for a given number of
  // processes; within f32 summation-order error of forward() on one process (dispatch with
  // Config::exact: forward()'s bits for any number of processes).
  void forward(Context& context, const TensorView& x, const TensorView& topk_ids,
               const TensorView& topk_weights, const MutableTensorView& out);

  const Stats& last_stats() const noexcept { return stats_; }
  int rank() const noexcept { return rank_; }
  int ranks() const noexcept { return ranks_; }
  const ExpertShard& shard() const noexcept { return shard_; }
  const ExpertPlacement& placement() const noexcept { return placement_; }

 private:
  void forward_all_reduce(Context& context, const TensorView& x, const TensorView& topk_ids,
                          const TensorView& topk_weights, const MutableTensorView& out);
  void forward_dispatch(Context& context, const TensorView& x, const TensorView& topk_ids,
                        const TensorView& topk_weights, const MutableTensorView& out);

  MPI_Comm comm_;
  int rank_ = 0, ranks_ = 1;
  ExpertShard shard_;
  ExpertPlacement placement_;
  std::span<const uint8_t> w13_, w2_;
  int64_t hidden_ = 0, top_k_ = 0;
  Config config_;
  Stats stats_;
  std::vector<float> partial_;
  std::vector<uint8_t> received_, returned_;
  std::vector<int64_t> recv_counts_;
  std::unique_ptr<Dispatch> dispatch_;
};

}  // namespace w4a8moe::mpi
