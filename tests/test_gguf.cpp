// GGUF: the reader on files written by the suite's own writer (metadata of every value
// type, alignment, tensor infos), Q4_0 read back bit for bit (values, f16 scales, and the packed
// buffer's scales), the dequantizers of the converted types against the formats' definitions,
// conversion error bounds, whole layers of three architectures against the independent
// references, and malformed files rejected with a message naming the file.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "checkpoint_families.hpp"
#include "checkpoint_test_util.hpp"
#include "checkpoint_writers.hpp"
#include "io/checkpoint.hpp"
#include "io/ggml_types.hpp"
#include "io/gguf.hpp"
#include "pack/packed_format.hpp"
#include "w4a8moe/expert_packer.hpp"

namespace {

using namespace ckpt_test;
using namespace w4a8moe;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------------------------
// The reader

TEST(Gguf, MetadataOfEveryValueTypeReadsBack) {
  TempDir dir;
  GgufWriter w;
  w.alignment = 64;
  const auto raw = [&](const char* key, uint32_t type, auto value) {
    Bytes b;
    b.put(value);
    w.kv_raw(key, type, b.data);
  };
  raw("u8", kU8, uint8_t{200});
  raw("i8", kI8, int8_t{-100});
  raw("u16", kU16, uint16_t{60000});
  raw("i16", kI16, int16_t{-30000});
  raw("u32", kU32, uint32_t{4000000000u});
  raw("i32", kI32, int32_t{-2000000000});
  raw("f32", kF32, 1.5f);
  raw("bool", kBool, uint8_t{1});
  raw("u64", kU64, uint64_t{1} << 40);
  raw("i64", kI64, int64_t{-(int64_t{1} << 40)});
  raw("f64", kF64, 0.1);
  w.kv_string("string", "héllo");
  w.kv_u32("general.alignment", 64);
  {
    Bytes b;  // array of f32
    b.put<uint32_t>(kF32);
    b.put<uint64_t>(3);
    for (const float v : {1.0f, -2.0f, 0.5f}) b.put(v);
    w.kv_raw("floats", kArray, b.data);
  }
  {
    Bytes b;  // array of arrays of i16
    b.put<uint32_t>(kArray);
    b.put<uint64_t>(2);
    for (int i = 0; i < 2; ++i) {
      b.put<uint32_t>(kI16);
      b.put<uint64_t>(2);
      b.put<int16_t>(static_cast<int16_t>(i));
      b.put<int16_t>(7);
    }
    w.kv_raw("nested", kArray, b.data);
  }
  w.kv_strings("strings", {"a", "", "ccc"});
  w.tensor("t0", kTF32, {3}, encode_f32({1, 2, 3}));
  w.tensor("t1", kTQ8_0, {64, 2}, random_blocks(kTQ8_0, 128, 1));
  w.write(dir / "m.gguf");

  const io::GgufFile f = io::GgufFile::open(dir / "m.gguf");
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.data_offset() % 64, 0u);
  EXPECT_EQ(*f.get_int("u8"), 200);
  EXPECT_EQ(*f.get_int("i8"), -100);
  EXPECT_EQ(*f.get_int("u16"), 60000);
  EXPECT_EQ(*f.get_int("i16"), -30000);
  EXPECT_EQ(*f.get_int("u32"), 4000000000LL);
  EXPECT_EQ(*f.get_int("i32"), -2000000000LL);
  EXPECT_EQ(*f.get_float("f32"), 1.5);
  EXPECT_EQ(*f.get_bool("bool"), true);
  EXPECT_EQ(*f.get_int("u64"), int64_t{1} << 40);
  EXPECT_EQ(*f.get_int("i64"), -(int64_t{1} << 40));
  EXPECT_EQ(*f.get_float("f64"), 0.1);
  EXPECT_EQ(*f.get_string("string"), "héllo");
  EXPECT_EQ(*f.get_numbers("floats"), (std::vector<double>{1.0, -2.0, 0.5}));
  EXPECT_EQ(f.find("nested")->count, 2u);
  EXPECT_EQ(f.find("strings")->count, 3u);
  EXPECT_FALSE(f.get_int("absent").has_value());
  EXPECT_THAT(error_of([&] { f.get_int("string"); }),
              HasSubstr("metadata 'string' must be an integer, got string"));
  EXPECT_THAT(error_of([&] { f.get_bool("u8"); }), HasSubstr("must be a bool, got uint8"));
  EXPECT_THAT(error_of([&] { f.get_numbers("strings"); }),
              HasSubstr("must be an array of numbers, got an array of string"));
  const io::GgufTensor& t1 = f.tensor("t1");
  EXPECT_EQ(t1.n_dims, 2);
  EXPECT_EQ(t1.ne[0], 64);
  EXPECT_EQ(t1.ne[1], 2);
  EXPECT_EQ(t1.bytes, 2u * 2u * 34u);
  EXPECT_EQ(t1.file_offset % 64, 0u);
  float values[3];
  std::memcpy(values, f.bytes(f.tensor("t0")).data(), 12);
  EXPECT_EQ(values[2], 3.0f);
  EXPECT_THAT(error_of([&] { f.tensor("t2"); }), HasSubstr("there is no tensor 't2'"));
}

