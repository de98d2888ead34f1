// Expert parallelism: each process holds a share of a layer's experts (docs/expert-parallel.md).
//
// The library moves no bytes between processes. It gives the steps, over plain buffers and
// counts, that any communicator (MPI, torch.distributed, a serving engine's own) fits around:
//
//   all-reduce        every process has all tokens: forward_local() into f32 partial sums, one
//                     sum across processes (the caller's all-reduce), write_output();
//   dispatch/combine  tokens are spread over the processes: Dispatch::pack() makes, for each
//                     process, the records of the tokens that chose its experts (rows already
//                     quantized); the caller's all-to-all moves them; Dispatch::compute() runs
//                     the records received; the caller's all-to-all brings the results back;
//                     Dispatch::combine() adds them into out.
//
// The MPI adapter (w4a8moe/mpi.hpp, built when MPI is found) and the torch.distributed adapter of
// the Python package implement both around these steps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe {

// Which of a layer's experts one process holds: a map from the layer's (global) expert index to
// the index of that expert in this process's packed weights, or -1 where another process holds
// it. The packed weights hold the local experts in local order.
class ExpertShard {
 public:
  // Every one of `experts` experts (one process).
  static ExpertShard all(int64_t experts);
  // Global experts [first, first + count) of `experts`, in order.
  static ExpertShard range(int64_t experts, int64_t first, int64_t count);
  // The share of `rank` when `experts` experts are split in contiguous ranges over `ranks`
  // processes as evenly as can be: the first experts % ranks processes hold one more.
  static ExpertShard even_split(int64_t experts, int64_t rank, int64_t ranks);
  // map[e]: the local index of global expert e, or -1; the local indices are 0 .. n - 1, each
  // exactly once. Throws Error naming `argument` otherwise.
  static ExpertShard from_map(std::span<const int32_t> map,
                              std::string_view argument = "expert_map");

  int64_t global_experts() const noexcept { return static_cast<int64_t>(map_.size()); }
  int64_t local_experts() const noexcept { return static_cast<int64_t>(globals_.size()); }
  std::span<const int32_t> map() const noexcept { return map_; }          // [global]
  std::span<const int32_t> globals() const noexcept { return globals_; }  // [local] -> global
  // The local experts are global [first(), first() + local_experts()) in order.
  bool contiguous() const noexcept;
  int64_t first() const noexcept { return globals_.empty() ? 0 : globals_.front(); }

 private:
  std::vector<int32_t> map_, globals_;
};

// forward() over this process's experts. w13_packed and w2_packed hold shard.local_experts()
// experts; topk_ids name global experts, in [0, shard.global_experts()). out [T, H] is x's dtype,
// or f32 (partial sums that an all-reduce adds). out[t] is the sum, in f32 in the fixed order
// (local experts ascending, then slots ascending), of the slots of token t whose expert is
// local; zero for a token with none. Same checks and errors as forward().
void forward_local(Context& context, const TensorView& x, const TensorView& topk_ids,
                   const TensorView& topk_weights, std::span<const uint8_t> w13_packed,
                   std::span<const uint8_t> w2_packed, const MoeParams& params,
                   const ExpertShard& shard, const MutableTensorView& out);

// f32 sums [T, H] (contiguous) -> out [T, H] (f32, bf16 or f16; bf16 and f16 round to nearest
// even), as forward() converts its accumulator: the last step of the all-reduce way.
void write_output(std::span<const float> sums, const MutableTensorView& out);

// Which process holds each expert of a layer. Built from every process's shard; each expert
// held by exactly one process.
class ExpertPlacement {
 public:
  // shards[r]: the shard of process r. Throws Error when an expert is held by none or by
  // several, or when the shards disagree on the number of experts.
  static ExpertPlacement from_shards(std::span<const ExpertShard> shards);
  // The placement of ExpertShard::even_split over `ranks` processes.
  static ExpertPlacement even_split(int64_t experts, int64_t ranks);

  int64_t ranks() const noexcept { return ranks_; }
  int64_t experts() const noexcept { return static_cast<int64_t>(owner_.size()); }
  int32_t owner(int64_t expert) const noexcept { return owner_[static_cast<size_t>(expert)]; }
  std::span<const int32_t> owners() const noexcept { return owner_; }

 private:
  std::vector<int32_t> owner_;
  int64_t ranks_ = 0;
};

// The dtype in which the results of dispatched records travel back.
enum class ResultDType : uint8_t { f32 = 0, bf16 = 1 };

struct DispatchConfig {
  int64_t hidden = 0;  // H
  int64_t top_k = 0;   // K
  MoeParams params;
  ResultDType result_dtype = ResultDType::f32;
  // false: one result row per record (the record's weighted sum over its slots).
  // true: one f32 row per (record, slot), unweighted, and combine() adds a token's rows in
  // forward()'s order (experts ascending, then slots): the same bits as forward() on one process
  // whatever the number of processes, for K / (slots per process) times the result bytes.
  // f32 results only.
  bool exact = false;
};

