// The program's expert-parallel processes: MPI when the build has it (W4A8MOE_HAVE_MPI), else an
// error that says how to get it.
#include "w4a8moe/parallel.hpp"

#include <cstdlib>

#if W4A8MOE_HAVE_MPI
#include <mpi.h>

#include "w4a8moe/mpi.hpp"
#endif

namespace w4a8moe::cli {

#if W4A8MOE_HAVE_MPI

struct Parallel::Impl {
  std::unique_ptr<mpi::ExpertParallel> ep;
  mpi::Config config;
};

namespace {
void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}
}  // namespace

Parallel::Parallel(const ExecutionOptions& options, const std::string& default_results)
    : impl_(std::make_unique<Impl>()) {
  if (options.expert_parallel.empty()) return;
  impl_->config.way = mpi::parse_way(options.expert_parallel, "--expert-parallel");
  results_ = options.ep_results.empty() ? default_results : options.ep_results;
  if (results_ == "bf16")
    impl_->config.result_dtype = ResultDType::bf16;
  else if (results_ == "exact")
    impl_->config.exact = true;
  else if (results_ != "f32")
    throw Error("--ep-results: expected f32, bf16 or exact, got '" + options.ep_results + "'");
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    MPI_Init(nullptr, nullptr);
    std::atexit(finalize_at_exit);
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks_);
  on_ = true;
  dispatch_ = impl_->config.way == mpi::Way::dispatch;
  way_ = mpi::way_name(impl_->config.way);
}

void Parallel::setup(int64_t experts, std::span<const uint8_t> w13, std::span<const uint8_t> w2,
                     int64_t top_k, const MoeParams& params) {
  if (!on_) return;
  impl_->config.params = params;
  impl_->ep = std::make_unique<mpi::ExpertParallel>(MPI_COMM_WORLD,
                                                    ExpertShard::even_split(experts, rank_, ranks_),
                                                    w13, w2, top_k, impl_->config);
}

void Parallel::forward(Context& context, const TensorView& x, const TensorView& ids,
                       const TensorView& weights, const MutableTensorView& out) {
  impl_->ep->forward(context, x, ids, weights, out);
}

double Parallel::comm_seconds() const noexcept {
  return impl_->ep ? impl_->ep->last_stats().comm_seconds : 0.0;
}
uint64_t Parallel::bytes_sent() const noexcept {
  return impl_->ep ? impl_->ep->last_stats().bytes_sent : 0;
}
uint64_t Parallel::bytes_received() const noexcept {
  return impl_->ep ? impl_->ep->last_stats().bytes_received : 0;
}

void Parallel::barrier() const {
  if (on_) MPI_Barrier(MPI_COMM_WORLD);
}

double Parallel::max_over_processes(double v) const {
  double out = v;
  if (on_) MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

double Parallel::sum_over_processes(double v) const {
  double out = v;
  if (on_) MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return out;
}

std::vector<uint8_t> Parallel::gather_rows(std::span<const uint8_t> mine) const {
  if (!on_ || !dispatch_) return {mine.begin(), mine.end()};
  const int count = static_cast<int>(mine.size());
  std::vector<int> counts(static_cast<size_t>(ranks_)), displs(static_cast<size_t>(ranks_));
  MPI_Gather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::vector<uint8_t> all;
  if (rank_ == 0) {
    int at = 0;
    for (int r = 0; r < ranks_; ++r) {
      displs[static_cast<size_t>(r)] = at;
      at += counts[static_cast<size_t>(r)];
    }
    all.resize(static_cast<size_t>(at));
  }
  MPI_Gatherv(mine.data(), count, MPI_BYTE, all.data(), counts.data(), displs.data(), MPI_BYTE, 0,
              MPI_COMM_WORLD);
  return all;
}

#else  // no MPI in this build

struct Parallel::Impl {};

Parallel::Parallel(const ExecutionOptions& options, const std::string&) {
  if (!options.expert_parallel.empty())
    throw Error(
        "--expert-parallel: this build has no MPI (install libopenmpi-dev, then configure "
        "and build again), got '" +
        options.expert_parallel + "'");
}

void Parallel::setup(int64_t, std::span<const uint8_t>, std::span<const uint8_t>, int64_t,
                     const MoeParams&) {}
void Parallel::forward(Context&, const TensorView&, const TensorView&, const TensorView&,
                       const MutableTensorView&) {}
double Parallel::comm_seconds() const noexcept { return 0.0; }
uint64_t Parallel::bytes_sent() const noexcept { return 0; }
uint64_t Parallel::bytes_received() const noexcept { return 0; }
void Parallel::barrier() const {}
double Parallel::max_over_processes(double v) const { return v; }
double Parallel::sum_over_processes(double v) const { return v; }
std::vector<uint8_t> Parallel::gather_rows(std::span<const uint8_t> mine) const {
  return {mine.begin(), mine.end()};
}

#endif

Parallel::~Parallel() = default;

std::vector<int32_t> Parallel::local_experts(int64_t experts) const {
  if (!on_) return {};
  const ExpertShard s = ExpertShard::even_split(experts, rank_, ranks_);
  return {s.globals().begin(), s.globals().end()};
}

std::pair<int64_t, int64_t> Parallel::token_run(int64_t tokens) const {
  if (!dispatch_) return {0, tokens};
  const int64_t first = tokens * rank_ / ranks_;
  return {first, tokens * (rank_ + 1) / ranks_ - first};
}

TensorView Parallel::rows_of(const TensorView& v) const {
  const auto [first, count] = token_run(v.shape[0]);
  const size_t row = static_cast<size_t>(v.stride()) * dtype_bytes(v.dtype);
  return TensorView::of(static_cast<const uint8_t*>(v.data) + static_cast<size_t>(first) * row,
                        v.dtype, {count, v.shape[1]}, v.row_stride);
}

}  // namespace w4a8moe::cli
