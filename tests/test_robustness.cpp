// Hostile inputs (docs/robustness.md): NaN/Inf and zeros in scales and biases stay with
// their expert; huge and overflowing dimensions are refused before anything is allocated or read;
// null and misaligned pointers; buffers that end (or start) at an unmapped page are read within
// their bounds by every kernel set; the context's memory limit chunks a call or refuses it.
// CTest runs this suite once per kernel set (W4A8MOE_ISA).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "reference/reference.hpp"
#include "registry.hpp"
#include "test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

using namespace moe_test::suite_names;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kHuge = int64_t{1} << 40;

CaseSpec spec_for(int group, uint64_t seed) {  // H 256, I 128, K 2
  return {.tokens = 24, .experts = 6, .group_size = group, .bias = true, .seed = seed};
}

// The experts token t was routed to.
std::set<int64_t> experts_of(const Case& c, int64_t t) {
  std::set<int64_t> out;
  for (int64_t k = 0; k < c.spec.top_k; ++k) {
    int32_t id;
    std::memcpy(&id, c.ids.data() + 4 * (t * c.spec.top_k + k), 4);
    out.insert(id);
  }
  return out;
}

void set_float(moe_test::FloatTensor& t, size_t i, float v) {
  ASSERT_EQ(t.dtype, DType::f32);
  std::memcpy(t.bytes.data() + 4 * i, &v, 4);
  t.values[i] = v;
}

bool row_equal(const moe_test::Output& a, const moe_test::Output& b, int64_t t) {
  const size_t row = static_cast<size_t>(a.cols) * w4a8moe::dtype_bytes(a.dtype);
  return std::memcmp(a.bytes.data() + t * row, b.bytes.data() + t * row, row) == 0;
}

// ---- NaN, Inf and zero in the weights' scales and biases --------------------------------------

class HostileData : public testing::Test {
 protected:
  moe_test::Output run(const Case& c) { return moe_test::run_forward(c, moe_test::pack(c), ctx_); }
  w4a8moe::Context ctx_{2};
};

TEST_F(HostileData, BadScaleOrBiasStaysWithItsExpert) {
  for (const int group : {-1, 64}) {
    const Case clean = moe_test::make_case(spec_for(group, 700 + static_cast<uint64_t>(group + 1)));
    const moe_test::Output expected = run(clean);
    const int64_t bad_expert = 3;
    const int64_t groups = group < 0 ? 1 : clean.spec.hidden / group;
    struct Poison {
      const char* what;
      moe_test::FloatTensor Case::*tensor;
      size_t index;
    };
    const size_t rows13 = static_cast<size_t>(2 * clean.spec.inter);
    const size_t rows2 = static_cast<size_t>(clean.spec.hidden);
    const auto e = static_cast<size_t>(bad_expert);
    const Poison poisons[] = {
        {"w13_scale", &Case::w13_scale, (e * rows13 + 5) * static_cast<size_t>(groups)},
        {"w13_scale (up row)", &Case::w13_scale,
         (e * rows13 + rows13 - 1) * static_cast<size_t>(groups)},
        {"w2_scale", &Case::w2_scale,
         (e * rows2 + 7) * static_cast<size_t>(group < 0 ? 1 : clean.spec.inter / group)},
        {"w13_bias", &Case::w13_bias, e * rows13 + 2},
        {"w2_bias", &Case::w2_bias, e * rows2 + 200},
    };
    for (const Poison& p : poisons)
      for (const float bad : {kNan, kInf, -kInf}) {
        SCOPED_TRACE(std::string(p.what) + " = " + std::to_string(bad) + ", group " +
                     std::to_string(group));
        Case c = clean;
        set_float(c.*p.tensor, p.index, bad);
        const moe_test::Output got = run(c);
        int64_t with = 0;
        for (int64_t t = 0; t < c.spec.tokens; ++t) {
          if (experts_of(c, t).count(bad_expert) != 0) {
            ++with;
            continue;
          }
          EXPECT_TRUE(row_equal(got, expected, t)) << "token " << t << " does not use expert 3";
        }
        EXPECT_GT(with, 0) << "the routing should send some tokens to expert 3";
      }
  }
}

