// The safetensors reader on malformed and hostile files: one file per check of the reader, each
// rejected with a message that names the file and the problem; deep nesting and long strings
// survived; every truncation and many random byte changes of a valid file read or refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "io/safetensors_writer.hpp"
#include "safetensors_test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {
namespace {

using safetensors_test::SafetensorsTest;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------------------------
// Malformed and hostile files

TEST_F(SafetensorsTest, RejectsMissingFileAndDirectory) {
  EXPECT_THAT(read_error_of(path("absent.safetensors")), HasSubstr("does not exist"));
  EXPECT_THAT(read_error_of(dir_.string()), HasSubstr("not a regular file"));
}

TEST_F(SafetensorsTest, RejectsEmptyFile) { EXPECT_THAT(read_error({}), HasSubstr("empty")); }

TEST_F(SafetensorsTest, RejectsShortHeaderLength) {
  EXPECT_THAT(read_error({2, 0, 0, 0, 0}), HasSubstr("shorter than the 8-byte header length"));
}

TEST_F(SafetensorsTest, RejectsBadHeaderLength) {
  EXPECT_THAT(read_error(make_bytes(0, "", 0)), HasSubstr("header length 0 is too small"));
  EXPECT_THAT(read_error(make_bytes(~uint64_t{0}, "{}", 0)), HasSubstr("exceeds the limit"));
  EXPECT_THAT(read_error(make_bytes(kMaxHeaderBytes + 1, "{}", 0)), HasSubstr("exceeds the limit"));
}

TEST_F(SafetensorsTest, RejectsHeaderLengthPastEndOfFile) {
  EXPECT_THAT(read_error(make_bytes(1000, "{}", 4)), HasSubstr("runs past the end of the file"));
  EXPECT_THAT(read_error(make_bytes(3, "{}", 0)), HasSubstr("runs past the end of the file"));
}

TEST_F(SafetensorsTest, RejectsInvalidJson) {
  EXPECT_THAT(read_error(make_bytes(R"({"a": )", 0)), HasSubstr("not valid JSON"));
  EXPECT_THAT(read_error(make_bytes(R"({"a": 1} trailing)", 0)), HasSubstr("not valid JSON"));
  // Bytes after a NUL must not be ignored (the JSON parser stops at a NUL as at end of input).
  EXPECT_THAT(read_error(make_bytes(std::string("{}\0\0\0\0\0\0", 8), 0)),
              HasSubstr("not valid JSON"));
  EXPECT_THAT(read_error(make_bytes(std::string("{}\0{\"a\"", 7), 0)),
              HasSubstr("NUL byte at byte 2"));
  EXPECT_THAT(read_error(make_bytes("{\"\xff\xfe\": 1}", 0)), HasSubstr("not valid JSON"));
}

TEST_F(SafetensorsTest, RejectsJsonThatIsNotAnObject) {
  EXPECT_THAT(read_error(make_bytes("[1, 2, 3]", 0)), HasSubstr("not a JSON object"));
  EXPECT_THAT(read_error(make_bytes("42", 0)), HasSubstr("not a JSON object"));
  EXPECT_THAT(read_error(make_bytes(R"({"a": [1]})", 0)),
              HasSubstr("tensor 'a' must be a JSON object"));
}

TEST_F(SafetensorsTest, RejectsMissingFields) {
  EXPECT_THAT(read_error(make_bytes(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4)),
              HasSubstr("tensor 'a' has no 'dtype'"));
  EXPECT_THAT(read_error(make_bytes(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", 4)),
              HasSubstr("tensor 'a' has no 'shape'"));
  EXPECT_THAT(read_error(make_bytes(R"({"a":{"dtype":"F32","shape":[1]}})", 4)),
              HasSubstr("tensor 'a' has no 'data_offsets'"));
}

TEST_F(SafetensorsTest, RejectsFieldsOfTheWrongType) {
  EXPECT_THAT(read_error(make_bytes(R"({"a":{"dtype":5,"shape":[1],"data_offsets":[0,4]}})", 4)),
              HasSubstr("'dtype' that is not a string"));
  EXPECT_THAT(
      read_error(make_bytes(R"({"a":{"dtype":"F32","shape":"1","data_offsets":[0,4]}})", 4)),
      HasSubstr("'shape' that is not an array"));
  EXPECT_THAT(
      read_error(make_bytes(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4)),
      HasSubstr("not an integer"));
  EXPECT_THAT(
      read_error(make_bytes(R"({"a":{"dtype":"F32","shape":["1"],"data_offsets":[0,4]}})", 4)),
      HasSubstr("not an integer"));
  EXPECT_THAT(read_error(make_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4)),
              HasSubstr("[begin, end]"));
  EXPECT_THAT(
      read_error(make_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})", 8)),
      HasSubstr("[begin, end]"));
  EXPECT_THAT(
      read_error(make_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":{"a":1}}})", 4)),
      HasSubstr("[begin, end]"));
  EXPECT_THAT(
      read_error(make_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", 4)),
      HasSubstr("not non-negative integers"));
  EXPECT_THAT(
      read_error(make_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}})", 4)),
      HasSubstr("not non-negative integers"));
  EXPECT_THAT(
      read_error(make_bytes(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,99999999999999999999]}})", 4)),
      HasSubstr("not non-negative integers"));
}