TEST(Gguf, DequantizersMatchTheFormatDefinitions) {
  for (const uint32_t type : {kTQ4_0, kTQ4_1, kTQ5_0, kTQ8_0, kTQ4_K, kTQ5_K, kTQ6_K, kTMXFP4}) {
    SCOPED_TRACE(io::ggml_type_label(type));
    const int64_t n = 512;
    const std::vector<uint8_t> bytes = random_blocks(type, n, type);
    const std::vector<float> want = decode_blocks(type, bytes, n);
    std::vector<float> got(n);
    io::ggml_dequantize_row(static_cast<io::GgmlType>(type), bytes.data(), n, got.data());
    double max_abs = 0;
    for (const float v : want) max_abs = std::max(max_abs, std::fabs(static_cast<double>(v)));
    ASSERT_GT(max_abs, 0.0);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_NEAR(got[static_cast<size_t>(i)], want[static_cast<size_t>(i)], 1e-6 * max_abs) << i;
  }
}

TEST(Gguf, Q5_0KeepsTheSignOfAZeroAsGgml) {
  // {half d = -1; qh: bit 0 set; qs[0] = 0}: element 0 is q = 16, (16 - 16) * -1 = -0.0 in ggml
  // (and in the gguf package); element 1 is q = 0, (0 - 16) * -1 = 16.
  std::vector<uint8_t> block(22, 0);
  block[0] = 0x00;
  block[1] = 0xbc;  // f16 -1.0
  block[2] = 0x01;  // qh bit 0: the 5th bit of element 0
  std::vector<float> y(32);
  io::ggml_dequantize_row(io::GgmlType::q5_0, block.data(), 32, y.data());
  EXPECT_EQ(y[0], 0.0f);
  EXPECT_TRUE(std::signbit(y[0])) << "+0.0 where ggml gives -0.0";
  EXPECT_EQ(y[1], 16.0f);
}

// ---------------------------------------------------------------------------------------------
// Q4_0: exact

TEST(Gguf, Q4_0ReadsBackBitForBit) {
  TempDir dir;
  GgufSpec spec;
  spec.H = 96;  // three Q4_0 blocks per row
  spec.I = 64;
  GgufModel g = make_gguf(spec);
  g.writer.write(dir / "m.gguf");
  const Moe& m = g.layers[1];
  const auto source = io::open_layer(dir / "m.gguf", 1, {});
  const io::LayerInfo& info = source->info();
  EXPECT_EQ(info.group_size, 32);
  EXPECT_EQ(info.w13_scale_dtype, DType::f16);
  EXPECT_EQ(info.w2_scale_dtype, DType::f16);
  for (const io::Conversion& c : source->conversions()) {
    EXPECT_TRUE(c.exact) << c.tensor;
    EXPECT_EQ(c.source, "Q4_0");
  }
  const Loaded w = load_all(*source);
  // int4 values: the file's q - 8, element for element
  EXPECT_EQ(w.w13, m.w13);
  EXPECT_EQ(w.w2, m.w2);
  // scales: the file's f16 d bits, unchanged
  const auto bits_of = [](const std::vector<uint8_t>& bytes) {
    std::vector<uint16_t> out(bytes.size() / 2);
    std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  };
  std::vector<uint16_t> want13, want2;
  for (const float s : m.w13_s) want13.push_back(f16_bits(s));
  for (const float s : m.w2_s) want2.push_back(f16_bits(s));
  EXPECT_EQ(bits_of(w.w13_scale_bytes), want13);
  EXPECT_EQ(bits_of(w.w2_scale_bytes), want2);

  // The streamed pack equals packing the whole tensors at once, byte for byte, and its scales are
  // the file's f16 bits in the kernel set's layout.
  const io::PackedLayer packed = io::pack_layer(*source, 3);
  PackOptions opt;
  opt.group_size = 32;
  const PackedWeights w13 = pack_w13(
      TensorView::of(w.w13.data(), DType::i8, {spec.E, 2 * spec.I, spec.H}),
      TensorView::of(w.w13_scale_bytes.data(), DType::f16, {spec.E, 2 * spec.I, spec.H / 32}), {},
      opt);
  const PackedWeights w2 = pack_w2(
      TensorView::of(w.w2.data(), DType::i8, {spec.E, spec.H, spec.I}),
      TensorView::of(w.w2_scale_bytes.data(), DType::f16, {spec.E, spec.H, spec.I / 32}), {}, opt);
  ASSERT_EQ(packed.w13.size(), w13.size());
  EXPECT_EQ(std::memcmp(packed.w13.bytes().data(), w13.bytes().data(), w13.size()), 0);
  ASSERT_EQ(packed.w2.size(), w2.size());
  EXPECT_EQ(std::memcmp(packed.w2.bytes().data(), w2.bytes().data(), w2.size()), 0);
  const detail::Geometry geo = detail::read_geometry(packed.w13.bytes(), "w13");
  ASSERT_EQ(geo.scale_dtype, DType::f16);
  for (int64_t e = 0; e < spec.E; ++e)
    for (int64_t n = 0; n < 2 * spec.I; ++n)
      for (int64_t b = 0; b < geo.groups; ++b) {
        const int64_t pr = geo.padded_row(n), q = pr / geo.panel, r = pr % geo.panel;
        const uint8_t* expert = packed.w13.bytes().data() + detail::kHeaderBytes +
                                static_cast<size_t>(e) * geo.expert_bytes;
        uint16_t got;
        std::memcpy(&got,
                    geo.panel_scales(expert, q) + static_cast<size_t>((b * geo.panel + r) * 2), 2);
        ASSERT_EQ(got, want13[static_cast<size_t>((e * 2 * spec.I + n) * geo.groups + b)])
            << "expert " << e << " row " << n << " group " << b;
      }
}