TEST_F(HostileData, ZeroScalesGiveTheContractsFiniteResult) {
  for (const int group : {-1, 32}) {
    Case c = moe_test::make_case(spec_for(group, 710));
    // expert 1: all w13 scales zero -> h = b13; expert 2: all w2 scales zero -> y = b2
    const size_t per13 = c.w13_scale.values.size() / 6, per2 = c.w2_scale.values.size() / 6;
    for (size_t i = 0; i < per13; ++i) set_float(c.w13_scale, per13 + i, 0.0f);
    for (size_t i = 0; i < per2; ++i) set_float(c.w2_scale, 2 * per2 + i, 0.0f);
    c.problem.w13_scale = c.w13_scale.values;
    c.problem.w2_scale = c.w2_scale.values;
    const std::vector<float> got = run(c).to_float();
    for (const float v : got) ASSERT_TRUE(std::isfinite(v));
    moe_test::ExactCheck check;
    check.check_magnitude = false;
    EXPECT_TRUE(moe_test::matches_exact(c, got, moe_ref::exact_forward(c.problem), check));
  }
  // every scale zero and no bias: exactly zero
  CaseSpec spec = spec_for(64, 711);
  spec.bias = false;
  Case c = moe_test::make_case(spec);
  for (size_t i = 0; i < c.w13_scale.values.size(); ++i) set_float(c.w13_scale, i, 0.0f);
  for (size_t i = 0; i < c.w2_scale.values.size(); ++i) set_float(c.w2_scale, i, 0.0f);
  for (const float v : run(c).to_float()) ASSERT_EQ(v, 0.0f);
}

// Float weights handed to quantize_weights (the step before packing): NaN or Inf anywhere, in
// any float dtype, is refused naming the element, never turned into int4 values or a scale.
TEST_F(HostileData, NanOrInfInFloatWeightsIsRefusedByTheQuantizer) {
  const int64_t E = 2, N = 4, K = 64;
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16})
    for (const float bad : {kNan, kInf, -kInf})
      for (const int64_t at : {int64_t{0}, int64_t{77}, E * N * K - 1}) {
        std::vector<float> values(static_cast<size_t>(E * N * K), 0.25f);
        values[static_cast<size_t>(at)] = bad;
        const moe_test::FloatTensor w = moe_test::make_float_tensor(values, dtype);
        const TensorView v = TensorView::of(w.bytes.data(), dtype, {E, N, K});
        for (const int group : {-1, 32})
          EXPECT_TRUE(throws_error([&] { w4a8moe::quantize_weights(v, group); },
                                   {"w", "finite", "flat index " + std::to_string(at)}))
              << w4a8moe::dtype_name(dtype) << " " << bad << " at " << at << " group " << group;
      }
}

// ---- huge dimensions ---------------------------------------------------------------------------