TEST_F(SafetensorsTest, RejectsUnknownDType) {
  const std::string msg =
      read_error(make_bytes(R"({"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8));
  EXPECT_THAT(msg, HasSubstr("tensor 'w'"));
  EXPECT_THAT(msg, HasSubstr("unsupported dtype 'F64'"));
  EXPECT_THAT(
      read_error(make_bytes(R"({"w":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", 4)),
      HasSubstr("unsupported dtype 'f32'"));
}

TEST_F(SafetensorsTest, RejectsOffsetsPastTheEnd) {
  EXPECT_THAT(
      read_error(make_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 8)),
      HasSubstr("past the end of the data region (8 bytes)"));
  EXPECT_THAT(read_error(make_bytes(
                  R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551615,)"
                  R"(18446744073709551615]}})",
                  8)),
              HasSubstr("past the end of the data region"));
}

TEST_F(SafetensorsTest, RejectsBeginAfterEnd) {
  EXPECT_THAT(
      read_error(make_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8)),
      HasSubstr("begin 8 after its end 4"));
}

TEST_F(SafetensorsTest, RejectsSizeThatDiffersFromShape) {
  const std::string msg =
      read_error(make_bytes(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", 16));
  EXPECT_THAT(msg, HasSubstr("holding 12 bytes"));
  EXPECT_THAT(msg, HasSubstr("shape [2, 2] of dtype F32 needs 16 bytes"));
}

TEST_F(SafetensorsTest, RejectsShapeWhoseSizeOverflows) {
  // 2^32 * 2^32 elements overflows 64 bits; so does 2^62 elements of 4 bytes; so does 2^63 - 1.
  EXPECT_THAT(
      read_error(make_bytes(
          R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0)),
      HasSubstr("overflows"));
  EXPECT_THAT(
      read_error(make_bytes(
          R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})", 0)),
      HasSubstr("overflows"));
  EXPECT_THAT(
      read_error(make_bytes(
          R"({"a":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,0]}})", 0)),
      HasSubstr("too large"));
}

TEST_F(SafetensorsTest, RejectsNegativeDimensions) {
  EXPECT_THAT(
      read_error(make_bytes(R"({"a":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,0]}})", 0)),
      HasSubstr("negative dimension -1"));
  // Two negatives multiply to a positive: still rejected.
  EXPECT_THAT(
      read_error(make_bytes(R"({"a":{"dtype":"F32","shape":[-1,-1],"data_offsets":[0,4]}})", 4)),
      HasSubstr("negative dimension"));
}

// Shared bytes would let a small file make the reader allocate many times its size.
TEST_F(SafetensorsTest, RejectsOverlappingTensors) {
  const std::string msg =
      read_error(make_bytes(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                            R"("b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})",
                            10));
  EXPECT_THAT(msg, HasSubstr("tensor 'b' (bytes 6 to 10) overlaps tensor 'a' (bytes 0 to 8)"));
  std::string many = "{";
  for (int i = 0; i < 1000; ++i)
    many += "\"t" + std::to_string(i) + R"(":{"dtype":"U8","shape":[64],"data_offsets":[0,64]},)";
  many.back() = '}';
  EXPECT_THAT(read_error(make_bytes(many, 64)), HasSubstr("overlaps"));
  // Zero-size tensors share no bytes, wherever they point.
  const std::string file = path("zeros.safetensors");
  write_raw(file, make_bytes(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                             R"("b":{"dtype":"F32","shape":[0],"data_offsets":[2,2]}})",
                             4));
  EXPECT_EQ(SafetensorsFile::read(file).entry("b").size_bytes, 0u);
}

TEST_F(SafetensorsTest, RejectsTooHighRank) {
  EXPECT_THAT(read_error(make_bytes(
                  R"({"a":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}})", 1)),
              HasSubstr("rank 9"));
}