// The dispatch / combine way for one process (rank) and one layer shape. Keeps its buffers
// between calls: a steady stream of calls of the same or fewer tokens allocates nothing.
//
// A record carries one activation row quantized as forward() quantizes it (int8 values, the
// row's scale and zero point: H + 16 bytes plus the routing, about a quarter of the f32 row):
// one record per (token, process holding any of its experts), or per (token, slot) when the
// router weight is applied on the input. Records for a process are in ascending token order;
// process `rank` sends itself records too (a communicator copies them).
//
// Results: forward_local's sum over a record's slots, in f32 or bf16. combine() adds a token's
// results in ascending order of the processes that computed them: the output is the same bits
// from run to run; it equals forward() on one process to the bit with one process and f32
// results, and within f32 summation-order error otherwise. DispatchConfig::exact returns a row
// per slot instead and gives forward()'s bits for any number of processes.
class Dispatch {
 public:
  Dispatch(ExpertPlacement placement, int64_t rank, const DispatchConfig& config);

  // Step 1: this process's tokens x [T, H] (f32, bf16, f16), topk_ids [T, K] (global experts),
  // topk_weights [T, K] -> the records for each process. Checks as forward() does.
  void pack(Context& context, const TensorView& x, const TensorView& topk_ids,
            const TensorView& topk_weights);
  size_t record_bytes() const noexcept { return record_bytes_; }
  // Records for each process (ranks() entries), and their bytes in process order.
  std::span<const int64_t> send_counts() const noexcept { return send_counts_; }
  std::span<const uint8_t> send_buffer() const noexcept { return send_; }

  // Step 2: the records received from each process (recv_counts[r] records from process r, in
  // process order, each record_bytes() long) -> one result row per record, in the same order.
  // w13_packed / w2_packed hold this process's experts (`shard`, which must agree with the
  // placement). Every record is checked (its slots, experts, zero point); a bad one throws Error
  // naming the sending process and the record.
  void compute(Context& context, std::span<const uint8_t> received,
               std::span<const int64_t> recv_counts, std::span<const uint8_t> w13_packed,
               std::span<const uint8_t> w2_packed, const ExpertShard& shard);
  size_t result_row_bytes() const noexcept;
  std::span<const uint8_t> results() const noexcept { return results_; }
  // Result rows for each process, in process order (after compute()): its records' count, or
  // with `exact` their slots held here.
  std::span<const int64_t> result_counts() const noexcept { return result_counts_; }
  // Result rows each process returns (after pack()): what result_counts() is there.
  std::span<const int64_t> returned_counts() const noexcept { return returned_counts_; }

  // Step 3: the results of this process's records, returned by each process (returned_counts()[r]
  // rows from process r, in process order) -> out [T, H] of x's dtype.
  void combine(Context& context, std::span<const uint8_t> returned, const MutableTensorView& out);

  int64_t ranks() const noexcept { return placement_.ranks(); }
  int64_t rank() const noexcept { return rank_; }
  const ExpertPlacement& placement() const noexcept { return placement_; }
  const DispatchConfig& config() const noexcept { return config_; }

 private:
  ExpertPlacement placement_;
  int64_t rank_;
  DispatchConfig config_;
  int64_t slots_per_record_;  // K, or 1 when the router weight is applied on the input
  size_t record_bytes_;
  // pack()
  int64_t tokens_ = 0;
  DType x_dtype_ = DType::f32;
  std::vector<int64_t> send_counts_;
  std::vector<uint8_t> send_;
  std::vector<int64_t> token_records_begin_;  // [T + 1] into token_records_
  std::vector<int64_t> token_records_;        // record positions of each token, process order
  std::vector<int64_t> record_dest_;          // per token record: process * K + slot
  std::vector<int64_t> record_slot_order_;    // a token's slots in the order of its records
  std::vector<int64_t> returned_counts_;      // result rows from each process
  std::vector<int64_t> record_rows_begin_;    // exact: first returned row of each record
  std::vector<int64_t> topk_ids_;             // exact: [T, K] as given
  std::vector<float> topk_weights_;           // exact: [T, K] as given
  // compute()
  std::vector<int64_t> result_counts_;
  std::vector<int32_t> ids_;
  std::vector<float> weights_, sums_;
  std::vector<uint8_t> results_;
  // combine()
  struct ReturnedSlot {
    int64_t expert, slot, row;
  };
  std::vector<float> acc_;
  std::vector<std::vector<ReturnedSlot>> token_slots_;  // exact: per thread, a token's rows
};

}  // namespace w4a8moe
