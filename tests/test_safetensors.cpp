// The safetensors reader and writer, and the case-file loader: round trips for every dtype, and
// one malformed or hostile file per check of the reader, each rejected with a message that names
// the file and the problem.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "io/case_file.hpp"
#include "io/safetensors_writer.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "w4a8moe_st_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  static void write_raw(const std::string& file, const std::vector<uint8_t>& bytes) {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good());
  }

  // A file with the given header length field, header text and data bytes.
  static std::vector<uint8_t> make_bytes(uint64_t header_length, const std::string& header,
                                         size_t data_bytes) {
    std::vector<uint8_t> out;
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(header_length >> (8 * i)));
    out.insert(out.end(), header.begin(), header.end());
    for (size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<uint8_t>(i * 7 + 1));
    return out;
  }
  static std::vector<uint8_t> make_bytes(const std::string& header, size_t data_bytes) {
    return make_bytes(header.size(), header, data_bytes);
  }

  // The message of the Error that reading `bytes` raises; fails the test if it does not throw.
  std::string read_error(const std::vector<uint8_t>& bytes) {
    const std::string file = path("bad.safetensors");
    write_raw(file, bytes);
    return read_error_of(file);
  }
  static std::string read_error_of(const std::string& file) {
    try {
      SafetensorsFile::read(file);
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(file)) << "the message must name the file";
      return e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "expected w4a8moe::Error, got another exception: " << e.what();
      return e.what();
    }
    ADD_FAILURE() << "reading " << file << " did not throw";
    return "";
  }

  fs::path dir_;
};

std::vector<uint8_t> pattern_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// ---------------------------------------------------------------------------------------------
// Round trips

TEST_F(SafetensorsTest, DTypeNamesRoundTrip) {
  for (DType d :
       {DType::f32, DType::bf16, DType::f16, DType::i8, DType::u8, DType::i32, DType::i64}) {
    const auto back = parse_safetensors_dtype(safetensors_dtype_name(d));
    ASSERT_TRUE(back.has_value()) << safetensors_dtype_name(d);
    EXPECT_EQ(*back, d);
  }
  EXPECT_FALSE(parse_safetensors_dtype("F64").has_value());
  EXPECT_FALSE(parse_safetensors_dtype("f32").has_value());  // the format's names are upper case
}

TEST_F(SafetensorsTest, RoundTripEveryDTypeInOneFile) {
  const std::vector<DType> dtypes = {DType::f32, DType::bf16, DType::f16, DType::i8,
                                     DType::u8,  DType::i32,  DType::i64};
  SafetensorsWriter writer;
  std::vector<std::vector<uint8_t>> contents;
  // Odd sizes, so that a writer which forgot alignment would misplace the wider types.
  const std::vector<std::vector<int64_t>> shapes = {{3, 5}, {7},    {2, 3, 3}, {5, 1, 3},
                                                    {13},   {1, 3}, {3, 1}};
  for (size_t i = 0; i < dtypes.size(); ++i) {
    int64_t numel = 1;
    for (int64_t d : shapes[i]) numel *= d;
    contents.push_back(pattern_bytes(static_cast<size_t>(numel) * dtype_bytes(dtypes[i]),
                                     static_cast<uint32_t>(i)));
    writer.add(std::string("t_") + safetensors_dtype_name(dtypes[i]), dtypes[i], shapes[i],
               contents.back());
  }
  writer.set_metadata("group_size", "128");
  writer.set_metadata("note", "a \"quoted\" value with unicode \xc3\xa9");
  const std::string file = path("all.safetensors");
  writer.write(file);

  const SafetensorsFile read = SafetensorsFile::read(file);
  EXPECT_EQ(read.names().size(), dtypes.size());
  for (size_t i = 0; i < dtypes.size(); ++i) {
    const std::string name = std::string("t_") + safetensors_dtype_name(dtypes[i]);
    SCOPED_TRACE(name);
    ASSERT_TRUE(read.contains(name));
    const TensorEntry& e = read.entry(name);
    EXPECT_EQ(e.dtype, dtypes[i]);
    EXPECT_EQ(e.shape, shapes[i]);
    const std::span<const uint8_t> bytes = read.bytes(name);
    ASSERT_EQ(bytes.size(), contents[i].size());
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), contents[i].begin()));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(bytes.data()) % 64, 0u);
    const TensorView v = read.view(name);
    EXPECT_EQ(v.data, bytes.data());
    EXPECT_EQ(v.dtype, dtypes[i]);
    EXPECT_EQ(v.rank, static_cast<int>(shapes[i].size()));
    for (size_t d = 0; d < shapes[i].size(); ++d) EXPECT_EQ(v.shape[d], shapes[i][d]);
    EXPECT_EQ(v.row_stride, 0);
  }
  EXPECT_EQ(read.metadata().at("group_size"), "128");
  EXPECT_EQ(read.metadata().at("note"), "a \"quoted\" value with unicode \xc3\xa9");
  EXPECT_EQ(read.metadata().size(), 2u);
}