// Views of a few real bytes that claim enormous shapes: every call must refuse them before it
// reads or allocates (a read would fault or trip the sanitizers; an allocation would fail or
// exhaust the machine).
TEST(HostileShapes, HugeDimensionsAreRefusedBeforeAllocating) {
  std::vector<uint8_t> tiny(4096, 0x88);
  const void* p = tiny.data();
  w4a8moe::PackOptions opt;
  opt.group_size = -1;
  const auto view3 = [&](DType dtype, int64_t e, int64_t n, int64_t k) {
    return TensorView::of(p, dtype, {e, n, k});
  };
  const auto view2 = [&](int64_t e, int64_t n) { return TensorView::of(p, DType::f32, {e, n}); };
  struct Weights {
    TensorView w, scale;
    const char* fragment;
  };
  const int64_t g30 = int64_t{1} << 30;
  const Weights cases[] = {
      {view3(DType::i8, kHuge, 2, 32), view2(kHuge, 2), "w13"},                  // E >= 2^32
      {view3(DType::i8, 2, kHuge, 32), view2(2, kHuge), "w13"},                  // rows >= 2^32
      {view3(DType::i8, 2, 2, kHuge), view2(2, 2), "w13"},                       // cols > 65536
      {view3(DType::i8, g30, g30, g30), view2(g30, g30), "address space"},       // 2^90 bytes
      {view3(DType::u8, 2, 2, int64_t{1} << 62), view2(2, 2), "address space"},  // 2 x cols
      {view3(DType::u8, 1, 2, INT64_MAX), view2(1, 2), "address space"},
  };
  for (const Weights& c : cases) {
    SCOPED_TRACE(c.fragment);
    EXPECT_TRUE(throws_error([&] { w4a8moe::pack_w13(c.w, c.scale, {}, opt); }, {c.fragment}));
  }
  // 2^20 experts of 2^20 x 2^16: counts fit in 64 bits, but 2^55 bytes cannot be allocated.
  const TensorView big_w = TensorView::of(p, DType::i8, {1 << 20, 1 << 20, 1 << 16});
  const TensorView big_s = TensorView::of(p, DType::f32, {1 << 20, 1 << 20});
  opt.memory_limit = size_t{1} << 30;
  EXPECT_TRUE(throws_error([&] { w4a8moe::pack_w13(big_w, big_s, {}, opt); },
                           {"w13", "memory limit", "1073741824"}));
  opt.memory_limit = SIZE_MAX;
  EXPECT_TRUE(throws_error([&] { w4a8moe::pack_w13(big_w, big_s, {}, opt); }, {"allocate"}));

  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::quantize_weights(TensorView::of(p, DType::f32, {1 << 30, 1 << 30, 1 << 30}), -1);
      },
      {"w", "address space"}));
  // 2^62 bytes: below PTRDIFF_MAX, but no platform maps memory that far (the output would
  // otherwise be allocated before the view is read)
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::quantize_weights(TensorView::of(p, DType::bf16, {1, 1, int64_t{1} << 61}), 32);
      },
      {"w", "address space"}));
  EXPECT_TRUE(
      throws_error([&] { w4a8moe::PackedWeights::allocate(SIZE_MAX - 10); }, {"PackedWeights"}));
}

TEST(HostileShapes, HugeActivationsAreRefused) {
  const Case c = moe_test::make_case(spec_for(64, 720));
  const moe_test::PackedPair packed = moe_test::pack(c);
  w4a8moe::Context ctx(2);
  moe_test::Output out = moe_test::make_output(c);
  const int64_t H = c.spec.hidden;
  const auto call = [&](const TensorView& x, const TensorView& ids, const TensorView& w,
                        const MutableTensorView& o) {
    return [&, x, ids, w, o] {
      w4a8moe::forward(ctx, x, ids, w, packed.w13.bytes(), packed.w2.bytes(), c.params(), o);
    };
  };
  const void* d = c.x.bytes.data();
  const TensorView ids = c.ids_view(), w = c.topk_weights_view();
  // T x K beyond 2^31 - 1 pairs
  EXPECT_TRUE(throws_error(
      call(TensorView::of(d, DType::f32, {kHuge, H}), TensorView::of(d, DType::i32, {kHuge, 2}),
           TensorView::of(d, DType::f32, {kHuge, 2}),
           MutableTensorView::of(out.bytes.data(), DType::f32, {kHuge, H})),
      {"pairs"}));
  // a row stride whose span overflows
  EXPECT_TRUE(throws_error(
      call(TensorView::of(d, DType::f32, {24, H}, int64_t{1} << 62), ids, w, out.view()),
      {"x", "address space"}));
  EXPECT_TRUE(throws_error(
      call(c.x_view(), ids, w,
           MutableTensorView::of(out.bytes.data(), DType::f32, {24, H}, INT64_MAX / 2)),
      {"out", "address space"}));
  // K enormous (T = 1)
  EXPECT_TRUE(throws_error(
      call(TensorView::of(d, DType::f32, {1, H}), TensorView::of(d, DType::i32, {1, kHuge}),
           TensorView::of(d, DType::f32, {1, kHuge}),
           MutableTensorView::of(out.bytes.data(), DType::f32, {1, H})),
      {"topk_ids"}));
  EXPECT_EQ(ctx.scratch_bytes(), 0u) << "nothing may be allocated for a refused call";
}

