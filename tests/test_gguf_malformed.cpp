// Malformed GGUF files rejected with a message naming the file: random corruptions, bad magic and
// version, truncation, offsets, unknown types, dimensions, counts and lengths beyond the file,
// duplicates and alignment, and missing tensors and metadata.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "checkpoint_test_util.hpp"
#include "checkpoint_writers.hpp"
#include "io/checkpoint.hpp"
#include "io/gguf.hpp"

namespace {

using namespace ckpt_test;
using namespace w4a8moe;
using ::testing::HasSubstr;

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
