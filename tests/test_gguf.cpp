// GGUF: the reader on files written by the suite's own writer (metadata of every value
// type, alignment, tensor infos), the dequantizers against the formats' definitions, Q4_0 read
// back bit for bit (values, f16 scales, and the packed buffer's scales), and the expert packer's
// and expert chunk's checks. Converted types and whole layers: test_gguf_layers.cpp; malformed
// files: test_gguf_malformed.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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

}  // namespace