TEST(Gguf, ExpertPackerChecksItsChunks) {
  const Moe m = make_moe(64, 64, 4, 2, 3);
  ExpertPacker p(WeightRole::w2, 3, {});
  EXPECT_THAT(error_of([&] {
                p.append(TensorView::of(m.w2.data(), DType::i8, {4, 64, 64}),
                         TensorView::of(m.w2_s.data(), DType::f32, {4, 64}), {});
              }),
              HasSubstr("expected at most 3 more experts"));
  p.append(TensorView::of(m.w2.data(), DType::i8, {1, 64, 64}),
           TensorView::of(m.w2_s.data(), DType::f32, {1, 64}), {});
  EXPECT_THAT(error_of([&] {
                PackOptions o;
                p.append(TensorView::of(m.w2.data(), DType::i8, {1, 64, 32}),
                         TensorView::of(m.w2_s.data(), DType::f32, {1, 64}), {});
              }),
              HasSubstr("expected chunks like the first"));
  EXPECT_THAT(error_of([&] { (void)std::move(p).finish(); }),
              HasSubstr("expected 3 experts appended before finish(), got 1"));
}

TEST(Gguf, ExpertChunkRefusesSlotsAndCountsPastItsSize) {
  w4a8moe::io::LayerInfo info;
  info.hidden = 64;
  info.inter = 32;
  info.group_size = 32;
  w4a8moe::io::ExpertChunk chunk(info, 2);
  EXPECT_NE(chunk.slot(1).w2, nullptr);
  EXPECT_EQ(chunk.w2(2).shape[0], 2);
  EXPECT_THAT(error_of([&] { (void)chunk.slot(2); }),
              HasSubstr("ExpertChunk: slot 2 outside [0, 2)"));
  EXPECT_THAT(error_of([&] { (void)chunk.slot(-1); }), HasSubstr("slot -1 outside [0, 2)"));
  EXPECT_THAT(error_of([&] { (void)chunk.w13_scale(3); }), HasSubstr("count 3 outside [0, 3)"));
}

// ---------------------------------------------------------------------------------------------
// Conversions

TEST(Gguf, ConvertedTypesStayWithinOneQuantizationStep) {
  for (const uint32_t type :
       {kTF32, kTF16, kTBF16, kTQ8_0, kTQ4_1, kTQ5_0, kTQ4_K, kTQ5_K, kTQ6_K}) {
    SCOPED_TRACE(io::ggml_type_label(type));
    TempDir dir;
    GgufSpec spec{.layers = 1, .H = 256, .I = 256, .E = 2};
    spec.types[0] = spec.types[1] = spec.types[2] = type;
    GgufModel g = make_gguf(spec);
    g.writer.write(dir / "m.gguf");
    const auto source = io::open_layer(dir / "m.gguf", 0, {});
    EXPECT_EQ(source->info().w13_scale_dtype, DType::f32);
    const Loaded w = load_all(*source);
    for (int which = 0; which < 3; ++which) {
      // the file's values [E, rows, cols] vs the loaded int4 * scale
      const std::vector<float>& file = g.floats[which][0];
      double err_sq = 0, ref_sq = 0;
      for (int64_t e = 0; e < spec.E; ++e)
        for (int64_t r = 0; r < 256; ++r)
          for (int64_t k = 0; k < 256; ++k) {
            const int64_t row = which == 2 ? e * 256 + r : e * 512 + (which == 1 ? 256 : 0) + r;
            const auto li = static_cast<size_t>(row * 256 + k);
            const std::vector<int8_t>& v = which == 2 ? w.w2 : w.w13;
            const std::vector<float>& s = which == 2 ? w.w2_s : w.w13_s;
            const double scale = static_cast<double>(s[static_cast<size_t>(row * 8 + k / 32)]);
            const double got = v[li] * scale;
            const double want =
                static_cast<double>(file[static_cast<size_t>((e * 256 + r) * 256 + k)]);
            // q4_0 rule: step |s|; the largest positive value may clamp from 8 to 7: one step
            ASSERT_LE(std::fabs(got - want), std::fabs(scale) * (1 + 1e-6) + 1e-12)
                << "tensor " << which << " expert " << e << " [" << r << ", " << k << "]";
            err_sq += (got - want) * (got - want);
            ref_sq += want * want;
          }
      const io::Conversion c = source->conversions()[static_cast<size_t>(which)];
      EXPECT_FALSE(c.exact);
      EXPECT_EQ(c.source, io::ggml_type_label(type));
      EXPECT_NEAR(c.relative_rms(), std::sqrt(err_sq / ref_sq), 1e-3 * std::sqrt(err_sq / ref_sq));
      EXPECT_GT(c.relative_rms(), 0.0);
      EXPECT_LT(c.relative_rms(), 0.2);
    }
  }
}

