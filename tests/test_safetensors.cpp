// The safetensors reader and writer: round trips for every dtype, the writer's layout (no holes,
// aligned offsets), empty tensors and scalars, the writer's refusals, replacing a file, and a
// foreign layout read. Malformed files: test_safetensors_hostile.cpp; the case-file loader:
// test_case_file.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
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
namespace fs = std::filesystem;

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

}  // namespace
}  // namespace w4a8moe::io
