// The processes of an expert-parallel run of the program (`mpirun -np N w4a8moe ...
// --expert-parallel all-reduce|dispatch`), over the MPI adapter (w4a8moe/mpi.hpp); one process
// when the option is not given. docs/expert-parallel.md, "The program".
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "w4a8moe/commands.hpp"
#include "w4a8moe/expert_parallel.hpp"

namespace w4a8moe::cli {

class Parallel {
 public:
  // Starts MPI (once per process) when options.expert_parallel names a way; throws Error when
  // this build has no MPI or the way or the results are unknown. `default_results`: the
  // command's results when options.ep_results is empty.
  Parallel(const ExecutionOptions& options, const std::string& default_results);
  ~Parallel();
  Parallel(const Parallel&) = delete;
  Parallel& operator=(const Parallel&) = delete;

  bool on() const noexcept { return on_; }
  bool dispatch() const noexcept { return dispatch_; }
  int rank() const noexcept { return rank_; }
  int ranks() const noexcept { return ranks_; }
  const std::string& way() const noexcept { return way_; }
  const std::string& results() const noexcept { return results_; }  // f32, bf16 or exact
  // The global experts this process packs: its even share of `experts` (all when off).
  std::vector<int32_t> local_experts(int64_t experts) const;
  // The tokens this process runs of a batch of T: [first, first + count). Dispatch: an even
  // share of the batch; all-reduce and one process: all of it.
  std::pair<int64_t, int64_t> token_run(int64_t tokens) const;
  // This process's rows (token_run of its T) of a [T, cols] tensor.
  TensorView rows_of(const TensorView& v) const;

  // Collective: the adapter for this process's packed experts (kept by the caller).
  void setup(int64_t experts, std::span<const uint8_t> w13, std::span<const uint8_t> w2,
             int64_t top_k, const MoeParams& params);
  // Collective: forward() of this process's token run (setup() first; off: forward()).
  void forward(Context& context, const TensorView& x, const TensorView& ids,
               const TensorView& weights, const MutableTensorView& out);
  // The last forward's communication time and the bytes this process sent and received.
  double comm_seconds() const noexcept;
  uint64_t bytes_sent() const noexcept;
  uint64_t bytes_received() const noexcept;

  // Collective helpers (no-ops with one process).
  void barrier() const;
  double max_over_processes(double v) const;
  double sum_over_processes(double v) const;
  // Each process's rows [T_r, cols] of `bytes_per_row` bytes, concatenated in process order on
  // process 0 (dispatch runs); others get an empty vector. With all-reduce or one process:
  // `mine` itself.
  std::vector<uint8_t> gather_rows(std::span<const uint8_t> mine) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  bool on_ = false, dispatch_ = false;
  int rank_ = 0, ranks_ = 1;
  std::string way_, results_;
};

}  // namespace w4a8moe::cli