// MXFP4 (gpt-oss GGUFs) packs as itself: the loaded codes and exponents mean exactly the file's
// values, with --exact too. Gate and up must both be MXFP4 for w13 to be (else the MXFP4 one of
// them is converted like any other type), down goes its own way.
TEST(Gguf, Mxfp4IsTakenExactly) {
  struct Mix {
    uint32_t gate, up, down;
    bool w13_exact, w2_exact;
  };
  for (const Mix mix :
       {Mix{kTMXFP4, kTMXFP4, kTMXFP4, true, true}, Mix{kTQ8_0, kTMXFP4, kTMXFP4, false, true},
        Mix{kTMXFP4, kTMXFP4, kTQ4_0, true, true}}) {
    SCOPED_TRACE(io::ggml_type_label(mix.gate) + "/" + io::ggml_type_label(mix.up) + "/" +
                 io::ggml_type_label(mix.down));
    TempDir dir;
    GgufSpec spec{.layers = 1, .H = 256, .I = 128, .E = 4};
    spec.types[0] = mix.gate;
    spec.types[1] = mix.up;
    spec.types[2] = mix.down;
    GgufModel g = make_gguf(spec);
    g.writer.write(dir / "m.gguf");
    io::LoadOptions options;
    options.require_exact = mix.w13_exact && mix.w2_exact;
    const auto source = io::open_layer(dir / "m.gguf", 0, options);
    const io::LayerInfo& info = source->info();
    EXPECT_EQ(info.group_size, 32);
    EXPECT_EQ(info.w13_format == WeightFormat::mxfp4, mix.gate == kTMXFP4 && mix.up == kTMXFP4);
    EXPECT_EQ(info.w2_format == WeightFormat::mxfp4, mix.down == kTMXFP4);
    const Loaded w = load_all(*source);
    for (int which = 0; which < 3; ++which) {
      const bool exact = which == 2 ? mix.w2_exact : mix.w13_exact;
      EXPECT_EQ(source->conversions()[static_cast<size_t>(which)].exact, exact) << which;
      const uint32_t type = which == 0 ? mix.gate : which == 1 ? mix.up : mix.down;
      if (!exact || type != kTMXFP4) continue;  // Q4_0's exactness is tested above
      const std::vector<float>& file = g.floats[which][0];
      const int64_t rows = which == 2 ? 256 : 128, cols = which == 2 ? 128 : 256;
      for (int64_t e = 0; e < spec.E; ++e)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < cols; ++k) {
            const int64_t row = which == 2 ? e * 256 + r : e * 256 + (which == 1 ? 128 : 0) + r;
            const std::vector<int8_t>& v = which == 2 ? w.w2 : w.w13;
            const std::vector<float>& sc = which == 2 ? w.w2_s : w.w13_s;
            ASSERT_EQ(static_cast<float>(v[static_cast<size_t>(row * cols + k)]) *
                          sc[static_cast<size_t>(row * (cols / 32) + k / 32)],
                      file[static_cast<size_t>((e * rows + r) * cols + k)])
                << "tensor " << which << " expert " << e << " [" << r << ", " << k << "]";
          }
    }
    check_layer(dir / "m.gguf", 0, RouteSpec{"softmax", true});
  }
}

TEST(Gguf, RefusesConversionsWhenExactIsRequiredAndTypesItCannotConvert) {
  TempDir dir;
  GgufSpec spec{.layers = 1, .H = 256, .I = 256};
  spec.types[2] = kTQ8_0;
  make_gguf(spec).writer.write(dir / "q8.gguf");
  EXPECT_THAT(exact_error(dir / "q8.gguf", 0),
              HasSubstr("tensor 'blk.0.ffn_down_exps.weight' has type Q8_0, which w4a8moe "
                        "does not take exactly (Q4_0 and MXFP4 it does"));
  spec.types[2] = kTIQ2_XXS;
  make_gguf(spec).writer.write(dir / "iq2.gguf");
  EXPECT_THAT(error_of([&] { io::open_layer(dir / "iq2.gguf", 0, {}); }),
              HasSubstr("tensor 'blk.0.ffn_down_exps.weight' has type IQ2_XXS, which w4a8moe "
                        "cannot convert"));
}

// ---------------------------------------------------------------------------------------------
// Whole layers of every model family against the independent references (checkpoint_families)

class GgufFamily : public ::testing::TestWithParam<FamilyRow> {};

TEST_P(GgufFamily, LayerRoutesAndRunsAsTheModel) {
  const FamilyRow& row = GetParam();
  TempDir dir;
  write_and_check_family(family_gguf(row), dir / "m.gguf", row, row.gguf_check);
}

INSTANTIATE_TEST_SUITE_P(Families, GgufFamily, ::testing::ValuesIn(gguf_families()),
                         family_test_name);