// The file the writer makes follows the layout of the reference implementation: header padded
// with spaces to a multiple of 8, tensors packed without holes, each offset a multiple of its
// element size.
TEST_F(SafetensorsTest, WriterLayoutHasNoHolesAndAlignedOffsets) {
  SafetensorsWriter writer;
  writer.add("a", DType::u8, {3}, std::vector<uint8_t>{1, 2, 3});
  writer.add("b", DType::i64, {2}, std::vector<int64_t>{-1, 1});
  writer.add("c", DType::bf16, {3}, std::vector<uint16_t>{1, 2, 3});
  writer.add("d", DType::f32, {1}, std::vector<float>{1.5f});
  const std::vector<uint8_t> bytes = writer.serialize();
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[static_cast<size_t>(i)];
  EXPECT_EQ(n % 8, 0u);
  ASSERT_LE(8 + n, bytes.size());
  const auto header =
      nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<ptrdiff_t>(n));
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, entry] : header.items()) {
    const uint64_t begin = entry["data_offsets"][0].get<uint64_t>();
    const uint64_t end = entry["data_offsets"][1].get<uint64_t>();
    const DType dtype = *parse_safetensors_dtype(entry["dtype"].get<std::string>());
    EXPECT_EQ(begin % dtype_bytes(dtype), 0u) << name;
    ranges.emplace_back(begin, end);
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t at = 0;
  for (const auto& [begin, end] : ranges) {
    EXPECT_EQ(begin, at);
    at = end;
  }
  EXPECT_EQ(8 + n + at, bytes.size());
}

TEST_F(SafetensorsTest, EmptyTensorsAndScalarsRoundTrip) {
  SafetensorsWriter writer;
  writer.add("empty", DType::f32, {0, 4}, nullptr, 0);
  writer.add("scalar", DType::i32, {}, std::vector<int32_t>{42});
  writer.add("zero_times_huge", DType::f32, {0, int64_t{1} << 62, int64_t{1} << 62}, nullptr, 0);
  const std::string file = path("edge.safetensors");
  writer.write(file);
  const SafetensorsFile read = SafetensorsFile::read(file);
  EXPECT_EQ(read.bytes("empty").size(), 0u);
  EXPECT_EQ(read.view("empty").shape[0], 0);
  EXPECT_FALSE(read.view("empty").empty());  // a zero-size view still has a valid pointer
  int32_t v = 0;
  std::memcpy(&v, read.bytes("scalar").data(), 4);
  EXPECT_EQ(v, 42);
  EXPECT_EQ(read.entry("zero_times_huge").size_bytes, 0u);
  try {
    read.view("scalar");
    ADD_FAILURE() << "a rank-0 view must be rejected";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("rank 0"));
  }
  EXPECT_TRUE(read.metadata().empty());
}

