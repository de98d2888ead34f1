// The MPI adapter under mpirun (CTest runs it on 1, 2 and 4 processes): both ways against
// forward() on one process, run-to-run bits, and bad input that must make every process throw
// (a hang fails by the test's timeout).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "test_util.hpp"
#include "w4a8moe/mpi.hpp"

namespace {

using moe_test::Case;
using moe_test::CaseSpec;
using w4a8moe::DType;
using w4a8moe::ExpertShard;
namespace mpi = w4a8moe::mpi;

int rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int ranks() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

moe_test::PackedPair pack_shard(const Case& c, const ExpertShard& shard, int64_t drop = 0) {
  w4a8moe::PackOptions o = c.pack_options();
  o.experts.assign(shard.globals().begin(), shard.globals().end() - drop);
  return {w4a8moe::pack_w13(c.w13_view(), c.w13_scale_view(), c.w13_bias_view(), o),
          w4a8moe::pack_w2(c.w2_view(), c.w2_scale_view(), c.w2_bias_view(), o)};
}

// Rows [t0, t0 + n) of the case's tokens, as views.
struct Tokens {
  w4a8moe::TensorView x, ids, weights;
};
Tokens tokens_of(const Case& c, int64_t t0, int64_t n) {
  const int64_t H = c.spec.hidden, K = c.spec.top_k;
  const size_t xe = w4a8moe::dtype_bytes(c.spec.x_dtype);
  const size_t ie = w4a8moe::dtype_bytes(c.spec.ids_dtype);
  const size_t we = w4a8moe::dtype_bytes(c.spec.topk_weights_dtype);
  return {w4a8moe::TensorView::of(c.x.bytes.data() + static_cast<size_t>(t0 * c.x_stride) * xe,
                                  c.spec.x_dtype, {n, H}, c.x_stride),
          w4a8moe::TensorView::of(c.ids.data() + static_cast<size_t>(t0 * K) * ie, c.spec.ids_dtype,
                                  {n, K}),
          w4a8moe::TensorView::of(c.topk_weights.bytes.data() + static_cast<size_t>(t0 * K) * we,
                                  c.spec.topk_weights_dtype, {n, K})};
}

struct MpiCase {
  CaseSpec spec;
  mpi::Way way;
  w4a8moe::ResultDType result = w4a8moe::ResultDType::f32;
  bool exact = false;
};

std::vector<MpiCase> cases() {
  std::vector<MpiCase> out;
  CaseSpec base;
  base.tokens = 21;  // not a multiple of the process count: uneven token shares
  base.hidden = 256;
  base.inter = 128;
  base.experts = 10;  // not a multiple of 4: uneven expert shares
  base.top_k = 2;
  base.group_size = 32;
  std::vector<CaseSpec> specs;
  specs.push_back(base);
  CaseSpec sparse = base;  // experts of the second half get no token
  sparse.routing = moe_test::Routing::sparse;
  sparse.seed = 2;
  specs.push_back(sparse);
  for (auto act : {w4a8moe::Activation::swigluoai, w4a8moe::Activation::swiglustep,
                   w4a8moe::Activation::gelu, w4a8moe::Activation::gelu_tanh}) {
    CaseSpec a = base;
    a.activation = act;
    a.seed = 10 + static_cast<uint64_t>(act);
    specs.push_back(a);
  }
  CaseSpec on_input = base;
  on_input.apply_router_weight_on_input = true;
  on_input.seed = 20;
  specs.push_back(on_input);
  CaseSpec bf16 = base;
  bf16.x_dtype = DType::bf16;
  bf16.topk_weights_dtype = DType::bf16;
  bf16.ids_dtype = DType::i64;
  bf16.bias = true;
  bf16.seed = 21;
  specs.push_back(bf16);
  for (const CaseSpec& s : specs)
    for (mpi::Way w : {mpi::Way::all_reduce, mpi::Way::dispatch}) out.push_back({s, w});
  out.push_back({base, mpi::Way::dispatch, w4a8moe::ResultDType::bf16});
  for (const CaseSpec& s : specs)  // a row per slot: forward()'s bits whatever the count
    out.push_back({s, mpi::Way::dispatch, w4a8moe::ResultDType::f32, true});
  return out;
}

std::string name_of(const testing::TestParamInfo<MpiCase>& info) {
  std::string s = moe_test::describe(info.param.spec) + " " + mpi::way_name(info.param.way) +
                  (info.param.result == w4a8moe::ResultDType::bf16 ? " bf16 results" : "") +
                  (info.param.exact ? " exact" : "");
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

class Mpi : public testing::TestWithParam<MpiCase> {};

TEST_P(Mpi, MatchesOneProcess) {
  const MpiCase& p = GetParam();
  const Case c = moe_test::make_case(p.spec);  // the same data on every process (same seed)
  w4a8moe::Context context(1);
  const moe_test::Output one = moe_test::run_forward(c, moe_test::pack(c), context);
  const int64_t E = p.spec.experts, T = p.spec.tokens, H = p.spec.hidden;
  const ExpertShard shard = ExpertShard::even_split(E, rank(), ranks());
  const auto packed = pack_shard(c, shard);
  mpi::Config config;
  config.way = p.way;
  config.params = c.params();
  config.result_dtype = p.result;
  config.exact = p.exact;
  mpi::ExpertParallel ep(MPI_COMM_WORLD, shard, packed.w13.bytes(), packed.w2.bytes(), p.spec.top_k,
                         config);
  // all-reduce: every process has all tokens; dispatch: process r has a contiguous run
  const int64_t t0 = p.way == mpi::Way::dispatch ? T * rank() / ranks() : 0;
  const int64_t n = p.way == mpi::Way::dispatch ? T * (rank() + 1) / ranks() - t0 : T;
  const Tokens in = tokens_of(c, t0, n);
  const size_t oe = w4a8moe::dtype_bytes(c.spec.x_dtype);
  std::vector<uint8_t> out(static_cast<size_t>(n * H) * oe, 0xff), again(out.size(), 0xff);
  ep.forward(context, in.x, in.ids, in.weights,
             w4a8moe::MutableTensorView::of(out.data(), c.spec.x_dtype, {n, H}));
  ep.forward(context, in.x, in.ids, in.weights,
             w4a8moe::MutableTensorView::of(again.data(), c.spec.x_dtype, {n, H}));
  EXPECT_EQ(out, again) << "the same bits from run to run";
  const uint8_t* want = one.bytes.data() + static_cast<size_t>(t0 * H) * oe;
  if ((ranks() == 1 || p.exact) && p.result == w4a8moe::ResultDType::f32) {
    EXPECT_EQ(0, std::memcmp(out.data(), want, out.size())) << "forward()'s bits";
  }
  // within f32 summation-order error (bf16: one rounding of each result row, and x's dtype)
  double tol = 1e-6;
  if (p.result == w4a8moe::ResultDType::bf16) tol = std::ldexp(1.0, -8) * 2;
  if (c.spec.x_dtype == DType::bf16) tol = std::ldexp(1.0, -7);
  double top = 0;
  for (int64_t i = 0; i < T * H; ++i)
    top = std::max(
        top,
        std::abs(static_cast<double>(moe_test::to_float(one.bytes.data(), c.spec.x_dtype, i))));
  ASSERT_TRUE(top > 0.1 && top < 100) << "outputs of order one: max " << top;
  for (int64_t i = 0; i < n * H; ++i) {
    const double got = moe_test::to_float(out.data(), c.spec.x_dtype, i);
    const double ref = moe_test::to_float(want, c.spec.x_dtype, i);
    ASSERT_LE(std::abs(got - ref), tol * top) << "element " << i << " of process " << rank();
  }
  if (p.way == mpi::Way::all_reduce && c.spec.x_dtype == DType::f32) {  // the exact reference
    std::vector<float> f(static_cast<size_t>(T * H));
    std::memcpy(f.data(), out.data(), out.size());
    EXPECT_TRUE(moe_test::matches_exact(c, f, moe_ref::exact_forward(c.problem)));
  }
  const mpi::Stats& st = ep.last_stats();
  EXPECT_GT(st.seconds, 0.0);
  if (ranks() > 1) {
    EXPECT_GT(st.bytes_sent + st.bytes_received, 0u);
  } else {
    EXPECT_EQ(st.bytes_sent, 0u);  // one process sends only to itself
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Mpi, testing::ValuesIn(cases()), name_of);

CaseSpec small() {
  CaseSpec s;
  s.tokens = 8;
  s.experts = 6;
  s.top_k = 2;
  return s;
}

TEST(MpiErrors, ShardsThatOverlapFailEverywhere) {
  if (ranks() == 1) GTEST_SKIP() << "one process holds every expert";
  const Case c = moe_test::make_case(small());
  const ExpertShard all = ExpertShard::all(6);  // every process claims every expert
  const auto packed = pack_shard(c, all);
  EXPECT_TRUE(moe_test::throws_error(
      [&] {
        mpi::ExpertParallel(MPI_COMM_WORLD, all, packed.w13.bytes(), packed.w2.bytes(), 2, {});
      },
      {"shards", "expert 0 held by processes 0 and 1"}));
}

TEST(MpiErrors, PackedWeightsThatDisagreeWithTheShardFailEverywhere) {
  const Case c = moe_test::make_case(small());
  const ExpertShard shard = ExpertShard::even_split(6, rank(), ranks());
  const int last = ranks() - 1;
  const auto packed = pack_shard(c, shard, rank() == last ? 1 : 0);  // one expert short there
  EXPECT_TRUE(moe_test::throws_error(
      [&] {
        mpi::ExpertParallel(MPI_COMM_WORLD, shard, packed.w13.bytes(), packed.w2.bytes(), 2, {});
      },
      {"rank " + std::to_string(last) + ": w13_packed", "local experts"}));
}

TEST(MpiErrors, SettingsThatDifferBetweenProcessesFailEverywhere) {
  if (ranks() == 1) GTEST_SKIP() << "nothing to differ from";
  const Case c = moe_test::make_case(small());
  const ExpertShard shard = ExpertShard::even_split(6, rank(), ranks());
  const auto packed = pack_shard(c, shard);
  EXPECT_TRUE(moe_test::throws_error(
      [&] {
        mpi::ExpertParallel(MPI_COMM_WORLD, shard, packed.w13.bytes(), packed.w2.bytes(),
                            rank() == 1 ? 3 : 2, {});
      },
      {"rank 1", "top_k of rank 0 (2)", "got 3"}));
  mpi::Config other;
  other.way = rank() == 1 ? mpi::Way::dispatch : mpi::Way::all_reduce;
  EXPECT_TRUE(moe_test::throws_error(
      [&] {
        mpi::ExpertParallel(MPI_COMM_WORLD, shard, packed.w13.bytes(), packed.w2.bytes(), 2, other);
      },
      {"rank 1", "expert-parallel way"}));
}

TEST(MpiErrors, BadTokensOnOneProcessFailEverywhere) {
  const Case c = moe_test::make_case(small());
  const ExpertShard shard = ExpertShard::even_split(6, rank(), ranks());
  const auto packed = pack_shard(c, shard);
  w4a8moe::Context context(1);
  const int last = ranks() - 1;
  std::vector<int32_t> ids(reinterpret_cast<const int32_t*>(c.ids.data()),
                           reinterpret_cast<const int32_t*>(c.ids.data()) + 16);
  if (rank() == last) ids[3] = 6;  // out of range there
  const auto ids_view = w4a8moe::TensorView::of(ids.data(), DType::i32, {8, 2});
  std::vector<float> out(8 * 256);
  const auto out_view = w4a8moe::MutableTensorView::of(out.data(), DType::f32, {8, 256});
  for (mpi::Way way : {mpi::Way::all_reduce, mpi::Way::dispatch}) {
    mpi::Config config;
    config.way = way;
    config.params = c.params();
    mpi::ExpertParallel ep(MPI_COMM_WORLD, shard, packed.w13.bytes(), packed.w2.bytes(), 2, config);
    EXPECT_TRUE(moe_test::throws_error(
        [&] { ep.forward(context, c.x_view(), ids_view, c.topk_weights_view(), out_view); },
        {"rank " + std::to_string(last) + ": topk_ids", "[0, 6)", "got 6"}))
        << mpi::way_name(way);
  }
  // all-reduce: every process must have the same tokens
  if (ranks() > 1) {
    mpi::Config config;
    config.params = c.params();
    mpi::ExpertParallel ep(MPI_COMM_WORLD, shard, packed.w13.bytes(), packed.w2.bytes(), 2, config);
    const int64_t n = rank() == 1 ? 7 : 8;
    const Tokens in = tokens_of(c, 0, n);
    EXPECT_TRUE(moe_test::throws_error(
        [&] {
          ep.forward(context, in.x, in.ids, in.weights,
                     w4a8moe::MutableTensorView::of(out.data(), DType::f32, {n, 256}));
        },
        {"rank 1", "the 8 tokens of rank 0", "got 7"}));
  }
}

// The report of a process other than 0: its failures, with its rank.
class FailurePrinter : public testing::EmptyTestEventListener {
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (r.failed())
      std::printf("[rank %d] %s:%d: failure\n%s\n", rank(), r.file_name() ? r.file_name() : "?",
                  r.line_number(), r.summary());
  }
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  testing::InitGoogleTest(&argc, argv);
  if (rank() != 0) {  // one report: the others print only their failures
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter);
  }
  const int failed = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any != 0 && failed == 0 && rank() == 0) std::printf("another process failed a test\n");
  MPI_Finalize();
  return any;
}