TEST(Gguf, ExpertRangesPackTheirBlocksAndAreChecked) {
  TempDir dir;
  GgufSpec spec;
  spec.layers = 1;
  spec.E = 6;
  spec.types[1] = kTQ8_0;  // converted: only the range's rows
  make_gguf(spec).writer.write(dir / "m.gguf");
  check_expert_range(dir / "m.gguf", 0, {0, 1});
  check_expert_range(dir / "m.gguf", 0, {5, 1});
  check_expert_range(dir / "m.gguf", 0, {2, -1});
  check_expert_range(dir / "m.gguf", 0, {0, 6});
  const auto range_error = [&](io::ExpertRange range) {
    io::LoadOptions options;
    options.experts = range;
    return error_of([&] { io::open_layer(dir / "m.gguf", 0, options); });
  };
  EXPECT_EQ(range_error({4, 3}),
            "LoadOptions::experts: expected a range [first, first + count) within the layer's "
            "experts [0, 6) with count >= 1 (or -1: to the last), got first 4, count 3");
  EXPECT_THAT(range_error({-1, 2}), HasSubstr("got first -1, count 2"));
  EXPECT_THAT(range_error({0, 0}), HasSubstr("got first 0, count 0"));
  EXPECT_THAT(range_error({6, -1}), HasSubstr("within the layer's experts [0, 6)"));
  // a shared-expert source is one expert
  io::LoadOptions shared;
  shared.shared_expert = true;
  GgufSpec with_shared = spec;
  with_shared.shared_expert = true;
  make_gguf(with_shared).writer.write(dir / "s.gguf");
  check_expert_range(dir / "s.gguf", 0, {0, 1}, shared);
  shared.experts = {1, 1};
  EXPECT_THAT(error_of([&] { io::open_layer(dir / "s.gguf", 0, shared); }),
              HasSubstr("within the layer's experts [0, 1)"));
}

// ---------------------------------------------------------------------------------------------
// Shared experts

TEST(Gguf, Qwen2MoeSharedExpertWithItsGate) {
  // the shared expert (Q4_0: exact) whose output is scaled by sigmoid(x . ffn_gate_inp_shexp);
  // the routed layer: GgufFamily/Qwen2Moe
  TempDir dir;
  GgufModel g = family_gguf(family("Qwen2Moe"));
  g.writer.write(dir / "q2.gguf");
  io::LoadOptions options;
  options.shared_expert = true;
  const auto shared = io::open_layer(dir / "q2.gguf", 1, options);
  const io::LayerInfo& info = shared->info();
  EXPECT_EQ(info.hidden, 96);
  EXPECT_EQ(info.inter, 160);
  EXPECT_FALSE(info.has_shared_expert);
  EXPECT_EQ(info.w13_scale_dtype, DType::f16);
  ASSERT_EQ(shared->conversions().size(), 3u);
  EXPECT_EQ(shared->conversions()[0].tensor, "blk.1.ffn_gate_shexp.weight");
  EXPECT_EQ(shared->conversions()[2].tensor, "blk.1.ffn_down_shexp.weight");
  for (const io::Conversion& c : shared->conversions()) EXPECT_TRUE(c.exact) << c.tensor;
  const Loaded w = load_all(*shared);
  EXPECT_EQ(w.w13, g.shared[1].w13);
  EXPECT_EQ(w.w2, g.shared[1].w2);
  for (size_t i = 0; i < w.w13_s.size(); ++i)
    ASSERT_EQ(f16_bits(w.w13_s[i]), f16_bits(g.shared[1].w13_s[i])) << i;
  check_shared(dir / "q2.gguf", 1, g.shared[1].router);
}

TEST(Gguf, DeepSeek2SharedExpertConvertedAndAddedAsIs) {
  // no gate: weight 1 for every token; Q8_0 / F16 / BF16 tensors converted with their error
  TempDir dir;
  GgufSpec spec{.arch = "deepseek2", .layers = 1, .H = 64, .I = 64, .E = 8, .K = 2, .Is = 128};
  spec.shared_expert = true;
  spec.shared_types[0] = kTQ8_0;
  spec.shared_types[1] = kTF16;
  spec.shared_types[2] = kTBF16;
  GgufModel g = make_gguf(spec);
  g.writer.write(dir / "ds.gguf");
  io::LoadOptions options;
  options.shared_expert = true;
  const auto shared = io::open_layer(dir / "ds.gguf", 0, options);
  EXPECT_FALSE(shared->info().shared_gate);
  EXPECT_EQ(shared->info().w13_scale_dtype, DType::f32);
  const Loaded w = load_all(*shared);
  const char* const types[3] = {"Q8_0", "F16", "BF16"};
  for (int which = 0; which < 3; ++which) {
    const io::Conversion c = shared->conversions()[static_cast<size_t>(which)];
    EXPECT_FALSE(c.exact);
    EXPECT_EQ(c.source, types[which]);
    EXPECT_GT(c.relative_rms(), 0.0);
    EXPECT_LT(c.relative_rms(), 0.2);
    // the loaded values are quantize_weights of the file's values
    const std::vector<float>& file = g.shared_floats[which][0];
    const int64_t rows = which == 2 ? 64 : 128, cols = which == 2 ? 128 : 64;
    const QuantizedWeights q = quantize_weights(
        TensorView::of(file.data(), DType::f32, {1, rows, cols}), 32, QuantRule::q4_0);
    const int64_t first = which == 1 ? 128 : 0;
    const std::vector<int8_t>& v = which == 2 ? w.w2 : w.w13;
    const std::vector<float>& sc = which == 2 ? w.w2_s : w.w13_s;
    EXPECT_TRUE(std::equal(q.values.begin(), q.values.end(), v.begin() + first * cols)) << which;
    EXPECT_TRUE(std::equal(q.scales.begin(), q.scales.end(), sc.begin() + first * (cols / 32)))
        << which;
  }
  check_shared(dir / "ds.gguf", 0, {});
  EXPECT_THAT(exact_error(dir / "ds.gguf", 0, options),
              HasSubstr("tensor 'blk.0.ffn_gate_shexp.weight' has type Q8_0, which w4a8moe "
                        "does not take exactly"));
}