TEST(HostileShapes, IdsAtTheExtremesAreRefused) {
  const Case c = moe_test::make_case(spec_for(-1, 721));
  const moe_test::PackedPair packed = moe_test::pack(c);
  w4a8moe::Context ctx(2);
  for (const int64_t bad : {INT64_MIN, int64_t{-1}, int64_t{6}, INT64_MAX, int64_t{INT32_MIN}}) {
    std::vector<int64_t> ids(static_cast<size_t>(24 * 2), 0);
    ids[47] = bad;
    moe_test::Output out = moe_test::make_output(c);
    const std::vector<uint8_t> before = out.bytes;
    EXPECT_TRUE(throws_error(
        [&] {
          w4a8moe::forward(ctx, c.x_view(), TensorView::of(ids.data(), DType::i64, {24, 2}),
                           c.topk_weights_view(), packed.w13.bytes(), packed.w2.bytes(), c.params(),
                           out.view());
        },
        {"topk_ids", std::to_string(bad), "token 23, slot 1"}));
    EXPECT_EQ(out.bytes, before) << "the output was touched";
  }
}

// ---- pointers ----------------------------------------------------------------------------------

TEST(HostilePointers, NullPointersAreErrors) {
  const Case c = moe_test::make_case(spec_for(64, 730));
  const moe_test::PackedPair packed = moe_test::pack(c);
  w4a8moe::Context ctx(1);
  moe_test::Output out = moe_test::make_output(c);
  const std::span<const uint8_t> null_span(static_cast<const uint8_t*>(nullptr), 4096);
  EXPECT_TRUE(throws_error([&] { w4a8moe::inspect_packed(null_span, "buffer"); }, {"buffer"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::forward(ctx, c.x_view(), c.ids_view(), c.topk_weights_view(), null_span,
                         packed.w2.bytes(), c.params(), out.view());
      },
      {"w13_packed"}));
  const auto opt = c.pack_options();
  TensorView w = c.w13_view(), s = c.w13_scale_view();
  w.data = nullptr;
  EXPECT_TRUE(throws_error([&] { w4a8moe::pack_w13(w, s, {}, opt); }, {"w13", "null"}));
  w = c.w13_view();
  s.data = nullptr;
  EXPECT_TRUE(throws_error([&] { w4a8moe::pack_w13(w, s, {}, opt); }, {"w13_scale", "null"}));
  w4a8moe::LogicalWeights lw = c.logical();
  lw.w2_scale.data = nullptr;
  EXPECT_TRUE(throws_error([&] { moe_test::run_library_reference(c, lw); }, {"w2_scale", "null"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::quantize_weights(TensorView::of(nullptr, DType::f32, {1, 1, 32}), -1);
      },
      {"w", "null"}));
}

// Every pointer an odd number of bytes off: the results are the same bits.
TEST(HostilePointers, MisalignedViewsGiveTheSameBits) {
  for (const DType xd : {DType::f32, DType::bf16}) {
    CaseSpec spec = spec_for(32, 731);
    spec.x_dtype = xd;
    const Case c = moe_test::make_case(spec);
    const moe_test::PackedPair packed = moe_test::pack(c);
    w4a8moe::Context ctx(2);
    const moe_test::Output expected = moe_test::run_forward(c, packed, ctx);
    auto shifted = [](std::span<const uint8_t> bytes, size_t by) {
      std::vector<uint8_t> v(bytes.size() + by);
      std::memcpy(v.data() + by, bytes.data(), bytes.size());
      return v;
    };
    const std::vector<uint8_t> x = shifted(c.x.bytes, 1), ids = shifted(c.ids, 3),
                               w = shifted(c.topk_weights.bytes, 1),
                               w13 = shifted(packed.w13.bytes(), 7),
                               w2 = shifted(packed.w2.bytes(), 5);
    std::vector<uint8_t> out(expected.bytes.size() + 1, 0xff);
    const int64_t T = spec.tokens, H = spec.hidden, K = spec.top_k;
    w4a8moe::forward(ctx, TensorView::of(x.data() + 1, xd, {T, H}),
                     TensorView::of(ids.data() + 3, DType::i32, {T, K}),
                     TensorView::of(w.data() + 1, DType::f32, {T, K}),
                     std::span<const uint8_t>(w13).subspan(7),
                     std::span<const uint8_t>(w2).subspan(5), c.params(),
                     MutableTensorView::of(out.data() + 1, xd, {T, H}));
    EXPECT_EQ(std::memcmp(out.data() + 1, expected.bytes.data(), expected.bytes.size()), 0)
        << w4a8moe::dtype_name(xd);

    // the packer's inputs, odd bytes off: the same packed bytes
    const std::vector<uint8_t> w13_scale = shifted(c.w13_scale.bytes, 3),
                               w13_bias = shifted(c.w13_bias.bytes, 1),
                               w13_values =
                                   shifted(std::span(reinterpret_cast<const uint8_t*>(c.w13.data()),
                                                     c.w13.size()),
                                           5);
    auto moved = [](TensorView v, const uint8_t* data) {
      v.data = data;
      return v;
    };
    const w4a8moe::PackedWeights again = w4a8moe::pack_w13(
        moved(c.w13_view(), w13_values.data() + 5), moved(c.w13_scale_view(), w13_scale.data() + 3),
        moved(c.w13_bias_view(), w13_bias.data() + 1), c.pack_options());
    EXPECT_TRUE(std::equal(again.bytes().begin(), again.bytes().end(), packed.w13.bytes().begin(),
                           packed.w13.bytes().end()));
  }
}