TEST_F(SafetensorsTest, RejectsTruncatedDataRegion) {
  SafetensorsWriter writer;
  writer.add("a", DType::f32, {4, 4}, std::vector<float>(16, 1.0f));
  std::vector<uint8_t> bytes = writer.serialize();
  // erase, not resize(size() - 5): under ASan, GCC 12 cannot see that size() >= 5 and warns
  // (-Wstringop-overflow) about the growing branch of resize
  bytes.erase(bytes.end() - 5, bytes.end());
  const std::string msg = read_error(bytes);
  EXPECT_THAT(msg, HasSubstr("tensor 'a'"));
  EXPECT_THAT(msg, HasSubstr("past the end of the data region"));
  EXPECT_THAT(msg, HasSubstr("truncated"));
}

TEST_F(SafetensorsTest, RejectsBadMetadata) {
  EXPECT_THAT(read_error(make_bytes(R"({"__metadata__":[1]})", 0)),
              HasSubstr("'__metadata__' must be an object"));
  EXPECT_THAT(read_error(make_bytes(R"({"__metadata__":{"group_size":128}})", 0)),
              HasSubstr("metadata 'group_size' must be a string"));
}

// Nesting a million levels deep must not overflow the stack (in parsing, in printing a value
// for a message, or in freeing the parsed header), and long strings are cut short in messages.
TEST_F(SafetensorsTest, SurvivesDeepNestingAndLongStrings) {
  const size_t depth = 1000000;
  const std::string nested = std::string(depth, '[') + std::string(depth, ']');
  EXPECT_THAT(read_error(make_bytes(nested, 0)),
              HasSubstr("not a JSON object but an array of 1 elements"));
  EXPECT_THAT(read_error(make_bytes(R"({"a":{"dtype":)" + nested + "}}", 0)),
              HasSubstr("'dtype' that is not a string: an array of 1 elements"));
  EXPECT_THAT(read_error(make_bytes(R"({"__metadata__":{"k":)" + nested + "}}", 0)),
              HasSubstr("metadata 'k' must be a string, got an array of 1 elements"));
  std::string objects;
  for (size_t i = 0; i < depth; ++i) objects += R"({"a":)";
  objects += "1" + std::string(depth, '}');
  EXPECT_THAT(read_error(make_bytes(objects, 0)), HasSubstr("tensor 'a' has no 'dtype'"));

  const std::string long_name(100000, 'z');
  const std::string msg = read_error(make_bytes(R"({"a":{"dtype":")" + long_name +
                                                    R"(","shape":[1],)"
                                                    R"("data_offsets":[0,1]}})",
                                                1));
  EXPECT_THAT(msg, HasSubstr("unsupported dtype"));
  EXPECT_THAT(msg, HasSubstr("zzz... (100000 bytes)"));
  EXPECT_LT(msg.size(), 1000u);
}

// Every truncation and many random byte changes of a valid file: each read either succeeds or
// throws Error; nothing else (run under the address sanitizer to catch out-of-bounds reads).
TEST_F(SafetensorsTest, SurvivesTruncationAndCorruption) {
  SafetensorsWriter writer;
  writer.add("x", DType::f32, {2, 3}, std::vector<float>(6, 0.5f));
  writer.add("ids", DType::i64, {2, 1}, std::vector<int64_t>{0, 1});
  writer.add("w", DType::u8, {5}, std::vector<uint8_t>{1, 2, 3, 4, 5});
  writer.set_metadata("activation", "silu");
  const std::vector<uint8_t> good = writer.serialize();
  const std::string file = path("fuzz.safetensors");
  const auto try_read = [&](const std::vector<uint8_t>& bytes) {
    write_raw(file, bytes);
    try {
      const SafetensorsFile f = SafetensorsFile::read(file);
      for (const std::string& name : f.names()) {
        const TensorEntry& e = f.entry(name);
        ASSERT_EQ(f.bytes(name).size(), e.size_bytes);
      }
    } catch (const Error&) {
    }
  };
  for (size_t n = 0; n < good.size(); ++n) {
    SCOPED_TRACE(n);
    try_read(std::vector<uint8_t>(good.begin(), good.begin() + static_cast<ptrdiff_t>(n)));
  }
  const unsigned seed = 12345;
  std::mt19937 rng(seed);
  for (int iter = 0; iter < 1500; ++iter) {
    std::vector<uint8_t> bytes = good;
    const int changes = 1 + static_cast<int>(rng() % 4);
    for (int c = 0; c < changes; ++c) {
      const size_t at = rng() % bytes.size();
      // Favour digits and JSON punctuation inside the header, where damage is most interesting.
      static constexpr char kChars[] = "0123456789-[]{},:\" eE.";
      bytes[at] = (rng() % 2) ? static_cast<uint8_t>(kChars[rng() % (sizeof(kChars) - 1)])
                              : static_cast<uint8_t>(rng());
    }
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " iteration " << iter);
    try_read(bytes);
  }
}

}  // namespace
}  // namespace w4a8moe::io