TEST(Gguf, SharedExpertMissingOrMalformed) {
  TempDir dir;
  GgufSpec spec{.layers = 1, .H = 64, .I = 64, .E = 4};
  io::LoadOptions options;
  options.shared_expert = true;
  make_gguf(spec).writer.write(dir / "none.gguf");
  EXPECT_FALSE(io::open_layer(dir / "none.gguf", 0, {})->info().has_shared_expert);
  EXPECT_THAT(error_of([&] { io::open_layer(dir / "none.gguf", 0, options); }),
              HasSubstr("layer 0 has no shared expert: tensor 'blk.0.ffn_gate_shexp.weight' is "
                        "missing"));
  const Moe sh = make_moe(64, 96, 1, 1, 5);
  const auto with = [&](std::vector<int64_t> down_ne, uint32_t feed_forward) {
    GgufModel g = make_gguf(spec);
    g.writer.kv_u32("qwen3moe.expert_shared_feed_forward_length", feed_forward);
    g.writer.tensor("blk.0.ffn_gate_shexp.weight", kTQ4_0, {64, 96}, q4_0_tensor(sh, 0));
    g.writer.tensor("blk.0.ffn_up_shexp.weight", kTQ4_0, {64, 96}, q4_0_tensor(sh, 1));
    g.writer.tensor("blk.0.ffn_down_shexp.weight", kTQ4_0, std::move(down_ne), q4_0_tensor(sh, 2));
    g.writer.write(dir / "sh.gguf");
    return error_of([&] { io::open_layer(dir / "sh.gguf", 0, options); });
  };
  EXPECT_EQ(with({96, 64}, 96), "(no error)");
  EXPECT_THAT(with({96, 64}, 128),
              HasSubstr("metadata 'qwen3moe.expert_shared_feed_forward_length' says 128 but "
                        "tensor 'blk.0.ffn_gate_shexp.weight' has 96 rows"));
  EXPECT_THAT(with({64, 96}, 96),
              HasSubstr("tensor 'blk.0.ffn_down_shexp.weight' must have ne "
                        "[96, 64] (GGUF order, innermost first), got [64, 96]"));
}

TEST(Gguf, SplitModel) {
  // three files as gguf-split writes them; any of them names the model
  TempDir dir;
  GgufSpec spec;
  spec.layers = 3;
  const std::vector<GgufWriter> parts = make_gguf(spec).writer.split(3);
  for (int i = 0; i < 3; ++i)
    parts[static_cast<size_t>(i)].write(dir /
                                        ("m-0000" + std::to_string(i + 1) + "-of-00003.gguf"));
  check_layer(dir / "m-00002-of-00003.gguf", 2, RouteSpec{"softmax", true});
  check_layer(dir / "m-00001-of-00003.gguf", 0, RouteSpec{"softmax", true});
  std::filesystem::remove(dir / "m-00003-of-00003.gguf");
  EXPECT_THAT(error_of([&] { io::open_layer(dir / "m-00001-of-00003.gguf", 1, {}); }),
              HasSubstr("m-00003-of-00003.gguf': cannot open the file"));
  std::filesystem::rename(dir / "m-00002-of-00003.gguf", dir / "m.gguf");
  EXPECT_THAT(error_of([&] { io::open_layer(dir / "m.gguf", 1, {}); }),
              HasSubstr("metadata 'split.count' says the model is split in 3 files, but the name "
                        "does not end in -NNNNN-of-3.gguf"));
}

// ---------------------------------------------------------------------------------------------
// Malformed files

class GgufMalformed : public ::testing::Test {
 protected:
  void SetUp() override {
    GgufSpec spec{.layers = 1, .H = 32, .I = 32, .E = 4};
    model_ = make_gguf(spec);
    bytes_ = model_.writer.serialize(&layout_);
  }
  // The message of opening `bytes` as a file (the reader alone, or the whole layer).
  std::string open_error(const std::vector<uint8_t>& bytes, bool layer = false) {
    const std::string path = dir_ / "bad.gguf";
    write_file(path, bytes);
    const std::string m = error_of([&] {
      if (layer) {
        io::open_layer(path, 0, {});
      } else {
        io::GgufFile::open(path);
      }
    });
    if (m != "(no error)") {
      EXPECT_THAT(m, HasSubstr(path)) << "the message must name the file";
    }
    return m;
  }
  template <class T>
  std::vector<uint8_t> patched(size_t at, T value) const {
    std::vector<uint8_t> b = bytes_;
    std::memcpy(b.data() + at, &value, sizeof value);
    return b;
  }
  TempDir dir_;
  GgufModel model_;
  GgufWriter::Layout layout_;
  std::vector<uint8_t> bytes_;
};

