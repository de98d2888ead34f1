// Expert parallelism in one process: N simulated processes, each with its shard of the experts,
// the communicator replaced by copies. Both ways are compared with forward() on one process
// (relative 1e-6, the f32 summation-order error) and with the exact reference; one process is
// the same bits as forward(); bad shards, placements and records are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "test_util.hpp"
#include "w4a8moe/expert_parallel.hpp"

namespace {

using moe_test::Case;
using moe_test::CaseSpec;
using w4a8moe::DType;
using w4a8moe::ExpertPlacement;
using w4a8moe::ExpertShard;

// The shard's experts packed from the case's full weights.
moe_test::PackedPair pack_shard(const Case& c, const ExpertShard& shard) {
  w4a8moe::PackOptions o = c.pack_options();
  o.experts.assign(shard.globals().begin(), shard.globals().end());
  w4a8moe::PackedWeights w13 = w4a8moe::pack_w13(c.w13_view(), c.w13_scale_view(),
                                                 c.w13_zero_point_view(), c.w13_bias_view(), o);
  o.input_order = {};  // w13's only
  return {std::move(w13), w4a8moe::pack_w2(c.w2_view(), c.w2_scale_view(), c.w2_zero_point_view(),
                                           c.w2_bias_view(), o)};
}

std::vector<ExpertShard> even_shards(int64_t experts, int64_t ranks) {
  std::vector<ExpertShard> s;
  for (int64_t r = 0; r < ranks; ++r) s.push_back(ExpertShard::even_split(experts, r, ranks));
  return s;
}

// |got - want| <= 1e-6 * max |want| of the row, per element; and the magnitude is of order one.
testing::AssertionResult close_to(const std::vector<float>& got, const std::vector<float>& want,
                                  int64_t cols, double rtol = 1e-6) {
  if (got.size() != want.size()) return testing::AssertionFailure() << "sizes differ";
  double top = 0;
  for (float v : want) top = std::max(top, std::abs(static_cast<double>(v)));
  if (!(top > 0.1 && top < 100))
    return testing::AssertionFailure() << "max |out| " << top << ": not of order one";
  for (size_t i = 0; i < got.size(); i += static_cast<size_t>(cols)) {
    double row = 0;
    for (int64_t j = 0; j < cols; ++j)
      row = std::max(row, std::abs(static_cast<double>(want[i + static_cast<size_t>(j)])));
    for (int64_t j = 0; j < cols; ++j) {
      const size_t k = i + static_cast<size_t>(j);
      if (!(std::abs(static_cast<double>(got[k]) - static_cast<double>(want[k])) <=
            rtol * row + 1e-30))
        return testing::AssertionFailure() << "element " << k << ": got " << got[k] << ", want "
                                           << want[k] << " (row max " << row << ")";
    }
  }
  return testing::AssertionSuccess();
}

bool same_bits(const moe_test::Output& a, const moe_test::Output& b) { return a.bytes == b.bytes; }

// The all-reduce way: every process computes its partial sums over all tokens; the sum is
// taken in process order.
moe_test::Output all_reduce(const Case& c, const std::vector<ExpertShard>& shards,
                            w4a8moe::Context& context) {
  const int64_t T = c.spec.tokens, H = c.spec.hidden;
  std::vector<float> sum(static_cast<size_t>(T * H), 0.0f), part(sum.size());
  for (const ExpertShard& shard : shards) {
    const auto packed = pack_shard(c, shard);
    std::fill(part.begin(), part.end(), NAN);
    w4a8moe::forward_local(context, c.x_view(), c.ids_view(), c.topk_weights_view(),
                           packed.w13.bytes(), packed.w2.bytes(), c.params(), shard,
                           w4a8moe::MutableTensorView::of(part.data(), DType::f32, {T, H}));
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
  }
  moe_test::Output out = moe_test::make_output(c);
  w4a8moe::write_output(sum, out.view());
  return out;
}

// The dispatch / combine way: the tokens are split in contiguous runs over the processes
// (process r takes tokens [starts[r], starts[r + 1])); all-to-all exchanges are copies.
moe_test::Output dispatch(const Case& c, const std::vector<ExpertShard>& shards,
                          w4a8moe::ResultDType result_dtype, w4a8moe::Context& context,
                          bool exact = false) {
  const auto N = static_cast<int64_t>(shards.size());
  const int64_t T = c.spec.tokens, H = c.spec.hidden, K = c.spec.top_k;
  const ExpertPlacement placement = ExpertPlacement::from_shards(shards);
  w4a8moe::DispatchConfig config;
  config.hidden = H;
  config.top_k = K;
  config.params = c.params();
  config.result_dtype = result_dtype;
  config.exact = exact;
  std::vector<w4a8moe::Dispatch> d;
  std::vector<int64_t> starts;
  for (int64_t r = 0; r <= N; ++r) starts.push_back(T * r / N);
  const size_t xe = w4a8moe::dtype_bytes(c.spec.x_dtype);
  const size_t ide = w4a8moe::dtype_bytes(c.spec.ids_dtype);
  const size_t we = w4a8moe::dtype_bytes(c.spec.topk_weights_dtype);
  for (int64_t r = 0; r < N; ++r) {
    d.emplace_back(placement, r, config);
    const int64_t t0 = starts[static_cast<size_t>(r)], n = starts[static_cast<size_t>(r) + 1] - t0;
    d.back().pack(
        context,
        w4a8moe::TensorView::of(c.x.bytes.data() + static_cast<size_t>(t0 * c.x_stride) * xe,
                                c.spec.x_dtype, {n, H}, c.x_stride),
        w4a8moe::TensorView::of(c.ids.data() + static_cast<size_t>(t0 * K) * ide, c.spec.ids_dtype,
                                {n, K}),
        w4a8moe::TensorView::of(c.topk_weights.bytes.data() + static_cast<size_t>(t0 * K) * we,
                                c.spec.topk_weights_dtype, {n, K}));
  }
  // all-to-all: process r receives, in process order, what each sent it
  auto segment = [&](int64_t from, int64_t to) {
    const auto counts = d[static_cast<size_t>(from)].send_counts();
    const int64_t before = std::accumulate(counts.begin(), counts.begin() + to, int64_t{0});
    return std::pair<int64_t, int64_t>{before, counts[static_cast<size_t>(to)]};
  };
  std::vector<std::vector<int64_t>> recv_counts(static_cast<size_t>(N));
  for (int64_t r = 0; r < N; ++r) {
    std::vector<uint8_t> received;
    for (int64_t s = 0; s < N; ++s) {
      const auto [at, count] = segment(s, r);
      const auto buf = d[static_cast<size_t>(s)].send_buffer();
      const size_t rb = d[static_cast<size_t>(s)].record_bytes();
      received.insert(received.end(), buf.begin() + static_cast<ptrdiff_t>(at * rb),
                      buf.begin() + static_cast<ptrdiff_t>((at + count) * rb));
      recv_counts[static_cast<size_t>(r)].push_back(count);
    }
    const auto packed = pack_shard(c, shards[static_cast<size_t>(r)]);
    d[static_cast<size_t>(r)].compute(context, received, recv_counts[static_cast<size_t>(r)],
                                      packed.w13.bytes(), packed.w2.bytes(),
                                      shards[static_cast<size_t>(r)]);
  }
  moe_test::Output out = moe_test::make_output(c);
  for (int64_t r = 0; r < N; ++r) {
    // the results of r's records, from each process in process order
    std::vector<uint8_t> returned;
    for (int64_t s = 0; s < N; ++s) {
      const auto counts = d[static_cast<size_t>(s)].result_counts();
      EXPECT_EQ(counts[static_cast<size_t>(r)],
                d[static_cast<size_t>(r)].returned_counts()[static_cast<size_t>(s)]);
      const int64_t before = std::accumulate(counts.begin(), counts.begin() + r, int64_t{0});
      const size_t rb = d[static_cast<size_t>(s)].result_row_bytes();
      const auto res = d[static_cast<size_t>(s)].results();
      returned.insert(
          returned.end(), res.begin() + static_cast<ptrdiff_t>(before * rb),
          res.begin() + static_cast<ptrdiff_t>((before + counts[static_cast<size_t>(r)]) * rb));
    }
    const int64_t t0 = starts[static_cast<size_t>(r)], n = starts[static_cast<size_t>(r) + 1] - t0;
    const size_t oe = w4a8moe::dtype_bytes(out.dtype);
    d[static_cast<size_t>(r)].combine(
        context, returned,
        w4a8moe::MutableTensorView::of(out.bytes.data() + static_cast<size_t>(t0 * H) * oe,
                                       out.dtype, {n, H}));
  }
  return out;
}

struct EpCase {
  CaseSpec spec;
  int64_t ranks;
};

std::string name_of(const testing::TestParamInfo<EpCase>& info) {
  std::string s = moe_test::describe(info.param.spec) + " N=" + std::to_string(info.param.ranks);
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

std::vector<EpCase> ep_cases() {
  std::vector<EpCase> out;
  auto add = [&](CaseSpec s, std::initializer_list<int64_t> ranks) {
    for (int64_t n : ranks) out.push_back({s, n});
  };
  CaseSpec base{
      .tokens = 24, .hidden = 256, .inter = 128, .experts = 8, .top_k = 2, .group_size = 64};
  add(base, {1, 2, 4});
  CaseSpec uneven = base;  // E = 10 over 4 processes: shares 3, 3, 2, 2
  uneven.experts = 10;
  uneven.top_k = 3;
  uneven.seed = 2;
  add(uneven, {3, 4});
  CaseSpec sparse = base;  // the second half of the experts gets no token
  sparse.routing = moe_test::Routing::sparse;
  sparse.seed = 3;
  add(sparse, {2, 4});
  for (auto act : {w4a8moe::Activation::swigluoai, w4a8moe::Activation::swiglustep,
                   w4a8moe::Activation::gelu, w4a8moe::Activation::gelu_tanh}) {
    CaseSpec a = base;
    a.activation = act;
    a.seed = 10 + static_cast<uint64_t>(act);
    add(a, {2});
  }
  CaseSpec on_input = base;
  on_input.apply_router_weight_on_input = true;
  on_input.top_k = 1;
  on_input.seed = 20;
  add(on_input, {1, 2});
  CaseSpec on_input_k2 = on_input;  // the weight on the input with two slots
  on_input_k2.top_k = 3;
  on_input_k2.seed = 21;
  add(on_input_k2, {1, 2, 4});
  CaseSpec bf16 = base;
  bf16.x_dtype = DType::bf16;
  bf16.scale_dtype = DType::bf16;
  bf16.topk_weights_dtype = DType::bf16;
  bf16.ids_dtype = DType::i64;
  bf16.bias = true;
  bf16.seed = 30;
  add(bf16, {1, 3});
  CaseSpec repeated = base;  // a token naming one expert in all its slots
  repeated.routing = moe_test::Routing::repeated;
  repeated.seed = 31;
  add(repeated, {2});
  CaseSpec channelwise = base;
  channelwise.group_size = -1;
  channelwise.hidden = 200;  // H not a multiple of the block: padded rows
  channelwise.seed = 32;
  add(channelwise, {2});
  CaseSpec ordered = base;  // w13 with an input order and zero points (act-order GPTQ)
  ordered.input_order = true;
  ordered.zero_points = true;
  ordered.seed = 33;
  add(ordered, {1, 2, 4});
  CaseSpec ordered_on_input = on_input_k2;
  ordered_on_input.input_order = true;
  ordered_on_input.seed = 34;
  add(ordered_on_input, {2});
  return out;
}

class ExpertParallel : public testing::TestWithParam<EpCase> {};

TEST_P(ExpertParallel, BothWaysMatchOneProcess) {
  const EpCase& p = GetParam();
  const Case c = moe_test::make_case(p.spec);
  w4a8moe::Context context(2);
  const auto packed = moe_test::pack(c);
  const moe_test::Output one = moe_test::run_forward(c, packed, context);
  const std::vector<ExpertShard> shards = even_shards(p.spec.experts, p.ranks);

  const moe_test::Output ar = all_reduce(c, shards, context);
  const moe_test::Output dp = dispatch(c, shards, w4a8moe::ResultDType::f32, context);
  if (p.spec.x_dtype == DType::f32) {
    EXPECT_TRUE(close_to(ar.to_float(), one.to_float(), p.spec.hidden)) << "all-reduce";
    EXPECT_TRUE(close_to(dp.to_float(), one.to_float(), p.spec.hidden)) << "dispatch";
  }
  // against the independent reference, as forward() is checked
  EXPECT_TRUE(moe_test::matches_exact(c, ar.to_float(), moe_ref::exact_forward(c.problem)));
  EXPECT_TRUE(moe_test::matches_exact(c, dp.to_float(), moe_ref::exact_forward(c.problem)));
  if (p.ranks == 1) {  // one process: the same bits as forward()
    EXPECT_TRUE(same_bits(ar, one));
    EXPECT_TRUE(same_bits(dp, one));
  }
  // the same bits from run to run, and for any thread count
  w4a8moe::Context three(3);
  EXPECT_TRUE(same_bits(dispatch(c, shards, w4a8moe::ResultDType::f32, three), dp));
  EXPECT_TRUE(same_bits(all_reduce(c, shards, three), ar));

  // exact results: forward()'s bits for any number of processes
  EXPECT_TRUE(same_bits(dispatch(c, shards, w4a8moe::ResultDType::f32, context, true), one))
      << "exact";

  // bf16 results: the dispatch costs one bf16 rounding per result row
  const moe_test::Output bf = dispatch(c, shards, w4a8moe::ResultDType::bf16, context);
  if (p.spec.x_dtype == DType::f32) {
    const double rounding = std::ldexp(1.0, -8) * static_cast<double>(p.spec.top_k);
    EXPECT_TRUE(close_to(bf.to_float(), one.to_float(), p.spec.hidden, rounding));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ExpertParallel, testing::ValuesIn(ep_cases()), name_of);

TEST(ExpertParallel, TokenWithAllExpertsElsewhereGetsZeros) {
  CaseSpec s{.tokens = 4, .experts = 4, .top_k = 1};
  const Case c = moe_test::make_case(s);
  w4a8moe::Context context(2);
  // experts {0, 1} here: a token routed to 2 or 3 has nothing local
  const ExpertShard shard = ExpertShard::range(4, 0, 2);
  const auto packed = pack_shard(c, shard);
  std::vector<float> out(static_cast<size_t>(s.tokens * s.hidden), NAN);
  w4a8moe::forward_local(
      context, c.x_view(), c.ids_view(), c.topk_weights_view(), packed.w13.bytes(),
      packed.w2.bytes(), c.params(), shard,
      w4a8moe::MutableTensorView::of(out.data(), DType::f32, {s.tokens, s.hidden}));
  const auto* ids = reinterpret_cast<const int32_t*>(c.ids.data());
  int elsewhere = 0, here = 0;
  for (int64_t t = 0; t < s.tokens; ++t) {
    const bool local = ids[t] < 2;
    (local ? here : elsewhere) += 1;
    for (int64_t h = 0; h < s.hidden; ++h) {
      const float v = out[static_cast<size_t>(t * s.hidden + h)];
      if (local)
        ASSERT_TRUE(std::isfinite(v));
      else
        ASSERT_EQ(v, 0.0f) << "token " << t;
    }
  }
  EXPECT_GT(elsewhere, 0);  // the seed routes tokens both ways
  EXPECT_GT(here, 0);
}

TEST(ExpertParallel, NonContiguousMap) {
  CaseSpec s{.tokens = 16, .experts = 6, .top_k = 2, .group_size = 32};
  const Case c = moe_test::make_case(s);
  w4a8moe::Context context(2);
  // process 0 holds 5, 0, 3 (in that local order); process 1 holds 1, 4, 2
  const std::vector<int32_t> map0 = {1, -1, -1, 2, -1, 0}, map1 = {-1, 0, 2, -1, 1, -1};
  const std::vector<ExpertShard> shards = {ExpertShard::from_map(map0),
                                           ExpertShard::from_map(map1)};
  EXPECT_FALSE(shards[0].contiguous());
  const auto packed = moe_test::pack(c);
  const auto one = moe_test::run_forward(c, packed, context).to_float();
  EXPECT_TRUE(close_to(all_reduce(c, shards, context).to_float(), one, s.hidden));
  EXPECT_TRUE(
      close_to(dispatch(c, shards, w4a8moe::ResultDType::f32, context).to_float(), one, s.hidden));
  EXPECT_TRUE(dispatch(c, shards, w4a8moe::ResultDType::f32, context, true).bytes ==
              moe_test::run_forward(c, packed, context).bytes);
}

TEST(ExpertParallel, ShardsAndPlacementsAreChecked) {
  using moe_test::throws_error;
  EXPECT_TRUE(throws_error([] { ExpertShard::range(8, 6, 3); }, {"count", "1 to 2", "got 3"}));
  EXPECT_TRUE(throws_error([] { ExpertShard::even_split(4, 0, 5); }, {"ranks", "got 5"}));
  EXPECT_TRUE(throws_error([] { ExpertShard::even_split(4, 4, 4); }, {"rank", "[0, 4)", "got 4"}));
  const std::vector<int32_t> twice = {0, 0, -1}, gap = {0, 2, -1}, none = {-1, -1},
                             out_of_range = {0, -2};
  EXPECT_TRUE(throws_error([&] { ExpertShard::from_map(twice); },
                           {"expert_map", "each local index once", "experts 0 and 1"}));
  EXPECT_TRUE(throws_error([&] { ExpertShard::from_map(gap); },
                           {"expert_map", "local indices 0 to 1", "no expert for 1"}));
  EXPECT_TRUE(throws_error([&] { ExpertShard::from_map(none); }, {"expert_map", "none"}));
  EXPECT_TRUE(throws_error([&] { ExpertShard::from_map(out_of_range); },
                           {"expert_map", "got -2 for expert 1"}));
  // a map that does not cover each expert exactly once across processes
  const std::vector<ExpertShard> overlap = {ExpertShard::range(6, 0, 4),
                                            ExpertShard::range(6, 3, 3)};
  EXPECT_TRUE(throws_error([&] { ExpertPlacement::from_shards(overlap); },
                           {"shards", "expert 3 held by processes 0 and 1"}));
  const std::vector<ExpertShard> hole = {ExpertShard::range(6, 0, 2), ExpertShard::range(6, 3, 3)};
  EXPECT_TRUE(throws_error([&] { ExpertPlacement::from_shards(hole); },
                           {"shards", "expert 2 held by none"}));
  const std::vector<ExpertShard> sizes = {ExpertShard::range(6, 0, 3), ExpertShard::range(7, 3, 4)};
  EXPECT_TRUE(
      throws_error([&] { ExpertPlacement::from_shards(sizes); }, {"shards", "got 7 at process 1"}));
  EXPECT_EQ(ExpertPlacement::even_split(10, 4).owner(6), 2);  // shares 3, 3, 2, 2
}

TEST(ExpertParallel, LocalForwardChecksTheShard) {
  using moe_test::throws_error;
  CaseSpec s;
  s.tokens = 4;
  s.experts = 6;
  const Case c = moe_test::make_case(s);
  w4a8moe::Context context(1);
  const ExpertShard shard = ExpertShard::range(6, 0, 3);
  const auto packed = pack_shard(c, ExpertShard::range(6, 0, 2));  // one expert short
  std::vector<float> out(static_cast<size_t>(s.tokens * s.hidden));
  const auto view = w4a8moe::MutableTensorView::of(out.data(), DType::f32, {s.tokens, s.hidden});
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::forward_local(context, c.x_view(), c.ids_view(), c.topk_weights_view(),
                               packed.w13.bytes(), packed.w2.bytes(), c.params(), shard, view);
      },
      {"w13_packed", "the shard's 3 local experts", "got 2"}));
  // ids name global experts: 6 is out of range for a layer of 6
  std::vector<int32_t> ids(static_cast<size_t>(s.tokens * s.top_k), 6);
  const auto full = pack_shard(c, shard);
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::forward_local(context, c.x_view(),
                               w4a8moe::TensorView::of(ids.data(), DType::i32, {s.tokens, s.top_k}),
                               c.topk_weights_view(), full.w13.bytes(), full.w2.bytes(), c.params(),
                               shard, view);
      },
      {"topk_ids", "[0, 6)", "got 6"}));
  // packing a selection: each expert once, in range
  w4a8moe::PackOptions o = c.pack_options();
  o.experts = {1, 1};
  EXPECT_TRUE(throws_error([&] { w4a8moe::pack_w2(c.w2_view(), c.w2_scale_view(), {}, o); },
                           {"PackOptions::experts", "each expert once", "1 twice"}));
  o.experts = {0, 6};
  EXPECT_TRUE(throws_error([&] { w4a8moe::pack_w2(c.w2_view(), c.w2_scale_view(), {}, o); },
                           {"PackOptions::experts", "[0, 6)", "got 6"}));
}