TEST_F(SafetensorsTest, AbsentTensorIsAnError) {
  SafetensorsWriter writer;
  writer.add("a", DType::u8, {1}, std::vector<uint8_t>{1});
  const std::string file = path("one.safetensors");
  writer.write(file);
  const SafetensorsFile read = SafetensorsFile::read(file);
  EXPECT_FALSE(read.contains("b"));
  try {
    read.view("b");
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("no tensor 'b'"));
  }
}

TEST_F(SafetensorsTest, WriterRejectsBadTensors) {
  SafetensorsWriter writer;
  writer.add("a", DType::f32, {2}, std::vector<float>{1, 2});
  const auto message = [&](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "no throw";
    return "";
  };
  EXPECT_THAT(message([&] {
                writer.add("a", DType::f32, {2}, std::vector<float>{1, 2});
              }),
              HasSubstr("already added"));
  EXPECT_THAT(message([&] {
                writer.add("b", DType::f32, {3}, std::vector<float>{1, 2});
              }),
              HasSubstr("needs 12 bytes, got 8"));
  EXPECT_THAT(message([&] {
                writer.add("c", DType::f32, {-2}, std::vector<float>{1, 2});
              }),
              HasSubstr("negative"));
  EXPECT_THAT(message([&] { writer.add("__metadata__", DType::u8, {1}, std::vector<uint8_t>{1}); }),
              HasSubstr("reserved"));
  EXPECT_THAT(message([&] { writer.add("", DType::u8, {1}, std::vector<uint8_t>{1}); }),
              HasSubstr("empty"));
  EXPECT_THAT(message([&] {
                writer.add("d", DType::u8, {int64_t{1} << 40, int64_t{1} << 40}, nullptr, 0);
              }),
              HasSubstr("more than 2^64"));
  EXPECT_THAT(message([&] { writer.write(path("no_such_dir/x.safetensors")); }),
              HasSubstr("cannot create"));
}

TEST_F(SafetensorsTest, WriteReplacesAnExistingFileAndLeavesNoTemporary) {
  const std::string file = path("out.safetensors");
  write_raw(file, {1, 2, 3});
  SafetensorsWriter writer;
  writer.add("a", DType::u8, {1}, std::vector<uint8_t>{9});
  writer.write(file);
  EXPECT_EQ(SafetensorsFile::read(file).bytes("a")[0], 9);
  size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_)) ++entries;
  EXPECT_EQ(entries, 1u);
}

// A header padded with spaces (as the format allows) and data in file order other than ours.
TEST_F(SafetensorsTest, ReadsAForeignLayout) {
  const std::string header = R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                             R"("a":{"dtype":"I32","shape":[1],"data_offsets":[4,8]},)"
                             R"("__metadata__":{"format":"pt"}}      )";
  std::vector<uint8_t> bytes = make_bytes(header, 0);
  for (uint8_t b : {7, 8, 0, 0, 1, 0, 0, 0}) bytes.push_back(b);
  const std::string file = path("foreign.safetensors");
  write_raw(file, bytes);
  const SafetensorsFile read = SafetensorsFile::read(file);
  EXPECT_EQ(read.bytes("b")[1], 8);
  int32_t a = 0;
  std::memcpy(&a, read.bytes("a").data(), 4);
  EXPECT_EQ(a, 1);
  EXPECT_EQ(read.metadata().at("format"), "pt");
}

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

// ---------------------------------------------------------------------------------------------
// Case loader

class CaseLoaderTest : public SafetensorsTest {
 protected:
  // A case with tiny tensors (the loader does not cross-check shapes; pack and forward do).
  SafetensorsWriter valid_case(const std::string& skip_tensor = "",
                               const std::string& skip_key = "") {
    SafetensorsWriter w;
    const auto add = [&](const std::string& name, DType dtype, std::vector<int64_t> shape) {
      if (name == skip_tensor) return;
      size_t bytes = dtype_bytes(dtype);
      for (int64_t d : shape) bytes *= static_cast<size_t>(d);
      const std::vector<uint8_t> zeros(bytes, 0);
      w.add(name, dtype, std::move(shape), zeros);
    };
    add("x", DType::bf16, {2, 64});
    add("topk_ids", DType::i64, {2, 2});
    add("topk_weights", DType::f32, {2, 2});
    add("w13", DType::u8, {3, 64, 32});
    add("w13_scale", DType::bf16, {3, 64, 2});
    add("w2", DType::i8, {3, 64, 32});
    add("w2_scale", DType::f32, {3, 64});
    const std::vector<std::pair<std::string, std::string>> meta = {
        {"group_size", "32"},
        {"activation", "swigluoai"},
        {"alpha", "1.5"},
        {"limit", "6.25"},
        {"gate_up_layout", "interleaved"},
        {"apply_router_weight_on_input", "true"}};
    for (const auto& [key, value] : meta)
      if (key != skip_key) w.set_metadata(key, value);
    return w;
  }