TEST_F(GgufMalformed, TheValidFileOpens) { EXPECT_EQ(open_error(bytes_, true), "(no error)"); }

TEST_F(GgufMalformed, RandomCorruptionsAreRejectedWithAMessageOrLoad) {
  // bytes of the header region overwritten at random (and random truncations): every outcome is
  // a load or a w4a8moe::Error, never a crash, a hang or another exception
  std::mt19937_64 rng(12345);
  int rejected = 0;
  const std::string path = dir_ / "fuzz.gguf";
  for (int i = 0; i < 160; ++i) {
    std::vector<uint8_t> b = bytes_;
    if (i % 10 == 9) {
      b.resize(rng() % b.size());
    } else {
      for (uint64_t f = 0, n = 1 + rng() % 4; f < n; ++f)
        b[rng() % layout_.data_begin] = static_cast<uint8_t>(rng());
    }
    write_file(path, b);
    try {
      const auto source = io::open_layer(path, 0, {});
      (void)source->router();
      (void)io::pack_layer(*source, 1);
    } catch (const Error& e) {
      ++rejected;
      ASSERT_GT(std::strlen(e.what()), 10u) << "case " << i;
    } catch (const std::exception& e) {
      FAIL() << "case " << i << ": not a w4a8moe::Error: " << e.what();
    }
  }
  EXPECT_GT(rejected, 80);
}

TEST_F(GgufMalformed, BadMagicAndVersion) {
  EXPECT_THAT(open_error(patched<char>(0, 'X')), HasSubstr("bad magic bytes"));
  EXPECT_THAT(open_error(patched<uint32_t>(4, 1)), HasSubstr("unsupported GGUF version 1"));
  EXPECT_THAT(open_error(patched<uint32_t>(4, 0x03000000)), HasSubstr("a big-endian file?"));
  EXPECT_THAT(open_error({'G', 'G'}), HasSubstr("too short"));
  EXPECT_THAT(open_error({}), HasSubstr("too short"));
}

TEST_F(GgufMalformed, TruncatedFiles) {
  std::vector<uint8_t> b = bytes_;
  b.resize(b.size() - 10);
  EXPECT_THAT(open_error(b), HasSubstr("runs past the end of the file"));
  EXPECT_THAT(open_error(b), HasSubstr("the file is truncated or the offset is wrong"));
  b.resize(layout_.info_begin.back() + 3);  // inside the tensor infos
  EXPECT_THAT(open_error(b), HasSubstr("runs past the end of the file"));
  b.resize(30);  // inside the metadata: the counts alone do not fit
  EXPECT_THAT(open_error(b), HasSubstr("metadata count 8 cannot fit in the rest of the file"));
  b = bytes_;
  b.resize(layout_.info_begin[0] - 5);  // inside the last metadata value
  EXPECT_THAT(open_error(b), HasSubstr("runs past the end of the file"));
}

TEST_F(GgufMalformed, OffsetsPastTheEndMisalignedOrOverlapping) {
  EXPECT_THAT(open_error(patched<uint64_t>(layout_.offset_field[0], uint64_t{1} << 40)),
              HasSubstr("tensor 'blk.0.ffn_gate_inp.weight' (F32 [32, 4], 512 bytes at data "
                        "offset 1099511627776) runs past the end of the file"));
  EXPECT_THAT(open_error(patched<uint64_t>(layout_.offset_field[0], ~uint64_t{0} - 31)),
              HasSubstr("runs past the end of the file"));
  EXPECT_THAT(open_error(patched<uint64_t>(layout_.offset_field[1], 3)),
              HasSubstr("data offset 3, not a multiple of the alignment 32"));
  EXPECT_THAT(open_error(patched<uint64_t>(layout_.offset_field[2], 0)), HasSubstr("overlaps"));
}

TEST_F(GgufMalformed, UnknownAndRemovedTypes) {
  EXPECT_THAT(open_error(patched<uint32_t>(layout_.type_field[1], 99)),
              HasSubstr("tensor 'blk.0.ffn_gate_exps.weight' has unknown type 99"));
  EXPECT_THAT(open_error(patched<uint32_t>(layout_.type_field[1], 31)),
              HasSubstr("Q4_0_4_4 (type 31, removed from ggml)"));
  // a known type whose blocks do not tile the rows
  GgufWriter w;
  w.tensor("odd", kTQ4_0, {48, 2}, std::vector<uint8_t>(54, 0));
  EXPECT_THAT(open_error(w.serialize()),
              HasSubstr("rows of 48 elements, not a multiple of the type's block of 32"));
}