TEST(HostilePointers, AnOutputOverlappingTheInputsIsRefused) {
  const Case c = moe_test::make_case(spec_for(64, 732));
  const moe_test::PackedPair packed = moe_test::pack(c);
  w4a8moe::Context ctx(1);
  const int64_t T = c.spec.tokens, H = c.spec.hidden;
  std::vector<uint8_t> x = c.x.bytes;
  const auto run_into = [&](void* out) {
    return [&, out] {
      w4a8moe::forward(ctx, TensorView::of(x.data(), DType::f32, {T, H}), c.ids_view(),
                       c.topk_weights_view(), packed.w13.bytes(), packed.w2.bytes(), c.params(),
                       MutableTensorView::of(out, DType::f32, {T, H}));
    };
  };
  EXPECT_TRUE(throws_error(run_into(x.data()), {"out", "overlap", "x"}));
  std::vector<uint8_t> wide(x.size() * 2);  // out starts inside x's last row
  std::memcpy(wide.data(), x.data(), x.size());
  x.swap(wide);
  EXPECT_TRUE(throws_error(run_into(x.data() + (T - 1) * H * 4 + 4), {"out", "overlap"}));
}

TEST(HostileShapes, ThreadCountsAreBounded) {
  EXPECT_TRUE(throws_error([] { w4a8moe::Context c(5000); }, {"threads", "4096", "5000"}));
  EXPECT_TRUE(throws_error([] { w4a8moe::Context c(-3); }, {"threads", "-3"}));
}

// ---- reads stay inside the buffers -------------------------------------------------------------

// A copy of some bytes placed against an inaccessible page: its last byte just before the page
// (at_end) or its first byte just after one. A read past the end (or before the start) faults,
// in release builds too.
class Guarded {
 public:
  Guarded(std::span<const uint8_t> bytes, bool at_end) : size_(bytes.size()) {
    page_ = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    const size_t pages = (size_ + page_ - 1) / page_;
    map_bytes_ = (pages + 2) * page_;
    void* m =
        ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("mmap failed");
    map_ = static_cast<uint8_t*>(m);
    ::mprotect(map_, page_, PROT_NONE);
    ::mprotect(map_ + (pages + 1) * page_, page_, PROT_NONE);
    data_ = at_end ? map_ + (pages + 1) * page_ - size_ : map_ + page_;
    if (size_ > 0) std::memcpy(data_, bytes.data(), size_);
  }
  ~Guarded() { ::munmap(map_, map_bytes_); }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  uint8_t* data() const { return data_; }
  std::span<const uint8_t> bytes() const { return {data_, size_}; }

 private:
  size_t size_, page_ = 4096, map_bytes_ = 0;
  uint8_t* map_ = nullptr;
  uint8_t* data_ = nullptr;
};