TEST(ExpertParallel, DispatchChecksWhatItReceives) {
  using moe_test::throws_error;
  CaseSpec s{.tokens = 6, .experts = 4, .top_k = 2};
  const Case c = moe_test::make_case(s);
  w4a8moe::Context context(1);
  const std::vector<ExpertShard> shards = even_shards(4, 2);
  const ExpertPlacement placement = ExpertPlacement::from_shards(shards);
  w4a8moe::DispatchConfig config;
  config.hidden = s.hidden;
  config.top_k = s.top_k;
  w4a8moe::Dispatch d0(placement, 0, config), d1(placement, 1, config);
  d0.pack(context, c.x_view(), c.ids_view(), c.topk_weights_view());
  const auto p1 = pack_shard(c, shards[1]);
  // what process 0 sends to process 1, received by process 1
  const auto counts = d0.send_counts();
  ASSERT_GT(counts[1], 0);
  const auto buf = d0.send_buffer();
  std::vector<uint8_t> rec(buf.begin() + static_cast<ptrdiff_t>(counts[0] * d0.record_bytes()),
                           buf.end());
  const std::vector<int64_t> recv = {counts[1], 0};
  d1.compute(context, rec, recv, p1.w13.bytes(), p1.w2.bytes(), shards[1]);  // fine
  EXPECT_TRUE(throws_error(
      [&] { d1.compute(context, rec, recv, p1.w13.bytes(), p1.w2.bytes(), shards[0]); },
      {"shard", "the experts the placement gives process 1"}));
  const std::vector<int64_t> short_counts = {counts[1] + 1, 0};
  EXPECT_TRUE(throws_error(
      [&] { d1.compute(context, rec, short_counts, p1.w13.bytes(), p1.w2.bytes(), shards[1]); },
      {"received", "bytes"}));
  const std::vector<int64_t> one_count = {counts[1]};
  EXPECT_TRUE(throws_error(
      [&] { d1.compute(context, rec, one_count, p1.w13.bytes(), p1.w2.bytes(), shards[1]); },
      {"recv_counts", "one count per process (2)", "got 1"}));
  // a record naming an expert of process 0 (a sender with another placement)
  std::vector<uint8_t> bad = rec;
  const int32_t e0 = 0, zp = 300;
  std::memcpy(bad.data() + 16, &e0, 4);
  EXPECT_TRUE(throws_error(
      [&] { d1.compute(context, bad, recv, p1.w13.bytes(), p1.w2.bytes(), shards[1]); },
      {"received: record 0 from process 0", "experts of process 1", "got expert 0"}));
  bad = rec;
  std::memcpy(bad.data() + 12, &zp, 4);
  EXPECT_TRUE(throws_error(
      [&] { d1.compute(context, bad, recv, p1.w13.bytes(), p1.w2.bytes(), shards[1]); },
      {"received: record 0 from process 0", "zero point in [-128, 127]", "got 300"}));
  // combine wants exactly the results of what pack() sent
  std::vector<float> out(static_cast<size_t>(s.tokens * s.hidden));
  const std::vector<uint8_t> few(8);
  EXPECT_TRUE(throws_error(
      [&] {
        d0.combine(context, few,
                   w4a8moe::MutableTensorView::of(out.data(), DType::f32, {s.tokens, s.hidden}));
      },
      {"returned", "result rows", "got 8 bytes"}));
  // the tokens a process dispatches are checked as forward() checks them
  std::vector<int32_t> ids(static_cast<size_t>(s.tokens * s.top_k), 4);
  EXPECT_TRUE(throws_error(
      [&] {
        d0.pack(context, c.x_view(),
                w4a8moe::TensorView::of(ids.data(), DType::i32, {s.tokens, s.top_k}),
                c.topk_weights_view());
      },
      {"topk_ids", "[0, 4)", "got 4"}));
}

}  // namespace

namespace {

TEST(ExpertParallel, SupportedConfigKnowsLocalExperts) {
  w4a8moe::MoeConfig c;
  c.hidden = 256;
  c.inter = 128;
  c.experts = 8;
  c.top_k = 2;
  c.local_experts = 3;
  EXPECT_TRUE(w4a8moe::is_supported_config(c).supported);
  c.local_experts = 9;
  const w4a8moe::Support s = w4a8moe::is_supported_config(c);
  EXPECT_FALSE(s.supported);
  EXPECT_NE(s.reason.find("local experts (9) must be 0 (all) or 1 to experts (8)"),
            std::string::npos)
      << s.reason;
}

}  // namespace