TEST_F(GgufMalformed, DimensionsAndSizes) {
  GgufWriter w;
  w.tensor("five", kTF32, {1, 1, 1, 1, 1}, encode_f32({1}));
  EXPECT_THAT(open_error(w.serialize()),
              HasSubstr("tensor 'five' has 5 dimensions (expected 1 to 4)"));
  GgufWriter big;
  big.tensor("big", kTF32, {int64_t{1} << 40, int64_t{1} << 40, 4}, {});
  EXPECT_THAT(open_error(big.serialize()), HasSubstr("whose size overflows 64 bits"));
}

TEST_F(GgufMalformed, CountsAndLengthsBeyondTheFile) {
  EXPECT_THAT(open_error(patched<uint64_t>(layout_.kv_count, uint64_t{1} << 50)),
              HasSubstr("metadata count 1125899906842624 cannot fit"));
  EXPECT_THAT(open_error(patched<uint64_t>(layout_.tensor_count, 1000000)),
              HasSubstr("tensor count 1000000 cannot fit"));
  // the first key's length
  EXPECT_THAT(open_error(patched<uint64_t>(24, uint64_t{1} << 62)),
              HasSubstr("the key of metadata pair 0"));
  GgufWriter w;
  Bytes b;
  b.put<uint32_t>(kU32);
  b.put<uint64_t>(uint64_t{1} << 61);
  w.kv_raw("huge", kArray, b.data);
  EXPECT_THAT(open_error(w.serialize()),
              HasSubstr("metadata 'huge' holds 2305843009213693952 elements of uint32, more than "
                        "the rest of the file"));
  GgufWriter t;
  Bytes v;
  v.put<uint8_t>(0);
  t.kv_raw("typed", 13, v.data);
  EXPECT_THAT(open_error(t.serialize()),
              HasSubstr("metadata 'typed' has an unknown value type 13"));
}

TEST_F(GgufMalformed, DuplicatesAndAlignment) {
  GgufWriter w;
  w.kv_u32("a", 1);
  w.kv_u32("a", 2);
  EXPECT_THAT(open_error(w.serialize()), HasSubstr("duplicate metadata 'a'"));
  GgufWriter t;
  t.tensor("x", kTF32, {1}, encode_f32({1}));
  t.tensor("x", kTF32, {1}, encode_f32({2}));
  EXPECT_THAT(open_error(t.serialize()), HasSubstr("duplicate tensor 'x'"));
  GgufWriter a;
  a.kv_u32("general.alignment", 24);
  EXPECT_THAT(open_error(a.serialize()),
              HasSubstr("'general.alignment' must be a power of two, got 24"));
  GgufWriter a2;
  a2.kv_u64("general.alignment", 32);
  EXPECT_THAT(open_error(a2.serialize()),
              HasSubstr("'general.alignment' must be a uint32, got uint64"));
}

TEST_F(GgufMalformed, MissingTensorsAndMetadata) {
  TempDir dir;
  GgufSpec spec{.layers = 1, .H = 32, .I = 32, .E = 4};
  const auto layer_error = [&](const GgufSpec& s) {
    return open_error(make_gguf(s).writer.serialize(), true);
  };
  // a writer without one tensor: rebuild from scratch
  {
    GgufWriter w;
    w.kv_string("general.architecture", "qwen3moe");
    w.kv_u32("qwen3moe.expert_used_count", 2);
    const Moe m = make_moe(32, 32, 4, 2, 1);
    w.tensor("blk.0.ffn_gate_inp.weight", kTF32, {32, 4}, encode_f32(m.router));
    w.tensor("blk.0.ffn_gate_exps.weight", kTQ4_0, {32, 32, 4}, q4_0_tensor(m, 0));
    w.tensor("blk.0.ffn_up_exps.weight", kTQ4_0, {32, 32, 4}, q4_0_tensor(m, 1));
    EXPECT_THAT(open_error(w.serialize(), true),
                HasSubstr("tensor 'blk.0.ffn_down_exps.weight' is missing"));
  }
  GgufSpec five = spec;
  five.expert_count_meta = 5;
  EXPECT_THAT(layer_error(five), HasSubstr("metadata 'qwen3moe.expert_count' says 5 but tensor "
                                           "'blk.0.ffn_gate_exps.weight' has 4 experts"));
  {
    GgufWriter w;
    w.kv_string("general.architecture", "qwen3moe");
    EXPECT_THAT(
        open_error(w.serialize(), true),
        HasSubstr("layer 0 has no MoE experts: tensor 'blk.0.ffn_gate_exps.weight' is missing"));
  }
  GgufSpec mamba = spec;
  mamba.arch = "mamba";
  EXPECT_THAT(layer_error(mamba),
              HasSubstr("architecture 'mamba' is not one whose routing w4a8moe knows"));
  const std::string path = dir / "ok.gguf";
  make_gguf(spec).writer.write(path);
  EXPECT_THAT(error_of([&] { io::open_layer(path, 3, {}); }),
              HasSubstr("layer 3 does not exist: the model has 1 blocks"));
  EXPECT_THAT(error_of([&] { io::open_layer(dir / "absent.gguf", 0, {}); }),
              HasSubstr("no such file or folder"));
}

}  // namespace