TEST(GuardPages, EveryBufferIsReadWithinItsBounds) {
  struct Shape {
    int64_t tokens, hidden, inter, experts, top_k;
    int group;
    bool nibbles, bias;
    DType x_dtype;
  };
  // Odd sizes (channelwise H, I not multiples of 32), tile edges, nibble-packed inputs.
  const Shape shapes[] = {
      {1, 256, 96, 4, 2, 32, false, true, DType::f32},
      {13, 200, 72, 5, 3, -1, false, true, DType::bf16},
      {9, 128, 64, 3, 3, 64, true, false, DType::f16},
      {17, 96, 40, 4, 1, -1, true, true, DType::f32},
  };
  for (const Shape& sh : shapes)
    for (const bool at_end : {true, false}) {
      CaseSpec spec{sh.tokens, sh.hidden, sh.inter, sh.experts, sh.top_k, sh.group, sh.x_dtype};
      spec.bias = sh.bias;
      spec.nibbles = sh.nibbles;
      spec.seed = 740;
      const Case c = moe_test::make_case(spec);
      SCOPED_TRACE(moe_test::describe(spec) + (at_end ? " at the end" : " at the start"));
      const moe_test::PackedPair packed = moe_test::pack(c);
      w4a8moe::Context ctx(2);
      const moe_test::Output expected = moe_test::run_forward(c, packed, ctx);

      // the packer's inputs
      const TensorView w13v = c.w13_view(), w2v = c.w2_view();
      const size_t w13_bytes = static_cast<size_t>(w13v.numel()),
                   w2_bytes = static_cast<size_t>(w2v.numel());
      const Guarded w13(std::span(static_cast<const uint8_t*>(w13v.data), w13_bytes), at_end);
      const Guarded w2(std::span(static_cast<const uint8_t*>(w2v.data), w2_bytes), at_end);
      const Guarded s13(c.w13_scale.bytes, at_end), s2(c.w2_scale.bytes, at_end);
      const Guarded b13(c.w13_bias.bytes, at_end), b2(c.w2_bias.bytes, at_end);
      auto moved = [](TensorView v, const Guarded& g) {
        v.data = g.data();
        return v;
      };
      const auto opt = c.pack_options();
      const w4a8moe::PackedWeights p13 =
          w4a8moe::pack_w13(moved(w13v, w13), moved(c.w13_scale_view(), s13),
                            sh.bias ? moved(c.w13_bias_view(), b13) : TensorView{}, opt);
      const w4a8moe::PackedWeights p2 =
          w4a8moe::pack_w2(moved(w2v, w2), moved(c.w2_scale_view(), s2),
                           sh.bias ? moved(c.w2_bias_view(), b2) : TensorView{}, opt);
      ASSERT_TRUE(std::equal(p13.bytes().begin(), p13.bytes().end(), packed.w13.bytes().begin(),
                             packed.w13.bytes().end()));
      ASSERT_TRUE(std::equal(p2.bytes().begin(), p2.bytes().end(), packed.w2.bytes().begin(),
                             packed.w2.bytes().end()));

      // forward's inputs and output
      const Guarded x(c.x.bytes, at_end), ids(c.ids, at_end), w(c.topk_weights.bytes, at_end);
      const Guarded g13(packed.w13.bytes(), at_end), g2(packed.w2.bytes(), at_end);
      Guarded out(expected.bytes, at_end);
      std::memset(out.data(), 0xff, expected.bytes.size());
      MutableTensorView ov;
      ov.data = out.data();
      ov.dtype = sh.x_dtype;
      ov.rank = 2;
      ov.shape = {sh.tokens, sh.hidden, 0};
      w4a8moe::forward(ctx, moved(c.x_view(), x), moved(c.ids_view(), ids),
                       moved(c.topk_weights_view(), w), g13.bytes(), g2.bytes(), c.params(), ov);
      EXPECT_TRUE(std::equal(expected.bytes.begin(), expected.bytes.end(), out.data()));

      // the reference reads the logical weights
      w4a8moe::LogicalWeights lw = c.logical();
      lw.w13 = moved(w13v, w13);
      lw.w2 = moved(w2v, w2);
      lw.w13_scale = moved(c.w13_scale_view(), s13);
      lw.w2_scale = moved(c.w2_scale_view(), s2);
      if (sh.bias) {
        lw.w13_bias = moved(c.w13_bias_view(), b13);
        lw.w2_bias = moved(c.w2_bias_view(), b2);
      }
      EXPECT_NO_THROW(w4a8moe::reference_forward(moved(c.x_view(), x), moved(c.ids_view(), ids),
                                                 moved(c.topk_weights_view(), w), lw, c.params(),
                                                 ov));
    }
}