  std::string load_error(const SafetensorsWriter& w) {
    const std::string file = path("case.safetensors");
    w.write(file);
    try {
      load_case(file);
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(file));
      return e.what();
    }
    ADD_FAILURE() << "load_case did not throw";
    return "";
  }
};

TEST_F(CaseLoaderTest, LoadsAValidCase) {
  const std::string file = path("case.safetensors");
  valid_case().write(file);
  LoadedCase loaded = load_case(file);
  const LoadedCase c = std::move(loaded);  // views survive a move
  EXPECT_EQ(c.x.dtype, DType::bf16);
  EXPECT_EQ(c.x.rank, 2);
  EXPECT_EQ(c.x.shape[1], 64);
  EXPECT_EQ(c.x.data, c.file.bytes("x").data());
  EXPECT_EQ(c.topk_ids.dtype, DType::i64);
  EXPECT_EQ(c.topk_weights.dtype, DType::f32);
  EXPECT_EQ(c.weights.w13.dtype, DType::u8);
  EXPECT_EQ(c.weights.w13.shape[2], 32);
  EXPECT_EQ(c.weights.w13_scale.rank, 3);
  EXPECT_EQ(c.weights.w2.dtype, DType::i8);
  EXPECT_EQ(c.weights.w2_scale.rank, 2);
  EXPECT_TRUE(c.weights.w13_bias.empty());
  EXPECT_TRUE(c.weights.w2_bias.empty());
  EXPECT_EQ(c.weights.group_size, 32);
  EXPECT_EQ(c.weights.gate_up_layout, GateUpLayout::interleaved);
  EXPECT_EQ(c.params.activation, Activation::swigluoai);
  EXPECT_EQ(c.params.alpha, 1.5f);
  EXPECT_EQ(c.params.limit, 6.25f);
  EXPECT_TRUE(c.params.apply_router_weight_on_input);
  const PackOptions options = c.pack_options();
  EXPECT_EQ(options.group_size, 32);
  EXPECT_EQ(options.gate_up_layout, GateUpLayout::interleaved);
}

TEST_F(CaseLoaderTest, DefaultsForOptionalMetadataAndBiases) {
  SafetensorsWriter w = valid_case("", "alpha");
  w.set_metadata("group_size", "-1");
  w.set_metadata("activation", "gelu_tanh");
  w.set_metadata("apply_router_weight_on_input", "false");
  w.add("w13_bias", DType::f32, {3, 64}, std::vector<float>(3 * 64, 0.0f));
  w.add("w2_bias", DType::f16, {3, 64}, std::vector<uint16_t>(3 * 64, 0));
  const std::string file = path("case.safetensors");
  w.write(file);
  const LoadedCase c = load_case(file);
  EXPECT_EQ(c.weights.group_size, -1);
  EXPECT_EQ(c.params.activation, Activation::gelu_tanh);
  EXPECT_EQ(c.params.alpha, MoeParams{}.alpha);
  EXPECT_FALSE(c.params.apply_router_weight_on_input);
  EXPECT_FALSE(c.weights.w13_bias.empty());
  EXPECT_EQ(c.weights.w2_bias.dtype, DType::f16);

  SafetensorsWriter minimal = valid_case("", "gate_up_layout");
  minimal.write(file);
  EXPECT_EQ(load_case(file).weights.gate_up_layout, GateUpLayout::halves);
}

TEST_F(CaseLoaderTest, MissingTensor) {
  for (const char* name : {"x", "topk_ids", "topk_weights", "w13", "w13_scale", "w2", "w2_scale"}) {
    SCOPED_TRACE(name);
    EXPECT_THAT(load_error(valid_case(name)),
                HasSubstr(std::string("tensor '") + name + "' is missing"));
  }
}

TEST_F(CaseLoaderTest, MissingRequiredMetadata) {
  EXPECT_THAT(load_error(valid_case("", "group_size")),
              HasSubstr("metadata 'group_size' is missing"));
  EXPECT_THAT(load_error(valid_case("", "activation")),
              HasSubstr("metadata 'activation' is missing"));
}

TEST_F(CaseLoaderTest, BadGroupSize) {
  for (const char* text : {"12x", "", " 128", "128 ", "1.5", "+128", "0x80", "99999999999"}) {
    SCOPED_TRACE(text);
    SafetensorsWriter w = valid_case();
    w.set_metadata("group_size", text);
    EXPECT_THAT(
        load_error(w),
        HasSubstr(std::string("metadata 'group_size' must be an integer, got '") + text + "'"));
  }
}

TEST_F(CaseLoaderTest, UnknownActivation) {
  SafetensorsWriter w = valid_case();
  w.set_metadata("activation", "relu");
  const std::string msg = load_error(w);
  EXPECT_THAT(msg, HasSubstr("metadata 'activation'"));
  EXPECT_THAT(msg, HasSubstr("relu"));
}

TEST_F(CaseLoaderTest, BadOptionalMetadata) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"alpha", "abc"},
      {"alpha", "1.5x"},
      {"alpha", "nan"},
      {"limit", "inf"},
      {"limit", ""},
      {"apply_router_weight_on_input", "yes"},
      {"apply_router_weight_on_input", "1"},
      {"gate_up_layout", "halfs"}};
  for (const auto& [key, value] : bad) {
    SCOPED_TRACE(key + "=" + value);
    SafetensorsWriter w = valid_case();
    w.set_metadata(key, value);
    const std::string msg = load_error(w);
    EXPECT_THAT(msg, HasSubstr("metadata '" + key + "'"));
    EXPECT_THAT(msg, HasSubstr("got '" + value + "'"));
  }
}

TEST_F(CaseLoaderTest, WrongIdsDType) {
  SafetensorsWriter w = valid_case("topk_ids");
  w.add("topk_ids", DType::f32, {2, 2}, std::vector<float>(4, 0.0f));
  EXPECT_THAT(load_error(w), HasSubstr("tensor 'topk_ids' must have dtype I32 or I64, got F32"));
}

TEST_F(CaseLoaderTest, WrongWeightDTypeAndRank) {
  SafetensorsWriter w = valid_case("w13");
  w.add("w13", DType::i32, {3, 64, 8}, std::vector<int32_t>(3 * 64 * 8, 0));
  EXPECT_THAT(load_error(w), HasSubstr("tensor 'w13' must have dtype I8"));

  SafetensorsWriter r = valid_case("x");
  r.add("x", DType::f32, {128}, std::vector<float>(128, 0.0f));
  EXPECT_THAT(load_error(r), HasSubstr("tensor 'x' must have rank 2, got shape [128]"));

  SafetensorsWriter s = valid_case("w2_scale");
  s.add("w2_scale", DType::f32, {192}, std::vector<float>(192, 0.0f));
  EXPECT_THAT(load_error(s), HasSubstr("tensor 'w2_scale' must have rank 2 or 3"));
}

TEST_F(CaseLoaderTest, MalformedFileNamesTheFile) {
  const std::string file = path("case.safetensors");
  write_raw(file, make_bytes("{oops", 0));
  try {
    load_case(file);
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(file));
    EXPECT_THAT(e.what(), HasSubstr("not valid JSON"));
  }
}

}  // namespace
}  // namespace w4a8moe::io