// ---- resource limits ---------------------------------------------------------------------------

// docs/robustness.md, "Resource limits": the scratch of forward() for a chunk of c tokens, each
// array rounded up to 64 bytes (here: an upper bound, adding 64 per array and per row).
size_t documented_scratch(const CaseSpec& s, int64_t chunk, int threads) {
  const auto a64 = [](int64_t v) { return static_cast<size_t>((v + 63) / 64 * 64); };
  const int64_t hp = (s.hidden + 31) / 32 * 32, ip = (s.inter + 31) / 32 * 32;
  const int64_t gh = s.group_size < 0 ? 1 : s.hidden / s.group_size;
  const int64_t gi = s.group_size < 0 ? 1 : s.inter / s.group_size;
  const int64_t pairs = chunk * s.top_k;
  const int64_t rows = s.apply_router_weight_on_input ? pairs : chunk;
  const int64_t tile = w4a8moe::detail::active_set().tile_m;  // the tile rows of the set in use
  size_t total = 0;
  total += static_cast<size_t>(rows) * a64(hp + 4 * gh) + a64(32 * rows);
  total += a64(4 * pairs) + a64(4 * (s.experts + 1)) + 2 * a64(4 * s.experts);
  total += static_cast<size_t>(pairs) * (a64(4 * ip) + a64(ip + 4 * gi)) + a64(32 * pairs);
  total += a64(4 * chunk * s.hidden);
  total += static_cast<size_t>(threads) * a64(tile * 256 * 4 + 4 * s.hidden);
  return total;
}

TEST(ResourceLimits, ScratchFollowsTheDocumentedFormula) {
  for (const bool on_input : {false, true})
    for (const int64_t tokens : {int64_t{1}, int64_t{40}}) {
      CaseSpec spec = spec_for(32, 750);
      spec.tokens = tokens;
      spec.apply_router_weight_on_input = on_input;
      const Case c = moe_test::make_case(spec);
      w4a8moe::Context ctx(3);
      moe_test::run_forward(c, moe_test::pack(c), ctx);
      const size_t bound = documented_scratch(spec, tokens, 3);
      EXPECT_LE(ctx.scratch_bytes(), bound) << moe_test::describe(spec);
      EXPECT_GE(ctx.scratch_bytes(), bound / 2) << moe_test::describe(spec);
    }
}

TEST(ResourceLimits, ALimitChunksTheCallWithTheSameBits) {
  CaseSpec spec = spec_for(64, 751);
  spec.tokens = 100;
  const Case c = moe_test::make_case(spec);
  const moe_test::PackedPair packed = moe_test::pack(c);
  w4a8moe::Context ctx(2);
  EXPECT_EQ(ctx.memory_limit(), w4a8moe::Context::kDefaultMemoryLimit);
  const moe_test::Output expected = moe_test::run_forward(c, packed, ctx);
  const size_t unlimited = ctx.scratch_bytes();
  for (const int64_t chunk : {int64_t{1}, int64_t{7}, int64_t{33}}) {
    const size_t limit = documented_scratch(spec, chunk, 2);
    ASSERT_LT(limit, unlimited);
    ctx.set_memory_limit(limit);  // lowered: the next call releases the larger scratch
    EXPECT_EQ(moe_test::run_forward(c, packed, ctx).bytes, expected.bytes) << "limit " << limit;
    EXPECT_LE(ctx.scratch_bytes(), limit);
    EXPECT_GT(ctx.scratch_bytes(), 0u);
  }
}

TEST(ResourceLimits, ACallThatCannotFitIsRefusedWithTheNeedAndTheLimit) {
  const Case c = moe_test::make_case(spec_for(64, 752));
  const moe_test::PackedPair packed = moe_test::pack(c);
  w4a8moe::Context ctx(2);
  ctx.set_memory_limit(1000);
  moe_test::Output out = moe_test::make_output(c);
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::forward(ctx, c.x_view(), c.ids_view(), c.topk_weights_view(), packed.w13.bytes(),
                         packed.w2.bytes(), c.params(), out.view());
      },
      {"memory limit of 1000 bytes", "needs", "set_memory_limit"}));
  EXPECT_EQ(ctx.scratch_bytes(), 0u);
}

}  // namespace
